"""Render conversations with the target's own chat template and mark the assistant tokens.

The loss mask is found without any table of templates: for each assistant turn i, the text the template
produces for `messages[:i]` with the generation prompt is where the answer starts, and the text for
`messages[:i+1]` is where it ends (its end-of-turn token included, trailing whitespace not). This holds for
any template whose renderings of a conversation's prefixes are prefixes of its full rendering (Llama-3,
ChatML, Llama-2, Mistral, ...). For templates that rewrite earlier turns (e.g. drop past reasoning, as
Qwen3's does), the answer's text - or, reasoning dropped, its text after `</think>` - is searched for in
the full rendering instead: the mask covers each answer as the template renders the whole conversation.

Mask convention, used by every stage: `loss_mask[t] == 1` iff token t belongs to an assistant answer, i.e.
it is a token the draft is trained to predict.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


REASONING_END = "</think>"  # where reasoning models' answers end their reasoning (Qwen3, DeepSeek-R1, ...)


@dataclass
class RenderedSample:
    id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to render.max_length


def _template(tokenizer, messages, add_generation_prompt=False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_char_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False
) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and the [start, end) character span of every assistant answer in it."""
    full = _template(tokenizer, messages, add_generation_prompt)
    spans = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _template(tokenizer, messages[:i], add_generation_prompt=True)
        through = _template(tokenizer, messages[: i + 1]).rstrip()
        if full.startswith(through) and through.startswith(before) and len(before) >= cursor:
            start, end = len(before), len(through)
        else:
            start, end = _search_answer(full, message["content"], through, before, cursor)
        spans.append((start, end))
        cursor = end
    return full, spans


def _search_answer(full: str, content: str, through: str, before: str, cursor: int) -> tuple[int, int]:
    """Fallback for templates that rewrite history: find the answer text itself after `cursor` - whole, or
    as reasoning models' templates render a past answer, its reasoning (up to `</think>`) dropped."""
    for answer in dict.fromkeys([content.strip(), content.rpartition(REASONING_END)[2].strip()]):
        start = full.find(answer, cursor) if answer else -1
        if start >= 0:
            break
    if start < 0:
        raise ValueError("the assistant answer does not appear in the template's rendering")
    end = start + len(answer)
    # Take the end-of-turn marker too: whatever follows the answer in this turn's own rendering.
    if through.startswith(before):
        suffix = through[len(before) :]
        cut = suffix.rfind(answer)
        if cut >= 0 and full.startswith(suffix[cut + len(answer) :], end):
            end += len(suffix) - cut - len(answer)
    return start, end


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, conv_id: str, messages: list[dict], add_generation_prompt=False
) -> RenderedSample:
    """Token ids of the chat-templated conversation and its assistant-only loss mask (untruncated); with
    `add_generation_prompt`, the prompt of the next answer (what regeneration sends the engine)."""
    text, spans = assistant_char_spans(tokenizer, messages, add_generation_prompt)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss_mask = []
    span_index = 0
    for start, _ in encoding["offset_mapping"]:
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= start
        loss_mask.append(int(inside))
    return RenderedSample(conv_id, list(encoding["input_ids"]), loss_mask)


def render_all(
    tokenizer, conversations, max_length: int, overlong: str
) -> tuple[list[RenderedSample], Counter, int]:
    """Render every conversation and apply the max-length policy.

    Returns the samples, the skipped conversations counted by reason, and how many were truncated.
    """
    samples, skipped, num_truncated = [], Counter(), 0
    for conv in conversations:
        try:
            sample = render_conversation(tokenizer, conv.id, conv.messages)
        except (
            Exception
        ) as error:  # a template may raise on content it rejects; one record must not stop the run
            log.warning("conversation %s: cannot render with the chat template: %s", conv.id, error)
            skipped["template_error"] += 1
            continue
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
