"""Training-time test (TTT) for the EAGLE-3 head: the K-step rollout, its attention, teacher and loss.

Pure functions on tensors (no I/O, no Accelerator), so every piece is tested on CPU. DESIGN.md section 4:
at step k the draft at position t gets the embedding of x_{t+1+k} and, as hidden state, `fc(aux_t)` at
step 0 or its own output of step k-1 (pre-norm, post-norm with `norm_output`; not detached); its RoPE position is t + k; it predicts
x_{t+2+k} against the target's distribution at t+1+k restricted to the draft vocabulary. Its attention
sees the step-0 keys at positions <= t plus the keys of steps 1..k at the same position t.

    total_loss, metrics = ttt_loss(draft, batch, num_steps=7, gamma=0.8, target_lm_head=w_VH,
                                   draft_to_target=vocab.draft_to_target, chunk_size=1024)

Shape legend:
    B batch, T positions, H hidden, A aux layers, N query heads, G key/value heads, R = N/G queries per
    key/value head, D head dim, J earlier steps on the diagonal (1..k), K steps, V target vocab,
    Vd draft vocab, C tokens in a teacher chunk.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from heads.eagle3 import Eagle3Draft


def ttt_attention(
    q_BNTD: Tensor,
    k0_BGTD: Tensor,
    v0_BGTD: Tensor,
    diag_k_BGTJD: Tensor | None = None,
    diag_v_BGTJD: Tensor | None = None,
    query_positions_BT: Tensor | None = None,
) -> Tensor:
    """Attention of one TTT step: causal over step 0, plus the same-position keys of steps 1..k.

    Both score blocks share one softmax, so memory is O(T^2 + T*K), never a dense (T x K*T) mask.
    No key-padding mask: batches are right-padded, so a pad key sits after every real position and is
    visible (causal or diagonal) only to pad queries, which get no loss.
    With `query_positions_BT`, the T queries (and their diagonal keys) belong to those anchor positions of
    the S step-0 keys instead of to positions 0..S-1 (P-EAGLE's subsampled deeper depths).
    """
    b, n, t, d = q_BNTD.shape
    g, s = k0_BGTD.shape[1], k0_BGTD.shape[2]
    # Query head n reads key/value head n // R (HF's repeat_kv order): a view, no copies of the keys.
    q_BGRTD = q_BNTD.view(b, g, n // g, t, d) * d**-0.5
    scores_BGRTT = torch.einsum("bgrtd,bgsd->bgrts", q_BGRTD, k0_BGTD)
    if query_positions_BT is None:
        future = torch.ones(t, s, dtype=torch.bool, device=q_BNTD.device).triu(1)
    else:
        future = (torch.arange(s, device=q_BNTD.device) > query_positions_BT[..., None])[:, None, None]
    scores_BGRTT = scores_BGRTT.masked_fill(future, float("-inf"))
    if diag_k_BGTJD is None:
        probs_BGRTT = torch.softmax(scores_BGRTT.float(), dim=-1).to(q_BNTD.dtype)
        return torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTT, v0_BGTD).reshape(b, n, t, d)
    scores_BGRTJ = torch.einsum("bgrtd,bgtjd->bgrtj", q_BGRTD, diag_k_BGTJD)
    probs = torch.softmax(torch.cat([scores_BGRTT, scores_BGRTJ], dim=-1).float(), dim=-1).to(q_BNTD.dtype)
    probs_BGRTT, probs_BGRTJ = probs.split([s, diag_k_BGTJD.shape[3]], dim=-1)
    out_BGRTD = torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTT, v0_BGTD)
    out_BGRTD = out_BGRTD + torch.einsum("bgrtj,bgtjd->bgrtd", probs_BGRTJ, diag_v_BGTJD)
    return out_BGRTD.reshape(b, n, t, d)


def shift_left(x_BT: torch.Tensor, shift: int, fill: int | bool = 0) -> torch.Tensor:
    """x[:, t + shift] at t, `fill` where that runs past the end."""
    out_BT = torch.full_like(x_BT, fill)
    if shift < x_BT.shape[1]:
        out_BT[:, : x_BT.shape[1] - shift] = x_BT[:, shift:]
    return out_BT


def ttt_rollout(model: Eagle3Draft, input_ids_BT: Tensor, aux_BTAH: Tensor, num_steps: int) -> list[Tensor]:
    """Pre-norm layer outputs [B, T, H] of steps 0..K-1, teacher-forced (step k reads x_{t+1+k})."""
    layer = model.layer
    t = input_ids_BT.shape[1]
    positions_BT = torch.arange(t + num_steps - 1, device=input_ids_BT.device).expand(
        input_ids_BT.shape[0], -1
    )
    # Step k's token sits k places after step 0's, so its RoPE position is t + k, as when vLLM drafts a chain.
    cos_all, sin_all = model.rope(positions_BT)
    hidden_BTH = model.combine_aux(aux_BTAH)
    outs, diag_k, diag_v = [], [], []
    for step in range(num_steps):
        # Token ids past the end are a placeholder (0): those positions are never valid for the loss.
        embeds_BTH = model.embed(shift_left(input_ids_BT, 1 + step))
        cos_BTD, sin_BTD = cos_all[:, step : step + t], sin_all[:, step : step + t]
        q_BNTD, k_BGTD, v_BGTD, residual_BTH = layer.project(embeds_BTH, hidden_BTH, cos_BTD, sin_BTD)
        if step == 0:
            k0_BGTD, v0_BGTD = k_BGTD, v_BGTD
            attn_BNTD = ttt_attention(q_BNTD, k0_BGTD, v0_BGTD)
        else:
            diag_k.append(k_BGTD)
            diag_v.append(v_BGTD)
            attn_BNTD = ttt_attention(
                q_BNTD, k0_BGTD, v0_BGTD, torch.stack(diag_k, dim=3), torch.stack(diag_v, dim=3)
            )
        out_BTH = layer.finish(attn_BNTD, residual_BTH)
        outs.append(out_BTH)
        # Fed back (post-norm with norm_output) without detaching: later steps' gradients reach earlier ones.
        hidden_BTH = model.carry(out_BTH)
    return outs


@torch.no_grad()
def teacher_probs(
    final_hidden_BTH: Tensor,
    target_lm_head_VH: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    needed_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The target's next-token distribution at every position, restricted to the draft vocabulary.

    Returns (probs_BTVd fp32, summing to 1 over the draft vocabulary; in_draft_BT bool: the target's
    argmax over its FULL vocabulary is a draft token). Logits are computed in the lm_head's dtype, as the
    target computes them, then softmaxed in fp32 - `chunk_size` tokens at a time, so fp32 logits over the
    whole target vocabulary never exist for more than one chunk. With `needed_BT`, only those positions
    are computed (the full-vocabulary product is the costliest part of a step); the others get zero
    probabilities and in_draft False.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be positive")
    b, t, h = final_hidden_BTH.shape
    draft_to_target = draft_to_target.to(final_hidden_BTH.device)
    is_draft_V = torch.zeros(target_lm_head_VH.shape[0], dtype=torch.bool, device=final_hidden_BTH.device)
    is_draft_V[draft_to_target] = True
    rows_M = torch.arange(b * t, device=final_hidden_BTH.device)
    if needed_BT is not None:
        rows_M = rows_M[needed_BT.reshape(-1)]
    hidden_MH = final_hidden_BTH.reshape(b * t, h)[rows_M]
    probs_NVd = hidden_MH.new_zeros(b * t, draft_to_target.numel(), dtype=torch.float32)
    in_draft_N = torch.zeros(b * t, dtype=torch.bool, device=hidden_MH.device)
    for start in range(0, rows_M.numel(), chunk_size):
        chunk_C = rows_M[start : start + chunk_size]
        logits_CV = (
            hidden_MH[start : start + chunk_size].to(target_lm_head_VH.dtype) @ target_lm_head_VH.T
        ).float()
        in_draft_N[chunk_C] = is_draft_V[logits_CV.argmax(-1)]
        probs_NVd[chunk_C] = torch.softmax(logits_CV[:, draft_to_target], dim=-1)
    return probs_NVd.view(b, t, -1), in_draft_N.view(b, t)


def step_valid_mask(
    loss_mask_BT: Tensor, in_draft_BT: Tensor, step: int, attention_mask_BT: Tensor | None = None
) -> Tensor:
    """[B, T] bool: position t has a loss at step k (it predicts x_{t+2+k} from the teacher at t+1+k).

    Valid iff x_{t+2+k} exists, is real (attention_mask) and an assistant token (loss_mask), and the
    target's argmax at t+1+k is in the draft vocabulary (otherwise the draft cannot match it).
    """
    valid_BT = shift_left(loss_mask_BT.bool(), 2 + step, False) & shift_left(in_draft_BT, 1 + step, False)
    if attention_mask_BT is not None:
        valid_BT &= shift_left(attention_mask_BT.bool(), 2 + step, False)
    return valid_BT


def step_loss(
    logits_BTVd: Tensor, teacher_BTVd: Tensor, valid_BT: Tensor, denominator: Tensor | float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(soft cross-entropy over valid positions, correct_BT, num_valid). Zero loss with none valid.

    The loss is the mean over this batch's valid positions, or the sum divided by `denominator` when given
    (the trainer passes a count over the whole global batch, so that any split of it across processes
    and micro-batches gives the same gradient).
    """
    logprobs_BTVd = torch.log_softmax(logits_BTVd.float(), dim=-1)
    ce_BT = -(teacher_BTVd * logprobs_BTVd).sum(-1)
    num_valid = valid_BT.sum()
    if denominator is None:
        denominator = num_valid.clamp(min=1)
    loss = torch.where(valid_BT, ce_BT, 0.0).sum() / denominator
    correct_BT = (logits_BTVd.argmax(-1) == teacher_BTVd.argmax(-1)) & valid_BT
    return loss, correct_BT, num_valid


def chain_counts(correct_KBT: Tensor, eligible_KBT: Tensor) -> tuple[Tensor, Tensor]:
    """(hits_K, totals_K): at depth j, positions whose depths < j were all right and that are eligible at j
    (totals), and of those, the ones right at j (hits). Counts, so they sum over batches and ranks."""
    correct_KBT = correct_KBT & eligible_KBT
    all_before_KBT = torch.cat([torch.ones_like(correct_KBT[:1]), correct_KBT[:-1].cumprod(0)]).bool()
    reached_KBT = all_before_KBT & eligible_KBT
    return (reached_KBT & correct_KBT).sum((1, 2)), reached_KBT.sum((1, 2))


def conditional_accuracies(hits_K: Tensor, totals_K: Tensor) -> list[float]:
    """acc_j' = accuracy at depth j given depths < j were right (0 where no chain reached depth j)."""
    return [float(h) / float(n) if n else 0.0 for h, n in zip(hits_K.tolist(), totals_K.tolist())]


def expected_acceptance_length(cond_accs: list[float]) -> float:
    """1 + acc_0 + acc_0*acc_1' + ...: tokens per verify step (bonus token included) for a chain of drafts."""
    return 1.0 + sum(math.prod(cond_accs[: j + 1]) for j in range(len(cond_accs)))


def depth_losses(
    model: Eagle3Draft,
    outs: list[Tensor],
    batch: dict[str, Tensor],
    probs_BTVd: Tensor,
    in_draft_BT: Tensor,
    gamma: float,
    denominator: Tensor | float | None = None,
    anchors: list[Tensor | None] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_k gamma^k loss_k and the metrics, from each depth's pre-norm outputs (TTT steps or P-EAGLE depths).

    outs[k] is [B, T, H] (every position an anchor) or, with anchors[k] = index_BM, [B, M, H] at those
    anchor positions. Depth k at anchor t predicts x_{t+2+k} against the target's distribution at t+1+k.
    """
    input_ids_BT, loss_mask_BT = batch["input_ids"], batch["loss_mask"].bool()
    attention_mask_BT = batch.get("attention_mask")
    total = torch.zeros((), device=input_ids_BT.device)
    metrics: dict[str, torch.Tensor] = {}
    correct, eligible = [], []
    for step, out_BMH in enumerate(outs):
        index_BM = anchors[step] if anchors is not None else None
        valid_BT = step_valid_mask(loss_mask_BT, in_draft_BT, step, attention_mask_BT)
        # Eligible for the acceptance estimate: an assistant token to predict, whatever the target's argmax.
        eligible_BT = step_valid_mask(loss_mask_BT, torch.ones_like(in_draft_BT), step, attention_mask_BT)
        if index_BM is None:
            batch_M, pos_M = valid_BT.nonzero(as_tuple=True)
            row_M = pos_M
        else:
            selected_BT = torch.zeros_like(valid_BT).scatter_(1, index_BM, True)
            valid_BT, eligible_BT = valid_BT & selected_BT, eligible_BT & selected_BT
            batch_M, row_M = valid_BT.gather(1, index_BM).nonzero(as_tuple=True)
            pos_M = index_BM[batch_M, row_M]
        # The teacher of step k at t is the target at t+1+k. Logits only at the M positions with a loss
        # (answer tokens; never where t+2+k runs past the end), gathered as [1, M, ...]: prompt positions
        # cost no lm_head work.
        loss, correct_1M, num_valid = step_loss(
            model.logits(out_BMH[batch_M, row_M])[None],
            probs_BTVd[batch_M, pos_M + 1 + step][None],
            torch.ones(1, batch_M.numel(), dtype=torch.bool, device=valid_BT.device),
            denominator,
        )
        correct_BT = torch.zeros_like(valid_BT)
        correct_BT[batch_M, pos_M] = correct_1M[0]
        total = total + gamma**step * loss
        metrics[f"loss_{step}"] = loss.detach()
        metrics[f"acc_{step}"] = correct_BT.sum() / num_valid.clamp(min=1)
        metrics[f"num_valid_{step}"] = num_valid
        correct.append(correct_BT)
        eligible.append(eligible_BT)
    hits_K, totals_K = chain_counts(torch.stack(correct), torch.stack(eligible))
    for step in range(len(outs)):
        metrics[f"chain_hits_{step}"], metrics[f"chain_total_{step}"] = hits_K[step], totals_K[step]
    return total, metrics


def batch_teacher(batch: dict[str, Tensor], target_lm_head: Tensor, draft_to_target: Tensor, chunk_size: int):
    """(probs_BTVd, in_draft_BT) at the positions some depth needs: x_{t+1} an answer token."""
    # The teacher at j serves a loss only where x_{j+1} is an answer token: prompts cost no teacher work.
    needed_BT = shift_left(batch["loss_mask"].bool(), 1, False)
    return teacher_probs(batch["final_hidden"], target_lm_head, draft_to_target, chunk_size, needed_BT)


def ttt_loss(
    model: Eagle3Draft,
    batch: dict[str, torch.Tensor],
    num_steps: int,
    gamma: float,
    target_lm_head: torch.Tensor,
    draft_to_target: torch.Tensor,
    chunk_size: int,
    denominator: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = sum_k gamma^k loss_k over a right-padded batch (loss_k: see `step_loss` for `denominator`).

    batch: input_ids [B, T] int64, loss_mask [B, T] bool, aux_hidden [B, T, A, H], final_hidden [B, T, H],
    optional attention_mask [B, T] (1 = real token; without it every position is real).
    Metrics (detached tensors), per step k: loss_k; acc_k and num_valid_k over the positions with a loss;
    chain_hits_k / chain_total_k, counts for `conditional_accuracies` where a target argmax outside the
    draft vocabulary counts as a miss (as in vLLM), not as skipped.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: TTT needs at least one step")
    if not gamma > 0:
        raise ValueError(f"gamma={gamma}: the step weight must be positive")
    assert model.config.num_hidden_layers == 1, "the TTT rollout drives a one-layer head"
    probs_BTVd, in_draft_BT = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    outs = ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], num_steps)
    return depth_losses(model, outs, batch, probs_BTVd, in_draft_BT, gamma, denominator)
