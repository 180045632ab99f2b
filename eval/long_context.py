"""Long prompts for measuring acceptance by context length, from what is shipped here (nothing downloaded;
artifacts/long_data.py), on the held-out side of data_prep's split (the prompt hash of
`data.eval_fraction`: none of them was trained on, whatever long data a head was trained on):

- `long_chat`: ShareGPT conversations continued at their last user turn - the whole history before it, the
  answers as logged - first the conversations whose parts the shipped file split apart, joined again
  (2k-8k+ tokens), then the file's records as they are;
- `long_code`: Python's own standard-library files, each whole in a user turn with a question about it;
- `long_agent`: a coding agent's session about each such file - its task, its calls and the tools' results
  (the file's directory listed, the lines naming a definition found, the file read whole) - rendered with
  its tools, ending where the agent answers (serve it with a chat template that renders tools, e.g.
  `target.chat_template=${chat_template:smollm2_tools.jinja}`; the default SmolLM2 template drops the calls).

Both are spread over the context buckets (`eval.context_buckets`) up to the longest prompt the server
takes (its `max_model_len` less the workload's `max_tokens`): as many prompts in each bucket as the sources
give, taken in a fixed order, so that every bucket is measured on requests of its own length.

    prompts = long_prompts("long_code", tokenizer, 24, [512, 2048, 4096, 8192], 8064, {}, 0.05)
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from types import SimpleNamespace

from artifacts.prompts import chat_prompt_ids, record_messages

LONG_SOURCES = ("long_chat", "long_code", "long_agent")
MAX_RECORDS = 20000  # ShareGPT records read at most for long_chat (a few seconds of parsing)


def held_out(messages: list[dict], eval_fraction: float) -> bool:
    from data_prep.sources import is_held_out

    return is_held_out(SimpleNamespace(messages=messages), eval_fraction)


def long_chat_messages(eval_fraction: float) -> Iterator[list[dict]]:
    """Held-out ShareGPT conversations of two or more questions, up to their last user turn: the joined
    ones first, then the file's records, in file order."""
    from artifacts.long_data import sharegpt_joined, sharegpt_records

    records = itertools.chain(sharegpt_joined(), itertools.islice(sharegpt_records(), MAX_RECORDS))
    for record in records:
        try:
            messages = record_messages(record)
        except ValueError:
            continue  # a record eval cannot send: skipped, as data_prep skips it
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if len(users) < 2 or not held_out(messages, eval_fraction):
            continue
        yield messages[: users[-1] + 1]


def long_code_messages(eval_fraction: float) -> Iterator[list[dict]]:
    """A question about each held-out standard-library file (artifacts/long_data.py), in its fixed order."""
    from artifacts.long_data import code_conversations

    for record in code_conversations(max_chars=None):
        if held_out(record["messages"], eval_fraction):
            yield record["messages"]


def long_agent_records(eval_fraction: float) -> Iterator[dict]:
    """A held-out agent session about each standard-library file (artifacts/long_data.py), with its tools."""
    from artifacts.long_data import agent_conversations

    for record in agent_conversations(max_chars=None):
        if held_out(record["messages"], eval_fraction):
            yield record


def spread_by_length(prompts: Iterator[list[int]], bounds: list[int], num_prompts: int, limit: int):
    """Up to `num_prompts` of `prompts`, an equal share in each context bucket up to `limit` tokens (the
    buckets' bounds `bounds`, the last one closed at `limit`), in bucket order."""
    edges = [b for b in sorted(bounds) if b < limit] + [limit]
    quota = math.ceil(num_prompts / len(edges))
    chosen: list[list[list[int]]] = [[] for _ in edges]
    for ids in prompts:
        if len(ids) > limit:
            continue
        bucket = chosen[bisect.bisect_left(edges, len(ids))]
        if len(bucket) < quota:
            bucket.append(ids)
        if all(len(b) >= quota for b in chosen):
            break
    return [ids for bucket in chosen for ids in bucket][:num_prompts]


def long_prompts(
    source: str, tokenizer, num_prompts: int, bounds: list[int], limit: int, template_kwargs, eval_fraction
) -> list[list[int]]:
    """The token ids of a long-context workload's prompts (module docstring), spread over the buckets."""
    if source == "long_agent":
        records = long_agent_records(eval_fraction)
    else:
        messages = (long_chat_messages if source == "long_chat" else long_code_messages)(eval_fraction)
        records = ({"messages": m} for m in messages)
    rendered = (
        chat_prompt_ids(tokenizer, r["messages"], r.get("tools"), template_kwargs=template_kwargs)
        for r in records
    )
    return spread_by_length(rendered, bounds, num_prompts, limit)
