"""Replace every assistant turn with the target's own answer, turn by turn, through vLLM's offline API.

A head learns the target's own style best (the EAGLE-3 recipe): answer j of a conversation is generated
from its user turns and the target's own earlier answers. The conversations are cut into chunks of
`regen.batch_size`; rank r of N regenerates chunks r, r+N, ... and writes each one to its own file
(atomically) as soon as it is done, so an interrupted run loses at most one chunk per rank, and a rerun -
with any number of processes - reuses every finished chunk.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

from artifacts import atomic
from artifacts.cache import file_sha256
from data_prep.render import render_conversation
from target.vllm import EngineSettings, running_llm

log = logging.getLogger(__name__)


def regen_settings(cfg) -> dict:
    """What decides the regenerated text: recorded in the manifest and part of the cache's identity (and so
    of the head's record: artifacts/manifest.py answer_temperatures reads it)."""
    settings = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
    }
    if cfg.temperature > 0:  # sampled: how many answers, and seeds per request (greedy caches keep theirs)
        settings |= {
            "samples_per_prompt": cfg.samples_per_prompt,
            "include_greedy": cfg.include_greedy,
            "seeds": "per_request",
        }
    return settings


def answer_samples(conversations: list, cfg) -> list:
    """Each conversation `regen.samples_per_prompt` times, as `<id>#<j>`: each sample is regenerated with
    its own seeds, so a prompt gives that many different answers (one conversation each)."""
    n = cfg.samples_per_prompt
    if n == 1:
        return conversations
    return [type(c)(id=f"{c.id}#{j}", messages=c.messages) for c in conversations for j in range(n)]


def sampling_params(cfg, conversation_id: str, turn: int):
    """The request's vLLM sampling: greedy at temperature 0 (and for sample 0 with `include_greedy`), else
    sampled with a seed of its own from (regen.seed, the conversation id, the turn): a sample's answer does
    not depend on which requests share its batch, so a resumed chunk regenerates the same text."""
    from vllm import SamplingParams

    greedy = cfg.temperature == 0 or (cfg.include_greedy and conversation_id.rsplit("#", 1)[-1] == "0")
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=cfg.max_new_tokens)
    key = f"{cfg.seed}/{conversation_id}/{turn}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
    return SamplingParams(
        temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens, seed=seed
    )


def start_engine(target_path: str, cfg, device_index: int | None = None):
    """The plain regeneration engine (`capture.engine=hf`: the states are computed afterwards), a context:
    shut down when it leaves. Its processes start on this rank's GPU (`device_index`; None: CPU)."""
    # No counters to read here: the offline engine keeps its stats off, as it does by default.
    settings = EngineSettings(
        target_path, None, dict(cfg.vllm_kwargs), "regen.vllm_kwargs", seed=cfg.seed, log_stats=False
    )
    return running_llm(settings, (device_index, 1))


def regenerate_conversations(llm, tokenizer, conversations, cfg, capture=None, sink=None):
    """New conversations whose assistant turns are the target's answers, and counts of what happened.

    Each turn's prompt is rendered here with the target's chat template (data_prep/render.py) and sent as
    token ids, so the engine reads exactly the tokens the cache will hold. A conversation is cut before the
    first turn the target answers with nothing, or whose prompt does not fit the engine's `max_model_len`
    (and dropped if that is its first answer): an empty answer teaches the draft nothing.

    `capture` (a target/capture.CaptureEngine whose engine is `llm`): the states of every conversation are
    captured in the same pass, from the request of its last answered turn, which holds every earlier turn as
    its prompt. Each conversation kept then goes to `sink` as one sample, as soon as its states are read:
    its tokens (that prompt and the answer's tokens but the last, which no forward pass reads), its loss
    mask (the earlier answers and this one), its aux and final states and the regenerated conversation.
    """
    max_model_len = llm.llm_engine.model_config.max_model_len
    counts = Counter()
    # Each conversation as its system/user turns; answers are filled in round by round.
    users = [[m for m in c.messages if m["role"] != "assistant"] for c in conversations]
    num_answers = [sum(m["role"] == "assistant" for m in c.messages) for c in conversations]
    history = [[m for m in u if m["role"] == "system"] for u in users]
    questions = [[m for m in u if m["role"] == "user"] for u in users]
    alive = [n > 0 for n in num_answers]
    last = {}  # conversation -> (its prompt, the output) of its last answered turn, while capturing
    try:
        for turn in range(max(num_answers, default=0)):
            batch, prompts = [], []
            for i, conv in enumerate(conversations):
                if not (alive[i] and turn < num_answers[i]):
                    continue
                try:
                    prompt = render_conversation(tokenizer, conv.id, history[i] + [questions[i][turn]], True)
                except Exception as error:  # a template may reject a record: skip it, as render_all does
                    log.warning("conversation %s: cannot render turn %d with the chat template: %s",
                                conv.id, turn + 1, error)  # fmt: skip
                    counts["template_error"] += 1
                    alive[i], history[i] = False, []  # dropped whole: its earlier answers were rendered
                    continue  # in a context this turn's template rejects
                # vLLM refuses a whole call over one prompt longer than the engine: leave those out here.
                if len(prompt.input_ids) >= max_model_len:
                    counts["prompt_too_long"] += 1
                    alive[i] = False
                    continue
                batch.append(i)
                prompts.append(prompt)
            if not batch:
                break
            params = [sampling_params(cfg, conversations[i].id, turn) for i in batch]
            if capture is None:
                outputs = llm.generate(token_prompts([p.input_ids for p in prompts]), params, use_tqdm=True)
            else:
                outputs = capture.generate([p.input_ids for p in prompts], params, True, progress=True)
            for i, prompt, output in zip(batch, prompts, outputs):
                completion = output.outputs[0]
                counts[f"finish_{completion.finish_reason}"] += 1
                if not completion.text.strip():
                    counts["empty_answer"] += 1
                    alive[i] = False
                    if capture is not None:
                        capture.discard(output)
                    continue
                history[i] = history[i] + [
                    questions[i][turn],
                    {"role": "assistant", "content": completion.text},
                ]
                if capture is not None:
                    if i in last:
                        capture.discard(last[i][1])  # superseded: this turn's request holds that one's tokens
                    last[i] = (prompt, output)

        regenerated = []
        for i, (conv, messages, ok) in enumerate(zip(conversations, history, alive)):
            if not any(m["role"] == "assistant" for m in messages):
                counts["conversations_dropped"] += 1
                continue
            regenerated.append(type(conv)(id=conv.id, messages=messages))
            counts["conversations_cut_short"] += int(not ok)
            if capture is not None:
                prompt, output = last.pop(i)
                answer = list(output.outputs[0].token_ids)[:-1]
                ids = prompt.input_ids + answer
                aux, final = capture.states(output, ids, f"conversation {conv.id!r}")
                sink({"id": conv.id, "input_ids": ids, "loss_mask": prompt.loss_mask + [1] * len(answer),
                      "aux_hidden": aux, "final_hidden": final, "conversation": regenerated[-1]})  # fmt: skip
    finally:
        for _, output in last.values():  # an error or an interrupt: no capture file is left behind
            capture.discard(output)
    return regenerated, counts


def token_prompts(prompts: list[list[int]]):
    """vLLM's prompts for token-id lists: the engine reads them as they are, without tokenizing."""
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=p) for p in prompts]


def remove_stale_chunks(out_dir: Path, current: set[str], batch_size: int) -> None:
    """Remove chunk files another chunking left (regen.batch_size changed since they were written): their
    conversations are regenerated in this run's chunks, said in the log."""
    stale = [p for p in out_dir.glob("chunk-*-of-*.json") if p.name not in current]
    if stale:
        log.warning(
            "%s: %d chunk file(s) of another regen.batch_size than %d (or other data): removed; their "
            "conversations are regenerated in chunks of %d",
            out_dir, len(stale), batch_size, batch_size,
        )  # fmt: skip
        for path in stale:
            path.unlink(missing_ok=True)


def regenerate_rank_share(
    conversations, tokenizer, target_path: str, cfg, out_dir: Path, accelerator, capture=None
):
    """Regenerate this rank's chunks (reusing finished ones), then read every chunk in order.

    Returns the conversations, a record for the manifest (counts of what happened, the vLLM version and
    the checksum of each chunk file of regenerated conversations, in `out_dir`) and each chunk's shards.

    `capture` (data_prep/capture.CapturedChunks): the states are captured in the same pass and each chunk's
    samples written as cache shards ({split: [file names]}) before its chunk file; a chunk counts as finished
    only when its shards verify too. None: no states, and the shards returned are None.
    """
    import vllm

    out_dir.mkdir(parents=True, exist_ok=True)
    world, rank = accelerator.num_processes, accelerator.process_index
    chunks = [conversations[i : i + cfg.batch_size] for i in range(0, len(conversations), cfg.batch_size)]

    def chunk_path(c):
        return out_dir / f"chunk-{c:05d}-of-{len(chunks):05d}.json"

    def ids(c):
        return [conv.id for conv in chunks[c]]

    def finished(c):
        if not chunk_path(c).exists():
            return False
        data = json.loads(chunk_path(c).read_text())
        if data.get("ids") != ids(c):  # written for other chunks (another regen.batch_size or data)
            return False
        return capture is None or capture.verify(data.get("shards"))

    if accelerator.is_main_process:
        remove_stale_chunks(out_dir, {chunk_path(c).name for c in range(len(chunks))}, cfg.batch_size)
    mine = range(rank, len(chunks), world)
    todo = [c for c in mine if not finished(c)]
    if len(todo) < len(mine):
        log.info("reusing %d finished chunk(s) of regenerated answers in %s", len(mine) - len(todo), out_dir)
    if todo:
        device_index = accelerator.local_process_index if accelerator.device.type == "cuda" else None
        running = (
            start_engine(target_path, cfg, device_index) if capture is None else capture.engine(device_index)
        )
        with running as engine:
            for number, c in enumerate(todo):
                log.info("regenerating chunk %d of %d (%d conversations; %d/%d of this rank's)",
                         c + 1, len(chunks), len(chunks[c]), number + 1, len(todo))  # fmt: skip
                if capture is None:
                    new, counts = regenerate_conversations(engine, tokenizer, chunks[c], cfg)
                    shards = {}
                else:
                    writer = capture.chunk_writer(c)  # shards of cache.max_shard_mb, written as they fill
                    new, counts = regenerate_conversations(
                        engine.llm, tokenizer, chunks[c], cfg, engine, writer.add
                    )
                    shards = {"shards": writer.close()}
                    counts.update(writer.counts)
                conversations_done = [{"id": x.id, "messages": x.messages} for x in new]
                atomic.write_json(
                    chunk_path(c),
                    {"ids": ids(c), "counts": counts, **shards, "conversations": conversations_done},
                )
    accelerator.wait_for_everyone()

    by_id, counts, shards = {}, Counter(), []
    for c in range(len(chunks)):
        data = json.loads(chunk_path(c).read_text())
        counts.update(data["counts"])
        by_id.update({x["id"]: x["messages"] for x in data["conversations"]})
        shards.append(data.get("shards"))
    counts = {
        **counts,
        "vllm_version": vllm.__version__,
        "files": {chunk_path(c).name: file_sha256(chunk_path(c)) for c in range(len(chunks))},
    }
    kind = type(conversations[0])
    regenerated = [kind(id=c.id, messages=by_id[c.id]) for c in conversations if c.id in by_id]
    return regenerated, counts, (shards if capture is not None else None)
