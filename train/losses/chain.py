"""EAGLE-3's training-time test (TTT, `ttt_loss`): the head's chain of K drafting steps, rolled out
teacher-forced, and its loss.

Pure functions on tensors, tested on CPU. `ttt_rollout` drives the head through its own `forward`
(heads/eagle3.py) once per drafting step, with a `heads.attention.KVCache` in steps mode that holds the keys
of earlier steps (docs/design.md#training-time-test): step k at position t reads x_{t+1+k} beside
`fc(aux_t)` (step 0) or its own output of step k-1 (`carry`, not detached), at RoPE position t + k, and
predicts x_{t+2+k} against the target's draft-vocabulary distribution at t+1+k; it sees step 0's keys at
<= t and steps 1..k's keys at t. Each step's loss and the total: positions.py `depth_losses`.

    total, metrics = ttt_loss(draft, batch, 7, 0.8, target_lm_head_VH, vocab.draft_to_target, 1024)

Shape legend: B batch, T positions, H hidden, A aux layers, K steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.attention import KVCache, document_positions
from heads.eagle3 import Eagle3Draft
from train.losses.positions import Dpace, depth_losses, depth_weights, prediction_anchors
from train.losses.rows import batch_teacher, shift_left
from train.objectives import KL, Objective


def ttt_rollout(
    model: Eagle3Draft,
    input_ids_BT: Tensor,
    aux_BTAH: Tensor,
    num_steps: int,
    starts_BT: Tensor | None = None,
    anchors_BM: Tensor | None = None,
    fed_BMK: Tensor | None = None,
) -> list[Tensor]:
    """Pre-norm outputs [B, T, H] of steps 0..K-1, teacher-forced (step k reads x_{t+1+k}): one call of the
    head's forward per step, the cache holding the earlier steps' keys at each position; in rows packed
    at `starts_BT`, each position sees and is placed in its own document only. With `anchors_BM`, the
    outputs are [B, M, H] at those rows only (`prediction_anchors`); step 0's keys are still every row's.
    `fed_BMK` (with anchors): step k >= 1 reads fed_BMK[..., k-1] instead, the head's own drafts of a
    rollout (on-policy replay, train/losses/replay.py) - the chain as it was served."""
    if starts_BT is None:
        positions_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
    else:
        positions_BT = document_positions(starts_BT)
    cache = KVCache(len(model.layers), steps=True, starts_BS=starts_BT)
    hidden_BTH = model.target_hidden(aux_BTAH)
    outs = []
    for step in range(num_steps):
        # Token ids past the end are a placeholder (0): those positions are never valid for the loss.
        # Step k's token sits k places after step 0's: RoPE position t + k, as when vLLM drafts a chain.
        ids_BT, rope_BT = shift_left(input_ids_BT, 1 + step), positions_BT + step
        if step == 0:  # the sequence: inputs and keys at every row
            out_BTH = model(ids_BT, hidden_BTH, rope_BT, cache, outputs_BM=anchors_BM)
        elif anchors_BM is None:
            out_BTH = model(ids_BT, hidden_BTH, rope_BT, cache)
        else:
            ids_BM, rope_BM = ids_BT.gather(1, anchors_BM), rope_BT.gather(1, anchors_BM)
            if fed_BMK is not None:
                ids_BM = fed_BMK[..., step - 1]
            out_BTH = model(ids_BM, hidden_BTH, rope_BM, cache, anchors_BM)
        outs.append(out_BTH)
        # Fed back (post-norm with norm_output) without detaching: later steps' gradients reach earlier ones.
        hidden_BTH = model.carry(out_BTH)
    return outs


def ttt_loss(
    model: Eagle3Draft,
    batch: dict[str, torch.Tensor],
    num_steps: int,
    gamma: float,
    target_lm_head: torch.Tensor,
    draft_to_target: torch.Tensor,
    chunk_size: int,
    denominators: torch.Tensor | None = None,
    objective: Objective = KL,
    dpace: Dpace | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = sum_k gamma^k loss_k over a right-padded batch (loss_k: `position_loss`, its denominators);
    with `dpace`, sum_k loss_k, each prediction weighed by D-PACE over its anchor's chain of steps.

    batch: input_ids [B, T] int64, loss_mask [B, T] bool, aux_hidden [B, T, A, H], final_hidden [B, T, H],
    optional attention_mask [B, T] (1 = real token; without it every position is real), optional doc_starts
    [B, T] int64 (rows packing several samples: where each position's sample starts; train/data.py).
    Metrics (detached tensors), per step k: loss_k, loss_sum_k and num_pred_k (its mean's sum and count);
    acc_k and num_valid_k over the positions with a loss; chain_hits_k / chain_total_k, counts for
    `conditional_accuracies` where a target argmax outside the draft vocabulary counts as a miss (as in
    vLLM), not as skipped; greedy_t1_* and sampled_t1_*, the same at temperature 1 (`Chains`).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: TTT needs at least one step")
    weights = depth_weights(gamma, num_steps)
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    # Every step at the anchors some step trains: a long prompt's rows give step 0's keys, nothing more.
    anchors = prediction_anchors(batch, range(num_steps))
    outs = ttt_rollout(
        model, batch["input_ids"], batch["aux_hidden"], num_steps, batch.get("doc_starts"), anchors.index_BM
    )
    return depth_losses(
        model, objective, outs, batch, teacher, weights, denominators, [anchors] * num_steps, dpace
    )
