"""How much memory one training step takes per rank, before any step runs: the model train's pre-flight
check uses and bench/memory.py checks against measured peaks (docs/gpu.md#memory).

    breakdown = step_memory(cfg, draft, target_config, batch_size=4, seq_len=2048, world=8, zero_stage=2)
    needed = peak_bytes(breakdown)   # what the rank's device must hold at the step's peak

The states are counted exactly from the head as built (its parameters, which of them train, the
optimizer's two moments, what ZeRO shards); the activations are what autograd keeps for backward per
query token of each decoder-layer call (TTT steps, P-EAGLE depths, DFlash blocks), per sequence position,
and the bounded transients of the chunked attention and loss (heads/attention.py, train/losses/rows.py).
The per-token coefficients are counts of the tensors autograd saves (bf16 autocast over fp32 weights: fp32
norms and residuals, bf16 projections), checked by tests/test_train_memory.py and by the benchmark.

Shape legend: B micro-batch, T tokens per sample, H hidden, I intermediate, A aux layers, V target vocab,
Vd draft vocab.
"""

from __future__ import annotations

import logging
import math

import torch

from heads.attention import SCORE_BUDGET_BYTES
from heads.layers import fused_rows
from train.losses import LOGIT_BUDGET_BYTES

log = logging.getLogger("train")  # train's own logger: the estimate is one of its lines
GB = 1e9
# Bytes autograd keeps per query token of one decoder-layer call, per unit of H and of I (bf16 autocast;
# counted by bench/saved.py at the 8B widths): the RMSNorms' fp32 products and the fp32 residual sums, the
# bf16 casts the projections save, RoPE'd q/k and the attention's output; SwiGLU's gate, up, SiLU and
# product in bf16.
PER_QUERY_H, PER_QUERY_I = 34, 8
# EAGLE-3 and P-EAGLE's first layer reads [embedding, hidden] (2H): its norms and casts, per query, beyond.
FIRST_LAYER_H = 12
# Per sequence position, beyond the layer calls: the fp32 states fc reads, and per aux layer their fp32
# norm and bf16 cast.
PER_POSITION_H, PER_AUX_H = 4, 6
# DFlash: each layer projects the whole context's keys and values for the blocks to read (fp32 input cast,
# normed keys, values), per context position and layer.
PER_CONTEXT_H = 12
# DFlash, per block query token and layer: the block's J keys (fp32, normed) and values (bf16) laid out per
# query (block_attention hands each query its block's keys as its extra keys), per unit of J x KV width.
PER_BLOCK_KEY = 4 + 2
# An attention call whose scores fit SCORE_BUDGET_BYTES runs unchunked and keeps, per query and key, the
# fp32 softmax and the bf16 probabilities (not the bf16 scores: masking and the fp32 cast save none;
# counted by bench/saved.py at the 8B widths).
PER_SCORE = 6
# The checkpointed loss rows without chunking (M x Vd below LOGIT_BUDGET_BYTES), per prediction and draft
# token: the bf16 logits, their fp32 log-softmax and its exp, the teacher rows gathered for them and their
# product (bench/saved.py at the 8B widths).
PER_LOGIT = 17


def depth_anchors(head, seq_len: int, num_answer: int) -> list[int]:
    """P-EAGLE: the anchors per row of each depth after the first (COD keeps cod_ratio^d of the answers)."""
    return [min(seq_len, math.ceil(num_answer * head.cod_ratio**d)) for d in range(1, head.num_depths)]


def block_anchors(head, num_answer: int, packed: bool = False) -> int:
    """DFlash: the blocks per row, one per anchor (a packed row's samples each draw their own: up to all
    its answer positions)."""
    return num_answer if packed else min(head.num_anchors, num_answer)


def head_layer_calls(
    head, batch_size: int, seq_len: int, num_answer: int, packed: bool = False
) -> tuple[int, int]:
    """(query tokens summed over the head's decoder-layer calls, context tokens summed over layers) of one
    micro-batch; `num_answer` positions per row have an answer token to predict. A `packed` row holds
    several samples, each drawing its own DFlash anchors: up to all its answer positions."""
    b, t = batch_size, seq_len
    if head.kind == "eagle1":
        return b * t, 0
    if head.kind == "eagle3":  # step 0 over the sequence, the later steps at the rows some step trains
        return b * (t + min(t, num_answer) * (head.num_ttt_steps - 1)), 0
    if head.kind == "peagle":
        return b * (t + sum(depth_anchors(head, t, num_answer))) * head.num_layers, 0
    blocks = b * block_anchors(head, num_answer, packed) * head.block_size
    return blocks * head.num_layers, b * t * head.num_layers


def scored_calls(head, seq_len: int, num_answer: int, packed: bool = False) -> list[tuple[int, int]]:
    """(queries, keys) per row of each decoder-layer call that goes through `attention`'s scores rather than
    the fused causal kernel (heads/attention.py): TTT's later steps and P-EAGLE's depths with their extra
    keys, DFlash's blocks over the context and their own keys; every call of a packed row. Each layer makes
    the same calls. TTT's steps and P-EAGLE's first depth query the rows some depth trains; so does their
    call over the sequence where it does not take the fused kernel (heads/layers.py `fused_rows`: packed
    rows, a sliding window, or at most a quarter of the rows trained)."""
    t = seq_len
    plain = [(t, t)] if packed else []
    m = min(t, num_answer)
    if head.kind in ("eagle3", "peagle") and not fused_rows(packed, head.sliding_window, m, t):
        plain = [(m, t)]
    if head.kind == "eagle3":
        return plain + [(m, t + k) for k in range(1, head.num_ttt_steps)]
    if head.kind == "peagle":
        return plain + [(m, t + d) for d, m in enumerate(depth_anchors(head, t, num_answer), start=1)]
    if head.kind == "dflash":
        return [(block_anchors(head, num_answer, packed) * head.block_size, t + head.block_size)]
    return plain


def predictions(head, batch_size: int, seq_len: int, num_answer: int, packed: bool = False) -> int:
    """The draft predictions one micro-batch trains (at most): an answer position's per TTT step, P-EAGLE's
    anchors per depth, DFlash's J - 1 slots per anchor."""
    b = batch_size
    if head.kind == "eagle3":
        return b * num_answer * head.num_ttt_steps
    if head.kind == "peagle":
        return b * (num_answer + sum(depth_anchors(head, seq_len, num_answer)))
    if head.kind == "dflash":
        return b * block_anchors(head, num_answer, packed) * (head.block_size - 1)
    return b * num_answer


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
    packed: bool = False,
) -> dict[str, int]:
    """Bytes per rank of one training step with micro-batch `batch_size` x `seq_len`, by component.

    `answer_fraction`: the share of positions with an answer token to predict (the teacher, the loss, the
    anchors); 1 is the worst case. `online`: the target runs in the step (train.features=online).
    `packed`: rows of several samples (train.pack_length): no attention call takes the fused causal kernel.
    The activations are what autograd saves (bench/saved.py counts them); the teacher rows are held beside.
    """
    head, h = cfg.head, target_config.hidden_size
    i, heads = target_config.intermediate_size, target_config.num_attention_heads
    v = target_config.vocab_size
    vd = getattr(draft.config, "draft_vocab_size", v)  # EAGLE-1 decodes with the target's lm_head
    params = [(n, p) for n, p in draft.named_parameters() if "embed_tokens" not in n]
    trainable = sum(p.numel() for _, p in params if p.requires_grad)
    matmul = sum(p.numel() for _, p in params if p.dim() == 2)
    half = cfg.train.mixed_precision in ("bf16", "fp16")
    optimizer_shards = world if zero_stage >= 1 else 1
    b, t = batch_size, seq_len
    answers = max(1, round(t * answer_fraction))
    queries, context = head_layer_calls(head, b, t, answers, packed)
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
        + b * t * (PER_POSITION_H + PER_AUX_H * num_aux) * h
        + context * PER_CONTEXT_H * h,
        # The largest of the bounded transients (they come one after another: the teacher's
        # full-vocabulary chunk before the forward, an attention chunk's scores and probabilities in it, a
        # logit chunk with its log-probabilities, teacher rows and gradient in the loss).
        "transients": max(
            min(cfg.train.teacher_chunk_size, rows) * v * 6,
            5 * min(SCORE_BUDGET_BYTES, 4 * b * heads * t * t) // 2,
            9 * min(LOGIT_BUDGET_BYTES, 4 * rows * vd) // 2,
        ),
        # Kernel workspaces and scratch (cuBLAS, oneDNN), the allocator's first pages: what a tiny step
        # still takes.
        "workspace": 128 * 2**20,
    }
    kv = (getattr(target_config, "num_key_value_heads", None) or heads) * getattr(
        draft.config, "head_dim", h // heads
    )
    if head.kind == "dflash":
        breakdown["activations"] += queries * PER_BLOCK_KEY * head.block_size * kv
    if head.kind in ("eagle3", "peagle"):
        breakdown["activations"] += queries // head.num_layers * FIRST_LAYER_H * h
    for q, keys in scored_calls(head, t, answers, packed):
        # A call whose scores fit the budget runs unchunked and keeps them (attention chunks the others).
        if 4 * b * heads * q * keys <= SCORE_BUDGET_BYTES:
            breakdown["activations"] += PER_SCORE * heads * b * q * keys * head.num_layers
        # TTT's step k and P-EAGLE's depth k read the k earlier steps' keys and values, stacked in bf16.
        if head.kind in ("eagle3", "peagle") and keys > t:
            breakdown["activations"] += 2 * 2 * b * q * (keys - t) * kv * head.num_layers
    # The fused rows (train.fused_loss) keep each prediction's output gradient, fp32, and under D-PACE's
    # weights its output too, for backward to recompute. The checkpointed rows keep nothing when chunked;
    # unchunked (small shapes) each drafting step keeps its logits, and a frozen lm_head's bf16 cast (autocast
    # caches only the casts of weights that train).
    unfused = head.kind == "eagle1" or not cfg.train.fused_loss
    predicted = predictions(head, b, t, answers, packed)
    if not unfused:
        breakdown["activations"] += 4 * h * predicted * (2 if head.position_weights == "dpace" else 1)
    if unfused and rows * vd * 4 <= LOGIT_BUDGET_BYTES:
        breakdown["activations"] += predicted * PER_LOGIT * vd
        if half and head.kind != "eagle1" and head.freeze_lm_head:
            steps = {"eagle3": head.num_ttt_steps, "peagle": head.num_depths}.get(head.kind, 1)
            breakdown["half_weight_copies"] += 2 * vd * h * (steps - 1)
    if online:
        breakdown["online_target"] = target_weights_bytes(target_config, target_bytes)
        # its forward under inference mode: a layer's MLP at a time (a MoE layer's: the experts each token
        # is routed to)
        breakdown["online_forward"] = b * t * (2 * active_intermediate(target_config) + 4 * h) * target_bytes
    return breakdown


# What is held before the first step (the head's weights, the target's matrices, the batch, an online
# target) and what the step adds.
IN_SETUP = ("head_weights", "target_embedding", "target_lm_head", "batch_states", "online_target")


def peak_bytes(breakdown: dict[str, int], in_setup: bool = True) -> int:
    """The peak of a step from its components, which do not all live at once: AdamW's moments persist;
    on top of them, the forward and backward hold the activations, the half-precision weight copies, the
    teacher, one transient and the gradients as they fill (half of them on average while activations are
    still held), and the optimizer step the gradients and as much again in AdamW's temporaries.
    `in_setup=False`: only what the step adds to what was held before it."""
    get = breakdown.get
    during = (
        get("workspace", 0) + get("activations", 0) + get("half_weight_copies", 0) + get("teacher", 0) + get("transients", 0)
        + get("online_forward", 0) + get("gradients", 0) // 2
    )  # fmt: skip
    step = 2 * get("gradients", 0)
    held = sum(get(k, 0) for k in IN_SETUP) if in_setup else 0
    return held + get("optimizer", 0) + max(during, step)


def num_experts(target_config) -> int:
    """The routed experts of a MoE target's sparse layers (Qwen3-MoE / Qwen2-MoE `num_experts`, Mixtral
    `num_local_experts`, DeepSeek `n_routed_experts`); 0 for a dense target."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(target_config, name, None):
            return int(getattr(target_config, name))
    return 0


def sparse_layer(target_config, layer: int) -> bool:
    """Whether layer `layer` of a MoE target routes to experts (the others have a dense MLP)."""
    if not num_experts(target_config) or layer in (getattr(target_config, "mlp_only_layers", None) or []):
        return False
    step = getattr(target_config, "decoder_sparse_step", None) or 1
    return (layer + 1) % step == 0 and layer >= (getattr(target_config, "first_k_dense_replace", None) or 0)


def expert_sizes(target_config) -> tuple[int, int]:
    """(one routed expert's intermediate size, the shared experts' total intermediate size)."""
    expert = getattr(target_config, "moe_intermediate_size", None) or target_config.intermediate_size
    shared = getattr(target_config, "shared_expert_intermediate_size", None) or 0
    shared += (getattr(target_config, "n_shared_experts", None) or 0) * expert
    return expert, shared


def mlp_params(target_config, layer: int) -> int:
    """Layer `layer`'s MLP weights: gate, up and down projections of every expert (all of them are held,
    whichever a token is routed to), the shared experts and the router; a dense MLP's otherwise."""
    h = target_config.hidden_size
    if not sparse_layer(target_config, layer):
        return 3 * h * target_config.intermediate_size
    expert, shared = expert_sizes(target_config)
    experts = num_experts(target_config)
    return experts * 3 * h * expert + h * experts + 3 * h * shared + (h if shared else 0)


def active_intermediate(target_config) -> int:
    """The MLP width a token runs through: the dense intermediate size, or for a MoE target its
    `num_experts_per_tok` experts and the shared ones (the largest over its layers)."""
    dense = target_config.intermediate_size
    if not num_experts(target_config):
        return dense
    expert, shared = expert_sizes(target_config)
    routed = (getattr(target_config, "num_experts_per_tok", None) or 1) * expert + shared
    layers = range(target_config.num_hidden_layers)
    return max(routed if sparse_layer(target_config, n) else dense for n in layers)


def target_weights_bytes(target_config, bytes_per_weight: int) -> int:
    """A Llama-shaped target's weights (embedding, layers, norm, lm_head unless tied), every expert of a
    MoE target's layers counted."""
    h, v = target_config.hidden_size, target_config.vocab_size
    heads = target_config.num_attention_heads
    kv = getattr(target_config, "num_key_value_heads", None) or heads
    d = getattr(target_config, "head_dim", None) or h // heads
    qk_norm = 2 * d if str(getattr(target_config, "model_type", "")).startswith("qwen3") else 0
    attention = h * heads * d * 2 + 2 * h * kv * d + 2 * h + qk_norm
    layers = sum(attention + mlp_params(target_config, n) for n in range(target_config.num_hidden_layers))
    tied = getattr(target_config, "tie_word_embeddings", False)
    return bytes_per_weight * (v * h * (1 if tied else 2) + layers + h)


def describe(breakdown: dict[str, int], in_setup: bool = True) -> str:
    """`peak GB (component GB, ...)`, largest first."""
    parts = sorted(breakdown.items(), key=lambda kv: -kv[1])
    return (
        f"{peak_bytes(breakdown, in_setup) / GB:.1f} GB peak ("
        + ", ".join(f"{name} {value / GB:.1f}" for name, value in parts if value >= 0.05 * GB)
        + ")"
    )


# A step may take at most this share of a GPU's memory by the model: the CUDA context, NCCL's buffers and
# the allocator's fragmentation take the rest (the model over-predicts measured peaks by ~10%: docs/gpu.md).
MAX_GPU_SHARE = 0.9


def check_step_fits(cfg, accelerator, draft, target_config, seq_len: int) -> dict[str, int]:
    """Refuse, before the first step, a micro-batch whose step cannot fit this rank's device, naming the
    setting to change; on CPU say so when it exceeds the memory available. Returns the estimate."""
    zero_stage = 0
    if accelerator.state.deepspeed_plugin is not None:
        zero_stage = int(accelerator.state.deepspeed_plugin.zero_stage)
    b, accumulation = cfg.train.batch_size, cfg.train.gradient_accumulation_steps
    packed = cfg.train.pack_length is not None
    estimate = step_memory(cfg, draft, target_config, b, seq_len, accelerator.num_processes, zero_stage,
                           online=cfg.train.features == "online", packed=packed)  # fmt: skip
    needed, device = peak_bytes(estimate), torch.device(accelerator.device)
    log.info("one training step of %d x %d tokens: about %s per rank", b, seq_len, describe(estimate))
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
        if needed > MAX_GPU_SHARE * capacity:
            online = estimate.get("online_target", 0)
            halvings = [b >> n for n in range(1, b.bit_length()) if b >> n >= 1]
            fits = next((n for n in halvings if peak_bytes(step_memory(
                cfg, draft, target_config, n, seq_len, accelerator.num_processes, zero_stage, online=online > 0,
                packed=packed,
            )) <= MAX_GPU_SHARE * capacity), None)  # fmt: skip
            cache = (
                f"train.features=cache (the online target's weights take {online / GB:.1f} GB of it, every expert "
                "of a MoE target counted; data_prep caches the states with cache.hidden_states=true, through "
                "vLLM at tensor parallel with capture.engine=vllm capture.tensor_parallel_size)"
            )
            if fits:
                smaller = (f"train.batch_size={fits} train.gradient_accumulation_steps={accumulation * b // fits} "
                           "(the same global batch)" + (f", or {cache}" if online else ""))  # fmt: skip
            elif online:
                smaller = cache
            else:
                smaller = "a shorter render.max_length, DeepSpeed ZeRO-2/3 (conf/accelerate/), or GPUs with more memory"
            raise ValueError(
                f"train.batch_size={b}: one step of {b} x {seq_len} tokens needs about {describe(estimate)}, "
                f"more than {MAX_GPU_SHARE:.0%} of the {capacity / GB:.1f} GB of {device} (train/memory.py); "
                f"set {smaller}"
            )
    else:
        import psutil

        available = psutil.virtual_memory().available
        if needed > available:
            log.warning("one step may need more than the %.1f GB of memory available now", available / GB)
    return estimate
