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
from heads.reference_decoder import DraftHead, Rounds, speculative_generate


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
    target, head: DraftHead, prompt: list[int], num_draft_tokens: int, max_new_tokens: int, stop_ids
) -> Rollout:
    """Decode `prompt` with `head` drafting `num_draft_tokens` a round and the target verifying (greedy)."""
    rounds = Rounds()
    speculative_generate(target, head, prompt, num_draft_tokens, max_new_tokens, stop_ids, rounds=rounds)
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
