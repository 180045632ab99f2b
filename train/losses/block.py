"""DFlash's block drafting (`block_loss`, docs/dflash.md): random blocks per sequence, one forward of the head
over all of them, and the loss of each mask slot.

Pure functions on tensors, tested on CPU. Random anchors a per sequence (x_{a+1} an answer token), each
block of a random length L (`sample_blocks`: the block vLLM serves at k = L - 1); one forward of the head
over every block [x_a, mask x (L-1)] at positions a..a+L-1, each block seeing the target's context at
positions < a and itself (bidirectionally unless the head is causal); slot k at a+k predicts x_{a+k}
against the target's draft-vocabulary distribution at a+k-1, weighted exp(-(k-1)/decay) (positions.py
`loss_weights`) or per prediction by D-PACE.

    blocks = sample_blocks(batch, 512, (2, 16), sample_generators(batch))
    total, metrics = block_loss(draft, batch, weights, w_VH, vocab.draft_to_target, 1024, blocks=blocks)

Shape legend: B batch, T positions, M anchors per row, J = head.block_size slots per block, H hidden, A aux
layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from heads.attention import document_positions
from heads.dflash import DFlashDraft
from train.losses.positions import (
    Dpace,
    documents,
    kept_first,
    row_anchors,
    sample_generators,
    wanted_first,
    weighed_total,
)
from train.losses.rows import batch_teacher, draft_rows, same_document, shift_left
from train.objectives import KL, Objective


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
    """Up to `num_anchors` random anchors per sample, among its positions a >= 1 whose next token x_{a+1}
    is an answer token of its own (a block needs some context before its anchor and an answer to predict),
    each block's length uniform in lengths = (shortest, longest). Sample i's draws come from generators[i]
    alone; a packed row holds its samples' blocks one sample after the other."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors={num_anchors}: a block loss needs at least one anchor per sequence")
    shortest, longest = lengths
    starts_BT = batch.get("doc_starts")
    wanted_BT = shift_left(batch["loss_mask"].bool(), 1, False) & same_document(starts_BT, 1)
    first_BT = torch.zeros_like(wanted_BT)
    first_BT[:, 0] = True
    wanted_BT &= ~(first_BT if starts_BT is None else document_positions(starts_BT) == 0)
    docs = documents(batch)
    b, t = wanted_BT.shape
    kept_rows: list[list[int]] = [[] for _ in range(b)]
    drawn_rows: list[list[int]] = [[] for _ in range(b)]
    for doc, generator, (order, wanted) in zip(docs, generators, wanted_first(wanted_BT, docs, generators)):
        n = min(wanted, num_anchors)
        kept_rows[doc.row] += order[:n]
        if shortest < longest:
            drawn_rows[doc.row] += torch.randint(shortest, longest + 1, (n,), generator=generator).tolist()
    keep_BM = kept_first(torch.tensor([len(kept) for kept in kept_rows], dtype=torch.int64))
    lengths_BM = torch.full(keep_BM.shape, longest, dtype=torch.int64)
    for row, drawn in enumerate(drawn_rows):
        lengths_BM[row, : len(drawn)] = torch.tensor(drawn, dtype=torch.int64)
    index_BM = row_anchors(kept_rows, t)[:, : keep_BM.shape[1]]
    device = wanted_BT.device
    return Blocks(index_BM.to(device), keep_BM.to(device), lengths_BM.to(device))


def block_forward(
    model: DFlashDraft,
    input_ids_BT: Tensor,
    aux_BTAH: Tensor,
    anchors_BM: Tensor,
    lengths_BM: Tensor | None = None,
    starts_BT: Tensor | None = None,
) -> Tensor:
    """Pre-norm outputs [B, M, J, H] of one block per anchor: [x_a, mask x (J-1)] at positions a..a+J-1
    (J = head.block_size), in one call of the head's forward over the whole batch's context (each block
    seeing its own document's, in rows packed at `starts_BT`); a block shorter than J (`lengths_BM`) is
    served as one: its tokens see none of the slots after it."""
    j = model.config.block_size
    block_ids_BMJ = torch.full((*anchors_BM.shape, j), model.config.mask_token_id, device=input_ids_BT.device)
    block_ids_BMJ[..., 0] = input_ids_BT.gather(1, anchors_BM)
    if lengths_BM is not None and not bool((lengths_BM < j).any()):
        lengths_BM = None  # full blocks: nothing to hide
    hidden_BTH = model.target_hidden(aux_BTAH)
    return model(block_ids_BMJ, anchors_BM, hidden_BTH, lengths_BM=lengths_BM, documents_BS=starts_BT)


def slot_predictions(batch: dict[str, Tensor], blocks: Blocks, k: int) -> tuple[Tensor, Tensor]:
    """(position_BM, predictions_BM): where mask slot k+1 of each block sits (a+k+1, clamped to the batch),
    and whether it is a prediction slot k trains - a drawn anchor whose block reaches that slot and a real
    answer token of its own sample there. Slot k's loss is their mean."""
    loss_mask_BT = batch["loss_mask"].bool()
    attention_mask_BT = batch.get("attention_mask")
    t = loss_mask_BT.shape[1]
    position_BM = blocks.index_BM + k + 1
    inside_BM = (position_BM < t) & (blocks.lengths_BM > k + 1) & blocks.keep_BM
    position_BM = position_BM.clamp(max=t - 1)
    answer_BM = loss_mask_BT.gather(1, position_BM)
    if attention_mask_BT is not None:
        answer_BM &= attention_mask_BT.bool().gather(1, position_BM)
    starts_BT = batch.get("doc_starts")
    if starts_BT is not None:
        answer_BM &= starts_BT.gather(1, position_BM) == starts_BT.gather(1, blocks.index_BM)
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
    dpace: Dpace | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """total = sum_k weights[k] * loss_k over the block's K = block_size - 1 mask slots, loss_k the mean of
    the objective over slot k's predictions (`slot_predictions`; `blocks` None: `sample_blocks` of full
    blocks, 512 anchors); the batch and the metrics as `ttt_loss`'s, per slot (`chain_*_k`: the slots before
    k all right, as vLLM accepts). With `dpace`, each prediction weighs its block's D-PACE weight
    instead of `weights` (`chain_weights`): a slot whose target token is outside the
    draft vocabulary counts as one the draft misses (c = 0)."""
    num_slots = model.config.block_size - 1
    if len(weights) != num_slots:
        raise ValueError(f"{len(weights)} loss weights for {num_slots} mask slots")
    if blocks is None:
        block = model.config.block_size
        blocks = sample_blocks(batch, 512, (block, block), sample_generators(batch))
    teacher = batch_teacher(batch, target_lm_head, draft_to_target, chunk_size)
    out_BMJH = block_forward(
        model, batch["input_ids"], batch["aux_hidden"], blocks.index_BM, blocks.lengths_BM,
        batch.get("doc_starts"),
    )  # fmt: skip
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
            weighed=dpace is not None,
        )
        slots.append((rows, eligible_BM, (batch_R, row_R)))
    return weighed_total(slots, weights, denominators, dpace)
