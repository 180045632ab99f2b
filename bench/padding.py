"""How much of a training step's positions are padding: a cache's train split batched as train batches it
(`plan_epoch`: each optimizer step's rows sorted by length, then cut into micro-batches, each padded to its
longest), one sample a row and packed (`train.pack_length`, render.max_length when unset), beside the
bound: every sample packed longest first (docs/benchmarks.md#padding).

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
from bench import new_file
from train.data import plan_epoch


def answer_counts(split: CacheSplit) -> list[int]:
    """Answer tokens (loss_mask) of every sample, read from the loss-mask bits alone."""
    counts = []
    for shard_index, start, end, _ in split._where:
        bits = split._handle(shard_index).get_slice("loss_mask_bits")[start // 8 : (end + 7) // 8].numpy()
        counts.append(int(np.unpackbits(bits, bitorder="little")[start % 8 : start % 8 + end - start].sum()))
    return counts


def padded_fractions(lengths: list[int], answers: list[int], micro_batches: list[list[list[int]]]) -> dict:
    """{"padding", "answer"}: shares of the positions computed, each micro-batch's rows padded to its
    longest (a row: its samples' tokens together)."""
    computed = sum(len(rows) * max(sum(lengths[i] for i in row) for row in rows) for rows in micro_batches)
    ids = [i for rows in micro_batches for row in rows for i in row]
    return {
        "padding": 1 - sum(lengths[i] for i in ids) / computed,
        "answer": sum(answers[i] for i in ids) / computed,
        "samples_per_step": len(ids),
    }


def packed_padding(lengths: list[int], budget: int, rows_per_batch: int) -> float:
    """Padding share when all the samples are packed into rows of at most `budget` tokens, first fit,
    longest first, the rows then batched `rows_per_batch` at a time longest first, each micro-batch padded
    to its longest row as train's collate pads it: the bound for any plan of train's (which packs each
    epoch's random order, `train.data.pack_rows`) - 0 with one row a micro-batch, as the plan's is."""
    rows: list[int] = []
    for n in sorted(lengths, reverse=True):
        for r, used in enumerate(rows):
            if used + n <= budget:
                rows[r] += n
                break
        else:
            rows.append(n)
    rows.sort(reverse=True)
    computed = sum(
        len(batch) * batch[0]
        for batch in (rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch))
    )
    return 1 - sum(lengths) / computed


def plan_fractions(lengths, answers, cfg, processes: int, epochs: int, pack_length: int | None) -> dict:
    """`padded_fractions` of train's plan, averaged over `epochs` epochs (samples per optimizer step)."""
    b, accumulation = cfg.train.batch_size, cfg.train.gradient_accumulation_steps
    per_epoch = []
    for epoch in range(epochs):
        plan = plan_epoch(lengths, b, processes, accumulation, cfg.seed, epoch, pack_length)
        micro = [rows for step in plan for rank in step for rows in rank]
        fractions = padded_fractions(lengths, answers, micro)
        per_epoch.append({**fractions, "samples_per_step": fractions["samples_per_step"] / len(plan)})
    return {key: round(float(np.mean([e[key] for e in per_epoch])), 4) for key in per_epoch[0]}


def measure(cfg, processes: int, epochs: int) -> dict:
    split = CacheSplit(Path(cfg.run_dir).resolve() / "cache", "train", verify=False)
    lengths, answers = split.lengths, answer_counts(split)
    pack_length = cfg.train.pack_length or cfg.render.max_length
    b, accumulation = cfg.train.batch_size, cfg.train.gradient_accumulation_steps
    return {
        "samples": len(lengths),
        "mean_length": round(float(np.mean(lengths)), 1),
        "max_length": cfg.render.max_length,
        "micro_batch": f"{b} rows x {processes} processes x {accumulation} accumulated",
        "one_a_row": plan_fractions(lengths, answers, cfg, processes, epochs, None),
        "pack_length": pack_length,
        "packed": plan_fractions(lengths, answers, cfg, processes, epochs, pack_length),
        "packed_bound": round(packed_padding(lengths, pack_length, b), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--processes", type=int, default=1, help="training processes (8 for the GPU recipes)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs' plans averaged over")
    parser.add_argument("--out", type=new_file, default=None, help="write the result as JSON here")
    parser.add_argument("overrides", nargs="*", help="pipeline config overrides, after --")
    args = parser.parse_args()
    cfg = compose("config", [*args.overrides, f"run_dir={args.run_dir.resolve()}"])
    result = measure(cfg, args.processes, args.epochs)
    alone, packed = result["one_a_row"], result["packed"]
    print(
        f"{result['samples']} samples, mean {result['mean_length']} tokens (max {result['max_length']}), "
        f"{result['micro_batch']}:\n  one sample a row: padding {alone['padding']:.1%} of the positions "
        f"computed, answers {alone['answer']:.1%}, {alone['samples_per_step']:.1f} samples a step\n"
        f"  packed (train.pack_length={result['pack_length']}): padding {packed['padding']:.1%}, answers "
        f"{packed['answer']:.1%}, {packed['samples_per_step']:.1f} samples a step (all packed longest "
        f"first: {result['packed_bound']:.1%})"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
