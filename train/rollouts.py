"""On-policy rollouts (train.stage=on_policy, train/on_policy.py): the target decodes training prompts with
the current head drafting and verifying, losslessly - the reference decoder (heads/reference_decoder.py),
whose decisions vLLM's equal (export verification proves it per head) and which exposes every round - and
what each verification exposed is kept for replay (train/losses/replay.py):

- the sequence the target read and the head's features of every position of it, as the rollout computed
  them (the head drafts from exactly these);
- per round: its anchor t (the last position the head read before drafting: drafts 1..k predict positions
  t+2..t+k+1), the k drafts, how many were accepted, and the target's final post-norm state at each drafted
  position given the drafts before it - the verification forward's own, so no extra target pass; the
  teacher is computed from them as from the cache's final states (train/losses/rows.py `teacher_rows`).

A file per iteration and process, `<run_dir>/on_policy/rollouts/iter-00003-rank-0.safetensors`, the rollouts
back to back (n sequences, N tokens, R rounds in all):
    input_ids       [N] int64          the sequences the target read, prompt first
    features        [N, A, H] bf16     the head's features of each position (aux states; as the cache's)
    offsets         [n+1] int64        sequence i is tokens [offsets[i], offsets[i+1])
    anchors         [R] int64          each round's anchor, counted from its sequence's start
    drafts          [R, k] int64       target token ids
    accepted        [R] int64
    final           [R, k, H] bf16     the target's final states at the drafted positions
    round_offsets   [n+1] int64        sequence i's rounds are [round_offsets[i], round_offsets[i+1])

Shape legend: B batch, T positions, M rounds per row, K drafts per round, A aux layers, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from artifacts import atomic
from artifacts.cache import HIDDEN_DTYPE, CacheSplit
from heads.acceptance import AcceptanceCounts
from heads.reference_decoder import (
    DraftHead,
    Request,
    Rounds,
    speculative_generate,
    target_forward,
    target_states,
)


@dataclass
class Rollout:
    """One prompt decoded by the target with the head drafting: see the module's docstring."""

    input_ids: torch.Tensor  # [T] int64
    features: torch.Tensor  # [T, A, H]
    anchors: torch.Tensor  # [R] int64
    drafts: torch.Tensor  # [R, K] int64 (target ids)
    accepted: torch.Tensor  # [R] int64
    final: torch.Tensor  # [R, K, H]

    def counts(self) -> AcceptanceCounts:
        """The rollout's acceptance counts, as vLLM counts them."""
        counts = AcceptanceCounts()
        for accepted in self.accepted.tolist():
            counts.observe(self.drafts.shape[1], accepted)
        return counts


def prompt_ids(split: CacheSplit, index: int) -> list[int]:
    """The prompt of cached sample `index`: its tokens up to its first trained (answer) token, which end with
    the generation prompt as the target was asked."""
    sample = split[index]
    answer = sample["loss_mask"].nonzero()
    if not len(answer):
        raise ValueError(f"{split.split_dir}: sample {split.ids[index]} has no answer token to roll out from")
    return sample["input_ids"][: int(answer[0])].tolist()


def roll_out(
    target, head: DraftHead, prompt: list[int], num_draft_tokens: int, max_new_tokens: int, stop_ids,
    temperature: float = 0.0, seed: int = 0,
) -> Rollout:  # fmt: skip
    """Decode `prompt` with `head` drafting `num_draft_tokens` a round and the target verifying (greedy, or
    sampled at `temperature` from a stream seeded `seed`)."""
    rounds = Rounds()
    speculative_generate(
        target, head, prompt, num_draft_tokens, max_new_tokens, stop_ids, rounds, temperature, seed
    )
    return rollout_of(rounds, num_draft_tokens)


@torch.inference_mode()
def roll_out_batch(
    target, head: DraftHead, prompts: list[list[int]], num_draft_tokens: int, max_new_tokens: int, stop_ids,
    temperature: float = 0.0, seeds: list[int] | None = None,
) -> list[Rollout]:  # fmt: skip
    """`roll_out` of several prompts at once: one target forward verifies every unfinished prompt's round,
    so the target's weights are read once for them all (on a CPU, most of a round's time). Each prompt is
    its own `Request` - prefilled alone, drafted alone by the head, accepted as the reference decoder
    accepts from its own seeded stream (`seeds`, at `temperature`) - so only the target's arithmetic is
    batched. The rows share one cache of slots: the prompts' keys left-padded, then every round's k+1 for
    every row; a row's slot mask hides its pads and the drafts it rejected, which stay in their slots
    instead of being cropped. A finished row leaves the batch, and slots no row still sees leave the cache
    with it."""
    from transformers import DynamicCache

    seeds = range(len(prompts)) if seeds is None else seeds
    requests = [
        Request(head, p, num_draft_tokens, max_new_tokens, stop_ids, Rounds(), temperature, seed)
        for p, seed in zip(prompts, seeds, strict=True)
    ]
    caches = []
    for request in requests:
        cache = DynamicCache(config=target.config)
        request.start(*target_forward(target, head, request.ids, cache, start=0, last_logits=True)[:2])
        caches.append(cache)
    rows = [r for r in requests if not r.done]
    cache, mask_BS = stack_caches([c for c, r in zip(caches, requests) if not r.done], target)
    del caches
    steps = torch.arange(num_draft_tokens + 1, device=target.device)
    while rows:
        ids_BT = torch.tensor([r.draft() for r in rows], device=target.device)
        positions_BT = torch.tensor([len(r.ids) for r in rows], device=target.device)[:, None] + steps
        slots = mask_BS.shape[1]
        mask_BS = torch.cat([mask_BS, torch.ones_like(ids_BT)], dim=1)
        features, logits_BTV, final_BTH = target_states(target, head, ids_BT, positions_BT, cache, mask_BS)
        for b, request in enumerate(rows):
            kept = request.verify(features[b : b + 1], logits_BTV[b], final_BTH[b])
            mask_BS[b, slots + kept :] = 0
        if any(r.done for r in rows):
            keep = torch.tensor(
                [b for b, r in enumerate(rows) if not r.done], dtype=torch.int64, device=target.device
            )
            mask_BS = mask_BS[keep]
            seen = mask_BS.any(0)
            mask_BS = mask_BS[:, seen]
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[keep][:, :, seen], layer.values[keep][:, :, seen]
            rows = [r for r in rows if not r.done]
    return [rollout_of(r.rounds, num_draft_tokens) for r in requests]


def roll_out_all(
    target, head: DraftHead, prompts: list[list[int]], num_draft_tokens: int, max_new_tokens: int, stop_ids,
    temperature: float = 0.0, seeds: list[int] | None = None, batch_size: int = 16, progress=None,
) -> list[Rollout]:  # fmt: skip
    """Rollouts of `prompts` in their order, `batch_size` decoded together (1: the reference decoder, a
    prompt at a time), in order of length so that a batch pads little; `progress` (a tqdm bar) is advanced
    by each batch's prompts."""
    seeds = list(range(len(prompts))) if seeds is None else seeds
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rollouts: list[Rollout | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        args = (num_draft_tokens, max_new_tokens, stop_ids, temperature)
        if batch_size == 1:
            done = [roll_out(target, head, prompts[batch[0]], *args, seeds[batch[0]])]
        else:
            done = roll_out_batch(target, head, [prompts[i] for i in batch], *args, [seeds[i] for i in batch])
        for i, rollout in zip(batch, done):
            rollouts[i] = rollout
        if progress is not None:
            progress.update(len(batch))
    return rollouts


def stack_caches(caches: list, target):
    """One cache of the rows' single-row caches, left-padded to the longest, and its slot mask [B, S] (1:
    a row's real key)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    lengths = [c.get_seq_length() for c in caches]
    mask_BS = torch.zeros(len(caches), max(lengths, default=0), dtype=torch.int64, device=target.device)
    for b, length in enumerate(lengths):
        mask_BS[b, mask_BS.shape[1] - length :] = 1
    stacked = DynamicCache(config=target.config)
    if not caches:
        return stacked, mask_BS
    for i, layer in enumerate(caches[0].layers):
        if type(layer) is not DynamicLayer:  # a sliding window drops slots: not one cache of slots
            raise ValueError(
                f"{type(target).__name__}: {type(layer).__name__} cache layers cannot batch rollouts; "
                "set on_policy.rollout_batch_size=1"
            )
        pad = [(0, 0, mask_BS.shape[1] - n, 0) for n in lengths]
        keys = torch.cat([torch.nn.functional.pad(c.layers[i].keys, p) for c, p in zip(caches, pad)])
        values = torch.cat([torch.nn.functional.pad(c.layers[i].values, p) for c, p in zip(caches, pad)])
        stacked.update(keys, values, i)
    return stacked, mask_BS


def rollout_of(rounds: Rounds, num_draft_tokens: int) -> Rollout:
    """A finished request's `Rounds` as a `Rollout` (features and final states in the cache's dtype)."""
    features = torch.cat(rounds.features, dim=1)[0]
    assert features.shape[0] == len(rounds.ids), "a feature row for every position the target read"
    return Rollout(
        torch.tensor(rounds.ids, dtype=torch.int64),
        features.to(HIDDEN_DTYPE).cpu(),
        torch.tensor(rounds.anchors, dtype=torch.int64),
        torch.tensor(rounds.drafts, dtype=torch.int64).view(-1, num_draft_tokens),
        torch.tensor(rounds.accepted, dtype=torch.int64),
        torch.stack(rounds.final).to(HIDDEN_DTYPE).cpu()
        if rounds.final
        else torch.zeros(0, num_draft_tokens, features.shape[-1], dtype=HIDDEN_DTYPE),
    )


def write_rollouts(path: Path, rollouts: list[Rollout]) -> None:
    """The rollouts as one safetensors file, atomically (a crash leaves the old file or none)."""
    if not rollouts:
        raise ValueError(f"{path}: no rollouts to write")

    def offsets(lengths):
        return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)

    tensors = {
        "input_ids": torch.cat([r.input_ids for r in rollouts]),
        "features": torch.cat([r.features for r in rollouts]),
        "offsets": offsets([len(r.input_ids) for r in rollouts]),
        "anchors": torch.cat([r.anchors for r in rollouts]),
        "drafts": torch.cat([r.drafts for r in rollouts]),
        "accepted": torch.cat([r.accepted for r in rollouts]),
        "final": torch.cat([r.final for r in rollouts]),
        "round_offsets": offsets([len(r.anchors) for r in rollouts]),
    }
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    atomic.save(path, lambda tmp: atomic.save_tensors(tensors, tmp))


def read_rollouts(path: Path) -> list[Rollout]:
    """The rollouts `write_rollouts` wrote, or a ValueError naming the file."""
    try:
        tensors = load_file(str(path))
        offsets, rounds = tensors["offsets"].tolist(), tensors["round_offsets"].tolist()
    except Exception as error:  # a truncated or foreign file: say which, and what to do
        raise ValueError(f"{path}: not a rollouts file ({error}); delete it to roll out again") from None
    return [
        Rollout(
            tensors["input_ids"][a:b],
            tensors["features"][a:b],
            tensors["anchors"][c:d],
            tensors["drafts"][c:d],
            tensors["accepted"][c:d],
            tensors["final"][c:d],
        )
        for a, b, c, d in zip(offsets, offsets[1:], rounds, rounds[1:])
    ]


def collate_rollouts(rollouts: list[Rollout], device) -> dict[str, torch.Tensor]:
    """Right-padded rows for replay, a rollout a row: input_ids [B, T], aux_hidden [B, T, A, H] fp32, and per
    row its rounds in order of their anchors (M the most rounds of a row; `round_mask` False pads):
    anchor_BM, drafts_BMK, accepted_BM, final_BMKH fp32."""
    b = len(rollouts)
    t = max(len(r.input_ids) for r in rollouts)
    m = max(max(len(r.anchors) for r in rollouts), 1)
    k, h = rollouts[0].final.shape[1:]
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "aux_hidden": torch.zeros(b, t, *rollouts[0].features.shape[1:]),
        "anchor_BM": torch.zeros(b, m, dtype=torch.int64),
        "round_mask": torch.zeros(b, m, dtype=torch.bool),
        "drafts_BMK": torch.zeros(b, m, k, dtype=torch.int64),
        "accepted_BM": torch.zeros(b, m, dtype=torch.int64),
        "final_BMKH": torch.zeros(b, m, k, h),
    }
    for row, rollout in enumerate(rollouts):
        n, r = len(rollout.input_ids), len(rollout.anchors)
        batch["input_ids"][row, :n] = rollout.input_ids
        batch["aux_hidden"][row, :n] = rollout.features.float()
        batch["anchor_BM"][row, :r] = rollout.anchors
        batch["round_mask"][row, :r] = True
        batch["drafts_BMK"][row, :r] = rollout.drafts
        batch["accepted_BM"][row, :r] = rollout.accepted
        batch["final_BMKH"][row, :r] = rollout.final.float()
    return {key: value.to(device) for key, value in batch.items()}
