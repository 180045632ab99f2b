"""Where a round's time goes when vLLM drafts, on this CPU: the target alone, then the same head served at
T=1 with vLLM's default greedy drafts and with `draft_sample_method=probabilistic`, compiled as served, one
request at a time on the same prompts and seeds; each timed, then decoded again under py-spy (every
process of the engine, native frames off) for where the time goes.

    python -m bench.proposer_profile --target ~/.cache/eagle-pipeline/SmolLM2-135M-Instruct \
        --head runs/q_t1/export --kind peagle --k 3

Prints one JSON line per method: tokens/s and ms per token (unprofiled), mean acceptance length, and the
busy samples of the process that runs the model split into the target's forward, its lm_head, the proposer (the head's
forward and inputs; its logits and sampling: `compute_probs_and_sample_next_token` for probabilistic
drafts, the argmax for greedy ones), the rejection sampler, the target's sampler and the rest of the model
runner, as fractions and as ms of a generated token. py-spy must be able to attach (ptrace); the raw stacks
are kept in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.sampling_check import QUESTIONS, chat_prompt_ids

# Buckets of the model process's busy stacks, first match wins: (name, frames any of which puts a sample in it).
BUCKETS = (
    (
        "draft logits and sampling",
        ("compute_probs_and_sample_next_token", "_greedy_sample", "_sample_draft_tokens"),
    ),
    ("proposer (head forward, its inputs)", ("propose_draft_token_ids",)),
    ("rejection sampler", ("RejectionSampler.forward", "rejection_sample")),
    ("target sampler", ("Sampler.forward",)),
    ("target lm_head (full vocabulary)", ("LlamaForCausalLM.compute_logits", "LogitsProcessor")),
    ("target forward", ("_model_forward",)),
    ("model runner, rest", ("execute_model", "sample_tokens")),
)
# Frames of a process waiting for work (vLLM's shared-memory queue spins): not busy.
WAITING = ("acquire_read", "sched_yield", "SpinCondition.wait")


def bucket_of(stack: str) -> str:
    for name, frames in BUCKETS:
        if any(frame in stack for frame in frames):
            return name
    return "other"


def split(raw: Path) -> dict[str, int]:
    """Busy samples per bucket from py-spy's raw (collapsed) output, in the process that runs the model (the
    one with the most samples in `execute_model`: the worker under the CPU build's MP executor); a stack
    waiting for work is left out. py-spy --subprocesses prefixes each stack with its process chain: the last
    `process ...` frame is the process it was sampled in."""
    stacks: dict[str, list[tuple[str, int]]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or "(idle)" in stack:
            continue
        frames = stack.split(";")
        process = [frame for frame in frames if frame.startswith("process ")][-1:] or [frames[0]]
        stacks.setdefault(process[0], []).append((stack, int(count)))

    def model_samples(process: str) -> int:
        return sum(n for stack, n in stacks[process] if "execute_model" in stack)

    counts: dict[str, int] = {}
    for stack, n in stacks[max(stacks, key=model_samples)] if stacks else []:
        if any(frame in stack for frame in WAITING) and "execute_model" not in stack:
            continue
        name = bucket_of(stack)
        counts[name] = counts.get(name, 0) + n
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the target's directory")
    parser.add_argument("--head", type=Path, required=True, help="an export directory (export/main.py's)")
    parser.add_argument("--kind", default="peagle", help="the head's kind (head.kind)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the five chat prompts")
    parser.add_argument("--out", type=Path, default=Path("runs/proposer_profile"))
    args = parser.parse_args()

    import vllm

    from export.to_vllm import speculative_config
    from heads.acceptance import AcceptanceCounts
    from target.vllm import EngineSettings, running_llm

    if args.out.exists() and any(args.out.iterdir()):
        parser.error(
            f"--out {args.out} is not empty: name a new directory (its raw stacks would be replaced)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = chat_prompt_ids(args.target, QUESTIONS[1:])
    spy = Path(sys.executable).parent / "py-spy"
    for method in ("baseline", "greedy", "probabilistic"):
        spec = None
        if method != "baseline":
            spec = {**speculative_config(args.kind, str(args.head), args.k), "draft_sample_method": method}
        engine_args = {"max_model_len": 1024, "kv_cache_memory_bytes": 2**30}  # compiled, as served
        settings = EngineSettings(args.target, spec, engine_args, "--target", dtype="bfloat16")
        with running_llm(settings) as llm:

            def decode(seed: int) -> int:
                tokens = 0
                for i, prompt in enumerate(prompts):  # one request at a time: concurrency 1
                    params = vllm.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=seed + i)
                    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
                    tokens += len(out[0].outputs[0].token_ids)
                return tokens

            decode(10_000)  # warm-up: compiled graphs for every shape these requests take
            before = AcceptanceCounts.from_vllm_metrics(llm.get_metrics())
            start = time.perf_counter()
            tokens = sum(decode(round_ * 100) for round_ in range(args.rounds))  # timed without the profiler
            seconds = time.perf_counter() - start
            counts = AcceptanceCounts.from_vllm_metrics(llm.get_metrics()) - before
            raw = args.out / f"{method}.txt"
            profiler = subprocess.Popen(
                [str(spy), "record", "--pid", str(os.getpid()), "--subprocesses", "--format", "raw",
                 "--rate", "100", "--output", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(2)  # attached
            decode(0)  # the same requests again, sampled (the profiler slows them: fractions only)
            profiler.send_signal(2)  # SIGINT: py-spy writes what it sampled
            profiler.wait(timeout=60)
        samples = split(raw)
        busy = sum(samples.values())
        ms_per_token = 1000 * seconds / tokens
        row = {
            "method": method,
            "tokens_per_s": round(tokens / seconds, 2),
            "ms_per_token": round(ms_per_token, 1),
            "mean_acceptance_length": (
                round(1 + counts.num_accepted_tokens / counts.num_drafts, 3) if counts.num_drafts else None
            ),
            "busy_samples": busy,
            "split": {name: round(n / max(busy, 1), 3) for name, n in sorted(samples.items())},
            # each part's share of a generated token's wall time (the unprofiled pass's)
            "ms_per_token_split": {
                name: round(ms_per_token * n / max(busy, 1), 1) for name, n in sorted(samples.items())
            },
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
