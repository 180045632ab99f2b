"""How much memory one training step takes per rank, before any step runs: the model train's pre-flight
check uses and train/benchmark_memory.py checks against measured peaks (docs/gpu.md#memory).

    breakdown = step_memory(cfg, draft, target_config, world=8, zero_stage=2, online=True)
    total_bytes = sum(breakdown.values())

The states are counted exactly from the head as built (its parameters, which of them train, the
optimizer's two moments, what ZeRO shards); the activations are what autograd keeps for backward per
query token of each decoder-layer call (TTT steps, P-EAGLE depths, DFlash blocks), per sequence position,
and the bounded transients of the chunked attention and loss (heads/attention.py, train/losses.py). The
per-token coefficients are counts of the tensors autograd saves (bf16 autocast over fp32 weights: fp32 norms
and residuals, bf16 projections), checked by tests/test_train_memory.py and by the benchmark.

Shape legend: B micro-batch, T tokens per sample, H hidden, I intermediate, A aux layers, V target vocab,
Vd draft vocab.
"""

from __future__ import annotations

import math

import torch

from heads.attention import SCORE_BUDGET_BYTES
from train.losses import LOGIT_BUDGET_BYTES

GB = 1e9
# Bytes autograd keeps per query token of one decoder-layer call, per unit of H and of I (bf16 autocast):
# the fp32 input and residual, RMSNorms' fp32 inputs, the bf16 casts the projections save, RoPE'd q/k,
# the attention's output, SwiGLU's gate, up and product.
PER_QUERY_H, PER_QUERY_I = 40, 10
# Per sequence position, beyond the layer calls: the aux states' casts, fc and its norms, the carried state.
PER_POSITION_H = 30
# DFlash: each layer projects the whole context's keys and values for the blocks to read (fp32 input cast,
# normed keys, values), per context position and layer.
PER_CONTEXT_H = 12
# Without chunking (M x Vd below LOGIT_BUDGET_BYTES), per query token: bf16 logits, their fp32 log-softmax
# and the teacher rows gathered for them.
PER_LOGIT = 10


def head_layer_calls(head, batch_size: int, seq_len: int, num_answer: int) -> tuple[int, int]:
    """(query tokens summed over the head's decoder-layer calls, context tokens summed over layers) of one
    micro-batch; `num_answer` positions per sample have an answer token to predict."""
    b, t = batch_size, seq_len
    if head.kind == "eagle1":
        return b * t, 0
    if head.kind == "eagle3":
        return b * t * head.num_ttt_steps, 0
    if head.kind == "peagle":
        per_layer = b * t + sum(
            b * min(t, math.ceil(num_answer * head.cod_ratio**d)) for d in range(1, head.num_depths)
        )
        return per_layer * head.num_layers, 0
    anchors = min(head.num_anchors, num_answer)
    return b * anchors * head.block_size * head.num_layers, b * t * head.num_layers


def step_memory(
    cfg,
    draft: torch.nn.Module,
    target_config,
    batch_size: int,
    seq_len: int,
    world: int = 1,
    zero_stage: int = 0,
    online: bool = False,
    answer_fraction: float = 1.0,
) -> dict[str, int]:
    """Bytes per rank of one training step with micro-batch `batch_size` x `seq_len`, by component.

    `answer_fraction`: the share of positions with an answer token to predict (the teacher, the loss, the
    anchors); 1 is the worst case. `online`: the target runs in the step (train.features=online).
    """
    head, h = cfg.head, target_config.hidden_size
    i, heads = target_config.intermediate_size, target_config.num_attention_heads
    v, vd = target_config.vocab_size, draft.config.draft_vocab_size if hasattr(draft.config, "draft_vocab_size") else target_config.vocab_size
    params = [(n, p) for n, p in draft.named_parameters() if "embed_tokens" not in n]
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    matmul = sum(p.numel() for _, p in params if p.dim() == 2)
    half = cfg.train.mixed_precision in ("bf16", "fp16")
    optimizer_shards = world if zero_stage >= 1 else 1
    b, t = batch_size, seq_len
    answers = max(1, round(t * answer_fraction))
    queries, context = head_layer_calls(head, b, t, answers)
    rows = b * answers  # positions whose teacher some loss needs
    num_aux = len(getattr(draft.config, "aux_layer_ids", []) or [])
    target_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[cfg.target.dtype]
    breakdown = {
        "head_weights": 4 * sum(p.numel() for _, p in params) // (world if zero_stage >= 3 else 1),
        "gradients": 4 * trainable // (world if zero_stage >= 2 else 1),
        "optimizer": 8 * trainable // optimizer_shards,
        "half_weight_copies": 2 * matmul if half else 0,
        "target_embedding": 4 * v * h,  # the draft's frozen copy, fp32
        "target_lm_head": target_bytes * v * h,
        "batch_states": 4 * b * t * (num_aux + 1) * h,  # collated fp32 aux and final states
        "teacher": 4 * rows * vd,
        "activations": queries * (PER_QUERY_H * h + PER_QUERY_I * i)
        + b * t * (PER_POSITION_H + 2 * num_aux) * h
        + context * PER_CONTEXT_H * h,
        # The largest attention chunk's scores (fp32, their bf16 source and the probabilities), one logit
        # chunk (bf16 logits, fp32 log-probabilities, teacher rows, their product and gradient), the
        # teacher's full-vocabulary chunk: bounded by the budgets whatever the batch.
        "transients": 5 * min(SCORE_BUDGET_BYTES, 4 * b * heads * t * t) // 2
        + 9 * min(LOGIT_BUDGET_BYTES, 4 * rows * vd) // 2
        + min(cfg.train.teacher_chunk_size, rows) * v * 6,
    }
    per_step_logits = queries * vd * 4
    if per_step_logits <= LOGIT_BUDGET_BYTES:  # small shapes: the logits are kept, not chunked
        breakdown["activations"] += queries * PER_LOGIT * vd
    if online:
        breakdown["online_target"] = target_weights_bytes(target_config, target_bytes)
        # its forward under inference mode: a layer's MLP at a time
        breakdown["online_forward"] = b * t * (2 * i + 4 * h) * target_bytes
    return breakdown


def target_weights_bytes(target_config, bytes_per_weight: int) -> int:
    """A Llama-shaped target's weights (embedding, layers, norm, lm_head unless tied)."""
    h, i, v = target_config.hidden_size, target_config.intermediate_size, target_config.vocab_size
    heads = target_config.num_attention_heads
    kv = getattr(target_config, "num_key_value_heads", None) or heads
    d = getattr(target_config, "head_dim", None) or h // heads
    layer = h * heads * d * 2 + 2 * h * kv * d + 3 * h * i + 2 * h
    tied = getattr(target_config, "tie_word_embeddings", False)
    return bytes_per_weight * (v * h * (1 if tied else 2) + target_config.num_hidden_layers * layer + h)


def describe(breakdown: dict[str, int]) -> str:
    """`total GB (component GB, ...)`, largest first."""
    parts = sorted(breakdown.items(), key=lambda kv: -kv[1])
    return f"{sum(breakdown.values()) / GB:.1f} GB (" + ", ".join(
        f"{name} {value / GB:.1f}" for name, value in parts if value >= 0.05 * GB
    ) + ")"
