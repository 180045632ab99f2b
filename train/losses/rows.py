"""The rows a loss is computed on: the target's teacher rows at the positions some loss needs, and the draft's
objective against them row by row, its logits in bounded memory.

Pure functions on tensors (no I/O, no Accelerator), tested on CPU. The teacher (`teacher_rows`, at the
positions a depth needs: `batch_teacher`) is the target's next-token distribution restricted to the draft
vocabulary, computed only where x_{t+1} is an answer token; `step_valid_mask` says where draft position k
has a loss. `draft_rows` gives each prediction's objective (`train.loss`, train/objectives.py: forward KL by
default) and, detached, what it says about acceptance (`RowLosses`), never keeping more than
LOGIT_BUDGET_BYTES of draft logits at a time. `teacher_probs` and `step_loss` are the dense forms, every
position laid out [B, T, Vd] (benchmarks and tests).

    teacher = batch_teacher(batch, target_lm_head_VH, vocab.draft_to_target, 1024)
    rows = draft_rows(draft, KL, out_MH, teacher, teacher.row_BT[batch_M, pos_M + 1 + step])

Shape legend: B batch, T positions, N positions with a teacher row, M predictions with a loss, C rows in a
chunk, H hidden, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from train.objectives import Objective, acceptance, log_probs, token_losses


def shift_left(x_BT: torch.Tensor, shift: int, fill: int | bool = 0) -> torch.Tensor:
    """x[:, t + shift] at t, `fill` where that runs past the end."""
    out_BT = torch.full_like(x_BT, fill)
    if shift < x_BT.shape[1]:
        out_BT[:, : x_BT.shape[1] - shift] = x_BT[:, shift:]
    return out_BT


class Teacher(NamedTuple):
    """The target's draft-vocabulary distribution at the positions some loss needs, compact: fp32 rows
    [N, Vd] only for those positions (not [B*T, Vd] for every position, prompts and padding included)."""

    probs_NVd: Tensor  # summing to 1 over the draft vocabulary
    row_BT: Tensor  # int64: the row of position (b, t) in probs_NVd; -1 where it was not computed
    in_draft_BT: Tensor  # bool: the target's argmax over its FULL vocabulary is a draft token
    mass_N: Tensor  # fp32: the target's probability (full vocabulary) on draft tokens: acceptance estimates


@torch.no_grad()
def target_logits(hidden_NH: Tensor, target_lm_head_VH: Tensor) -> Tensor:
    """[N, V] fp32: the target's logits, computed in its lm_head's dtype whatever the draft's precision: under
    bf16 autocast an fp32 lm_head would otherwise run in bf16, and the teacher (which positions it leaves
    outside the draft vocabulary, its distribution) would follow the draft's mixed-precision setting instead
    of the target - and differ between autocast and DeepSpeed's bf16 engine, which runs no autocast."""
    with torch.autocast(hidden_NH.device.type, enabled=False):
        return (hidden_NH.to(target_lm_head_VH.dtype) @ target_lm_head_VH.T).float()


@torch.no_grad()
def teacher_rows(
    final_hidden_BTH: Tensor,
    target_lm_head_VH: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    needed_BT: Tensor | None = None,
) -> Teacher:
    """The target's next-token distribution at the `needed_BT` positions (all when None), restricted to the
    draft vocabulary; in_draft is False where not computed.

    Logits are computed in the lm_head's dtype, as the target computes them, then softmaxed in fp32 -
    `chunk_size` tokens at a time, so fp32 logits over the whole target vocabulary never exist for more
    than one chunk (the full-vocabulary product is the costliest part of a step: prompts cost nothing).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be positive")
    b, t, h = final_hidden_BTH.shape
    device = final_hidden_BTH.device
    draft_to_target = draft_to_target.to(device)
    is_draft_V = torch.zeros(target_lm_head_VH.shape[0], dtype=torch.bool, device=device)
    is_draft_V[draft_to_target] = True
    needed_N = (
        torch.ones(b * t, dtype=torch.bool, device=device) if needed_BT is None else needed_BT.reshape(-1)
    )
    positions_N = needed_N.nonzero().squeeze(1)
    row_N = torch.full((b * t,), -1, dtype=torch.int64, device=device)
    row_N[positions_N] = torch.arange(positions_N.numel(), device=device)
    hidden_NH = final_hidden_BTH.reshape(b * t, h)[positions_N]
    probs_NVd = hidden_NH.new_empty(positions_N.numel(), draft_to_target.numel(), dtype=torch.float32)
    mass_N = hidden_NH.new_empty(positions_N.numel(), dtype=torch.float32)
    in_draft_N = torch.zeros(b * t, dtype=torch.bool, device=device)
    for start in range(0, positions_N.numel(), chunk_size):
        rows = slice(start, start + chunk_size)
        logits_CV = target_logits(hidden_NH[rows], target_lm_head_VH)
        in_draft_N[positions_N[rows]] = is_draft_V[logits_CV.argmax(-1)]
        draft_logits_CVd = logits_CV[:, draft_to_target]
        probs_NVd[rows] = torch.softmax(draft_logits_CVd, dim=-1)
        mass_N[rows] = torch.exp(draft_logits_CVd.logsumexp(-1) - logits_CV.logsumexp(-1))
    return Teacher(probs_NVd, row_N.view(b, t), in_draft_N.view(b, t), mass_N)


def teacher_probs(
    final_hidden_BTH: Tensor,
    target_lm_head_VH: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    needed_BT: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`teacher_rows` laid out at every position: (probs_BTVd fp32, zero where not computed; in_draft_BT)."""
    teacher = teacher_rows(final_hidden_BTH, target_lm_head_VH, draft_to_target, chunk_size, needed_BT)
    b, t = teacher.row_BT.shape
    probs_BTVd = teacher.probs_NVd.new_zeros(b, t, teacher.probs_NVd.shape[1])
    probs_BTVd[teacher.row_BT >= 0] = teacher.probs_NVd
    return probs_BTVd, teacher.in_draft_BT


def batch_teacher(
    batch: dict[str, Tensor], target_lm_head: Tensor, draft_to_target: Tensor, chunk_size: int
) -> Teacher:
    """The teacher at the positions some depth needs: x_{t+1} an answer token (of the same document)."""
    # The teacher at j serves a loss only where x_{j+1} is an answer token: prompts cost no teacher work.
    needed_BT = shift_left(batch["loss_mask"].bool(), 1, False) & same_document(batch.get("doc_starts"), 1)
    return teacher_rows(batch["final_hidden"], target_lm_head, draft_to_target, chunk_size, needed_BT)


def same_document(starts_BT: Tensor | None, shift: int) -> Tensor | bool:
    """[B, T] bool: position t + shift belongs to t's document - in a row packing several (`starts_BT`, where
    each position's document starts: train/data.py `collate`); True without packing (one row, one sample)."""
    if starts_BT is None:
        return True
    return shift_left(starts_BT, shift, -1) == starts_BT


def step_valid_mask(
    loss_mask_BT: Tensor,
    in_draft_BT: Tensor,
    step: int,
    attention_mask_BT: Tensor | None = None,
    starts_BT: Tensor | None = None,
) -> Tensor:
    """[B, T] bool: position t has a loss at step k (it predicts x_{t+2+k} from the teacher at t+1+k).

    Valid iff x_{t+2+k} exists, is real (attention_mask), of t's own document (`starts_BT`, packed rows) and
    an assistant token (loss_mask), and the target's argmax at t+1+k is in the draft vocabulary (otherwise
    the draft cannot match it).
    """
    valid_BT = shift_left(loss_mask_BT.bool(), 2 + step, False) & shift_left(in_draft_BT, 1 + step, False)
    if attention_mask_BT is not None:
        valid_BT &= shift_left(attention_mask_BT.bool(), 2 + step, False)
    return valid_BT & same_document(starts_BT, 2 + step)


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


# The most bytes of fp32 draft logits one loss keeps at a time. Above it, rows go in chunks that each fit,
# every chunk under activation checkpointing: training keeps no [M, Vd] logits, log-probabilities or teacher
# rows per drafting step (at K=7 and 8k answer tokens they would take ~18 GB), and backward recomputes one
# chunk's lm_head at a time. A module setting so tests can force the chunked path at tiny shapes.
LOGIT_BUDGET_BYTES = 256 * 2**20


def estimating() -> bool:
    """Whether the temperature-1 acceptance estimates are computed: in held-out evaluation, which runs
    without grad, only. Training reads none of them, and they cost a [M, Vd] product, exp and min per step."""
    return not torch.is_grad_enabled()


class RowLosses(NamedTuple):
    """Per prediction (M rows): the objective (with its graph) and, detached, what it says about acceptance."""

    loss: Tensor  # [M] the objective (train/objectives.py) against the teacher row
    correct: Tensor  # [M] bool: the draft's argmax is the target's (accepted at temperature 0)
    target_ce: Tensor  # [M] -log q(argmax p): the draft's confidence in the target's token (D-PACE)
    # When `estimating()`, else None: [M] the acceptance at temperature 1 of the draft's argmax as vLLM
    # drafts it, p(argmax q), and of a token sampled from the draft, sum_v min(p_v, q_v).
    greedy_t1: Tensor | None
    sampled_t1: Tensor | None

    @staticmethod
    def cat(parts: list[RowLosses]) -> RowLosses:
        return RowLosses(*(None if field[0] is None else torch.cat(field) for field in zip(*parts)))


def objective_rows(
    model, objective: Objective, out_CH: Tensor, probs_NVd: Tensor, mass_N: Tensor, rows_C: Tensor
) -> RowLosses:
    """`RowLosses` of the draft's logits at these outputs against the teacher rows `rows_C`; the acceptance
    estimates use the target's full-vocabulary probabilities of the draft tokens (rows times `mass_N`)."""
    logits_CVd = model.logits(out_CH)
    teacher_CVd = probs_NVd[rows_C]
    logq_CVd = log_probs(logits_CVd)
    loss_C = token_losses(objective, teacher_CVd, logq_CVd, mass_N[rows_C])
    estimate = estimating()
    with torch.no_grad():
        draft_C, target_C = logits_CVd.argmax(-1), teacher_CVd.argmax(-1)
        target_ce_C = -logq_CVd.gather(1, target_C[:, None]).squeeze(1)
        greedy_C = sampled_C = None
        if estimate:
            p_CVd = teacher_CVd * mass_N[rows_C, None]
            greedy_C = p_CVd.gather(1, draft_C[:, None]).squeeze(1)
            sampled_C = acceptance(p_CVd, logq_CVd.exp())
    return RowLosses(loss_C, draft_C == target_C, target_ce_C, greedy_C, sampled_C)


def draft_rows(
    model, objective: Objective, out_MH: Tensor, teacher: Teacher, rows_M: Tensor, weighed: bool = False
) -> RowLosses:
    """`objective_rows` at M outputs against the teacher rows `rows_M`, the logits computed
    LOGIT_BUDGET_BYTES at a time: while training, each chunk with its gradients in the forward
    (`fused_rows`, `objective.fused`) or under checkpointing; without grad, chunk by chunk. `weighed`: the
    caller weighs the rows' losses each its own way (D-PACE), so that the fused backward recomputes."""
    m, vd = rows_M.numel(), teacher.probs_NVd.shape[1]
    chunk = max(1, LOGIT_BUDGET_BYTES // (4 * vd))
    training = torch.is_grad_enabled() and out_MH.requires_grad
    params = logit_params(model)
    if training and objective.fused and not any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 shards them
        return fused_rows(model, objective, out_MH, teacher, rows_M, chunk, params, weighed)
    keep_graph = training and m > chunk
    parts = []
    for start in range(0, max(m, 1), chunk):
        rows = slice(start, start + chunk)
        inputs = (model, objective, out_MH[rows], teacher.probs_NVd, teacher.mass_N, rows_M[rows])
        parts.append(
            checkpoint(objective_rows, *inputs, use_reentrant=False)
            if keep_graph
            else objective_rows(*inputs)
        )
    return RowLosses.cat(parts)


def logit_params(model) -> list[Tensor]:
    """The trainable weights `model.logits` reads: the final norm's and the lm_head's (a frozen lm_head: not)."""
    return [p for module in (model.norm, model.lm_head) for p in module.parameters() if p.requires_grad]


def fused_rows(
    model, objective, out_MH, teacher, rows_M, chunk: int, params: list[Tensor], weighed: bool
) -> RowLosses:
    """`draft_rows` while training, without recomputation: `FusedRows` (see there)."""
    loss_M, correct_M, target_ce_M = FusedRows.apply(
        out_MH, model, objective, teacher, rows_M, chunk, weighed, *params
    )
    return RowLosses(loss_M, correct_M, target_ce_M, None, None)


class FusedRows(torch.autograd.Function):
    """The draft's loss rows with their gradients computed in the forward, chunk by chunk: lm_head(norm(out)),
    log-softmax and the objective of one chunk, then at once its gradients, so that no chunk's logits are
    recomputed in backward (the checkpointed path's extra lm_head product) or kept.

    Row m's loss depends on out[m] and the logit weights (`logit_params`) alone, so backward, given each
    row's upstream gradient g_m, needs only d loss_m / d out[m] (kept, [M, H]) times g_m, and for the
    weights sum_m g_m d loss_m / d w: with one g for every row (a position's fixed weight over its
    denominator: every objective but D-PACE's per-prediction weights) that is g times the sum kept from
    the forward; otherwise (D-PACE: `weighed`) backward recomputes each chunk for the weights' share, from
    the outputs and the autocast the forward kept for it. It keeps the outputs only then: otherwise it holds
    their gradients in their place, as much as the checkpointed path holds.
    """

    @staticmethod
    def forward(ctx, out_MH, model, objective, teacher, rows_M, chunk, weighed, *params):
        m = rows_M.numel()
        grads_MH = torch.zeros_like(out_MH)
        sums = [torch.zeros_like(p) for p in params]
        losses, correct, target_ce = [], [], []
        for start in range(0, m, chunk):
            rows = slice(start, start + chunk)
            with torch.enable_grad():
                x_CH = out_MH[rows].detach().requires_grad_()
                part = objective_rows(model, objective, x_CH, teacher.probs_NVd, teacher.mass_N, rows_M[rows])
                got = torch.autograd.grad(part.loss.sum(), [x_CH, *params], allow_unused=True)
            grads_MH[rows] = got[0]
            for total, grad in zip(sums, got[1:]):
                if grad is not None:
                    total += grad
            losses.append(part.loss.detach())
            correct.append(part.correct)
            target_ce.append(part.target_ce)
        device = out_MH.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.model, ctx.objective, ctx.teacher, ctx.chunk = model, objective, teacher, chunk
        ctx.out_dtype, ctx.weighed = out_MH.dtype, weighed
        ctx.save_for_backward(out_MH if weighed else None, rows_M, grads_MH, *sums)
        empty = out_MH.new_empty(0)
        loss_M = torch.cat(losses) if losses else empty
        correct_M = torch.cat(correct) if correct else rows_M.new_empty(0, dtype=torch.bool)
        target_ce_M = torch.cat(target_ce) if target_ce else empty
        ctx.mark_non_differentiable(correct_M, target_ce_M)
        return loss_M, correct_M, target_ce_M

    @staticmethod
    def backward(ctx, g_M, _correct, _target_ce):
        out_MH, rows_M, grads_MH, *sums = ctx.saved_tensors
        g_M = g_M.to(grads_MH.dtype)
        d_out = grads_MH * g_M[:, None]
        if not sums:
            param_grads = []
        elif not ctx.weighed:  # one weight for every row
            # Rows weighed differently would be silently wrong: refuse (a non-finite loss is the trainer's to name).
            if g_M.numel() and bool(g_M.isfinite().all()) and not bool((g_M == g_M[0]).all()):
                raise RuntimeError("draft_rows: rows weighed each their own way need weighed=True")
            param_grads = [total * g_M[0] if g_M.numel() else torch.zeros_like(total) for total in sums]
        else:  # each row its own weight (D-PACE): the weights' share recomputed, chunk by chunk
            params = logit_params(ctx.model)
            param_grads = [torch.zeros_like(total) for total in sums]
            device, enabled, dtype = ctx.autocast
            for start in range(0, rows_M.numel(), ctx.chunk):
                rows = slice(start, start + ctx.chunk)
                with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                    part = objective_rows(
                        ctx.model, ctx.objective, out_MH[rows].detach(), ctx.teacher.probs_NVd,
                        ctx.teacher.mass_N, rows_M[rows],
                    )  # fmt: skip
                    got = torch.autograd.grad((part.loss * g_M[rows]).sum(), params, allow_unused=True)
                for total, grad in zip(param_grads, got):
                    if grad is not None:
                        total += grad
        return (d_out.to(ctx.out_dtype), None, None, None, None, None, None, *param_grads)
