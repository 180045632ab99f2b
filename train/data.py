"""Batches from the cache: a deterministic plan of optimizer steps, padding, and the target's hidden
states computed online when the cache holds none (`train.features=online`).

The plan depends only on the sample lengths, the seed and the epoch, so a resumed run replays exactly
the batches of an uninterrupted one, and a global batch is the same samples whatever the number of
processes: each optimizer step takes batch_size x processes x accumulation random samples, sorts them by
length (less padding) and deals consecutive runs of batch_size to (accumulation index, rank).
"""

from __future__ import annotations

import torch

from artifacts.cache import HIDDEN_DTYPE
from target.model import target_hidden_states


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


class OnlineStates:
    """The frozen target in the training step (`train.features=online`): for a padded batch, what the cache
    would have given - the aux states at the cache's ids and the final post-norm state, through data_prep's
    own `target_hidden_states`, rounded to the cache's bf16, zero on padding and on each sample's last aux
    row (the cache never stores that row) - as float32."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model, self.aux_layer_ids = model, list(aux_layer_ids)

    def __call__(self, input_ids_BT, attention_mask_BT) -> tuple[torch.Tensor, torch.Tensor]:
        aux_BTNH, final_BTH = target_hidden_states(
            self.model, input_ids_BT, attention_mask_BT.long(), self.aux_layer_ids
        )
        real_BT = attention_mask_BT.bool()
        lengths_B = real_BT.sum(1)
        has_next_BT = torch.arange(real_BT.shape[1], device=real_BT.device) < (lengths_B - 1)[:, None]
        aux_BTNH = aux_BTNH.to(HIDDEN_DTYPE).float() * has_next_BT[:, :, None, None]
        final_BTH = final_BTH.to(HIDDEN_DTYPE).float() * real_BT[:, :, None]
        return aux_BTNH, final_BTH


def collate(samples: list[dict[str, torch.Tensor]], device, states: OnlineStates | None = None):
    """Right-pad samples from `CacheSplit` into one batch on `device`; hidden states as float32, from the
    samples or, for a cache without them, from `states` (the target, online)."""
    lengths = [len(s["input_ids"]) for s in samples]
    b, t = len(samples), max(lengths)
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
    }
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["loss_mask"][row, :n] = sample["loss_mask"]
        batch["attention_mask"][row, :n] = True
    batch = {k: v.to(device) for k, v in batch.items()}
    if "final_hidden" not in samples[0]:
        if states is None:
            raise ValueError("these samples hold no hidden states: collate needs the target (OnlineStates)")
        batch["aux_hidden"], batch["final_hidden"] = states(batch["input_ids"], batch["attention_mask"])
        return batch
    n_aux, h = samples[0]["aux_hidden"].shape[1:]
    aux = torch.zeros(b, t, n_aux, h, dtype=torch.float32)
    final = torch.zeros(b, t, h, dtype=torch.float32)
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        aux[row, :n] = sample["aux_hidden"]
        final[row, :n] = sample["final_hidden"]
    batch["aux_hidden"], batch["final_hidden"] = aux.to(device), final.to(device)
    return batch
