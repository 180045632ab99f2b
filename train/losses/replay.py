"""On-policy replay (train.stage=on_policy, docs/design.md#on-policy-training): the head drafts again from
exactly the anchors of a rollout (train/rollouts.py), as it drafts when served, and is trained against the
target's distribution at each drafted position given the drafts before it - what the verification
computed - the Draft-OPD form (arXiv 2605.29343) for every drafting scheme:

- chain (EAGLE-3): step 0 at anchor t reads x_{t+1} beside fc(aux_t); step i reads the rollout's own draft i
  beside the step's previous output (chain.py `ttt_rollout` with `fed_BMK`), at position t + i;
- parallel (P-EAGLE): depth 0 as the chain's step 0, depths 1..K-1 the mask slots (`parallel_forward`);
- block (DFlash): one block [x_{t+1}, mask x K] at t+1..t+1+K over the context <= t (`block_forward`).

Unlike supervised training, a drafted position after the first rejection is trained against the target's
distribution given the rejected drafts (a chain head also reads them), and only anchors where a served round
began are trained. The loss: the accepted drafts (i < a) the `accepted` objective (forward KL), a mean over
them; the rejected ones (i >= a: the first rejection and the rest of the round) the `rejected` objective
(reverse KL), weighted gamma^i and normalised by the weights' sum; the two terms averaged.

    total, metrics = replay_loss(draft, batch, w_VH, vocab.draft_to_target, 1024, KL, RKL, 0.8)

Pure functions on tensors, tested on CPU. Shape legend: B batch, T positions, M rounds per row, K drafts per
round, H hidden, N predictions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.losses.block import block_forward
from train.losses.chain import ttt_rollout
from train.losses.parallel import parallel_forward
from train.losses.positions import Anchors
from train.losses.rows import draft_rows, teacher_rows
from train.objectives import Objective


def ordered_anchors(batch: dict[str, Tensor], shift: int = 0) -> Tensor:
    """[B, M]: each row's round anchors (+ `shift`) in order, then distinct other positions where the row has
    fewer rounds than M (never trained), so that the steps' keys nest as the attention needs."""
    anchor_BM, mask_BM = batch["anchor_BM"], batch["round_mask"]
    wanted_BT = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
    wanted_BT.scatter_(1, anchor_BM + shift, mask_BM)
    order_BT = torch.sort((~wanted_BT).to(torch.uint8), dim=1, stable=True).indices
    index_BM = order_BT[:, : anchor_BM.shape[1]]
    assert bool((index_BM[mask_BM] == (anchor_BM + shift)[mask_BM]).all()), "rounds in order of their anchors"
    return index_BM


def replay_outputs(model, batch: dict[str, Tensor]) -> Tensor:
    """[B, M, K, H]: the last layer's pre-norm output at draft i of every round, the head drafting from the
    round's anchor as it drafts when served."""
    ids_BT, aux_BTAH, k = batch["input_ids"], batch["aux_hidden"], batch["drafts_BMK"].shape[2]
    if model.drafting == "block":
        index_BM = ordered_anchors(batch, shift=1)  # the block starts at the pending token, t + 1
        lengths_BM = torch.full_like(index_BM, k + 1)
        return block_forward(model, ids_BT, aux_BTAH, index_BM, lengths_BM)[:, :, 1 : k + 1]
    index_BM = ordered_anchors(batch)
    if model.parallel:
        anchors = Anchors(index_BM, batch["round_mask"])
        outs = parallel_forward(model, ids_BT, aux_BTAH, [anchors] * k)
    else:
        outs = ttt_rollout(model, ids_BT, aux_BTAH, k, None, index_BM, fed_BMK=batch["drafts_BMK"])
    return torch.stack(outs, dim=2)


def replay_masks(batch: dict[str, Tensor], gamma: float) -> tuple[Tensor, Tensor, Tensor]:
    """(accepted_BMK, rejected_BMK, weight_BMK): which drafts were accepted, which rejected (the first
    rejection and the rest of its round), and each rejected draft's weight gamma^i (0 elsewhere)."""
    b, m, k = batch["drafts_BMK"].shape
    depth_K = torch.arange(k, device=batch["drafts_BMK"].device)
    valid_BMK = batch["round_mask"][..., None].expand(b, m, k)
    below_BMK = depth_K < batch["accepted_BM"][..., None]
    rejected_BMK = valid_BMK & ~below_BMK
    return valid_BMK & below_BMK, rejected_BMK, torch.where(rejected_BMK, gamma ** depth_K.float(), 0.0)


def replay_denominators(batch: dict[str, Tensor], gamma: float) -> Tensor:
    """[2] fp32: the accepted drafts' count and the rejected drafts' weight sum, what the two terms of
    `replay_loss` divide by (summed over micro-batches and processes by the trainer)."""
    accepted_BMK, _, weight_BMK = replay_masks(batch, gamma)
    return torch.stack([accepted_BMK.sum().float(), weight_BMK.sum()])


def replay_loss(
    model,
    batch: dict[str, Tensor],
    target_lm_head: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    accepted: Objective,
    rejected: Objective,
    gamma: float,
    denominators: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """(total, metrics): half the accepted drafts' mean `accepted` objective plus half the rejected drafts'
    gamma^i-weighted mean `rejected` objective; their denominators `replay_denominators`' (this batch's when
    None). Metrics (detached): loss_accepted / loss_rejected (each term), and per draft i agree_i / num_i:
    the replayed draft's argmax is the target's at that position, and the rounds that reached it."""
    out_BMKH = replay_outputs(model, batch)
    b, m, k, h = out_BMKH.shape
    accepted_BMK, rejected_BMK, weight_BMK = replay_masks(batch, gamma)
    valid_BMK = accepted_BMK | rejected_BMK
    teacher = teacher_rows(
        batch["final_BMKH"].reshape(1, b * m * k, h), target_lm_head, draft_to_target, chunk_size,
        valid_BMK.reshape(1, -1),
    )  # fmt: skip
    rows_BMK = teacher.row_BT.view(b, m, k)
    if denominators is None:
        denominators = replay_denominators(batch, gamma)
    terms, agree_BMK = [], torch.zeros_like(valid_BMK)
    for mask_BMK, objective, weight_N, denominator in (
        (accepted_BMK, accepted, None, denominators[0]),
        (rejected_BMK, rejected, weight_BMK[rejected_BMK], denominators[1]),
    ):
        if not bool(mask_BMK.any()):
            terms.append(out_BMKH.sum() * 0.0)  # every weight in the graph, for DDP
            continue
        # The rejected drafts weigh each their own gamma^i: the fused rows' backward recomputes for them.
        rows = draft_rows(
            model, objective, out_BMKH[mask_BMK], teacher, rows_BMK[mask_BMK], weighed=weight_N is not None
        )
        loss_N = rows.loss if weight_N is None else rows.loss * weight_N
        terms.append(loss_N.sum() / denominator.clamp(min=1e-12))
        agree_BMK[mask_BMK] = rows.correct
    metrics = {"loss_accepted": terms[0].detach(), "loss_rejected": terms[1].detach()}
    for i in range(k):
        metrics[f"agree_{i}"] = agree_BMK[..., i].sum().float()
        metrics[f"num_{i}"] = valid_BMK[..., i].sum().float()
    return (terms[0] + terms[1]) / 2, metrics
