"""Replace every assistant turn with the target's own answer, turn by turn, through vLLM's offline API.

A head learns the target's own style best (the EAGLE-3 recipe): answer j of a conversation is generated
from its user turns and the target's own earlier answers. The conversations are cut into chunks of
`regen.batch_size`; rank r of N regenerates chunks r, r+N, ... and writes each one to its own file
(atomically) as soon as it is done, so an interrupted run loses at most one chunk per rank, and a rerun -
with any number of processes - reuses every finished chunk.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from collections import Counter
from pathlib import Path

from artifacts.cache import file_sha256
from artifacts.manifest import write_json_atomic
from target.vllm import EngineSettings, llm_kwargs

log = logging.getLogger(__name__)


def regen_settings(cfg) -> dict:
    """What decides the regenerated text: recorded in the manifest and part of the cache's identity."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
    }


def start_engine(target_path: str, cfg, device_index: int | None = None):
    from vllm import LLM

    if device_index is not None:
        # One engine per rank, on that rank's GPU: the engine process inherits this variable.
        os.environ["CUDA_VISIBLE_DEVICES"] = str(device_index)
    # No counters to read here: the offline engine keeps its stats off, as it does by default.
    settings = EngineSettings(
        target_path, None, dict(cfg.vllm_kwargs), "regen.vllm_kwargs", seed=cfg.seed, log_stats=False
    )
    return LLM(**llm_kwargs(settings))


def regenerate_conversations(llm, conversations, cfg):
    """New conversations whose assistant turns are the target's answers, and counts of what happened.

    A conversation is cut before the first turn the target answers with nothing, or whose prompt does
    not fit the engine's `max_model_len` (and dropped if that is its first answer): an empty answer
    teaches the draft nothing.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens)
    tokenizer = llm.get_tokenizer()
    max_model_len = llm.llm_engine.model_config.max_model_len
    counts = Counter()
    # Each conversation as its system/user turns; answers are filled in round by round.
    users = [[m for m in c.messages if m["role"] != "assistant"] for c in conversations]
    num_answers = [sum(m["role"] == "assistant" for m in c.messages) for c in conversations]
    history = [[m for m in u if m["role"] == "system"] for u in users]
    questions = [[m for m in u if m["role"] == "user"] for u in users]
    alive = [n > 0 for n in num_answers]
    for turn in range(max(num_answers, default=0)):
        batch, prompts = [], []
        for i in range(len(conversations)):
            if not (alive[i] and turn < num_answers[i]):
                continue
            prompt = history[i] + [questions[i][turn]]
            # vLLM refuses a whole call over one prompt longer than the engine: leave those out here.
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
            if len(tokenizer.encode(text, add_special_tokens=False)) >= max_model_len:
                counts["prompt_too_long"] += 1
                alive[i] = False
                continue
            batch.append(i)
            prompts.append(prompt)
        if not batch:
            break
        outputs = llm.chat(prompts, params, use_tqdm=True)
        for i, prompt, output in zip(batch, prompts, outputs):
            completion = output.outputs[0]
            counts[f"finish_{completion.finish_reason}"] += 1
            if not completion.text.strip():
                counts["empty_answer"] += 1
                alive[i] = False
                continue
            history[i] = prompt + [{"role": "assistant", "content": completion.text}]

    regenerated = []
    for conv, messages, ok in zip(conversations, history, alive):
        if any(m["role"] == "assistant" for m in messages):
            regenerated.append(type(conv)(id=conv.id, messages=messages))
            counts["conversations_cut_short"] += int(not ok)
        else:
            counts["conversations_dropped"] += 1
    return regenerated, counts


def regenerate_rank_share(conversations, target_path: str, cfg, out_dir: Path, accelerator):
    """Regenerate this rank's chunks (reusing finished ones), then read every chunk in order.

    Returns the conversations and a record for the manifest: counts of what happened, the vLLM version
    and the checksum of each chunk file of regenerated conversations (in `out_dir`).
    """
    import vllm

    if cfg.batch_size < 1:
        raise ValueError(f"regen.batch_size={cfg.batch_size}: must be at least 1")
    out_dir.mkdir(parents=True, exist_ok=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    chunks = [conversations[i : i + cfg.batch_size] for i in range(0, len(conversations), cfg.batch_size)]

    def chunk_path(c):
        return out_dir / f"chunk-{c:05d}-of-{len(chunks):05d}.json"

    mine = range(rank, len(chunks), world)
    todo = [c for c in mine if not chunk_path(c).exists()]
    if len(todo) < len(mine):
        log.info("reusing %d finished chunk(s) of regenerated answers in %s", len(mine) - len(todo), out_dir)
    if todo:
        device_index = accelerator.local_process_index if accelerator.device.type == "cuda" else None
        llm = start_engine(target_path, cfg, device_index)
        for number, c in enumerate(todo):
            log.info("regenerating chunk %d of %d (%d conversations; %d/%d of this rank's)",
                     c + 1, len(chunks), len(chunks[c]), number + 1, len(todo))  # fmt: skip
            new, counts = regenerate_conversations(llm, chunks[c], cfg)
            write_json_atomic(
                chunk_path(c),
                {"counts": counts, "conversations": [{"id": x.id, "messages": x.messages} for x in new]},
            )
        del llm
        gc.collect()
    accelerator.wait_for_everyone()

    by_id, counts = {}, Counter()
    for c in range(len(chunks)):
        data = json.loads(chunk_path(c).read_text())
        counts.update(data["counts"])
        by_id.update({x["id"]: x["messages"] for x in data["conversations"]})
    counts = {
        **counts,
        "vllm_version": vllm.__version__,
        "files": {chunk_path(c).name: file_sha256(chunk_path(c)) for c in range(len(chunks))},
    }
    kind = type(conversations[0])
    return [kind(id=c.id, messages=by_id[c.id]) for c in conversations if c.id in by_id], counts
