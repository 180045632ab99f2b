"""EAGLE-1's loss (`eagle1_loss`, docs/design.md#the-draft-heads): SmoothL1(f_pred, f_true) + 0.1 * soft CE
over the target's full vocabulary, noise U(-0.1, 0.1) on the input features; f_{t+1} predicted at t
decodes x_{t+2}: TTT's step-0 shift and mask (rows.py `step_valid_mask`).

Pure functions on tensors, tested on CPU. The full-vocabulary CE goes `chunk_size` rows at a time, each
chunk checkpointed (`chunked_full_vocab`), so no [M, V] logits are kept for backward.

    total, metrics = eagle1_loss(draft, batch, w_VH, 1024)

Shape legend: B batch, T positions, S = T - 1 positions with a next feature, M valid positions, C rows in a
chunk, H hidden, V target vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from heads.attention import KVCache, document_positions
from heads.eagle1 import Eagle1Draft
from train.losses.rows import estimating, step_valid_mask, target_logits
from train.objectives import KL, Objective, acceptance, log_probs, token_losses


def add_feature_noise(
    features_BTH: Tensor, noise_range: float, generator: torch.Generator | None = None
) -> Tensor:
    """features + U(-noise_range, noise_range), in fp32 (the draft casts to its own dtype).

    The noise comes from `generator` (or the global RNG when None), so restoring that RNG state on resume
    replays it. EAGLE's noise stands in for the draft's own prediction errors, which it reads back at
    inference. (SafeAILab's script also scales it by 512 / T; docs/design.md#the-draft-heads fixes plain U(-0.1, 0.1).)
    """
    if noise_range < 0:
        raise ValueError(f"noise_range={noise_range}: the half-width of the uniform noise must be >= 0")
    features_BTH = features_BTH.float()
    unit_BTH = torch.rand(
        features_BTH.shape, generator=generator, device=features_BTH.device, dtype=torch.float32
    )
    return features_BTH + (2 * unit_BTH - 1) * noise_range


def full_vocab_rows(
    objective: Objective, pred_CH: Tensor, true_CH: Tensor, target_lm_head_VH: Tensor
) -> Tensor:
    """[4]: the sum over rows of the objective between softmax(lm_head(true)) and lm_head(pred), and
    (detached) of rows whose argmaxes agree, of p(argmax q) and of sum min(p, q) (`RowLosses`; these two
    are 0 unless `estimating()`): EAGLE-1's loss over the target's full vocabulary.

    Logits are computed in the lm_head's dtype, as the target computes them, then soft-maxed in fp32.
    """
    teacher_CV = torch.softmax(target_logits(true_CH, target_lm_head_VH), -1)
    logits_CV = (pred_CH.to(target_lm_head_VH.dtype) @ target_lm_head_VH.T).float()
    logq_CV = log_probs(logits_CV)
    # The teacher is the target's whole distribution: its mass on the vocabulary drafted is 1.
    mass_C = torch.ones(teacher_CV.shape[0], device=teacher_CV.device)
    loss_sum = token_losses(objective, teacher_CV, logq_CV, mass_C).sum()
    estimate = estimating()
    with torch.no_grad():
        draft_C = logits_CV.argmax(-1)
        correct = (draft_C == teacher_CV.argmax(-1)).sum().float()
        if estimate:
            greedy, sampled = (
                teacher_CV.gather(1, draft_C[:, None]).sum(),
                acceptance(teacher_CV, logq_CV.exp()).sum(),
            )
        else:
            greedy = sampled = torch.zeros_like(correct)  # not read in training
        accepted = torch.stack([correct, greedy, sampled])
    return torch.cat([loss_sum[None], accepted])


def chunked_full_vocab(
    objective: Objective, pred_MH: Tensor, true_MH: Tensor, target_lm_head_VH: Tensor, chunk_size: int
) -> Tensor:
    """`full_vocab_rows` over all rows, `chunk_size` rows at a time.

    Each chunk runs under activation checkpointing when it needs a gradient: otherwise autograd would keep
    every chunk's fp32 [C, V] probabilities until backward - the whole batch's full-vocabulary logits after
    all. Checkpointed, backward recomputes one chunk's teacher and logits at a time (twice the lm_head
    matmuls, a fraction of the memory).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be positive")
    sums = pred_MH.new_zeros(4, dtype=torch.float32)
    for start in range(0, pred_MH.shape[0], chunk_size):
        inputs = (objective, pred_MH[start : start + chunk_size], true_MH[start : start + chunk_size])
        if torch.is_grad_enabled() and inputs[1].requires_grad:
            sums = sums + checkpoint(full_vocab_rows, *inputs, target_lm_head_VH, use_reentrant=False)
        else:
            sums = sums + full_vocab_rows(*inputs, target_lm_head_VH)
    return sums


def eagle1_loss(
    model: Eagle1Draft,
    batch: dict[str, torch.Tensor],
    target_lm_head: torch.Tensor,
    chunk_size: int,
    *,
    noise_range: float = 0.1,
    ce_weight: float = 0.1,
    add_noise: bool = True,
    generator: torch.Generator | None = None,
    objective: Objective = KL,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = SmoothL1(f_pred, f_true) + ce_weight * the objective (soft CE by default: EAGLE-1's), both
    means over the valid positions.

    batch: input_ids [B, T] int64, loss_mask [B, T] bool, final_hidden [B, T, H], optional attention_mask
    [B, T] (1 = real token; batches are right-padded), optional doc_starts [B, T] (packed rows). target_lm_head: the target's frozen [V, H] weight.
    add_noise=False for evaluation. Metrics (detached tensors): loss, loss_regression (SmoothL1, beta 1,
    mean over positions and hidden dims), loss_ce, acc_0 (draft argmax == target argmax), num_valid, and
    chain_hits_0 / chain_total_0 (the same counts, named as `ttt_loss` names them, so they sum over ranks).
    """
    if ce_weight < 0:
        raise ValueError(f"ce_weight={ce_weight}: the cross-entropy weight must be >= 0")
    input_ids_BT, final_hidden_BTH = batch["input_ids"], batch["final_hidden"]
    b, t = input_ids_BT.shape
    s = max(t - 1, 0)  # the last position has no next token to read and no next feature to predict
    starts_BT = batch.get("doc_starts")
    valid_BS = step_valid_mask(
        batch["loss_mask"].bool(),
        torch.ones_like(input_ids_BT, dtype=torch.bool),
        0,
        batch.get("attention_mask"),
        starts_BT,
    )[:, :s]
    features_BSH = final_hidden_BTH[:, :s]
    if add_noise and noise_range > 0:
        features_BSH = add_feature_noise(features_BSH, noise_range, generator)
    positions_BS = torch.arange(s, device=input_ids_BT.device).expand(b, -1)
    cache = None
    if starts_BT is not None:  # packed rows: each position sees and is placed in its own document only
        positions_BS = document_positions(starts_BT[:, :s])
        cache = KVCache(len(model.layers), starts_BS=starts_BT[:, :s])
    pred_BSH = model(input_ids_BT[:, 1:], features_BSH, positions_BS, cache)

    # Only valid rows go on: the regression and the full-vocabulary CE cost nothing for padding or prompts.
    pred_MH = pred_BSH[valid_BS].float()
    true_MH = final_hidden_BTH[:, 1:][valid_BS]
    num_valid = valid_BS.sum()
    denom = num_valid.clamp(min=1)
    regression = F.smooth_l1_loss(pred_MH, true_MH.float(), reduction="none").mean(-1).sum() / denom
    ce_sum, num_correct, greedy_t1, sampled_t1 = chunked_full_vocab(
        objective, pred_MH, true_MH, target_lm_head, chunk_size
    )
    ce = ce_sum / denom
    total = regression + ce_weight * ce
    metrics = {
        "loss": total.detach(),
        "loss_regression": regression.detach(),
        "loss_ce": ce.detach(),
        "acc_0": num_correct / denom,
        "num_valid": num_valid,
        "chain_hits_0": num_correct,
        "chain_total_0": num_valid,
        "greedy_t1_hits_0": greedy_t1,
        "greedy_t1_total_0": num_valid,
        "sampled_t1_hits_0": sampled_t1,
        "sampled_t1_total_0": num_valid,
    }
    return total, metrics
