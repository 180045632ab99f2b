"""Read the target's generated text as an OpenAI-compatible vLLM server reads it: reasoning and tool calls
split out by vLLM's own parsers, named as `vllm serve --reasoning-parser / --tool-call-parser` names them.

Regeneration (data_prep/regenerate.py) turns each answer into the message a client would send back as
history - `content`, `reasoning_content`, `tool_calls` with parsed arguments - so the next turn is rendered
as the server renders it, and a regenerated tool call can be compared with the logged one.
"""

from __future__ import annotations

import json


class AnswerReader:
    """`message(text, tools, kwargs)`: the assistant message of a generated text. Without parsers the text is
    the content as generated (a template that reads reasoning out of its content, as Qwen3's does, still
    renders it as it was generated). `skip_special_tokens(tools, kwargs)`: how the server decodes that text.
    `kwargs`: the request's chat-template kwargs (its thinking mode; the run's when None)."""

    def __init__(
        self, tokenizer, tool_parser: str | None, reasoning_parser: str | None, template_kwargs=None
    ):
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        self.tool_parser_cls = self.reasoning_parser_cls = None
        if tool_parser:
            from vllm.tool_parsers import ToolParserManager

            self.tool_parser_cls = named(ToolParserManager.get_tool_parser, tool_parser, "regen.tool_parser")
        if reasoning_parser:
            from vllm.reasoning import ReasoningParserManager

            self.reasoning_parser_cls = named(
                ReasoningParserManager.get_reasoning_parser, reasoning_parser, "regen.reasoning_parser"
            )

    def request(self, tools, kwargs=None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        kwargs = self.template_kwargs if kwargs is None else kwargs
        return ChatCompletionRequest(
            model="target",
            messages=[{"role": "user", "content": ""}],
            tools=tools,
            chat_template_kwargs=kwargs or None,
        )

    def skip_special_tokens(self, tools, kwargs=None) -> bool:
        """Whether the server decodes the answer without its special tokens: vLLM's default, unless the
        parsers' `adjust_request` turn it off (they do where their markers are special tokens, e.g. hermes
        with tools, qwen3 reasoning), as vLLM 0.32's chat path calls them before sampling."""
        request = self.request(tools, kwargs)
        if self.reasoning_parser_cls:
            kwargs = self.template_kwargs if kwargs is None else kwargs
            request = self.reasoning_parser_cls(self.tokenizer, chat_template_kwargs=kwargs).adjust_request(
                request
            )
        if self.tool_parser_cls and tools:
            request = self.tool_parser_cls(self.tokenizer, request.tools).adjust_request(request)
        return request.skip_special_tokens

    def message(self, text: str, tools: list[dict] | None, kwargs=None) -> dict:
        if not (self.reasoning_parser_cls or (self.tool_parser_cls and tools)):
            return {"role": "assistant", "content": text}
        kwargs = self.template_kwargs if kwargs is None else kwargs
        request = self.request(tools, kwargs)
        reasoning, content = None, text
        if self.reasoning_parser_cls:
            parser = self.reasoning_parser_cls(self.tokenizer, chat_template_kwargs=kwargs)
            reasoning, content = parser.extract_reasoning(text, request)
        message = {"role": "assistant", "content": content or ""}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_parser_cls and tools:
            found = self.tool_parser_cls(self.tokenizer, request.tools).extract_tool_calls(
                message["content"], request
            )
            if found.tools_called:
                message["content"] = found.content or ""
                message["tool_calls"] = [
                    {"type": "function",
                     "function": {"name": call.function.name, "arguments": arguments_of(call.function.arguments)}}
                    for call in found.tool_calls
                ]  # fmt: skip
        return message


def arguments_of(arguments: str) -> dict:
    """A parsed call's arguments (vLLM hands them back as a JSON string) as the dict templates render."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}  # as vLLM coerces an unreadable argument string when the call comes back as history
    return value if isinstance(value, dict) else {}


def named(get, name: str, setting: str):
    try:
        return get(name)
    except KeyError as error:
        raise ValueError(f"{setting}={name!r}: {error.args[0]}") from None


def tool_calls_of(message: dict) -> list[tuple[str, dict]]:
    """A message's calls as (name, arguments), for comparing a regenerated turn with the logged one."""
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
