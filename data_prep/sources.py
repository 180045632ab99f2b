"""Load the conversations of `data.source` (or every source of `data.mix`) for training.

`load_conversations(cfg.data)` checks the data settings, reads each source's raw records
(`data_prep/records.py`), turns each record into a `Conversation` - `[system] user`, then assistant turns
each answered by the user or, after a tool call, by its results; with the request's tools
(`artifacts/conversation.py`) - and keeps the usable ones.
Records that cannot be used are skipped and counted by reason; a conversation identical to an earlier
one (after normalisation, whatever its id or file) is kept once (`duplicate_conversation`). Truncated or
corrupt JSON files keep their complete records and are reported (or raise, with `strict=true`), because
real dumps often ship cut off.

`cfg.mix` lists several sources instead of `cfg.source` (e.g. ShareGPT and UltraChat), each with its own
split, format, field names and `num_samples`; they are read in order and each one's ids are prefixed
with its name. The fingerprint of the result, and `split_key`, which decides the held-out split, are
here too.

The data_prep stage calls `load_conversations` from its `run(cfg)`; to inspect a source by hand:

    python -m data_prep.sources path/to/sharegpt.json --format sharegpt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass

from artifacts.config import (
    RECORD_FORMATS,
    DataConfig,
    DataSourceConfig,
    check_data,
    field_errors,
    source_entries,
)
from artifacts.conversation import (
    Conversation,
    SkippedRecord,
    canonical_json,
    extract_turns,
    normalize_messages,
    record_id,
    record_template_kwargs,
    record_tools,
    request_record,
)
from artifacts.prompts import first_turn_prompt
from data_prep.records import read_records
from data_prep.request_log import merge_requests

logger = logging.getLogger(__name__)


@dataclass
class LoadedConversations:
    conversations: list[Conversation]
    skipped: collections.Counter  # reason -> number of records skipped for it
    problems: list[str]  # one line per file-level problem, naming the file and the line or byte offset
    fingerprint: str  # sha256 over ids + messages in order: changes whenever the training data does
    # per-request logs (data_prep/request_log.py): records merged into a longer one, shared turns, lent reasoning
    merged: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class UniqueIds:
    """Hands out ids, renaming repeats `id#2`, `id#3`, ... in the order they are met."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.next_copy: dict[str, int] = {}  # remembers the last suffix so 10k repeats stay linear
        self.num_renamed = 0

    def claim(self, wanted: str) -> str:
        copy = self.next_copy.get(wanted, 1)
        unique = wanted if copy == 1 else f"{wanted}#{copy}"
        while unique in self.used:
            copy += 1
            unique = f"{wanted}#{copy}"
        self.next_copy[wanted] = copy
        self.used.add(unique)
        self.num_renamed += unique != wanted
        return unique


def load_conversations(cfg: DataConfig) -> LoadedConversations:
    """Read `cfg.source` (or every source of `cfg.mix`, in order), keep the usable conversations and count
    the rest by why they were dropped."""
    # Checked when a config is composed; here again for a DataConfig given directly (tests, the CLI below).
    field_errors(cfg, "data")
    check_data(cfg)
    conversations: list[Conversation] = []
    skipped: collections.Counter = collections.Counter()
    merged: collections.Counter = collections.Counter()
    problems: list[str] = []
    ids = UniqueIds()
    seen: set[str] = set()  # content digests of the conversations kept so far, across every source
    for where, entry in source_entries(cfg):
        id_prefix = f"{entry.name}/" if cfg.mix else ""
        found, found_skipped, found_problems = read_source(entry, where, id_prefix, cfg, ids, seen)
        if cfg.merge_requests:
            found, found_merged = merge_requests(found)
            merged.update({k: v for k, v in found_merged.items() if v})
            if found_merged["merged"]:
                logger.info("%s: %d records were requests of a longer one and are trained in it (%s)",
                            where, found_merged["merged"], found_merged)  # fmt: skip
        if cfg.mix:
            logger.info("%s (%s): %d conversations (skipped: %s)",
                        where, entry.name, len(found), dict(found_skipped))  # fmt: skip
        conversations += found
        skipped.update(found_skipped)
        problems += found_problems

    if ids.num_renamed:
        logger.warning(
            "%d conversations repeat an earlier id; made unique by appending #2, #3, ...", ids.num_renamed
        )
    logger.info(
        "loaded %d conversations from %s (skipped: %s)",
        len(conversations),
        describe_sources(cfg),
        dict(skipped),
    )
    fingerprint = fingerprint_conversations(conversations)
    return LoadedConversations(conversations, skipped, problems, fingerprint, merged)


def describe_sources(cfg: DataConfig) -> str:
    """`data.source`, or the mix as `name=source[split]` entries, for logs and manifests."""
    if not cfg.mix:
        return str(cfg.source)
    return " + ".join(f"{entry.name}={entry.source}[{entry.split}]" for entry in cfg.mix)


def read_source(
    entry: DataConfig | DataSourceConfig,
    where: str,
    id_prefix: str,
    cfg: DataConfig,
    ids: UniqueIds,
    seen: set[str],
) -> tuple[list[Conversation], collections.Counter, list[str]]:
    """The usable conversations of one source (`entry`: where it is, its format, fields and num_samples;
    `cfg`: the settings shared by every source), the records skipped by reason, and file problems.
    A conversation identical to one already in `seen` (after normalisation) is skipped as a duplicate."""
    role_map = {str(source_role).strip().lower(): role for source_role, role in cfg.role_map.items()}
    skipped: collections.Counter = collections.Counter()
    problems: list[str] = []

    def report_problem(message: str) -> None:
        if cfg.strict:
            raise ValueError(f"{message} (data.strict=true; set it false to keep the complete records)")
        logger.warning(message)
        problems.append(message)
        skipped["corrupt_json"] += 1

    conversations: list[Conversation] = []
    pattern = re.compile(cfg.match) if cfg.match else None
    first_fields = None  # the fields of the first record, named when nothing could be read
    for record in read_records(entry, report_problem, where):
        if first_fields is None and isinstance(record, dict):
            first_fields = sorted(record)
        try:
            record = request_record(record)
            turns = extract_turns(record, entry)
            messages = normalize_messages(
                turns, role_map, cfg.system_prompt, cfg.max_turns, entry.unanswered == "answer"
            )
            tools = record_tools(record)
            template_kwargs = record_template_kwargs(record)
        except SkippedRecord as skip:
            skipped[skip.reason] += 1
            continue
        if pattern and not pattern.search(next(m["content"] for m in messages if m["role"] == "user")):
            skipped["no_match"] += 1
            continue
        digest = hashlib.sha256(canonical_json(content_of(messages, tools, template_kwargs))).hexdigest()
        if digest in seen:
            skipped["duplicate_conversation"] += 1
            continue
        seen.add(digest)
        conversation_id = ids.claim(id_prefix + record_id(record, messages, entry.id_field))
        conversations.append(Conversation(conversation_id, messages, tools, template_kwargs))
        if entry.num_samples is not None and len(conversations) >= entry.num_samples:
            break  # stop reading: the rest of the source would be thrown away

    if not conversations:
        expected = entry.messages_field or {"sharegpt": "conversations", "openai": "messages"}.get(
            entry.format, "conversations or messages"
        )
        fields = (
            f"; the records have the fields {first_fields}, and the turns are read from {expected} "
            f"(another field: {where}.messages_field)"
            if first_fields is not None and skipped.get("malformed_record")
            else ""
        )
        raise ValueError(
            f"no usable conversations in {where}.source={entry.source!r} (format={entry.format}); "
            f"skipped: {dict(skipped)}; problems: {problems}{fields}"
        )
    return conversations, skipped, problems


def split_key(conversation: Conversation) -> str:
    """What the train / held-out split hashes: the prompt (system message and first user turn), so that
    conversations sharing a prompt land on one side and no held-out prompt was trained on."""
    return hashlib.sha256(canonical_json(first_turn_prompt(conversation.messages))).hexdigest()


SPLIT_BY = "prompt_sha256"  # what is_held_out hashes (a cache split another way is refused, not mixed)


def is_held_out(conversation: Conversation, eval_fraction: float) -> bool:
    """Deterministic split by content: the first 64 bits of the prompt's sha256 as a fraction of 2^64."""
    return int(split_key(conversation)[:16], 16) < eval_fraction * 2**64


def content_of(messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None):
    """What a conversation says, for digests: its messages, and its tools and template kwargs where the
    request had some (so the digests of conversations without are what they were before these were read)."""
    if template_kwargs:
        return [messages, tools, template_kwargs]
    return messages if tools is None else [messages, tools]


def fingerprint_conversations(conversations: list[Conversation]) -> str:
    digest = hashlib.sha256()
    for conversation in conversations:
        # json.dumps escapes newlines inside strings, so b"\n" cleanly separates conversations.
        content = content_of(conversation.messages, conversation.tools, conversation.template_kwargs)
        digest.update(canonical_json([conversation.id, content]) + b"\n")
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description="Load a conversation source and summarize what is usable.")
    parser.add_argument("source", help="file, glob, directory or Hugging Face hub dataset name")
    parser.add_argument("--format", default="auto", choices=RECORD_FORMATS)
    parser.add_argument("--split", default="train")
    parser.add_argument("--strict", action="store_true", help="raise on truncated/corrupt files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = DataConfig(source=args.source, format=args.format, split=args.split, strict=args.strict)
    loaded = load_conversations(cfg)
    print(
        f"{len(loaded.conversations)} conversations | skipped {dict(loaded.skipped)} | merged "
        f"{dict(loaded.merged)} | fingerprint {loaded.fingerprint}"
    )
    print(json.dumps(asdict(loaded.conversations[0]), ensure_ascii=False, indent=2)[:2000])


if __name__ == "__main__":
    main()
