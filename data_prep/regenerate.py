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
from dataclasses import replace
from pathlib import Path

from artifacts import atomic
from artifacts.cache import file_sha256
from artifacts.conversation import answered
from artifacts.prompts import request_kwargs
from data_prep.render import SENT_WITHOUT_REASONING, TemplateDrops, render_prompt
from target.answers import AnswerReader, tool_calls_of
from target.vllm import EngineSettings, running_llm

log = logging.getLogger(__name__)


def answer_samples(conversations: list, cfg) -> list:
    """Each conversation `regen.samples_per_prompt` times, as `<id>#<j>`: each sample is regenerated with
    its own seeds, so a prompt gives that many different answers (one conversation each)."""
    n = cfg.samples_per_prompt
    if n == 1:
        return conversations
    return [replace(c, id=f"{c.id}#{j}") for c in conversations for j in range(n)]


def sampling_params(cfg, conversation_id: str, turn: int, skip_special_tokens: bool = True):
    """The request's vLLM sampling: greedy at temperature 0 (and for sample 0 with `include_greedy`), else
    sampled with a seed of its own from (regen.seed, the conversation id, the turn): a sample's answer does
    not depend on which requests share its batch, so a resumed chunk regenerates the same text. Decoded as
    the server decodes it (`skip_special_tokens`, from the parsers: AnswerReader.skip_special_tokens)."""
    from vllm import SamplingParams

    greedy = cfg.temperature == 0 or (cfg.include_greedy and conversation_id.rsplit("#", 1)[-1] == "0")
    if greedy:
        return SamplingParams(
            temperature=0.0, max_tokens=cfg.max_new_tokens, skip_special_tokens=skip_special_tokens
        )
    key = f"{cfg.seed}/{conversation_id}/{turn}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:4], "little")
    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_new_tokens,
                          seed=seed, skip_special_tokens=skip_special_tokens)  # fmt: skip


def start_engine(target_path: str, cfg, device_index: int | None = None):
    """The plain regeneration engine (`capture.engine=hf`: the states are computed afterwards), a context:
    shut down when it leaves. Its processes start on this rank's GPU (`device_index`; None: CPU)."""
    # No counters to read here: the offline engine keeps its stats off, as it does by default.
    settings = EngineSettings(
        target_path, None, dict(cfg.vllm_kwargs), "regen.vllm_kwargs", seed=cfg.seed, log_stats=False
    )
    return running_llm(settings, (device_index, 1))


UNANSWERED = {"role": "assistant", "content": None}  # what was logged after a question kept unanswered


def conversation_steps(messages: list[dict]) -> list[tuple[list[dict], dict]]:
    """Per assistant turn: the messages that come before it and after the answer before it (the system
    message and a user turn, or the tool results it answers), and the logged answer; a last question no
    answer follows (`data.unanswered=answer`) is a turn too, whose logged answer is UNANSWERED."""
    steps, inputs = [], []
    for message in messages:
        if message["role"] == "assistant":
            steps.append((inputs, message))
            inputs = []
        else:
            inputs.append(message)
    if inputs and any(m["role"] in ("user", "tool") for m in inputs):
        steps.append((inputs, UNANSWERED))
    return steps


def check_tool_parser(conversations, cfg) -> None:
    """Regenerating a conversation with tools needs the server's tool-call parser, to read a regenerated call
    and compare it with the logged one."""
    with_tools = next((c.id for c in conversations if c.tools
                       or any(m.get("tool_calls") for m in c.messages)), None)  # fmt: skip
    if with_tools is not None and not getattr(cfg, "tool_parser", None):
        raise ValueError(
            f"conversation {with_tools!r} has tools or tool calls: set regen.tool_parser to the parser the "
            "target is served with (`vllm serve --tool-call-parser`, e.g. hermes for Qwen3 and Hermes-style "
            "templates), so that regenerated tool calls are read as the server reads them"
        )


def regenerate_conversations(
    llm, tokenizer, conversations, cfg, capture=None, sink=None, template_kwargs=None
):
    """New conversations whose assistant turns are the target's answers, and counts of what happened.

    Each turn's prompt is the history so far (the target's earlier answers, as the server renders them) and
    the logged messages that led to the turn (a user turn, or the results of the calls it answers), rendered
    here with the target's chat template, its tools and `template_kwargs` (the request's own over them:
    data_prep/render.py), and sent as token ids, so the engine reads exactly the tokens the cache will hold.
    The answer is decoded and read as the server does it (target/answers.py: `regen.reasoning_parser`,
    `regen.tool_parser`, and their `skip_special_tokens`). A conversation
    ends after a regenerated turn whose tool calls differ from the logged ones (`tool_call_diverged`: the
    logged results no longer answer them); it is cut before the first turn the target answers with nothing,
    or whose prompt does not fit the engine's `max_model_len` (and dropped if that is its first answer).

    Every trained token is one the target generated, as it generated it: a sample is a request's token ids
    and the answer's generated ids (an answer cut at `max_new_tokens` stays cut: no end of turn is added). A
    request that holds the previous request and its answer token for token carries that answer's mask, and
    the previous request is no sample of its own; a request whose template re-rendered the earlier answers
    otherwise (Qwen3 drops the reasoning of earlier turns; a parser's content may render with other
    whitespace) trains none of them, and the previous request and its answer are a sample of their own
    (`<id>/turn<n>`, as render_samples names them). An answer to a logged turn of `weight` 0 is not trained.
    Each sample goes to `sink` as it is made: its id, `conversation` (the regenerated one), token ids and
    loss mask, and with `capture` (a target/capture.CaptureEngine whose engine is `llm`, which captures the
    states in the same pass) its aux and final states - for the prompt and the answer's tokens but the last,
    which no forward pass reads.
    """
    check_tool_parser(conversations, cfg)
    reader = AnswerReader(
        tokenizer, getattr(cfg, "tool_parser", None), getattr(cfg, "reasoning_parser", None), template_kwargs
    )
    max_model_len = llm.llm_engine.model_config.max_model_len
    kwargs = [
        request_kwargs(template_kwargs, c.template_kwargs) for c in conversations
    ]  # each request's thinking mode
    skips = [reader.skip_special_tokens(c.tools, k) for c, k in zip(conversations, kwargs)]
    counts = Counter()
    steps = [conversation_steps(c.messages) for c in conversations]
    history = [[] for _ in conversations]
    alive = [bool(s) for s in steps]
    diverged = [False] * len(conversations)
    last = {}  # conversation -> (ids, loss mask, output, number of answers) of its last request and answer
    num_own = Counter()  # conversation -> the samples it sent to `sink` before its last

    def discard(output) -> None:
        if capture is not None:
            capture.discard(output)

    def emit(i: int) -> None:
        ids, mask, output, turn = last.pop(i)
        conv = conversations[i]
        split_id = f"{conv.id}/turn{turn}" if num_own[i] or alive[i] else conv.id
        num_own[i] += 1
        done = replace(conv, messages=history[i])
        sample = {"id": split_id, "conversation": done}
        if capture is not None:  # the states of every token a forward pass read: all but the last
            ids, mask = ids[:-1], mask[:-1]
            sample["aux_hidden"], sample["final_hidden"] = capture.states(
                output, ids, f"conversation {conv.id!r}"
            )
        if sink is not None:
            sink(sample | {"input_ids": ids, "loss_mask": mask})

    try:
        for turn in range(max(map(len, steps), default=0)):
            batch, prompts, requests = [], [], {}
            for i, conv in enumerate(conversations):
                if not (alive[i] and turn < len(steps[i])):
                    continue
                messages = history[i] + steps[i][turn][0]
                try:
                    prompt = render_prompt(tokenizer, conv.id, messages, conv.tools, kwargs[i])
                except Exception as error:  # a template may reject a record: skip it, as render_all does
                    log.warning("conversation %s: cannot render turn %d with the chat template: %s",
                                conv.id, turn + 1, error)  # fmt: skip
                    counts[error.reason if isinstance(error, TemplateDrops) else "template_error"] += 1
                    alive[i], history[i] = False, []  # dropped whole: its earlier answers were rendered
                    if i in last:  # in a context this turn's template rejects
                        discard(last.pop(i)[2])
                    continue
                # vLLM refuses a whole call over one prompt longer than the engine: leave those out here.
                if len(prompt.input_ids) >= max_model_len:
                    counts["prompt_too_long"] += 1
                    alive[i] = False
                    continue
                batch.append(i)
                prompts.append(prompt)
                requests[i] = messages
            if not batch:
                break
            params = [sampling_params(cfg, conversations[i].id, turn, skips[i]) for i in batch]
            if capture is None:
                outputs = llm.generate(token_prompts([p.input_ids for p in prompts]), params, use_tqdm=True)
            else:
                outputs = capture.generate([p.input_ids for p in prompts], params, True, progress=True)
            for i, prompt, output in zip(batch, prompts, outputs):
                completion = output.outputs[0]
                counts[f"finish_{completion.finish_reason}"] += 1
                answer = reader.message(completion.text, conversations[i].tools, kwargs[i])
                if not answered(answer):
                    counts["empty_answer"] += 1
                    alive[i] = False
                    discard(output)
                    continue
                logged = steps[i][turn][1]
                if logged is not UNANSWERED and tool_calls_of(answer) != tool_calls_of(logged):
                    counts["tool_call_diverged"] += 1
                    diverged[i] = True
                elif answer.get("tool_calls"):  # the same calls: keep their ids, which the results name
                    answer["tool_calls"] = [{**new, **({"id": old["id"]} if "id" in old else {})}
                                            for new, old in zip(answer["tool_calls"], logged["tool_calls"])]  # fmt: skip
                counts["tool_calls_regenerated"] += len(answer.get("tool_calls") or [])
                # what the log says of the turn: not to train it (OpenAI's `weight`), sent back without reasoning
                answer |= {k: logged[k] for k in ("weight", SENT_WITHOUT_REASONING) if k in logged}
                history[i] = requests[i] + [answer]
                mask = [0] * len(prompt.input_ids)
                if i in last:
                    held_ids, held_mask, held_output, _ = last[i]
                    if prompt.input_ids[: len(held_ids)] == held_ids:  # it holds that answer as generated
                        discard(last.pop(i)[2])
                        mask[: len(held_mask)] = held_mask
                    else:  # the template re-rendered it: that request and its answer are a sample of their own
                        emit(i)
                generated = list(completion.token_ids)
                trained = int(logged.get("weight", 1) != 0)
                last[i] = (prompt.input_ids + generated, mask + [trained] * len(generated), output, turn + 1)
                alive[i] = alive[i] and not diverged[i]

        regenerated = []
        for i, (conv, messages, ok) in enumerate(zip(conversations, history, alive)):
            if not any(m["role"] == "assistant" for m in messages):
                counts["conversations_dropped"] += 1
                continue
            regenerated.append(replace(conv, messages=messages))
            ended_early = not ok and not diverged[i] or diverged[i] and len(messages) < len(conv.messages)
            counts["conversations_cut_short"] += int(ended_early)
            if i in last:
                alive[i] = False  # its last sample: named `<id>` unless an earlier one was its own
                emit(i)
    finally:
        for _, _, output, _ in last.values():  # an error or an interrupt: no capture file is left behind
            discard(output)
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
    conversations,
    tokenizer,
    target_path: str,
    cfg,
    out_dir: Path,
    accelerator,
    capture=None,
    template_kwargs=None,
):
    """Regenerate this rank's chunks (reusing finished ones), then read every chunk in order.

    Returns the conversations, a record for the manifest (counts of what happened, the vLLM version and
    the checksum of each chunk file of regenerated conversations, in `out_dir`) and the samples.

    `capture` (data_prep/capture.CapturedChunks): the states are captured in the same pass and each chunk's
    samples written as cache shards ({split: [file names]}) before its chunk file; a chunk counts as finished
    only when its shards verify too; the samples returned are each chunk's shards. None: no states, and the
    chunk file holds its samples' token ids and loss masks (`{"id", "conversation", "input_ids",
    "loss_mask"}`), which are returned.
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
        # a chunk file of an older version holds conversations only, not the generated ids: made again
        return capture.verify(data.get("shards")) if capture is not None else "samples" in data

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
                    found = []
                    new, counts = regenerate_conversations(
                        engine, tokenizer, chunks[c], cfg, None, found.append, template_kwargs
                    )
                    samples = {"samples": [{"id": s["id"], "conversation": s["conversation"].id,
                                            "input_ids": s["input_ids"], "loss_mask": s["loss_mask"]}
                                           for s in found]}  # fmt: skip
                else:
                    writer = capture.chunk_writer(c)  # shards of cache.max_shard_mb, written as they fill
                    new, counts = regenerate_conversations(
                        engine.llm, tokenizer, chunks[c], cfg, engine, writer.add, template_kwargs
                    )
                    samples = {"shards": writer.close()}
                    counts.update(writer.counts)
                conversations_done = [{"id": x.id, "messages": x.messages} for x in new]
                atomic.write_json(
                    chunk_path(c),
                    {"ids": ids(c), "counts": counts, **samples, "conversations": conversations_done},
                )
    accelerator.wait_for_everyone()

    by_id, counts, samples = {}, Counter(), []
    for c in range(len(chunks)):
        data = json.loads(chunk_path(c).read_text())
        counts.update(data["counts"])
        by_id.update({x["id"]: x["messages"] for x in data["conversations"]})
        if capture is None:
            samples += data["samples"]
        else:
            samples.append(data["shards"])
    counts = {
        **counts,
        "vllm_version": vllm.__version__,
        "files": {chunk_path(c).name: file_sha256(chunk_path(c)) for c in range(len(chunks))},
    }
    regenerated = [replace(c, messages=by_id[c.id]) for c in conversations if c.id in by_id]
    return regenerated, counts, samples
