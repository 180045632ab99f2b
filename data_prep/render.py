"""Render conversations with the target's own chat template and mark the tokens the target generates.

A conversation is rendered as the server renders its requests: its `tools` passed as `tools=`, the
template kwargs the head is served with (`render.chat_template_kwargs`, e.g. `enable_thinking`) and the
request's own over them (its thinking mode), a message's reasoning as `reasoning_content` (and `reasoning`,
as vLLM passes it) and tool-call arguments as dicts; a turn sent back as history without its reasoning
(`history_without_reasoning`) is so rendered in later requests. A turn of `weight` 0 is context, not
trained; a turn cut at the token limit (`finish_reason: length`) is trained up to its last text, not the
end of turn its template closes it with.

The loss mask is found without any table of templates: for assistant turn i, the text the template
produces for `messages[:i]` with the generation prompt is the request's prompt, and the text for
`messages[:i+1]` is that turn rendered as the target generates it (its reasoning, answer, tool-call JSON
and end-of-turn token; trailing whitespace not). So tool results, prompts and the template's scaffolding
(the generation prompt included) are never in the loss.

One conversation gives one sample when every turn's rendering is a prefix of the next (Llama-3, ChatML,
Mistral, ...). A template that rewrites history (Qwen3 drops the reasoning of turns before the last user
message) renders a later request differently from the earlier turn as it was generated: a new sample then
starts, rendered as that later request - the history as the template shows it, the new turns with their
reasoning - so each turn is trained exactly as it is served, and none is dropped.

Mask convention, used by every stage: `loss_mask[t] == 1` iff token t belongs to an assistant answer, i.e.
it is a token the draft is trained to predict.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from artifacts.prompts import apply_template, request_kwargs

log = logging.getLogger(__name__)


REASONING_END = "</think>"  # where reasoning models' answers end their reasoning (Qwen3, DeepSeek-R1, ...)


@dataclass
class RenderedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to render.max_length


class TemplateDrops(ValueError):
    """A chat template that renders without part of what the target generated or was asked with: its samples
    would train on answers the target never saw. `reason`: what the conversation is counted under."""

    reason = "template_drops"


class TemplateDropsTools(TemplateDrops):
    """The request's tools or an answer's tool calls (many templates written before tool calling ignore both)."""

    reason = "template_drops_tools"


class TemplateDropsReasoning(TemplateDrops):
    """An answer's reasoning (a template with no place for it): trained without it, a reasoning-only answer
    would be a lone end of turn."""

    reason = "template_drops_reasoning"


def check_tools_rendered(text: str, tools, message: dict | None = None) -> None:
    """Every tool's name in the rendering (and every call's name in the answer's); TemplateDropsTools if not."""
    names = [t.get("function", t).get("name") for t in tools or []]
    names += [c["function"]["name"] for c in (message or {}).get("tool_calls") or []]
    missing = [name for name in names if name and name not in text]
    if missing:
        raise TemplateDropsTools(
            f"the chat template renders no {missing[0]!r}: it drops the request's tools or tool calls (give the "
            "target a template that renders them: target.chat_template)"
        )


SENT_WITHOUT_REASONING = "history_without_reasoning"  # a turn the client sent back without its reasoning


def as_sent(messages: list[dict]) -> list[dict]:
    """Messages as history in a later request: a turn a per-request log showed sent back without its
    reasoning (data_prep/request_log.py) is rendered so, though the turn itself is trained with it."""
    return [{k: v for k, v in m.items() if k != "reasoning_content"} if m.get(SENT_WITHOUT_REASONING) else m
            for m in messages]  # fmt: skip


def render_text(tokenizer, messages, tools=None, template_kwargs=None, add_generation_prompt=False) -> str:
    return apply_template(tokenizer, messages, tools, template_kwargs, add_generation_prompt, tokenize=False)


def answer_segments(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], tools=None, template_kwargs=None
) -> list[tuple[str, list[tuple[int, int]], int]]:
    """The samples a conversation gives: (rendering, [start, end) character span of each answer in it, the
    index of its last message), one per run of turns whose renderings are prefixes of one another."""
    segments = []
    text, spans, last = None, [], -1
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_text(
            tokenizer, as_sent(messages[:i]), tools, template_kwargs, add_generation_prompt=True
        )
        through_full = render_text(tokenizer, as_sent(messages[:i]) + [message], tools, template_kwargs)
        through = through_full.rstrip()
        if text is None:  # the first request: the tools are in it (or the template dropped them)
            check_tools_rendered(before, tools)
        if through.startswith(before):
            span = (len(before), len(through))
        else:  # a template whose generation prompt is not how it renders an answer's start
            span = _search_answer(through, message, before)
        check_tools_rendered(through[span[0] : span[1]], None, message)
        reasoning = message.get("reasoning_content", "").strip()
        if reasoning and reasoning not in through[span[0] : span[1]]:
            raise TemplateDropsReasoning(
                "the chat template renders no reasoning (`reasoning_content`) in an answer: give the target a "
                "template that renders it (target.chat_template), or data without it"
            )
        if message.get("finish_reason") == "length":
            span = (span[0], cut_end(through, message, span))
        trained = [span] if message.get("weight", 1) != 0 else []  # weight 0: context only
        if text is not None and through.startswith(text.rstrip()) and span[0] >= len(text.rstrip()):
            spans += trained
        else:
            if text is not None:
                segments.append((text, spans, last))
            spans = trained
        text, last = through_full, i
    if text is not None:
        segments.append((text, spans, last))
    return segments


def cut_end(through: str, message: dict, span: tuple[int, int]) -> int:
    """Where an answer cut at the token limit ends in its rendering: after its last text (its content, or
    its reasoning when cut while reasoning), before what the template closes it with."""
    tail = message["content"].strip() or message.get("reasoning_content", "").strip()
    start = through.rfind(tail, span[0], span[1]) if tail else -1
    return start + len(tail) if start >= 0 else span[1]


def _search_answer(through: str, message: dict, before: str) -> tuple[int, int]:
    """Fallback for templates that render an answer's start unlike their generation prompt: the answer's
    text (whole, or after its reasoning) found after the part `through` shares with the prompt."""
    common = 0
    while common < min(len(before), len(through)) and before[common] == through[common]:
        common += 1
    content = message["content"]
    for answer in dict.fromkeys([content.strip(), content.rpartition(REASONING_END)[2].strip()]):
        start = through.rfind(answer, common) if answer else -1
        if start >= 0:
            return start, len(through)
    raise ValueError("the assistant answer does not appear in the template's rendering")


def _tokens(tokenizer, sample_id: str, text: str, spans: list[tuple[int, int]]) -> RenderedSample:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = []
    span_index = 0
    for start, _ in encoding["offset_mapping"]:
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= start
        loss_mask.append(int(inside))
    return RenderedSample(sample_id, list(encoding["input_ids"]), loss_mask)


def render_samples(
    tokenizer: PreTrainedTokenizerBase, conv_id: str, messages: list[dict], tools=None, template_kwargs=None
) -> list[RenderedSample]:
    """The token ids and loss masks (untruncated) of a conversation's samples: one, `conv_id`, when the
    template keeps history as it was generated; else one per run of turns, `conv_id/turn<n>` with n the
    number of its last assistant turn (1-based)."""
    segments = [s for s in answer_segments(tokenizer, messages, tools, template_kwargs) if s[1]]
    if len(segments) == 1:
        return [_tokens(tokenizer, conv_id, segments[0][0], segments[0][1])]
    samples = []
    for text, spans, last in segments:
        turn = sum(m["role"] == "assistant" for m in messages[: last + 1])
        samples.append(_tokens(tokenizer, f"{conv_id}/turn{turn}", text, spans))
    return samples


def render_prompt(
    tokenizer: PreTrainedTokenizerBase, conv_id: str, messages: list[dict], tools=None, template_kwargs=None
) -> RenderedSample:
    """The request that asks for the next answer (the generation prompt last), what regeneration sends the
    engine; its mask marks the earlier answers this request holds as they were generated (the last run of
    turns whose renderings are prefixes of it)."""
    text = render_text(tokenizer, as_sent(messages), tools, template_kwargs, add_generation_prompt=True)
    segments = answer_segments(tokenizer, messages, tools, template_kwargs)
    spans = segments[-1][1] if segments and text.startswith(segments[-1][0].rstrip()) else []
    return _tokens(tokenizer, conv_id, text, spans)


def render_all(
    tokenizer, conversations, max_length: int, overlong: str, template_kwargs=None
) -> tuple[list[RenderedSample], Counter, int]:
    """Render every conversation and apply the max-length policy.

    Returns the samples, the skipped conversations counted by reason, and how many were truncated.
    """
    samples, skipped, num_truncated = [], Counter(), 0
    for conv in conversations:
        try:
            kwargs = request_kwargs(template_kwargs, getattr(conv, "template_kwargs", None))
            rendered = render_samples(tokenizer, conv.id, conv.messages, getattr(conv, "tools", None), kwargs)
        except TemplateDrops as error:
            log.warning("conversation %s: %s", conv.id, error)
            skipped[error.reason] += 1
            continue
        except (
            Exception
        ) as error:  # a template may raise on what it rejects: one record must not stop the run
            log.warning("conversation %s: cannot render with the chat template: %s", conv.id, error)
            skipped["template_error"] += 1
            continue
        for sample in rendered:
            sample = fit_length(sample, max_length, overlong, skipped)
            if sample is not None:
                num_truncated += sample.truncated
                samples.append(sample)
    return samples, skipped, num_truncated


def fit_length(sample: RenderedSample, max_length: int, overlong: str, skipped: Counter):
    """The max-length policy on one sample: truncated (`sample.truncated` set), or None - dropped as too
    long or for having nothing to train on, counted in `skipped` by reason."""
    sample.truncated = len(sample.input_ids) > max_length
    if sample.truncated:
        if overlong == "drop":
            skipped["too_long"] += 1
            return None
        sample.input_ids = sample.input_ids[:max_length]
        sample.loss_mask = sample.loss_mask[:max_length]
    if sum(sample.loss_mask) == 0:
        skipped["no_loss_tokens"] += 1
        return None
    return sample
