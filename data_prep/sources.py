"""Read chat conversations from local files or the Hugging Face hub and normalize them.

`load_conversations(cfg.data)` turns ShareGPT (`conversations: [{from, value}]`), OpenAI
(`messages: [{role, content}]`) or custom-field records into `Conversation`s shaped
`[system] user assistant (user assistant)*`, the shape the chat template and the loss mask expect.
Records that cannot be used are skipped and counted by reason; a conversation identical to an earlier
one (after normalisation, whatever its id or file) is kept once (`duplicate_conversation`). Truncated or
corrupt JSON files keep their complete records and are reported (or raise, with `strict=true`), because
real dumps often ship cut off.

`cfg.source` is a .json / .jsonl / .parquet file, a glob of them, a directory of them (subdirectories
included), a directory written by `datasets` `save_to_disk`, or otherwise a Hugging Face hub dataset
name. `cfg.mix` lists several such sources instead (e.g. ShareGPT and UltraChat), each with its own
split, format, field names and `num_samples`; they are read in order and each one's ids are prefixed
with its name.

The data_prep stage calls `load_conversations` from its `run(cfg)`; to inspect a source by hand:

    python -m data_prep.sources path/to/sharegpt.json --format sharegpt
"""

from __future__ import annotations

import argparse
import collections
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import datasets
from omegaconf import MISSING

from artifacts.config import DataConfig, DataSourceConfig
from artifacts.prompts import NonTextContent, content_text, first_turn_prompt
from data_prep.record_files import ProblemReporter, read_file

logger = logging.getLogger(__name__)

FILE_EXTENSIONS = (".json", ".jsonl", ".parquet")
FORMATS = ("auto", "sharegpt", "openai", "fields")
ROLES = ("system", "user", "assistant")


@dataclass
class Conversation:
    id: str  # `id_field` of the record, else a hash of the messages; `name/` first in a mix; unique in a load
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]


@dataclass
class LoadedConversations:
    conversations: list[Conversation]
    skipped: collections.Counter  # reason -> number of records skipped for it
    problems: list[str]  # one line per file-level problem, naming the file and the line or byte offset
    fingerprint: str  # sha256 over ids + messages in order: changes whenever the training data does


class SkippedRecord(Exception):
    """A record that cannot become a conversation; `reason` is its key in `LoadedConversations.skipped`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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
    check_data_config(cfg)
    conversations: list[Conversation] = []
    skipped: collections.Counter = collections.Counter()
    problems: list[str] = []
    ids = UniqueIds()
    seen: set[str] = set()  # content digests of the conversations kept so far, across every source
    for where, entry in sources_to_read(cfg):
        id_prefix = f"{entry.name}/" if cfg.mix else ""
        found, found_skipped, found_problems = read_source(entry, where, id_prefix, cfg, ids, seen)
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
    return LoadedConversations(conversations, skipped, problems, fingerprint_conversations(conversations))


def sources_to_read(cfg: DataConfig) -> list[tuple[str, DataConfig | DataSourceConfig]]:
    """(name in messages, settings) per source: `data` itself, or each `data.mix[i]` in order."""
    if not cfg.mix:
        return [("data", cfg)]
    return [(f"data.mix[{index}]", entry) for index, entry in enumerate(cfg.mix)]


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
            turns = extract_turns(record, entry)
            messages = normalize_messages(turns, role_map, cfg.system_prompt, cfg.max_turns)
        except SkippedRecord as skip:
            skipped[skip.reason] += 1
            continue
        if pattern and not pattern.search(next(m["content"] for m in messages if m["role"] == "user")):
            skipped["no_match"] += 1
            continue
        digest = hashlib.sha256(canonical_json(messages)).hexdigest()
        if digest in seen:
            skipped["duplicate_conversation"] += 1
            continue
        seen.add(digest)
        conversation_id = ids.claim(id_prefix + record_id(record, messages, entry.id_field))
        conversations.append(Conversation(conversation_id, messages))
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


def check_data_config(cfg: DataConfig) -> None:
    if cfg.mix:
        if cfg.source is not None:
            raise ValueError(
                f"data.source={cfg.source!r} and data.mix are both set: list every source in data.mix "
                "and set data.source=null, or drop data.mix"
            )
        if cfg.num_samples is not None:
            raise ValueError(
                f"data.num_samples={cfg.num_samples} applies to data.source only: with data.mix, give each "
                "source its own data.mix[i].num_samples (override: data.mix.0.num_samples=N)"
            )
        names = [entry.name for entry in cfg.mix]
        for index, name in enumerate(names):
            if not name or name == MISSING or names.index(name) != index:
                raise ValueError(
                    f"data.mix[{index}].name={name!r}: every source needs its own non-empty name "
                    f"(it prefixes that source's conversation ids); names: {names}"
                )
    elif not cfg.source:
        raise ValueError(
            "data.source is not set: give a hub dataset name, a `save_to_disk` directory or local "
            ".json/.jsonl/.parquet files, or list several sources in data.mix"
        )
    for where, entry in sources_to_read(cfg):
        check_source_config(entry, where)
    bad_roles = {src: dst for src, dst in cfg.role_map.items() if dst not in ROLES}
    if bad_roles:
        raise ValueError(f"data.role_map must map onto {ROLES}; these do not: {bad_roles}")
    if cfg.match:
        try:
            re.compile(cfg.match)
        except re.error as error:
            raise ValueError(
                f"data.match={cfg.match!r} is not a valid regular expression: {error}"
            ) from error
    if not 0 <= cfg.eval_fraction < 1:
        raise ValueError(
            f"data.eval_fraction={cfg.eval_fraction}: the share of conversations held out must be in [0, 1) "
            "(0: no held-out split, nothing measured on held-out data; 1 would leave nothing to train on)"
        )
    if cfg.max_turns is not None and cfg.max_turns < 1:
        raise ValueError(f"data.max_turns must be >= 1 or null (all), got {cfg.max_turns}")


def check_source_config(entry: DataConfig | DataSourceConfig, where: str) -> None:
    """The settings of one source; `where` (`data` or `data.mix[i]`) names the fields in messages."""
    if not entry.source or entry.source == MISSING:
        raise ValueError(f"{where}.source is not set: give a hub dataset name, a directory or local files")
    if entry.format not in FORMATS:
        raise ValueError(f"{where}.format={entry.format!r} is not one of {FORMATS}")
    if entry.format == "fields" and not entry.messages_field:
        raise ValueError(
            f"{where}.format=fields needs {where}.messages_field (the record key holding the turns)"
        )
    if entry.num_samples is not None and entry.num_samples < 1:
        raise ValueError(f"{where}.num_samples must be >= 1 or null (all), got {entry.num_samples}")


# Sources: where the raw records come from.


def read_records(
    cfg: DataConfig | DataSourceConfig, report_problem: ProblemReporter, where: str = "data"
) -> Iterator[Any]:
    """Yield the raw records of `cfg.source` in a fixed order (files sorted by path)."""
    source = str(cfg.source)
    local = os.path.expanduser(source)
    if os.path.isdir(local) and is_saved_dataset(local):
        yield from read_saved_dataset(local, cfg.split, where)
    elif os.path.exists(local) or looks_like_path(source):
        turn_fields = ("conversations", "messages", cfg.messages_field)
        for path in find_data_files(source, where):
            yield from read_file(path, turn_fields, report_problem)
    else:
        yield from read_hub_dataset(source, cfg.split, where)


def looks_like_path(source: str) -> bool:
    # Hub names are `owner/name`, so a slash alone does not make a path; these do.
    return (
        os.path.isabs(source)
        or source.startswith((".", "~"))
        or source.lower().endswith(FILE_EXTENSIONS)
        or any(char in source for char in "*?[")
    )


def is_saved_dataset(directory: str) -> bool:
    # The files `Dataset.save_to_disk` and `DatasetDict.save_to_disk` always write.
    return any(os.path.isfile(os.path.join(directory, name)) for name in ("state.json", "dataset_dict.json"))


def find_data_files(source: str, where: str = "data") -> list[str]:
    """The .json/.jsonl/.parquet files a path, glob or directory names, sorted so runs repeat."""
    local = os.path.expanduser(source)
    if os.path.isdir(local):  # subdirectories too: a dump split into folders is read whole
        matches = sorted(
            path
            for path in glob.glob(os.path.join(glob.escape(local), "**", "*"), recursive=True)
            if os.path.isfile(path)
        )
    elif os.path.isfile(local):
        matches = [local]
    else:
        matches = sorted(path for path in glob.glob(local, recursive=True) if os.path.isfile(path))
    data_files = [path for path in matches if path.lower().endswith(FILE_EXTENSIONS)]
    others = [path for path in matches if path not in data_files]
    if data_files and others:
        logger.info("%s.source=%r: not reading %d files that are not %s, e.g. %s",
                    where, source, len(others), "/".join(FILE_EXTENSIONS), others[:3])  # fmt: skip
    if not data_files:
        found = f"; it matches only {matches[:5]}" if matches else ""
        raise ValueError(
            f"{where}.source={source!r} names no {'/'.join(FILE_EXTENSIONS)} file, glob of them, directory "
            f"of them or `save_to_disk` directory{found}"
        )
    return data_files


def read_saved_dataset(directory: str, split: str, where: str = "data") -> Iterator[dict]:
    loaded = datasets.load_from_disk(directory)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{directory} holds splits {sorted(loaded)}; {where}.split={split!r} is not one")
        loaded = loaded[split]
    yield from loaded


def read_hub_dataset(name: str, split: str, where: str = "data") -> Iterator[dict]:
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:  # hub, network and format errors all mean the same thing to the user
        raise ValueError(
            f"{where}.source={name!r} is not a local file or directory, and loading it as a Hugging Face "
            f"hub dataset (split={split!r}) failed: {err}"
        ) from err
    yield from dataset


def extract_turns(record: Any, cfg: DataConfig | DataSourceConfig) -> list[tuple[Any, Any]]:
    """The record's turns as (source role, content) pairs, read with the keys of its format."""
    if not isinstance(record, dict):
        raise SkippedRecord("malformed_record")
    if cfg.format == "sharegpt":
        turns_field, role_key, content_key = cfg.messages_field or "conversations", "from", "value"
    elif cfg.format == "openai":
        turns_field, role_key, content_key = cfg.messages_field or "messages", "role", "content"
    elif cfg.format == "fields":
        turns_field, role_key, content_key = cfg.messages_field, cfg.role_field, cfg.content_field
    else:
        # auto. Parquet/Arrow rows carry every column of the file, so an absent field reads as None.
        candidates = [cfg.messages_field] if cfg.messages_field else ["conversations", "messages"]
        turns_field = next((name for name in candidates if record.get(name) is not None), candidates[0])
        role_key, content_key = None, None

    turns = record.get(turns_field)
    if not isinstance(turns, list):
        raise SkippedRecord("malformed_record")
    if not turns:
        raise SkippedRecord("empty_conversation")
    if role_key is None:
        first = turns[0] if isinstance(turns[0], dict) else {}
        if first.get("from") is not None:
            role_key, content_key = "from", "value"
        elif first.get("role") is not None:
            role_key, content_key = "role", "content"
        else:
            role_key, content_key = cfg.role_field, cfg.content_field

    pairs = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise SkippedRecord("malformed_record")
        pairs.append((turn[role_key], turn[content_key]))
    return pairs


def normalize_messages(
    turns: list[tuple[Any, Any]],
    role_map: dict[str, str],
    system_prompt: str | None,
    max_turns: int | None = None,
) -> list[dict[str, str]]:
    """Map roles, check `[system] user assistant (user assistant)*`, drop orphan leading answers and an
    unanswered last question, keep the first `max_turns` exchanges."""
    messages = []
    for source_role, content in turns:
        if not isinstance(source_role, str):
            raise SkippedRecord("malformed_record")
        role = role_map.get(source_role.strip().lower())
        if role is None:
            raise SkippedRecord("unknown_role")
        try:
            text = content_text(content)  # a string, or OpenAI text parts joined
        except NonTextContent:
            raise SkippedRecord("non_text_content") from None
        if text is None:
            raise SkippedRecord("malformed_record")
        messages.append({"role": role, "content": text})

    system = messages[:1] if messages[0]["role"] == "system" else []
    after_system = messages[len(system) :]
    # ShareGPT dumps often begin with an answer whose question was cut off (about a third of ShareGPT
    # V3): that answer has no prompt to condition on, so it is dropped and the rest is kept.
    while after_system and after_system[0]["role"] == "assistant":
        after_system = after_system[1:]
    messages = system + after_system
    if not after_system:
        raise SkippedRecord("no_assistant_turn")
    for index, message in enumerate(after_system):
        if message["role"] != ("user" if index % 2 == 0 else "assistant"):
            raise SkippedRecord("not_alternating")
    if max_turns is not None:
        messages = messages[: len(system) + 2 * max_turns]
    if messages[-1]["role"] == "user":
        messages.pop()  # a question with no answer gives the draft nothing to learn
    assistant_turns = [message for message in messages if message["role"] == "assistant"]
    if not assistant_turns:
        raise SkippedRecord("no_assistant_turn")
    if any(not message["content"].strip() for message in assistant_turns):
        raise SkippedRecord("empty_assistant_turn")
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def record_id(record: dict, messages: list[dict[str, str]], id_field: str | None) -> str:
    value = record.get(id_field) if id_field else None
    if value is not None and str(value).strip():
        return str(value)
    # Content-derived, so the same conversation keeps its id (and its train/eval side) across runs.
    return hashlib.sha256(canonical_json(messages)).hexdigest()[:16]


def split_key(conversation: Conversation) -> str:
    """What the train / held-out split hashes: the prompt (system message and first user turn), so that
    conversations sharing a prompt land on one side and no held-out prompt was trained on."""
    return hashlib.sha256(canonical_json(first_turn_prompt(conversation.messages))).hexdigest()


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")


def fingerprint_conversations(conversations: list[Conversation]) -> str:
    digest = hashlib.sha256()
    for conversation in conversations:
        # json.dumps escapes newlines inside strings, so b"\n" cleanly separates conversations.
        digest.update(canonical_json([conversation.id, conversation.messages]) + b"\n")
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description="Load a conversation source and summarize what is usable.")
    parser.add_argument("source", help="file, glob, directory or Hugging Face hub dataset name")
    parser.add_argument("--format", default="auto", choices=FORMATS)
    parser.add_argument("--split", default="train")
    parser.add_argument("--strict", action="store_true", help="raise on truncated/corrupt files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = DataConfig(source=args.source, format=args.format, split=args.split, strict=args.strict)
    loaded = load_conversations(cfg)
    print(
        f"{len(loaded.conversations)} conversations | skipped {dict(loaded.skipped)} | fingerprint {loaded.fingerprint}"
    )
    print(json.dumps(asdict(loaded.conversations[0]), ensure_ascii=False, indent=2)[:2000])


if __name__ == "__main__":
    main()
