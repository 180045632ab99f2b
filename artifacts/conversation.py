"""Turn one raw record into a `Conversation`: read its turns, map the roles, check the shape.

`extract_turns` reads a ShareGPT (`conversations: [{from, value}]`), OpenAI (`messages: [{role, content}]`,
as OpenAI-compatible servers log requests: assistant `tool_calls`, `tool` results, reasoning fields) or
custom-field record; `normalize_messages` maps its roles and keeps it only when it is shaped as a chat the
template and the loss mask expect: `[system] user` then assistant turns, each answered by the user or, after
a tool call, by that call's `tool` results. A record that cannot be used raises `SkippedRecord` with the
reason `data_prep/sources.py` counts it under.

A kept message is `{"role", "content"}` with, where the record has them, `reasoning_content` (from
`reasoning`, else `reasoning_content`, as vLLM 0.32 reads them; a `thinking` field it ignores, and so does
this), `tool_calls` (`[{"type": "function", "function": {"name", "arguments": {...}}, "id"?}]`, arguments
parsed from their JSON string as vLLM parses them before rendering), `tool_call_id` and `name`, `weight` 0
(OpenAI's fine-tuning field: the turn is not trained) and `finish_reason: "length"` (a response cut at the
token limit). The request's `tools` (function schemas) and `chat_template_kwargs` stay on the conversation.
A record logged as a request and its response is read as its messages and then the response
(`request_record`).

On purpose unlike vLLM 0.32: a legacy assistant `function_call` is read as a tool call and a `function`
message as its result (vLLM drops the call and passes the role through, so the answer would render empty).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from artifacts.config import DataConfig, DataSourceConfig


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


# How servers and datasets name it, in vLLM 0.32's order: it reads `reasoning`, else `reasoning_content`
# (a message's `thinking` it ignores, and so does this).
REASONING_FIELDS = ("reasoning", "reasoning_content")


@dataclass
class Conversation:
    id: str  # `id_field` of the record, else a hash of the messages; `name/` first in a mix; unique in a load
    messages: list[dict]  # [{"role": "system"|"user"|"assistant"|"tool", "content": str, ...}, ...]
    tools: list[dict] | None = field(default=None)  # the request's function schemas, passed as `tools=`
    # the request's own chat-template kwargs (its thinking mode), over the run's `render.chat_template_kwargs`
    template_kwargs: dict | None = field(default=None)


def request_record(record: Any) -> Any:
    """A record logged as a request and its response (`{"request": {"messages", "tools", ...}, "response":
    {"choices": [{"message", "finish_reason"}]}}`, as logging proxies write them) as one record: the
    request's fields, its messages followed by the response's message (with its `finish_reason`). Any other
    record is returned as it is."""
    if not (isinstance(record, dict) and isinstance(record.get("request"), dict) and "response" in record):
        return record
    request, response = record["request"], record["response"]
    choices = response.get("choices") if isinstance(response, dict) else None
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
    if not isinstance(request.get("messages"), list) or not isinstance(choice, dict):
        raise SkippedRecord("malformed_record")
    message = choice.get("message")
    if not isinstance(message, dict):
        raise SkippedRecord("malformed_record")
    message = {"role": "assistant", **message}
    if choice.get("finish_reason") == "length":
        message["finish_reason"] = "length"
    found_id = record.get("id", response.get("id"))
    return {**request, "messages": [*request["messages"], message]} | ({"id": found_id} if found_id else {})


def record_template_kwargs(record: Any) -> dict | None:
    """The request's chat-template kwargs as vLLM 0.32 passes them to the template: its
    `chat_template_kwargs`, then its top-level `reasoning_effort` over them (and `enable_thinking` from it,
    `reasoning_effort != "none"`, unless the kwargs set it); None values ignored. None without any."""
    kwargs = record.get("chat_template_kwargs") if isinstance(record, dict) else None
    if isinstance(kwargs, str):  # some dumps store it as a JSON string
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise SkippedRecord("malformed_template_kwargs") from None
    if kwargs is not None and not isinstance(kwargs, dict):
        raise SkippedRecord("malformed_template_kwargs")
    kwargs = {k: v for k, v in (kwargs or {}).items() if v is not None}
    effort = record.get("reasoning_effort") if isinstance(record, dict) else None
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
        kwargs["reasoning_effort"] = effort
    return kwargs or None


class SkippedRecord(Exception):
    """A record that cannot become a conversation; `reason` is its key in `LoadedConversations.skipped`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def extract_turns(record: Any, cfg: DataConfig | DataSourceConfig) -> list[tuple[Any, Any, dict]]:
    """The record's turns as (source role, content, the turn itself) triples, read with the keys of its
    format (the turn, for the fields of a tool call or its result)."""
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

    triples = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn:
            raise SkippedRecord("malformed_record")
        # OpenAI logs an assistant turn that only calls tools with `content: null` (or none at all).
        if content_key not in turn and not (turn.get("tool_calls") or turn.get("function_call")):
            raise SkippedRecord("malformed_record")
        triples.append((turn[role_key], turn.get(content_key), turn))
    return triples


def record_tools(record: Any) -> list[dict] | None:
    """The request's `tools` (OpenAI function schemas, or bare functions), as a list; None without."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # some dumps store the list as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise SkippedRecord("malformed_tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise SkippedRecord("malformed_tools")
    return [t if "function" in t else {"type": "function", "function": t} for t in tools]


def normalize_tool_calls(turn: dict) -> list[dict] | None:
    """A turn's `tool_calls` (or legacy `function_call`) as `[{"type": "function", "function": {"name",
    "arguments": dict}}]` (with the call's `id` when logged); None without any."""
    calls = turn.get("tool_calls")
    if not calls and isinstance(turn.get("function_call"), dict):
        calls = [{"type": "function", "function": turn["function_call"]}]
    if not calls:
        return None
    if not isinstance(calls, list):
        raise SkippedRecord("malformed_tool_call")
    normalized = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SkippedRecord("malformed_tool_call")
        if call.get("type", "function") != "function":
            raise SkippedRecord("malformed_tool_call")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:  # vLLM parses the logged JSON string before rendering; the template dumps it again
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise SkippedRecord("malformed_tool_arguments") from None
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise SkippedRecord("malformed_tool_arguments")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        normalized.append(entry)
    return normalized


def message_of(role: str, content: Any, turn: dict) -> dict:
    """One turn as a kept message (the module's docstring says which fields)."""
    try:
        text = content_text(content)  # a string, or OpenAI text parts joined
    except NonTextContent:
        raise SkippedRecord("non_text_content") from None
    calls = normalize_tool_calls(turn) if role == "assistant" else None
    # An assistant turn that only calls tools or reasons (or says nothing: empty_assistant_turn).
    if text is None and content is None and role == "assistant":
        text = ""
    if text is None:
        raise SkippedRecord("malformed_record")
    message = {"role": role, "content": text}
    if role == "assistant":
        reasoning = next((turn[k] for k in REASONING_FIELDS if turn.get(k) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise SkippedRecord("malformed_record")
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        if turn.get("weight") == 0:  # OpenAI's fine-tuning field: this turn is context, not trained
            message["weight"] = 0
        if turn.get("finish_reason") == "length":  # cut at the token limit: no end of turn was generated
            message["finish_reason"] = "length"
    if role == "tool":
        if turn.get("tool_call_id") is not None:
            message["tool_call_id"] = str(turn["tool_call_id"])
        if isinstance(turn.get("name"), str):
            message["name"] = turn["name"]
    return message


SYSTEM_ROLES = ("system", "developer")  # the instructions a conversation opens with


def answered(message: dict) -> bool:
    """Whether an assistant message says anything: text, reasoning or a tool call."""
    return bool(
        message["content"].strip()
        or message.get("reasoning_content", "").strip()
        or message.get("tool_calls")
    )


def normalize_messages(
    turns: list[tuple[Any, Any, dict]],
    role_map: dict[str, str],
    system_prompt: str | None,
    max_turns: int | None = None,
    keep_unanswered: bool = False,
) -> list[dict]:
    """Map roles and check the shape: after `[system]`, a user turn, then assistant turns each followed by
    the user or - having called tools - by `tool` results (one per call, in any order), which the assistant
    or the user follows. Drop orphan leading answers and trailing turns no answer follows (`keep_unanswered`:
    keep them, for regeneration to answer), keep the first `max_turns` exchanges (an exchange: a user turn
    and all that follows it up to the next one)."""
    messages = []
    for source_role, content, turn in turns:
        if not isinstance(source_role, str):
            raise SkippedRecord("malformed_record")
        role = role_map.get(source_role.strip().lower())
        if role is None:
            raise SkippedRecord("unknown_role")
        messages.append(message_of(role, content, turn))

    num_system = next((i for i, m in enumerate(messages) if m["role"] not in SYSTEM_ROLES), len(messages))
    system, after_system = messages[:num_system], messages[num_system:]
    # ShareGPT dumps often begin with an answer whose question was cut off (about a third of ShareGPT
    # V3): that answer has no prompt to condition on, so it is dropped and the rest is kept.
    while after_system and after_system[0]["role"] == "assistant":
        after_system = after_system[1:]
    if after_system and after_system[0]["role"] == "tool":  # a result whose call the log lost: the server
        raise SkippedRecord("orphan_tool_result")  # rendered it, so without it no answer is as served
    if not after_system:
        raise SkippedRecord("no_assistant_turn")
    check_order(after_system)
    if max_turns is not None:
        users = [i for i, m in enumerate(after_system) if m["role"] == "user"]
        if len(users) > max_turns:
            after_system = after_system[: users[max_turns]]
    while after_system and after_system[-1]["role"] != "assistant" and not keep_unanswered:
        after_system.pop()  # a question or a tool result with no answer gives the draft nothing to learn
    messages = system + after_system
    assistant_turns = [message for message in messages if message["role"] == "assistant"]
    if not assistant_turns and not (keep_unanswered and after_system):
        raise SkippedRecord("no_assistant_turn")
    if not all(answered(message) for message in assistant_turns):
        raise SkippedRecord("empty_assistant_turn")
    if system_prompt and messages[0]["role"] not in SYSTEM_ROLES:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def check_order(messages: list[dict]) -> None:
    """The turn order after the system message (see normalize_messages); raises SkippedRecord."""
    previous = None
    pending: list[str | None] = []  # the ids of the calls the last assistant made that no result answered
    for message in messages:
        role = message["role"]
        if role in SYSTEM_ROLES:
            raise SkippedRecord("not_alternating")
        if role == "tool":
            if previous not in ("assistant", "tool") or previous == "assistant" and not pending:
                raise SkippedRecord("orphan_tool_result")
            call_id = message.get("tool_call_id")
            if call_id is not None and pending and all(p is not None for p in pending):
                if call_id not in pending:
                    raise SkippedRecord("unmatched_tool_result")
                pending.remove(call_id)
            elif pending:
                pending.pop(0)
            else:
                raise SkippedRecord("orphan_tool_result")  # more results than calls
        elif role == "assistant":
            if previous not in ("user", "tool") or pending:
                raise SkippedRecord("not_alternating")
            pending = [call.get("id") for call in message.get("tool_calls", [])]
        else:  # user
            if previous == "user" or pending:
                raise SkippedRecord("not_alternating")
        previous = role


def record_id(record: dict, messages: list[dict], id_field: str | None) -> str:
    value = record.get(id_field) if id_field else None
    if value is not None and str(value).strip():
        return str(value)
    # Content-derived, so the same conversation keeps its id (and its train/eval side) across runs.
    return hashlib.sha256(canonical_json(messages)).hexdigest()[:16]


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")
