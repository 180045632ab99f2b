"""Turn one raw record into a `Conversation`: read its turns, map the roles, check the shape.

`extract_turns` reads a ShareGPT (`conversations: [{from, value}]`), OpenAI (`messages: [{role, content}]`)
or custom-field record; `normalize_messages` maps its roles and keeps it only when it is shaped
`[system] user assistant (user assistant)*`, the shape the chat template and the loss mask expect. A
record that cannot be used raises `SkippedRecord` with the reason `data_prep/sources.py` counts it under.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from artifacts.config import DataConfig, DataSourceConfig
from artifacts.prompts import NonTextContent, content_text


@dataclass
class Conversation:
    id: str  # `id_field` of the record, else a hash of the messages; `name/` first in a mix; unique in a load
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}, ...]


class SkippedRecord(Exception):
    """A record that cannot become a conversation; `reason` is its key in `LoadedConversations.skipped`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


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


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")
