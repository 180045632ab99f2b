"""P-EAGLE's parallel drafting (`parallel_loss`, docs/design.md#p-eagle): the depths of one draft forward,
COD's anchor subsampling, and their loss.

Pure functions on tensors, tested on CPU. In one draft forward of a round the verified slot at anchor t
reads (x_{t+1}, `fc(aux_t)`) at position t, exactly as TTT's step 0 (chain.py); the K-1 mask slots vLLM
appends read (mask token, `fc(mask_hidden)`) at t+1..t+K-1 and see the real keys at <= t and the slots
before them. Same teacher, loss and metrics as TTT (positions.py `depth_losses`); unlike TTT a slot's input
does not depend on earlier slots' outputs. COD (P-EAGLE's anchor subsampling, `cod_ratio` r < 1): depth
d >= 1 at ~n_b*r^d of row b's n_b anchors (`cod_anchors`).

    anchors = cod_anchors(batch, 3, 0.7, row_generators(batch))
    total, metrics = parallel_loss(draft, batch, 3, 0.8, w_VH, vocab.draft_to_target, 1024, anchors=anchors)

Shape legend: B batch, T positions, M anchors kept at a depth, H hidden, A aux layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from heads.attention import KVCache
from heads.eagle3 import Eagle3Draft
from train.losses.positions import Anchors, Dpace, depth_losses, depth_weights, kept_first, wanted_first
from train.losses.rows import batch_teacher, shift_left
from train.objectives import KL, Objective


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
    dpace: Dpace | None = None,
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
