"""Prompts for decoding (export verification, eval): conversations rendered up to an answer.

A prompt is the conversation up to and including its first user turn (with its system message), rendered
with the target's chat template and the generation prompt - one single-turn request, as served.
"""

from __future__ import annotations

import json
from pathlib import Path


class NonTextContent(ValueError):
    """A message whose content has parts other than text (an image, audio, a file)."""


def content_text(content) -> str | None:
    """A message's text: a string as it is, OpenAI multi-part content (`[{"type": "text", "text": ...}]`)
    as its text parts joined by newlines; None when `content` has neither shape. Raises NonTextContent
    when a part is not text (the text alone would not be what was asked)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        return None
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        elif isinstance(part, dict) and part.get("type") not in (None, "text"):
            raise NonTextContent(f"a {part.get('type')!r} part")
        else:
            return None
    return "\n".join(texts)


def record_messages(record) -> list[dict]:
    """A workload record as `[{"role", "content"}]`: `{"prompt": "..."}` (one user turn), OpenAI
    `{"messages": [{"role", "content"}]}` or ShareGPT `{"conversations": [{"from", "value"}]}`, content a
    string or text parts. Raises ValueError saying what is wrong with the record."""
    from artifacts.config import DEFAULT_ROLE_MAP

    if not isinstance(record, dict):
        raise ValueError(f"a JSON {type(record).__name__}, not an object")
    if "prompt" in record:
        if content_text(record["prompt"]) is None:
            raise ValueError("`prompt` is not a string or a list of text parts")
        turns, role_key, content_key = [{"role": "user", "content": record["prompt"]}], "role", "content"
    elif isinstance(record.get("messages"), list):
        turns, role_key, content_key = record["messages"], "role", "content"
    elif isinstance(record.get("conversations"), list):
        turns, role_key, content_key = record["conversations"], "from", "value"
    else:
        raise ValueError(
            "needs a `prompt` string, a `messages` list (OpenAI) or a `conversations` list (ShareGPT)"
        )
    messages = []
    for index, turn in enumerate(turns):
        role = (
            DEFAULT_ROLE_MAP.get(str(turn.get(role_key, "")).strip().lower())
            if isinstance(turn, dict)
            else None
        )
        if role is None:
            raise ValueError(f"turn {index}: needs a `{role_key}` of {sorted(DEFAULT_ROLE_MAP)}")
        text = content_text(turn.get(content_key))
        if text is None:
            raise ValueError(f"turn {index}: `{content_key}` is not a string or a list of text parts")
        messages.append({"role": role, "content": text})
    prompt = first_turn_prompt(messages)
    if not prompt[-1]["content"].strip():
        raise ValueError("the first user turn is empty")
    return messages


def read_conversations(path: Path) -> list[dict]:
    """`{"id", "messages"}` records from a JSONL file: the cache's eval_conversations.jsonl or a workload
    file (any shape `record_messages` reads). A line that cannot be read raises, naming file and line."""
    path = Path(path)
    records = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not UTF-8 text ({error})") from error
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
            try:
                messages = record_messages(record)
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from error
            records.append({"id": record.get("id", f"{path.name}:{number}"), "messages": messages})
    return records


def distinct_prompts(conversations: list[dict]) -> list[dict]:
    """The conversations whose first-turn prompt is new, in order: the held-out file holds each prompt once
    per sampled answer (regen.samples_per_prompt), and a workload measures each prompt once."""
    seen, kept = set(), []
    for conversation in conversations:
        key = json.dumps(first_turn_prompt(conversation["messages"]), sort_keys=True)
        if key not in seen:
            seen.add(key)
            kept.append(conversation)
    return kept


def first_turn_prompt(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    raise ValueError("no user turn")


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids ending in the assistant's generation prompt."""
    ids = tokenizer.apply_chat_template(
        first_turn_prompt(messages), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def held_out_prompts(cache_dir: Path, tokenizer, num_prompts: int) -> list[list[int]]:
    """The first user turns of the cache's first `num_prompts` held-out conversations, chat-templated."""
    path = Path(cache_dir) / "eval_conversations.jsonl"
    if not path.exists():
        raise ValueError(f"{path} is missing: decoding reads the held-out prompts data_prep wrote there")
    conversations = distinct_prompts(read_conversations(path))[:num_prompts]
    if not conversations:
        raise ValueError(f"{path} holds no conversations: no held-out prompts to decode")
    return [prompt_token_ids(tokenizer, c["messages"]) for c in conversations]


def stop_token_ids(tokenizer, target_dir: Path) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS and the generation config's (vLLM stops on both)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = Path(target_dir) / "generation_config.json"
    if generation_config.exists():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    return sorted(ids)
