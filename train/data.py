"""Batches from the cache: a deterministic plan of optimizer steps, and padding.

The plan depends only on the sample lengths, the seed and the epoch, so a resumed run replays exactly
the batches of an uninterrupted one, and a global batch is the same samples whatever the number of
processes: each optimizer step takes batch_size x processes x accumulation random samples, sorts them by
length (less padding) and deals consecutive runs of batch_size to (accumulation index, rank).
"""

from __future__ import annotations

import torch


def plan_epoch(
    lengths: list[int], batch_size: int, num_processes: int, accumulation: int, seed: int, epoch: int
) -> list[list[list[list[int]]]]:
    """steps[s][rank][micro] = the sample indices of one micro-batch. An incomplete last step is dropped."""
    per_step = batch_size * num_processes * accumulation
    if len(lengths) < per_step:
        raise ValueError(
            f"{len(lengths)} training samples cannot fill one optimizer step of {per_step} "
            f"(train.batch_size={batch_size} x {num_processes} processes x "
            f"train.gradient_accumulation_steps={accumulation}); lower them or cache more data"
        )
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    steps = []
    for start in range(0, len(order) - per_step + 1, per_step):
        chunk = sorted(order[start : start + per_step], key=lambda i: (lengths[i], i))
        micro = [chunk[m * batch_size : (m + 1) * batch_size] for m in range(num_processes * accumulation)]
        steps.append(
            [[micro[a * num_processes + r] for a in range(accumulation)] for r in range(num_processes)]
        )
    return steps


def collate(samples: list[dict[str, torch.Tensor]], device) -> dict[str, torch.Tensor]:
    """Right-pad samples from `CacheSplit` into one batch on `device`; hidden states as float32."""
    lengths = [len(s["input_ids"]) for s in samples]
    b, t = len(samples), max(lengths)
    n_aux, h = samples[0]["aux_hidden"].shape[1:]
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
        "aux_hidden": torch.zeros(b, t, n_aux, h, dtype=torch.float32),
        "final_hidden": torch.zeros(b, t, h, dtype=torch.float32),
    }
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["loss_mask"][row, :n] = sample["loss_mask"]
        batch["attention_mask"][row, :n] = True
        batch["aux_hidden"][row, :n] = sample["aux_hidden"]
        batch["final_hidden"][row, :n] = sample["final_hidden"]
    return {k: v.to(device) for k, v in batch.items()}
