"""The losses of every head kind: training-time test (EAGLE-3), parallel drafting (P-EAGLE), block drafting
(DFlash) and EAGLE-1.

Pure functions on tensors (no I/O, no Accelerator), tested on CPU. Each drives the head through its own
`forward` (heads/), once per drafting step, with a `heads.attention.KVCache` in steps mode that holds the
keys of earlier steps (docs/design.md#training-time-test):

- TTT (`ttt_loss`): step k at position t reads x_{t+1+k} beside `fc(aux_t)` (step 0) or its own output of
  step k-1 (`carry`, not detached), at RoPE position t + k, and predicts x_{t+2+k} against the target's
  draft-vocabulary distribution at t+1+k; it sees step 0's keys at <= t and steps 1..k's keys at t.
- Parallel drafting (`parallel_loss`, docs/design.md#p-eagle): in one draft forward of a round the verified
  slot at anchor t reads (x_{t+1}, `fc(aux_t)`) at position t, exactly as TTT's step 0; the K-1 mask slots
  vLLM appends read (mask token, `fc(mask_hidden)`) at t+1..t+K-1 and see the real keys at <= t and the slots
  before them. Same teacher, loss and metrics as TTT; unlike TTT a slot's input does not depend on earlier
  slots' outputs. COD (P-EAGLE's anchor subsampling, `cod_ratio` r < 1): depth d >= 1 at ~n_b*r^d of row
  b's n_b anchors (`cod_anchors`).
- Block drafting (`block_loss`, docs/dflash.md): random anchors a per sequence (x_{a+1} an answer token),
  each block of a random length L (`sample_blocks`: the block vLLM serves at k = L - 1); one forward of the
  head over every block [x_a, mask x (L-1)] at positions a..a+L-1, each block seeing the target's context
  at positions < a and itself (bidirectionally unless the head is causal); slot k at a+k predicts x_{a+k}
  against the target's draft-vocabulary distribution at a+k-1, weighted exp(-(k-1)/decay).

- EAGLE-1 (`eagle1_loss`, docs/design.md#the-draft-heads): SmoothL1(f_pred, f_true) + 0.1 * soft CE, noise
  U(-0.1, 0.1) on the input features; f_{t+1} predicted at t decodes x_{t+2}: TTT's step-0 shift and mask.

Every draft position's loss is the mean of the objective (`train.loss`, train/objectives.py: forward KL
by default) over its predictions (`position_loss`; the trainer passes their count over the whole global
batch: docs/design.md#each-loss-a-mean-over-the-predictions-it-trains), weighted per position (gamma^k,
DFlash's decay, or D-PACE per prediction). What is random (anchors, block lengths) is drawn per sample
(`row_generators`), before the forward. `Chains` records the held-out acceptance estimates at temperature
0 and 1 as vLLM accepts a round.

    total, metrics = ttt_loss(draft, batch, 7, 0.8, target_lm_head_VH, vocab.draft_to_target, 1024)
    total, metrics = parallel_loss(...same..., anchors=cod_anchors(batch, 3, 0.7, row_generators(batch)))
    total, metrics = eagle1_loss(draft, batch, w_VH, 1024)

Shape legend: B batch, T positions, M anchors kept at a depth (or valid positions), H hidden, A aux layers,
K steps, V target vocab, Vd draft vocab, C rows in a chunk, S = T - 1 positions with a next feature.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from heads.acceptance import chain_counts
from heads.attention import KVCache
from heads.dflash import DFlashDraft
from heads.eagle1 import Eagle1Draft
from heads.eagle3 import Eagle3Draft
from train.objectives import KL, Objective, acceptance, dpace_weights, log_probs, token_losses


def shift_left(x_BT: torch.Tensor, shift: int, fill: int | bool = 0) -> torch.Tensor:
    """x[:, t + shift] at t, `fill` where that runs past the end."""
    out_BT = torch.full_like(x_BT, fill)
    if shift < x_BT.shape[1]:
        out_BT[:, : x_BT.shape[1] - shift] = x_BT[:, shift:]
    return out_BT


def ttt_rollout(model: Eagle3Draft, input_ids_BT: Tensor, aux_BTAH: Tensor, num_steps: int) -> list[Tensor]:
    """Pre-norm outputs [B, T, H] of steps 0..K-1, teacher-forced (step k reads x_{t+1+k}): one call of the
    head's forward per step, the cache holding the earlier steps' keys at each position."""
    positions_BT = torch.arange(input_ids_BT.shape[1], device=input_ids_BT.device).expand_as(input_ids_BT)
    cache = KVCache(len(model.layers), steps=True)
    hidden_BTH = model.target_hidden(aux_BTAH)
    outs = []
    for step in range(num_steps):
        # Token ids past the end are a placeholder (0): those positions are never valid for the loss.
        # Step k's token sits k places after step 0's: RoPE position t + k, as when vLLM drafts a chain.
        out_BTH = model(shift_left(input_ids_BT, 1 + step), hidden_BTH, positions_BT + step, cache)
        outs.append(out_BTH)
        # Fed back (post-norm with norm_output) without detaching: later steps' gradients reach earlier ones.
        hidden_BTH = model.carry(out_BTH)
    return outs


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
    loss_C = token_losses(objective, teacher_CVd, logq_CVd)
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


def draft_rows(model, objective: Objective, out_MH: Tensor, teacher: Teacher, rows_M: Tensor) -> RowLosses:
    """`objective_rows` at M outputs against the teacher rows `rows_M`, the logits computed
    LOGIT_BUDGET_BYTES at a time (see there)."""
    m, vd = rows_M.numel(), teacher.probs_NVd.shape[1]
    chunk = max(1, LOGIT_BUDGET_BYTES // (4 * vd))
    keep_graph = torch.is_grad_enabled() and out_MH.requires_grad and m > chunk
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


def position_loss(
    metrics: dict[str, Tensor],
    k: int,
    rows: RowLosses,
    predictions: Tensor,
    denominators: Tensor | None,
    row_weights: Tensor | None = None,
) -> Tensor:
    """Draft position k's loss term, the mean of its objective over the predictions it trains: the sum over
    this batch (each row weighted `row_weights`: D-PACE) divided by `denominators[k]` (the trainer's count
    over the whole global batch, so that any split across processes and micro-batches gives the same
    gradient), or by this batch's own `predictions` when None. Records loss_k, loss_sum_k, num_pred_k,
    num_valid_k and acc_k in `metrics`.

    A prediction is a draft position the head is trained at (an answer token to predict, an anchor drawn);
    it is valid - given a loss - when the target's argmax there is a draft token. Invalid ones add 0 to the
    sum and 1 to the count, as in vLLM, where they are rejected drafts.
    """
    denominator = predictions.clamp(min=1) if denominators is None else denominators[k]
    num_valid = torch.tensor(rows.correct.numel(), device=rows.loss.device)
    loss_sum = (rows.loss if row_weights is None else rows.loss * row_weights).sum()
    loss = loss_sum / denominator
    metrics[f"loss_{k}"] = loss.detach()
    metrics[f"loss_sum_{k}"] = loss_sum.detach()
    metrics[f"num_pred_{k}"] = predictions
    metrics[f"num_valid_{k}"] = num_valid
    metrics[f"acc_{k}"] = rows.correct.sum() / num_valid.clamp(min=1)
    return loss


class Anchors(NamedTuple):
    """The anchors one later P-EAGLE depth trains at (COD): `index_BM` positions per row, of which `keep_BM`
    are drawn (the rest pad the row to the batch's widest; they get no loss)."""

    index_BM: Tensor
    keep_BM: Tensor


def depth_predictions(batch: dict[str, Tensor], step: int, anchors: Anchors | None = None) -> Tensor:
    """[B, T] bool: the predictions of draft depth k (a TTT step, a P-EAGLE depth): anchor t (every
    position, or those `anchors` keep) with x_{t+2+k} a real answer token. The depth's loss is their mean."""
    loss_mask_BT = batch["loss_mask"].bool()
    eligible_BT = step_valid_mask(
        loss_mask_BT, torch.ones_like(loss_mask_BT), step, batch.get("attention_mask")
    )
    if anchors is None:
        return eligible_BT
    kept_BT = torch.zeros_like(eligible_BT).scatter_(1, anchors.index_BM, anchors.keep_BM)
    return eligible_BT & kept_BT


def depth_losses(
    model: Eagle3Draft,
    objective: Objective,
    outs: list[Tensor],
    batch: dict[str, Tensor],
    teacher: Teacher,
    weights: list[float],
    denominators: Tensor | None = None,
    anchors: list[Anchors | None] | None = None,
    dpace: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_k weights[k] * loss_k and the metrics, from each depth's pre-norm outputs (TTT steps or P-EAGLE
    depths); loss_k the mean of the objective over depth k's predictions (`position_loss`,
    `depth_predictions`), each weighed by D-PACE over its anchor's chain with `dpace` = a (`chain_weights`).

    outs[k] is [B, T, H] (every position an anchor) or, with anchors[k], [B, M, H] at anchors[k].index_BM.
    Depth k at anchor t predicts x_{t+2+k} against the target's distribution at t+1+k.
    """
    in_draft_BT = teacher.in_draft_BT
    positions = []
    for step, out_BMH in enumerate(outs):
        depth_anchors = anchors[step] if anchors is not None else None
        # Eligible for the acceptance estimate: an assistant token to predict, whatever the target's argmax.
        eligible_BT = depth_predictions(batch, step, depth_anchors)
        valid_BT = eligible_BT & shift_left(in_draft_BT, 1 + step, False)
        if depth_anchors is None:
            batch_M, pos_M = valid_BT.nonzero(as_tuple=True)
            row_M = pos_M
        else:
            batch_M, row_M = valid_BT.gather(1, depth_anchors.index_BM).nonzero(as_tuple=True)
            pos_M = depth_anchors.index_BM[batch_M, row_M]
        # The teacher of step k at t is the target at t+1+k. Logits only at the M positions with a loss
        # (answer tokens; never where t+2+k runs past the end): prompt positions cost no lm_head work.
        rows = draft_rows(
            model, objective, out_BMH[batch_M, row_M], teacher, teacher.row_BT[batch_M, pos_M + 1 + step]
        )
        positions.append((rows, eligible_BT, (batch_M, pos_M)))
    return weighed_total(positions, weights, denominators, dpace)


def weighed_total(
    positions: list[tuple[RowLosses, Tensor, tuple[Tensor, Tensor]]],
    weights: list[float],
    denominators: Tensor | None,
    dpace: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_k weights[k] * loss_k over a chain's positions and the metrics, the chains' acceptance counts
    included (`Chains`); with `dpace` = a the weights are per prediction (`chain_weights`) and every
    position's fixed weight is 1 (as `loss_weights` says for the logged total)."""
    if dpace is not None:
        weights = [1.0] * len(positions)
    total = torch.zeros((), device=positions[0][1].device)
    metrics: dict[str, Tensor] = {}
    chains = Chains()
    row_weights = chain_weights(positions, dpace)
    for k, (rows, eligible, index) in enumerate(positions):
        chains.add(rows, eligible, index)
        loss = position_loss(metrics, k, rows, eligible.sum(), denominators, row_weights[k])
        total = total + weights[k] * loss
    chains.record(metrics)
    return total, metrics


class Chains:
    """Per draft position, where each anchor's prediction was eligible and how likely it is accepted
    (temperature 0: right or not; temperature 1: `RowLosses.greedy_t1` and `sampled_t1`), laid out per
    anchor so that `record` can chain the positions of one anchor as vLLM accepts them."""

    FIELDS = ("correct", "greedy_t1", "sampled_t1")

    def __init__(self):
        self.eligible: list[Tensor] = []
        self.values: dict[str, list[Tensor]] = {name: [] for name in self.FIELDS}

    def add(self, rows: RowLosses, eligible: Tensor, index: tuple[Tensor, Tensor]) -> None:
        """One position's rows, at `index` (batch, anchor) of an `eligible`-shaped layout (0 elsewhere)."""
        self.eligible.append(eligible)
        for name in self.FIELDS:
            if getattr(rows, name) is None:  # not estimating
                continue
            laid_out = torch.zeros(eligible.shape, dtype=torch.float32, device=eligible.device)
            laid_out[index] = getattr(rows, name).float()
            self.values[name].append(laid_out)

    def record(self, metrics: dict[str, Tensor]) -> None:
        """chain_hits_k / chain_total_k (temperature 0: the positions before k all right), and the same
        expectations at temperature 1, greedy_t1_* and sampled_t1_*, into `metrics`."""
        eligible = torch.stack(self.eligible)
        for name, prefix in zip(self.FIELDS, ("chain", "greedy_t1", "sampled_t1")):
            if not self.values[name]:
                continue
            hits_K, totals_K = chain_counts(torch.stack(self.values[name]), eligible)
            for k in range(len(self.eligible)):
                metrics[f"{prefix}_hits_{k}"], metrics[f"{prefix}_total_{k}"] = hits_K[k], totals_K[k]


def chain_weights(
    positions: list[tuple[RowLosses, Tensor, tuple[Tensor, Tensor]]], dpace: float | None
) -> list[Tensor | None]:
    """Each position's per-prediction weights (None each: no D-PACE), from every position's (rows, eligible
    layout, index into it) of one draft chain - a DFlash block's slots, an anchor's TTT steps or P-EAGLE
    depths, laid out per anchor: with `dpace` = a, `dpace_weights` of the chain each prediction belongs to.
    A prediction whose target token lies outside the draft vocabulary has no row and counts as one the
    draft misses (c = 0)."""
    if dpace is None:
        return [None] * len(positions)
    eligible_NK = torch.stack([eligible.flatten() for _, eligible, _ in positions], dim=-1)
    ce_NK = torch.full(eligible_NK.shape, math.inf, device=eligible_NK.device)
    flat = [index[0] * positions[0][1].shape[1] + index[1] for _, _, index in positions]
    for k, ((rows, _, _), at) in enumerate(zip(positions, flat)):
        ce_NK[at, k] = rows.target_ce.float()
    weights_NK = dpace_weights(ce_NK, eligible_NK, dpace)
    return [weights_NK[at, k] for k, at in enumerate(flat)]


def batch_teacher(
    batch: dict[str, Tensor], target_lm_head: Tensor, draft_to_target: Tensor, chunk_size: int
) -> Teacher:
    """The teacher at the positions some depth needs: x_{t+1} an answer token."""
    # The teacher at j serves a loss only where x_{j+1} is an answer token: prompts cost no teacher work.
    needed_BT = shift_left(batch["loss_mask"].bool(), 1, False)
    return teacher_rows(batch["final_hidden"], target_lm_head, draft_to_target, chunk_size, needed_BT)


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
    dpace: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """total = sum_k gamma^k loss_k over a right-padded batch (loss_k: `position_loss`, its denominators);
    with `dpace` = a, sum_k loss_k, each prediction weighed by D-PACE over its anchor's chain of steps.

    batch: input_ids [B, T] int64, loss_mask [B, T] bool, aux_hidden [B, T, A, H], final_hidden [B, T, H],
    optional attention_mask [B, T] (1 = real token; without it every position is real).
    Metrics (detached tensors), per step k: loss_k, loss_sum_k and num_pred_k (its mean's sum and count);
    acc_k and num_valid_k over the positions with a loss; chain_hits_k / chain_total_k, counts for
    `conditional_accuracies` where a target argmax outside the draft vocabulary counts as a miss (as in
    vLLM), not as skipped; greedy_t1_* and sampled_t1_*, the same at temperature 1 (`Chains`).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps}: TTT needs at least one step")
    weights = depth_weights(gamma, num_steps)
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    outs = ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], num_steps)
    return depth_losses(model, objective, outs, batch, teacher, weights, denominators, dpace=dpace)


def depth_weights(gamma: float, num_steps: int) -> list[float]:
    """gamma^k, the weight of draft position k's mean loss (EAGLE-3's TTT steps, P-EAGLE's depths)."""
    if not gamma > 0:
        raise ValueError(f"gamma={gamma}: the weight of draft position k's loss (gamma^k) must be positive")
    return [gamma**k for k in range(num_steps)]


def row_generators(
    batch: dict[str, Tensor], generator: torch.Generator | None = None
) -> list[torch.Generator]:
    """One CPU generator per row for the loss's random draws (anchors, block lengths), seeded from the
    batch's `draw_seeds` (one per sample: `train.data.draw_seeds`), so that what is drawn for a sample does
    not depend on the batch, process or micro-batch it came in; without them, from `generator` (or the
    global RNG)."""
    if "draw_seeds" in batch:
        seeds = [int(s) for s in batch["draw_seeds"].tolist()]
    else:
        seeds = torch.randint(2**62, (batch["loss_mask"].shape[0],), generator=generator).tolist()
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def wanted_first(
    wanted_BT: Tensor, generators: list[torch.Generator], real_BT: Tensor | None = None
) -> Tensor:
    """[B, T] positions in one random order per row that puts the wanted ones first, then the row's other
    real positions, then its padding (anchor draws). Row b's order comes from generators[b] alone, drawn
    over its real length only: the same sample draws the same order however it is padded."""
    b, t = wanted_BT.shape
    lengths = [t] * b if real_BT is None else real_BT.sum(1).tolist()
    noise_BT = torch.ones(b, t)
    for row, (generator, n) in enumerate(zip(generators, lengths)):
        noise_BT[row, : int(n)] = torch.rand(int(n), generator=generator)
    return torch.argsort(noise_BT.to(wanted_BT.device) + (~wanted_BT).float(), dim=1, stable=True)


def kept_first(counts_B: Tensor) -> Tensor:
    """[B, M] bool, M = max(1, the largest count): row b keeps its first counts[b] entries."""
    m = max(1, int(counts_B.max())) if counts_B.numel() else 1
    return torch.arange(m, device=counts_B.device) < counts_B[:, None]


def cod_anchors(
    batch: dict[str, Tensor], num_depths: int, ratio: float, generators: list[torch.Generator]
) -> list[Anchors | None]:
    """The anchors of each depth (None at depth 0: every position), nested: row b keeps at depth d the
    first ceil(n_b * ratio^d) of its own random order of its n_b anchors with an answer token to predict
    (x_{t+2}). ratio >= 1 keeps every anchor at every depth."""
    if not 0 < ratio <= 1:
        raise ValueError(f"cod_ratio={ratio}: must be in (0, 1]")
    if ratio == 1:
        return [None] * num_depths
    wanted_BT = shift_left(batch["loss_mask"].bool(), 2, False)
    order_BT = wanted_first(wanted_BT, generators, batch.get("attention_mask"))
    wanted_B = wanted_BT.sum(1)
    anchors: list[Anchors | None] = [None]
    for d in range(1, num_depths):
        keep_BM = kept_first(torch.ceil(wanted_B * ratio**d).long())
        anchors.append(Anchors(order_BT[:, : keep_BM.shape[1]], keep_BM))
    return anchors


def parallel_forward(
    model: Eagle3Draft, input_ids_BT: Tensor, aux_BTAH: Tensor, anchors: list[Anchors | None]
) -> list[Tensor]:
    """The last layer's pre-norm outputs per depth: depth 0 [B, T, H]; depth d >= 1 [B, M_d, H] at
    anchors[d].index_BM (nested; None: all T positions). One call of the head's forward per depth; the cache
    gives depth d the real keys up to its anchor and the slots of depths 1..d there."""
    b, t = input_ids_BT.shape
    positions_BT = torch.arange(t, device=input_ids_BT.device).expand(b, t)
    index = [a.index_BM if a is not None else positions_BT for a in anchors]
    cache = KVCache(len(model.layers), steps=True)
    # Depth 0 is EAGLE-3's step 0 (the next token beside the aux states).
    outs = [model(shift_left(input_ids_BT, 1), model.target_hidden(aux_BTAH), index[0], cache, index[0])]
    # Mask slots share one token and one hidden state; depth d of anchor t sits at position t + d.
    mask_hidden_11H = model.mask_state()
    for d in range(1, len(anchors)):
        m = index[d].shape[1]
        mask_ids_BM = torch.full((b, m), model.config.mask_token_id, device=input_ids_BT.device)
        outs.append(model(mask_ids_BM, mask_hidden_11H.expand(b, m, -1), index[d] + d, cache, index[d]))
    return outs


def parallel_loss(
    model: Eagle3Draft,
    batch: dict[str, Tensor],
    num_depths: int,
    gamma: float,
    target_lm_head: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    denominators: Tensor | None = None,
    anchors: list[Anchors | None] | None = None,
    objective: Objective = KL,
    dpace: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """total = sum_d gamma^d loss_d over the K parallel depths, each the mean over its anchors (`anchors`,
    `cod_anchors`'; None: every anchor at every depth); the batch, metrics and `dpace` as `ttt_loss`'s."""
    if num_depths < 1:
        raise ValueError(f"num_depths={num_depths}: parallel drafting needs at least one depth")
    if not model.config.parallel_drafting:
        raise ValueError("parallel_loss needs a head with a mask_token_id (head.kind=peagle)")
    anchors = anchors or [None] * num_depths
    weights = depth_weights(gamma, num_depths)
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    outs = parallel_forward(model, batch["input_ids"], batch["aux_hidden"], anchors)
    return depth_losses(model, objective, outs, batch, teacher, weights, denominators, anchors, dpace)


class Blocks(NamedTuple):
    """The DFlash blocks of a batch: anchors `index_BM` per row (`keep_BM` drawn, the rest pad the row),
    each block `lengths_BM` tokens long (the anchor and lengths - 1 mask slots; at most head.block_size)."""

    index_BM: Tensor
    keep_BM: Tensor
    lengths_BM: Tensor


def sample_blocks(
    batch: dict[str, Tensor],
    num_anchors: int,
    lengths: tuple[int, int],
    generators: list[torch.Generator],
) -> Blocks:
    """Up to `num_anchors` random anchors per row, among the positions a >= 1 whose next token x_{a+1} is
    an answer token (a block needs some context before its anchor and an answer to predict), each block's
    length uniform in lengths = (shortest, longest). Row b's draws come from generators[b] alone."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: a block loss needs at least one anchor per sequence")
    shortest, longest = lengths
    wanted_BT = shift_left(batch["loss_mask"].bool(), 1, False)
    wanted_BT[:, 0] = False
    order_BT = wanted_first(wanted_BT, generators, batch.get("attention_mask"))
    keep_BM = kept_first(wanted_BT.sum(1).clamp(max=num_anchors))
    lengths_BM = torch.full(keep_BM.shape, longest, dtype=torch.int64)
    if shortest < longest:
        for row, (generator, n) in enumerate(zip(generators, keep_BM.sum(1).tolist())):
            lengths_BM[row, :n] = torch.randint(shortest, longest + 1, (n,), generator=generator)
    return Blocks(order_BT[:, : keep_BM.shape[1]], keep_BM, lengths_BM.to(wanted_BT.device))


def block_forward(
    model: DFlashDraft,
    input_ids_BT: Tensor,
    aux_BTAH: Tensor,
    anchors_BM: Tensor,
    lengths_BM: Tensor | None = None,
) -> Tensor:
    """Pre-norm outputs [B, M, J, H] of one block per anchor: [x_a, mask x (J-1)] at positions a..a+J-1
    (J = head.block_size), in one call of the head's forward over the whole batch's context; a block
    shorter than J (`lengths_BM`) is served as one: its tokens see none of the slots after it."""
    j = model.config.block_size
    block_ids_BMJ = torch.full((*anchors_BM.shape, j), model.config.mask_token_id, device=input_ids_BT.device)
    block_ids_BMJ[..., 0] = input_ids_BT.gather(1, anchors_BM)
    if lengths_BM is not None and not bool((lengths_BM < j).any()):
        lengths_BM = None  # full blocks: nothing to hide
    return model(block_ids_BMJ, anchors_BM, model.target_hidden(aux_BTAH), lengths_BM=lengths_BM)


def slot_predictions(batch: dict[str, Tensor], blocks: Blocks, k: int) -> tuple[Tensor, Tensor]:
    """(position_BM, predictions_BM): where mask slot k+1 of each block sits (a+k+1, clamped to the batch),
    and whether it is a prediction slot k trains - a drawn anchor whose block reaches that slot and a real
    answer token there. Slot k's loss is their mean."""
    loss_mask_BT = batch["loss_mask"].bool()
    attention_mask_BT = batch.get("attention_mask")
    t = loss_mask_BT.shape[1]
    position_BM = blocks.index_BM + k + 1
    inside_BM = (position_BM < t) & (blocks.lengths_BM > k + 1) & blocks.keep_BM
    position_BM = position_BM.clamp(max=t - 1)
    answer_BM = loss_mask_BT.gather(1, position_BM)
    if attention_mask_BT is not None:
        answer_BM &= attention_mask_BT.bool().gather(1, position_BM)
    return position_BM, answer_BM & inside_BM


def block_loss(
    model: DFlashDraft,
    batch: dict[str, Tensor],
    weights: list[float],
    target_lm_head: Tensor,
    draft_to_target: Tensor,
    chunk_size: int,
    denominators: Tensor | None = None,
    blocks: Blocks | None = None,
    objective: Objective = KL,
    dpace: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """total = sum_k weights[k] * loss_k over the block's K = block_size - 1 mask slots, loss_k the mean of
    the objective over slot k's predictions (`slot_predictions`; `blocks` None: `sample_blocks` of full
    blocks, 512 anchors); the batch and the metrics as `ttt_loss`'s, per slot (`chain_*_k`: the slots before
    k all right, as vLLM accepts). With `dpace` = a, each prediction weighs its block's D-PACE weight
    instead of `weights` (`chain_weights`): a slot whose target token is outside the
    draft vocabulary counts as one the draft misses (c = 0)."""
    num_slots = model.config.block_size - 1
    if len(weights) != num_slots:
        raise ValueError(f"{len(weights)} loss weights for {num_slots} mask slots")
    if blocks is None:
        block = model.config.block_size
        blocks = sample_blocks(batch, 512, (block, block), row_generators(batch))
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    out_BMJH = block_forward(
        model, batch["input_ids"], batch["aux_hidden"], blocks.index_BM, blocks.lengths_BM
    )
    slots = []
    for k in range(num_slots):
        # Slot k+1 of the block sits at a+k+1 and predicts the token there; its teacher is the target at a+k.
        position_BM, eligible_BM = slot_predictions(batch, blocks, k)
        valid_BM = eligible_BM & teacher.in_draft_BT.gather(1, position_BM - 1)
        batch_R, row_R = valid_BM.nonzero(as_tuple=True)
        rows = draft_rows(
            model,
            objective,
            out_BMJH[batch_R, row_R, k + 1],
            teacher,
            teacher.row_BT[batch_R, position_BM[batch_R, row_R] - 1],
        )
        slots.append((rows, eligible_BM, (batch_R, row_R)))
    return weighed_total(slots, weights, denominators, dpace)


def loss_weights(head_cfg, num_steps: int) -> list[float]:
    """The weight of draft position k's loss: gamma^k (EAGLE-3's TTT steps, P-EAGLE's depths), or DFlash's
    exp(-k / loss_decay) over its mask slots (arXiv 2602.06036); 1 under D-PACE, whose weights are per
    prediction (`chain_weights`)."""
    if head_cfg.position_weights == "dpace":
        return [1.0] * num_steps
    if head_cfg.kind == "dflash":
        return [math.exp(-k / head_cfg.loss_decay) for k in range(num_steps)]
    return depth_weights(head_cfg.gamma, num_steps)


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
    loss_sum = token_losses(objective, teacher_CV, logq_CV).sum()
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
