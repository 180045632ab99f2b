"""P-EAGLE's parallel drafting (`parallel_loss`, docs/design.md#p-eagle): the depths of one draft forward,
COD's anchor subsampling, and their loss.

Pure functions on tensors, tested on CPU. In one draft forward of a round the verified slot at anchor t
reads (x_{t+1}, `fc(aux_t)`) at position t, exactly as TTT's step 0 (chain.py); the K-1 mask slots vLLM
appends read (mask token, `fc(mask_hidden)`) at t+1..t+K-1 and see the real keys at <= t and the slots
before them. Same teacher, loss and metrics as TTT (positions.py `depth_losses`); unlike TTT a slot's input
does not depend on earlier slots' outputs. COD (P-EAGLE's anchor subsampling, `cod_ratio` r < 1): depth
d >= 1 at ~n_b*r^d of row b's n_b anchors (`cod_anchors`).

    anchors = cod_anchors(batch, 3, 0.7, sample_generators(batch))
    total, metrics = parallel_loss(draft, batch, 3, 0.8, w_VH, vocab.draft_to_target, 1024, anchors=anchors)

Shape legend: B batch, T positions, M anchors kept at a depth, H hidden, A aux layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.attention import KVCache, document_positions
from heads.eagle3 import Eagle3Draft
from train.losses.positions import (
    Anchors,
    Dpace,
    depth_losses,
    depth_weights,
    documents,
    kept_first,
    prediction_anchors,
    row_anchors,
    wanted_first,
)
from train.losses.rows import batch_teacher, same_document, shift_left
from train.objectives import KL, Objective


def cod_anchors(
    batch: dict[str, Tensor], num_depths: int, ratio: float, generators: list[torch.Generator]
) -> list[Anchors | None]:
    """The anchors of each depth (None at depth 0: every position), nested: sample i keeps at depth d the
    first ceil(n_i * ratio^d) of its own random order of its n_i anchors with an answer token of its own
    to predict (x_{t+2}). ratio >= 1 keeps every anchor at every depth. A packed row lists the anchors kept
    deeper first, so that each depth's are the first of the depth before's (the steps' keys nest)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"cod_ratio={ratio}: must be in (0, 1]")
    if ratio == 1:
        return [None] * num_depths
    loss_mask_BT = batch["loss_mask"].bool()
    wanted_BT = shift_left(loss_mask_BT, 2, False) & same_document(batch.get("doc_starts"), 2)
    docs = documents(batch)
    orders = wanted_first(wanted_BT, docs, generators)
    wanted_D = torch.tensor([n for _, n in orders], dtype=torch.int64)
    # keep_KD[d][i]: sample i's anchors at depth d (d = 1..K-1), then none past the last depth.
    keep_KD = [None] + [torch.ceil(wanted_D * ratio**d).long().tolist() for d in range(1, num_depths)]
    keep_KD.append([0] * len(docs))
    b, t = loss_mask_BT.shape
    kept_rows: list[list[int]] = [[] for _ in range(b)]
    for d in range(num_depths - 1, 0, -1):  # those kept deepest first
        for i, (doc, (order, _)) in enumerate(zip(docs, orders)):
            kept_rows[doc.row] += order[keep_KD[d + 1][i] : keep_KD[d][i]]
    index_BT = row_anchors(kept_rows, t).to(loss_mask_BT.device)
    anchors: list[Anchors | None] = [None]
    for d in range(1, num_depths):
        per_row_B = torch.zeros(b, dtype=torch.int64)
        per_row_B.index_add_(0, torch.tensor([doc.row for doc in docs]), torch.tensor(keep_KD[d]))
        keep_BM = kept_first(per_row_B.to(loss_mask_BT.device))
        anchors.append(Anchors(index_BT[:, : keep_BM.shape[1]], keep_BM))
    return anchors


def parallel_forward(
    model: Eagle3Draft,
    input_ids_BT: Tensor,
    aux_BTAH: Tensor,
    anchors: list[Anchors | None],
    starts_BT: Tensor | None = None,
) -> list[Tensor]:
    """The last layer's pre-norm outputs per depth, [B, M_d, H] at anchors[d].index_BM ([B, T, H] where
    None: all T positions; depth 0's keys are every row's whatever its anchors; depth d >= 1's nested). One call of the head's forward per depth; the cache
    gives depth d the real keys up to its anchor (of its document, in rows packed at `starts_BT`) and the
    slots of depths 1..d there."""
    b, t = input_ids_BT.shape
    positions_BT = torch.arange(t, device=input_ids_BT.device).expand(b, t)
    rope_BT = positions_BT if starts_BT is None else document_positions(starts_BT)
    index = [a.index_BM if a is not None else positions_BT for a in anchors]
    cache = KVCache(len(model.layers), steps=True, starts_BS=starts_BT)
    # Depth 0 is EAGLE-3's step 0 (the next token beside the aux states): keys at every row, outputs at
    # its anchors (or every row).
    hidden_BTH = model.target_hidden(aux_BTAH)
    outputs_BM = None if anchors[0] is None else index[0]
    outs = [model(shift_left(input_ids_BT, 1), hidden_BTH, rope_BT, cache, outputs_BM=outputs_BM)]
    # Mask slots share one token and one hidden state; depth d of anchor t sits at position t + d.
    mask_hidden_11H = model.mask_state()
    for d in range(1, len(anchors)):
        m = index[d].shape[1]
        mask_ids_BM = torch.full((b, m), model.config.mask_token_id, device=input_ids_BT.device)
        rope_BM = rope_BT.gather(1, index[d]) + d
        outs.append(model(mask_ids_BM, mask_hidden_11H.expand(b, m, -1), rope_BM, cache, index[d]))
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
    dpace: Dpace | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """total = sum_d gamma^d loss_d over the K parallel depths, each the mean over its anchors (`anchors`,
    `cod_anchors`'; None: every anchor at every depth); the batch, metrics and `dpace` as `ttt_loss`'s."""
    if num_depths < 1:
        raise ValueError(f"num_depths={num_depths}: parallel drafting needs at least one depth")
    if not model.config.parallel_drafting:
        raise ValueError("parallel_loss needs a head with a mask_token_id (head.kind=peagle)")
    anchors = list(anchors or [None] * num_depths)
    # Outputs only where a depth trains: depth 0 at its predictions, and without COD the later depths at
    # theirs (one set for all, nested as the steps' keys need); a long prompt's rows give keys only.
    anchors[0] = prediction_anchors(batch, range(1))
    if num_depths > 1 and anchors[1] is None:
        anchors[1:] = [prediction_anchors(batch, range(1, num_depths))] * (num_depths - 1)
    weights = depth_weights(gamma, num_depths)
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    outs = parallel_forward(model, batch["input_ids"], batch["aux_hidden"], anchors, batch.get("doc_starts"))
    return depth_losses(model, objective, outs, batch, teacher, weights, denominators, anchors, dpace)
