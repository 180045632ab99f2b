"""The cost of an on-policy rollout token (train/rollouts.py) against the number of prompts decoded together
(on_policy.rollout_batch_size): the same training prompts rolled out with a trained head at each batch size,
seconds per generated token, and a check that every batch size decided exactly as the reference decoder
(batch size 1) did.

    make runs/smollm2_quick/.done-train PROFILE=quick
    python -m bench.rollouts --run-dir runs/smollm2_quick --prompts 32 --batch-sizes 1 8 16 32 \
        -- experiment=smollm2_quick

Prints a table and writes <run_dir>/on_policy_bench/rollouts.json. The target runs in fp32 as the stage runs
it; set OMP_NUM_THREADS to the cores the stage would get.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from artifacts import atomic
from artifacts.cache import CacheSplit
from artifacts.config import compose
from artifacts.prompts import stop_token_ids
from heads.reference_decoder import inference_device, load_head
from target.model import load_tokenizer, target_dir
from train.rollouts import prompt_ids, roll_out_all


def cpu_model() -> str:
    """The CPU's model name and its bf16 instructions (a number's machine, as the README states them)."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), ""
    )
    flags = set(
        next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    )
    bf16 = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["no AVX512-BF16 or AMX"]
    return f"{name or platform.machine()} ({', '.join(bf16)})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--head-dir", type=Path, help="default: <run-dir>/draft_head")
    parser.add_argument(
        "--prompts", type=int, default=32, help="training prompts rolled out (the first ones)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--k", type=int, default=3, help="drafts a round")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("overrides", nargs="*", help="after --: the run's overrides (experiment=...)")
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    cfg = compose("config", [f"run_dir={args.run_dir}", *args.overrides])
    path = target_dir(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = target.requires_grad_(False).to(inference_device())
    head = load_head(args.head_dir or args.run_dir / "draft_head", target)
    stops = stop_token_ids(load_tokenizer(cfg.target), path)
    split = CacheSplit(args.run_dir / "cache", "train")
    prompts = [prompt_ids(split, i) for i in range(min(args.prompts, len(split)))]

    results, reference = [], None
    for size in args.batch_sizes:
        start = time.perf_counter()
        rollouts = roll_out_all(target, head, prompts, args.k, args.max_new_tokens, stops, batch_size=size)
        seconds = time.perf_counter() - start
        decisions = [(r.input_ids.tolist(), r.drafts.tolist(), r.accepted.tolist()) for r in rollouts]
        reference = reference or decisions
        tokens = sum(len(r.input_ids) - len(p) for r, p in zip(rollouts, prompts))
        row = {"batch_size": size, "seconds": seconds, "tokens": tokens, "seconds_per_token": seconds / tokens,
               "same_as_batch_1": decisions == reference if args.batch_sizes[0] == 1 else None}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    out = args.run_dir / "on_policy_bench" / "rollouts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": f"{cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "prompts": len(prompts), "k": args.k, "max_new_tokens": args.max_new_tokens, "results": results,
    }  # fmt: skip
    atomic.save(out, lambda tmp: tmp.write_text(json.dumps(record, indent=2)))
    print("| prompts together | s | tokens | s / token | vs 1 | decisions as batch 1 |")
    print("|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['batch_size']} | {row['seconds']:.0f} | {row['tokens']} | {row['seconds_per_token']:.4f} "
            f"| {results[0]['seconds_per_token'] / row['seconds_per_token']:.1f}x | {row['same_as_batch_1']} |"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
