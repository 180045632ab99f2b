"""Prompts for decoding (export verification, eval): conversations rendered up to an answer.

A prompt is the conversation up to and including its first user turn (with its system message), rendered
with the target's chat template and the generation prompt - one single-turn request, as served.
"""

from __future__ import annotations

import json
from pathlib import Path

from artifacts.config import DEFAULT_ROLE_MAP
from artifacts.conversation import (
    SYSTEM_ROLES,
    SkippedRecord,
    content_text,
    message_of,
    record_template_kwargs,
    record_tools,
)


def record_messages(record) -> list[dict]:
    """A workload record as messages: `{"prompt": "..."}` (one user turn), OpenAI `{"messages": [...]}` (as
    servers log requests: tool calls, tool results, reasoning; artifacts/conversation.py reads each turn)
    or ShareGPT `{"conversations": [{"from", "value"}]}`, content a string or text parts. Raises ValueError
    saying what is wrong with the record."""
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
        content = turn.get(content_key)
        if content_text(content) is None and not (role == "assistant" and content is None):
            raise ValueError(f"turn {index}: `{content_key}` is not a string or a list of text parts")
        try:  # NonTextContent (a ValueError) names the part
            messages.append(message_of(role, content, turn))
        except SkippedRecord as skipped:
            raise ValueError(f"turn {index}: its tool calls cannot be read ({skipped.reason})") from None
    prompt = first_turn_prompt(messages)
    if not prompt[-1]["content"].strip():
        raise ValueError("the first user turn is empty")
    return messages


def read_conversations(path: Path) -> list[dict]:
    """`{"id", "messages"}` records (and `"tools"` where the record has some) from a JSONL file: the cache's
    eval_conversations.jsonl or a workload file (any shape `record_messages` reads). A line that cannot be
    read raises, naming file and line."""
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
                records.append(read_record(record, f"{path.name}:{number}"))
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from error
    return records


def read_record(record, default_id: str) -> dict:
    """One record as `{"id", "messages"}` (and `"tools"`, `"chat_template_kwargs"` where it has some);
    ValueError says what is wrong."""
    messages = record_messages(record)
    try:
        tools = record_tools(record)
        kwargs = record_template_kwargs(record)
    except SkippedRecord as skipped:
        raise ValueError(f"`tools` or `chat_template_kwargs` cannot be read ({skipped.reason})") from None
    entry = {"id": record.get("id", default_id), "messages": messages}
    return entry | ({"tools": tools} if tools else {}) | ({"chat_template_kwargs": kwargs} if kwargs else {})


def request_kwargs(served: dict | None, own: dict | None) -> dict:
    """A request's chat-template kwargs as vLLM merges them: the served ones (the server's defaults), the
    request's own over them."""
    return {**(served or {}), **(own or {})}


def agentic(conversation: dict) -> bool:
    """Whether a conversation is an agent's: it has tools, calls or results."""
    messages = conversation["messages"]
    return bool(conversation.get("tools")) or any(
        m.get("tool_calls") or m["role"] == "tool" for m in messages
    )


def requests_of(conversation: dict) -> list[list[dict]]:
    """The requests a conversation stands for, as servers receive them: an agent's conversation, every
    request its assistant turns answered (the history up to each, tool results included; and the whole of
    it when it ends waiting for an answer); any other, its first user turn (a workload's one request)."""
    messages = conversation["messages"]
    if not agentic(conversation):
        return [first_turn_prompt(messages)]
    requests = [messages[:i] for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    if messages[-1]["role"] != "assistant":
        requests.append(messages)
    return requests


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


def served_template_kwargs(cfg) -> dict:
    """The chat-template kwargs a run renders and serves with (its thinking mode): `render.chat_template_kwargs`,
    and when it regenerates with `regen.reasoning=off`, `regen.reasoning_off_kwargs` over them."""
    kwargs = dict(cfg.render.chat_template_kwargs or {})
    if cfg.regen.enabled and cfg.regen.reasoning == "off":
        kwargs |= dict(cfg.regen.reasoning_off_kwargs)
    return kwargs


# what the pipeline keeps on a message and no template sees (data_prep/render.py, data_prep/request_log.py)
NOT_RENDERED = ("weight", "finish_reason", "history_without_reasoning")


def template_messages(messages: list[dict], chat_template: str | None = None) -> list[dict]:
    """Messages as vLLM 0.32 hands them to a chat template: reasoning under both names templates read it by;
    for a template that names no `developer` role, developer messages as system messages, every system
    message merged into one first (joined by blank lines)."""
    messages = [
        {k: v for k, v in m.items() if k not in NOT_RENDERED}
        | ({"reasoning": m["reasoning_content"]} if m.get("reasoning_content") is not None else {})
        for m in messages
    ]
    developer_role = isinstance(chat_template, str) and (
        '"developer"' in chat_template or "'developer'" in chat_template
    )
    if developer_role or not any(m["role"] == "developer" for m in messages):
        return messages
    system = [m["content"] for m in messages if m["role"] in SYSTEM_ROLES and m["content"]]
    rest = [m for m in messages if m["role"] not in SYSTEM_ROLES]
    return [{"role": "system", "content": "\n\n".join(system)}, *rest]


def apply_template(tokenizer, messages, tools=None, template_kwargs=None, add_generation_prompt=True,
                   tokenize=True):  # fmt: skip
    """The chat template on a request as the server applies it: its messages (template_messages), its tools
    and the template kwargs it is served with; text, or token ids with `tokenize`."""
    return tokenizer.apply_chat_template(
        template_messages(messages, tokenizer.chat_template),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=tokenize,
        return_dict=False,
        **(template_kwargs or {}),
    )


def chat_prompt_ids(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> list[int]:
    """A request's chat-template token ids, ending in the assistant's generation prompt."""
    return list(apply_template(tokenizer, messages, tools, template_kwargs))


def prompt_token_ids(tokenizer, messages: list[dict], tools=None, template_kwargs=None) -> list[int]:
    """Chat-template token ids of the first user turn, ending in the assistant's generation prompt."""
    return chat_prompt_ids(tokenizer, first_turn_prompt(messages), tools, template_kwargs)


def held_out_prompts(cache_dir: Path, tokenizer, num_prompts: int, template_kwargs=None) -> list[list[int]]:
    """The first user turns of the cache's first `num_prompts` held-out conversations, chat-templated with
    their tools and `template_kwargs` (the head's thinking mode)."""
    path = Path(cache_dir) / "eval_conversations.jsonl"
    if not path.exists():
        raise ValueError(f"{path} is missing: decoding reads the held-out prompts data_prep wrote there")
    conversations = distinct_prompts(read_conversations(path))[:num_prompts]
    if not conversations:
        raise ValueError(f"{path} holds no conversations: no held-out prompts to decode")
    return [
        prompt_token_ids(
            tokenizer,
            c["messages"],
            c.get("tools"),
            request_kwargs(template_kwargs, c.get("chat_template_kwargs")),
        )
        for c in conversations
    ]


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
