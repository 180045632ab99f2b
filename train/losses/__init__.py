"""The losses of every head kind, one file per kind on shared teacher and objective machinery: training-time
test (EAGLE-3), parallel drafting (P-EAGLE), block drafting (DFlash) and EAGLE-1.

Pure functions on tensors (no I/O, no Accelerator), tested on CPU. Each kind drives its head through the
head's own `forward` (heads/) and scores every draft position against the target's draft-vocabulary
distribution. Where each concern lives:

- rows.py: the teacher (`teacher_rows`, `batch_teacher`, `target_logits`, `Teacher`; dense `teacher_probs`),
  where a draft position has a loss (`step_valid_mask`, `shift_left`, `same_document` in packed rows), and the draft's objective per row in
  bounded memory (`draft_rows`, `objective_rows`, `RowLosses`, LOGIT_BUDGET_BYTES, `estimating`; dense
  `step_loss`).
- positions.py: each draft position's mean loss and weight (`position_loss`, `loss_weights`,
  `depth_weights`, D-PACE's `chain_weights`), the total and the chains' acceptance counts (`weighed_total`,
  `Chains`), the EAGLE-3 head's loss over its depths (`depth_losses`, `depth_predictions`, `Anchors`), and
  the per-sample random draws (`documents`, `sample_generators`, `wanted_first`, `row_anchors`,
  `kept_first`), the same for a sample alone in its row or packed with others.
- chain.py: EAGLE-3's TTT (`ttt_rollout`, `ttt_loss`).
- parallel.py: P-EAGLE's parallel drafting and COD (`cod_anchors`, `parallel_forward`, `parallel_loss`).
- block.py: DFlash's block drafting (`Blocks`, `sample_blocks`, `block_forward`, `slot_predictions`,
  `block_loss`).
- eagle1.py: EAGLE-1 (`add_feature_noise`, `full_vocab_rows`, `chunked_full_vocab`, `eagle1_loss`).

Imports point down: the kind modules import positions.py and rows.py, never each other; positions.py
imports rows.py. Every name is re-exported here (`from train.losses import ttt_loss`); a module setting is
read where it is defined, so a test patches it there (`train.losses.rows.LOGIT_BUDGET_BYTES`).

    total, metrics = ttt_loss(draft, batch, 7, 0.8, target_lm_head_VH, vocab.draft_to_target, 1024)
    total, metrics = parallel_loss(...same..., anchors=cod_anchors(batch, 3, 0.7, sample_generators(batch)))
    total, metrics = eagle1_loss(draft, batch, w_VH, 1024)
"""

from train.losses.block import Blocks, block_forward, block_loss, sample_blocks, slot_predictions
from train.losses.chain import ttt_loss, ttt_rollout
from train.losses.eagle1 import add_feature_noise, chunked_full_vocab, eagle1_loss, full_vocab_rows
from train.losses.parallel import cod_anchors, parallel_forward, parallel_loss
from train.losses.positions import (
    Anchors,
    Chains,
    Document,
    Dpace,
    chain_weights,
    depth_losses,
    depth_predictions,
    depth_weights,
    documents,
    kept_first,
    loss_weights,
    position_loss,
    prediction_anchors,
    row_anchors,
    sample_generators,
    wanted_first,
    weighed_total,
)
from train.losses.rows import (
    LOGIT_BUDGET_BYTES,
    RowLosses,
    Teacher,
    batch_teacher,
    draft_rows,
    estimating,
    objective_rows,
    same_document,
    shift_left,
    step_loss,
    step_valid_mask,
    target_logits,
    teacher_probs,
    teacher_rows,
)

__all__ = [
    "LOGIT_BUDGET_BYTES",
    "Anchors",
    "Blocks",
    "Document",
    "Dpace",
    "Chains",
    "RowLosses",
    "Teacher",
    "add_feature_noise",
    "batch_teacher",
    "block_forward",
    "block_loss",
    "chain_weights",
    "chunked_full_vocab",
    "cod_anchors",
    "depth_losses",
    "depth_predictions",
    "depth_weights",
    "documents",
    "draft_rows",
    "eagle1_loss",
    "estimating",
    "full_vocab_rows",
    "kept_first",
    "loss_weights",
    "objective_rows",
    "parallel_forward",
    "parallel_loss",
    "position_loss",
    "prediction_anchors",
    "sample_generators",
    "row_anchors",
    "same_document",
    "sample_blocks",
    "shift_left",
    "slot_predictions",
    "step_loss",
    "step_valid_mask",
    "target_logits",
    "teacher_probs",
    "teacher_rows",
    "ttt_loss",
    "ttt_rollout",
    "wanted_first",
    "weighed_total",
]
