"""The EAGLE-1 loss: feature regression plus soft cross-entropy through the target's frozen lm_head.

Pure functions on tensors (no I/O, no Accelerator), tested on CPU. DESIGN.md section 3 (EAGLE-1):
`SmoothL1(f_pred, f_true) + 0.1 * CE(soft target)`, uniform noise U(-0.1, 0.1) on the input features.

Alignment. f_t is the target's final post-norm hidden state at position t (the cache's `final_hidden`).
At position t the draft reads cat(embed(x_{t+1}), f_t) and predicts f_{t+1}. Through the target's lm_head,
f_{t+1} is the target's distribution over x_{t+2}: when vLLM has just sampled x_{t+1} from f_t, the draft
proposes x_{t+2}. So position t has a loss iff x_{t+2} is a real assistant token - loss_mask[t+2] and
attention_mask[t+2], the same shift as EAGLE-3's step 0 (`step_valid_mask`) - and that one mask serves both
the regression and the cross-entropy. (SafeAILab's EAGLE-1 script masks with loss_mask[t], two tokens
early; the shifted mask trains exactly the drafts that are verified on assistant text.)

    total, metrics = eagle1_loss(draft, batch, target_lm_head=w_VH, chunk_size=1024, generator=g)

Shape legend:
    B batch, T positions, S = T - 1 positions with a next feature, H hidden, V target vocab,
    M valid positions, C positions in a cross-entropy chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from heads.eagle1 import Eagle1Draft
from train.ttt import step_valid_mask


def add_feature_noise(
    features_BTH: Tensor, noise_range: float, generator: torch.Generator | None = None
) -> Tensor:
    """features + U(-noise_range, noise_range), in fp32 (the draft casts to its own dtype).

    The noise comes from `generator` (or the global RNG when None), so restoring that RNG state on resume
    replays it. EAGLE's noise stands in for the draft's own prediction errors, which it reads back at
    inference. (SafeAILab's script also scales it by 512 / T; DESIGN fixes the plain U(-0.1, 0.1).)
    """
    if noise_range < 0:
        raise ValueError(f"noise_range={noise_range}: the half-width of the uniform noise must be >= 0")
    features_BTH = features_BTH.float()
    unit_BTH = torch.rand(
        features_BTH.shape, generator=generator, device=features_BTH.device, dtype=torch.float32
    )
    return features_BTH + (2 * unit_BTH - 1) * noise_range


def soft_ce_sum(pred_CH: Tensor, true_CH: Tensor, target_lm_head_VH: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over rows of CE(softmax(lm_head(true)), log_softmax(lm_head(pred))), rows whose argmaxes agree).

    Logits are computed in the lm_head's dtype, as the target computes them, then soft-maxed in fp32.
    """
    with torch.no_grad():
        teacher_CV = torch.softmax((true_CH.to(target_lm_head_VH.dtype) @ target_lm_head_VH.T).float(), -1)
    logits_CV = (pred_CH.to(target_lm_head_VH.dtype) @ target_lm_head_VH.T).float()
    ce_sum = -(teacher_CV * torch.log_softmax(logits_CV, dim=-1)).sum()
    num_correct = (logits_CV.argmax(-1) == teacher_CV.argmax(-1)).sum()
    return ce_sum, num_correct


def chunked_soft_ce(
    pred_MH: Tensor, true_MH: Tensor, target_lm_head_VH: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """`soft_ce_sum` over all rows, `chunk_size` rows at a time.

    Each chunk runs under activation checkpointing when it needs a gradient: otherwise autograd would keep
    every chunk's fp32 [C, V] probabilities until backward - the whole batch's full-vocabulary logits after
    all. Checkpointed, backward recomputes one chunk's teacher and logits at a time (twice the lm_head
    matmuls, a fraction of the memory).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be positive")
    ce_sum = pred_MH.new_zeros((), dtype=torch.float32)
    num_correct = torch.zeros((), dtype=torch.int64, device=pred_MH.device)
    for start in range(0, pred_MH.shape[0], chunk_size):
        pred_CH, true_CH = pred_MH[start : start + chunk_size], true_MH[start : start + chunk_size]
        if torch.is_grad_enabled() and pred_CH.requires_grad:
            chunk_ce, chunk_correct = checkpoint(
                soft_ce_sum, pred_CH, true_CH, target_lm_head_VH, use_reentrant=False
            )
        else:
            chunk_ce, chunk_correct = soft_ce_sum(pred_CH, true_CH, target_lm_head_VH)
        ce_sum, num_correct = ce_sum + chunk_ce, num_correct + chunk_correct
    return ce_sum, num_correct


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = SmoothL1(f_pred, f_true) + ce_weight * soft CE, both means over the valid positions.

    batch: input_ids [B, T] int64, loss_mask [B, T] bool, final_hidden [B, T, H], optional attention_mask
    [B, T] (1 = real token; batches are right-padded). target_lm_head: the target's frozen [V, H] weight.
    add_noise=False for evaluation. Metrics (detached tensors): loss, loss_regression (SmoothL1, beta 1,
    mean over positions and hidden dims), loss_ce, acc_0 (draft argmax == target argmax), num_valid, and
    chain_hits_0 / chain_total_0 (the same counts, named as `ttt_loss` names them, so they sum over ranks).
    """
    if ce_weight < 0:
        raise ValueError(f"ce_weight={ce_weight}: the cross-entropy weight must be >= 0")
    input_ids_BT, final_hidden_BTH = batch["input_ids"], batch["final_hidden"]
    b, t = input_ids_BT.shape
    s = max(t - 1, 0)  # the last position has no next token to read and no next feature to predict
    valid_BS = step_valid_mask(
        batch["loss_mask"].bool(),
        torch.ones_like(input_ids_BT, dtype=torch.bool),
        0,
        batch.get("attention_mask"),
    )[:, :s]
    features_BSH = final_hidden_BTH[:, :s]
    if add_noise and noise_range > 0:
        features_BSH = add_feature_noise(features_BSH, noise_range, generator)
    positions_BS = torch.arange(s, device=input_ids_BT.device).expand(b, -1)
    pred_BSH = model(input_ids_BT[:, 1:], features_BSH, positions_BS)

    # Only valid rows go on: the regression and the full-vocabulary CE cost nothing for padding or prompts.
    pred_MH = pred_BSH[valid_BS].float()
    true_MH = final_hidden_BTH[:, 1:][valid_BS]
    num_valid = valid_BS.sum()
    denom = num_valid.clamp(min=1)
    regression = F.smooth_l1_loss(pred_MH, true_MH.float(), reduction="none").mean(-1).sum() / denom
    ce_sum, num_correct = chunked_soft_ce(pred_MH, true_MH, target_lm_head, chunk_size)
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
    }
    return total, metrics
