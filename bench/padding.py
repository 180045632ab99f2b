"""How much of a training step's positions are padding: a cache's train split batched as train batches it
(`plan_epoch`: each optimizer step's samples sorted by length, then cut into micro-batches, each padded to
its longest), beside the same samples packed to the micro-batch's token budget (first fit, longest first:
the padding packing would leave, docs/benchmarks.md#padding).

    python -m bench.padding --run-dir runs/smollm2 -- experiment=smollm2                  # the main job
    python -m bench.padding --run-dir runs/padding --processes 8 -- experiment=smollm2 \\
        render.max_length=2048 train.batch_size=4 train.gradient_accumulation_steps=2        # the 8B recipes' geometry

Everything after `--` is a pipeline config override, as for train/main.py; the cache in <run_dir>/cache must
exist. Reported: padded positions / all positions computed, answer positions (those with a loss) / all, per
epoch over `--epochs` epochs' plans, for train's plan and for packing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from artifacts.cache import CacheSplit
from artifacts.config import compose
from train.data import plan_epoch


def answer_counts(split: CacheSplit) -> list[int]:
    """Answer tokens (loss_mask) of every sample, read from the loss-mask bits alone."""
    counts = []
    for shard_index, start, end, _ in split._where:
        bits = split._handle(shard_index).get_slice("loss_mask_bits")[start // 8 : (end + 7) // 8].numpy()
        counts.append(int(np.unpackbits(bits, bitorder="little")[start % 8 : start % 8 + end - start].sum()))
    return counts


def padded_fractions(lengths: list[int], answers: list[int], micro_batches: list[list[int]]) -> dict:
    """{"padding", "answer"}: shares of the positions computed (each micro-batch padded to its longest)."""
    computed = sum(len(ids) * max(lengths[i] for i in ids) for ids in micro_batches)
    real = sum(lengths[i] for ids in micro_batches for i in ids)
    return {
        "padding": 1 - real / computed,
        "answer": sum(answers[i] for ids in micro_batches for i in ids) / computed,
    }


def packed_padding(lengths: list[int], budget: int) -> float:
    """Padding share when the samples are packed into rows of `budget` tokens, first fit, longest first."""
    rows: list[int] = []
    for n in sorted(lengths, reverse=True):
        for r, used in enumerate(rows):
            if used + n <= budget:
                rows[r] += n
                break
        else:
            rows.append(n)
    return 1 - sum(lengths) / (len(rows) * budget)


def measure(cfg, processes: int, epochs: int) -> dict:
    split = CacheSplit(Path(cfg.run_dir).resolve() / "cache", "train", verify=False)
    lengths, answers = split.lengths, answer_counts(split)
    b, accumulation = cfg.train.batch_size, cfg.train.gradient_accumulation_steps
    per_epoch = []
    for epoch in range(epochs):
        plan = plan_epoch(lengths, b, processes, accumulation, cfg.seed, epoch)
        micro = [ids for step in plan for rank in step for ids in rank]
        per_epoch.append(padded_fractions(lengths, answers, micro))
    budget = b * cfg.render.max_length
    return {
        "samples": len(lengths),
        "mean_length": round(float(np.mean(lengths)), 1),
        "max_length": cfg.render.max_length,
        "micro_batch": f"{b} x {processes} processes x {accumulation} accumulated",
        "padding": round(float(np.mean([e["padding"] for e in per_epoch])), 4),
        "answer": round(float(np.mean([e["answer"] for e in per_epoch])), 4),
        "packed_budget": budget,
        "packed_padding": round(packed_padding(lengths, budget), 4),
        "packed_answer": round(sum(answers) / (sum(lengths) / (1 - packed_padding(lengths, budget))), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--processes", type=int, default=1, help="training processes (8 for the GPU recipes)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs' plans averaged over")
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    parser.add_argument("overrides", nargs="*", help="pipeline config overrides, after --")
    args = parser.parse_args()
    cfg = compose("config", [*args.overrides, f"run_dir={args.run_dir.resolve()}"])
    result = measure(cfg, args.processes, args.epochs)
    print(
        f"{result['samples']} samples, mean {result['mean_length']} tokens (max {result['max_length']}), "
        f"{result['micro_batch']}: padding {result['padding']:.1%} of the positions computed, answers "
        f"{result['answer']:.1%}; packed to {result['packed_budget']} tokens a row: padding "
        f"{result['packed_padding']:.1%}, answers {result['packed_answer']:.1%}"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
