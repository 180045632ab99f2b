"""Prompts for decoding (export verification, eval): conversations rendered up to an answer.

A prompt is the conversation up to and including its first user turn (with its system message), rendered
with the target's chat template and the generation prompt - one single-turn request, as served.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_conversations(path: Path) -> list[dict]:
    """`{"id", "messages"}` records from a JSONL file of `{"messages": [...]}` (the cache's
    eval_conversations.jsonl) or `{"prompt": "..."}` records (a single user turn)."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from error
            if isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            elif isinstance(record.get("messages"), list):
                messages = record["messages"]
            else:
                raise ValueError(f"{path}:{number}: needs a string `prompt` or a `messages` list")
            records.append({"id": record.get("id", f"{path.name}:{number}"), "messages": messages})
    return records


def first_turn_prompt(messages: list[dict]) -> list[dict]:
    """The messages up to and including the first user turn."""
    for i, message in enumerate(messages):
        if message["role"] == "user":
            return messages[: i + 1]
    raise ValueError("conversation has no user turn")


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
    conversations = read_conversations(path)[:num_prompts]
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
