"""Replace every assistant turn with the target's own answer, turn by turn, through vLLM's offline API.

A head learns the target's own style best (the EAGLE-3 recipe): answer j of a conversation is generated
from its user turns and the target's own earlier answers. Rank r of N regenerates conversations
r, r+N, ...; each rank's results go to their own file (written atomically) and are reused on a rerun.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections import Counter
from pathlib import Path

from eagle.cache import file_sha256
from eagle.manifest import write_json_atomic

log = logging.getLogger(__name__)


def regen_settings(cfg) -> dict:
    """What decides the regenerated text: recorded in the manifest and part of the cache's identity."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
    }


def regenerate_conversations(conversations, target_path: str, cfg, device_index: int | None = None):
    """New conversations whose assistant turns are the target's answers, and counts of what happened.

    A conversation is cut before the first turn the target answers with nothing (and dropped if that is
    its first answer): an empty answer teaches the draft nothing.
    """
    from vllm import LLM, SamplingParams

    if device_index is not None:
        # One engine per rank, on that rank's GPU: the engine process inherits this variable.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device_index)
    llm = LLM(model=target_path, seed=cfg.seed, **dict(cfg.vllm_kwargs))
    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens)
    counts = Counter()
    # Each conversation as its system/user turns; answers are filled in round by round.
    users = [[m for m in c.messages if m["role"] != "assistant"] for c in conversations]
    num_answers = [sum(m["role"] == "assistant" for m in c.messages) for c in conversations]
    history = [[m for m in u if m["role"] == "system"] for u in users]
    questions = [[m for m in u if m["role"] == "user"] for u in users]
    alive = [n > 0 for n in num_answers]
    for turn in range(max(num_answers, default=0)):
        active = [i for i in range(len(conversations)) if alive[i] and turn < num_answers[i]]
        for start in range(0, len(active), cfg.batch_size):
            batch = active[start : start + cfg.batch_size]
            prompts = [history[i] + [questions[i][turn]] for i in batch]
            outputs = llm.chat(prompts, params, use_tqdm=True)
            for i, prompt, output in zip(batch, prompts, outputs):
                completion = output.outputs[0]
                counts[f"finish_{completion.finish_reason}"] += 1
                if not completion.text.strip():
                    counts["empty_answer"] += 1
                    alive[i] = False
                    continue
                history[i] = prompt + [{"role": "assistant", "content": completion.text}]
    del llm
    gc.collect()

    regenerated = []
    for conv, messages, ok in zip(conversations, history, alive):
        if any(m["role"] == "assistant" for m in messages):
            regenerated.append(type(conv)(id=conv.id, messages=messages))
            counts["conversations_cut_short"] += int(not ok)
        else:
            counts["conversations_dropped"] += 1
    return regenerated, counts


def regenerate_rank_share(conversations, target_path: str, cfg, out_dir: Path, accelerator):
    """Regenerate this rank's share (reusing a finished file), then read every rank's results in order.

    Returns the conversations and a record for the manifest: counts of what happened, the vLLM version
    and the checksum of each rank's file of regenerated conversations (in `out_dir`).
    """
    import vllm

    out_dir.mkdir(parents=True, exist_ok=True)
    world, rank = accelerator.num_processes, accelerator.process_index

    def part(r):
        return out_dir / f"part-{r:05d}-of-{world:05d}.json"

    if not part(rank).exists():
        mine = conversations[rank::world]
        device_index = accelerator.local_process_index if accelerator.device.type == "cuda" else None
        new, counts = regenerate_conversations(mine, target_path, cfg, device_index)
        write_json_atomic(
            part(rank),
            {"counts": counts, "conversations": [{"id": c.id, "messages": c.messages} for c in new]},
        )
    else:
        log.info("reusing regenerated answers in %s", part(rank))
    accelerator.wait_for_everyone()

    by_id, counts = {}, Counter()
    for r in range(world):
        data = json.loads(part(r).read_text())
        counts.update(data["counts"])
        by_id.update({c["id"]: c["messages"] for c in data["conversations"]})
    counts = {
        **counts,
        "vllm_version": vllm.__version__,
        "files": {part(r).name: file_sha256(part(r)) for r in range(world)},
    }
    kind = type(conversations[0])
    return [kind(id=c.id, messages=by_id[c.id]) for c in conversations if c.id in by_id], counts
