"""From per-prediction losses to a step's total: each draft position's loss (a TTT step, a P-EAGLE depth, a
DFlash mask slot) and its weight, the acceptance counts along a chain, the EAGLE-3 head's loss over its
depths (TTT's and P-EAGLE's alike), and the per-sample random draws of anchors.

Pure functions on tensors, tested on CPU. Every draft position's loss is the mean of the objective
(`train.loss`, train/objectives.py: forward KL by default) over its predictions (`position_loss`; the
trainer passes their count over the whole global batch:
docs/design.md#each-loss-a-mean-over-the-predictions-it-trains), weighted per position (gamma^k, DFlash's
decay: `loss_weights`; or D-PACE per prediction: `chain_weights`). `weighed_total` sums them; `Chains`
records the held-out acceptance estimates at temperature 0 and 1 as vLLM accepts a round. `depth_losses`
scores the EAGLE-3 head's outputs per depth (chain.py's TTT steps; parallel.py's P-EAGLE depths, at
`Anchors`). What is random (anchors, block lengths) is drawn per sample (`sample_generators`), before the
forward.

    weights = loss_weights(cfg.head, num_steps)
    total, metrics = depth_losses(draft, KL, outs, batch, teacher, weights, denominators, anchors)

Shape legend: B batch, T positions, M anchors kept at a depth (or valid positions), H hidden, K draft
positions, N anchors of a batch, flattened (B * anchors per row).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from heads.acceptance import chain_counts
from heads.eagle3 import Eagle3Draft
from train.losses.rows import RowLosses, Teacher, draft_rows, shift_left, step_valid_mask
from train.objectives import Objective, dpace_weights


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


class Dpace(NamedTuple):
    """D-PACE's settings: the floor a of `dpace_weights`, and `norm` how the weighted predictions make the
    total: "position" sum_k S_k / N_k (each position's weighted sum over its own count), "all" sum_k S_k /
    sum_k N_k (once over every prediction: speculators' loss_function, the D-PACE reference). The two are
    equal up to the factor K for full chains; with fewer predictions at deeper positions (COD anchors,
    DFlash's shorter blocks, chains cut by an answer's end) "position" weighs each of those N / N_k more."""

    a: float = 0.5
    norm: str = "position"


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
        loss_mask_BT,
        torch.ones_like(loss_mask_BT),
        step,
        batch.get("attention_mask"),
        batch.get("doc_starts"),
    )
    if anchors is None:
        return eligible_BT
    kept_BT = torch.zeros_like(eligible_BT).scatter_(1, anchors.index_BM, anchors.keep_BM)
    return eligible_BT & kept_BT


def prediction_anchors(batch: dict[str, Tensor], steps: range) -> Anchors:
    """The anchors where some draft depth of `steps` has a prediction (`depth_predictions`), each row's in
    order: the rows whose last-layer outputs a training forward needs. The others give keys only (a long
    prompt's rows), so the last layer's queries, attention and MLP run at these M rows, not at all T."""
    wanted_BT = torch.zeros_like(batch["loss_mask"], dtype=torch.bool)
    for step in steps:
        wanted_BT |= depth_predictions(batch, step)
    keep_BM = kept_first(wanted_BT.sum(1))
    # A permutation of each row, its wanted positions first and in order; the first M of it.
    order_BT = torch.sort((~wanted_BT).to(torch.uint8), dim=1, stable=True).indices
    return Anchors(order_BT[:, : keep_BM.shape[1]], keep_BM)


def depth_losses(
    model: Eagle3Draft,
    objective: Objective,
    outs: list[Tensor],
    batch: dict[str, Tensor],
    teacher: Teacher,
    weights: list[float],
    denominators: Tensor | None = None,
    anchors: list[Anchors | None] | None = None,
    dpace: Dpace | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_k weights[k] * loss_k and the metrics, from each depth's pre-norm outputs (TTT steps or P-EAGLE
    depths); loss_k the mean of the objective over depth k's predictions (`position_loss`,
    `depth_predictions`), each weighed by D-PACE over its anchor's chain with `dpace` (`chain_weights`).

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
            model, objective, out_BMH[batch_M, row_M], teacher, teacher.row_BT[batch_M, pos_M + 1 + step],
            weighed=dpace is not None,
        )  # fmt: skip
        positions.append((rows, eligible_BT, (batch_M, pos_M)))
    return weighed_total(positions, weights, denominators, dpace)


def weighed_total(
    positions: list[tuple[RowLosses, Tensor, tuple[Tensor, Tensor]]],
    weights: list[float],
    denominators: Tensor | None,
    dpace: Dpace | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """sum_k weights[k] * loss_k over a chain's positions and the metrics, the chains' acceptance counts
    included (`Chains`); with `dpace` the weights are per prediction (`chain_weights`) and every
    position's fixed weight is 1 (as `loss_weights` says for the logged total), or N_k / sum_j N_j under
    `dpace.norm` "all" (N_k position k's count of predictions: the total is then once over all of them)."""
    total = torch.zeros((), device=positions[0][1].device)
    metrics: dict[str, Tensor] = {}
    chains = Chains()
    row_weights = chain_weights(positions, dpace)
    counts = [eligible.sum() for _, eligible, _ in positions]
    if dpace is not None:
        weights = [1.0] * len(positions)
        if dpace.norm == "all":
            per_position = torch.stack(counts) if denominators is None else denominators[: len(positions)]
            weights = list(per_position.float() / per_position.sum().clamp(min=1))
    for k, (rows, eligible, index) in enumerate(positions):
        chains.add(rows, eligible, index)
        loss = position_loss(metrics, k, rows, counts[k], denominators, row_weights[k])
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
    positions: list[tuple[RowLosses, Tensor, tuple[Tensor, Tensor]]], dpace: Dpace | None
) -> list[Tensor | None]:
    """Each position's per-prediction weights (None each: no D-PACE), from every position's (rows, eligible
    layout, index into it) of one draft chain - a DFlash block's slots, an anchor's TTT steps or P-EAGLE
    depths, laid out per anchor: with `dpace`, `dpace_weights` of the chain each prediction belongs to.
    A prediction whose target token lies outside the draft vocabulary has no row and counts as one the
    draft misses (c = 0)."""
    if dpace is None:
        return [None] * len(positions)
    eligible_NK = torch.stack([eligible.flatten() for _, eligible, _ in positions], dim=-1)
    ce_NK = torch.full(eligible_NK.shape, math.inf, device=eligible_NK.device)
    flat = [index[0] * positions[0][1].shape[1] + index[1] for _, _, index in positions]
    for k, ((rows, _, _), at) in enumerate(zip(positions, flat)):
        ce_NK[at, k] = rows.target_ce.float()
    weights_NK = dpace_weights(ce_NK, eligible_NK, dpace.a)
    return [weights_NK[at, k] for k, at in enumerate(flat)]


def depth_weights(gamma: float, num_steps: int) -> list[float]:
    """gamma^k, the weight of draft position k's mean loss (EAGLE-3's TTT steps, P-EAGLE's depths)."""
    if not gamma > 0:
        raise ValueError(f"gamma={gamma}: the weight of draft position k's loss (gamma^k) must be positive")
    return [gamma**k for k in range(num_steps)]


def loss_weights(head_cfg, num_steps: int) -> list[float]:
    """The weight of draft position k's loss: gamma^k (EAGLE-3's TTT steps, P-EAGLE's depths), or DFlash's
    exp(-k / loss_decay) over its mask slots (arXiv 2602.06036); 1 under D-PACE, whose weights are per
    prediction (`chain_weights`)."""
    if head_cfg.position_weights == "dpace":
        return [1.0] * num_steps
    if head_cfg.kind == "dflash":
        return [math.exp(-k / head_cfg.loss_decay) for k in range(num_steps)]
    return depth_weights(head_cfg.gamma, num_steps)


class Document(NamedTuple):
    """One sample of a batch: its row, where it starts there, and its length (padding excluded)."""

    row: int
    start: int
    length: int


def documents(batch: dict[str, Tensor]) -> list[Document]:
    """Every sample of the batch in order (that of its `draw_seeds`): one a row, or those each packed row
    holds (`doc_starts`: where each position's document starts; train/data.py `collate`)."""
    loss_mask_BT = batch["loss_mask"]
    real_BT = batch.get("attention_mask")
    lengths = [loss_mask_BT.shape[1]] * loss_mask_BT.shape[0] if real_BT is None else real_BT.sum(1).tolist()
    if "doc_starts" not in batch:
        return [Document(row, 0, int(n)) for row, n in enumerate(lengths)]
    found = []
    for row, (starts, n) in enumerate(zip(batch["doc_starts"].tolist(), lengths)):
        begins = sorted({starts[t] for t in range(int(n))})
        found += [Document(row, a, b - a) for a, b in zip(begins, begins[1:] + [int(n)])]
    return found


def sample_generators(
    batch: dict[str, Tensor], generator: torch.Generator | None = None
) -> list[torch.Generator]:
    """One CPU generator per sample (`documents`) for the loss's random draws (anchors, block lengths),
    seeded from the batch's `draw_seeds` (`train.data.draw_seeds`), so that what is drawn for a sample does
    not depend on the batch, process, micro-batch or packed row it came in; without them, from `generator`
    (or the global RNG)."""
    if "draw_seeds" in batch:
        seeds = [int(s) for s in batch["draw_seeds"].tolist()]
    else:
        seeds = torch.randint(2**62, (len(documents(batch)),), generator=generator).tolist()
    return [torch.Generator().manual_seed(seed) for seed in seeds]


def wanted_first(
    wanted_BT: Tensor, docs: list[Document], generators: list[torch.Generator]
) -> list[tuple[list[int], int]]:
    """Per sample, its positions (in the row) in one random order that puts the wanted ones first, and how
    many are wanted (anchor draws). Sample i's order comes from generators[i] alone, drawn over its own
    length: the same sample draws the same order however it is padded or packed."""
    wanted = wanted_BT.cpu()
    orders = []
    for doc, generator in zip(docs, generators):
        wanted_N = wanted[doc.row, doc.start : doc.start + doc.length]
        noise_N = torch.rand(doc.length, generator=generator)
        order_N = torch.argsort(noise_N + (~wanted_N).float(), stable=True)
        orders.append(((order_N + doc.start).tolist(), int(wanted_N.sum())))
    return orders


def row_anchors(kept_rows: list[list[int]], length: int) -> Tensor:
    """[B, T] every row's positions, a permutation of 0..T-1: its kept anchors first (kept_rows[b], in that
    order), then the rest in order. A row keeping M anchors has them in its first M columns."""
    rows = []
    for kept in kept_rows:
        taken = set(kept)
        rows.append(kept + [t for t in range(length) if t not in taken])
    return torch.tensor(rows, dtype=torch.int64).view(len(kept_rows), length)


def kept_first(counts_B: Tensor) -> Tensor:
    """[B, M] bool, M = max(1, the largest count): row b keeps its first counts[b] entries."""
    m = max(1, int(counts_B.max())) if counts_B.numel() else 1
    return torch.arange(m, device=counts_B.device) < counts_B[:, None]
