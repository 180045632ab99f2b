"""The parts every draft head is built from, with the parameter names vLLM loads: RoPE, RMSNorm, the SwiGLU
MLP, the attention projections and the Llama decoder layer (and the base class of the heads themselves).

A decoder layer is `project` (norms, q/k/v, RoPE; the residual) then the one attention
(heads/attention.py) then `finish` (o_proj onto the residual, then the MLP); its `forward` runs the three
with an optional key/value cache, so every caller - training, the reference decoder - attends the same way.

Shape legend: B batch, T positions, H hidden, X layer input width, N query heads, G key/value heads,
D head dim, V target vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from heads.attention import LayerKV, attend
from heads.config import LlamaLayerConfig, rope_type


def rope_inv_freq(config: LlamaLayerConfig) -> Tensor:
    """[D/2] fp32 inverse frequencies, from transformers' RoPE code so scaled variants match the target."""
    kind = rope_type(config)
    if kind == "default":
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).float() / config.head_dim
        return 1.0 / (config.rope_theta**exponents)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {**config.rope_scaling, "rope_type": kind, "rope_theta": config.rope_theta}
    parameters.pop("type", None)
    hf_config = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=parameters,
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, None)
    assert attention_factor == 1.0, f"{kind} rope rescales cos/sin; not handled"
    return inv_freq.float()


def rope_cos_sin(inv_freq: Tensor, positions_BT: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [B, T, D] in fp32, laid out for `rotate_half` (each frequency used twice, halves)."""
    angles_BTd = positions_BT[..., None].float() * inv_freq.float()
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos(), angles_BTD.sin()


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x_BNTD: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
    # Like HF Llama: cos/sin in the activation dtype, broadcast over heads.
    cos_B1TD = cos_BTD.to(x_BNTD.dtype).unsqueeze(1)
    sin_B1TD = sin_BTD.to(x_BNTD.dtype).unsqueeze(1)
    return x_BNTD * cos_B1TD + rotate_half(x_BNTD) * sin_B1TD


class RMSNorm(nn.Module):
    """Llama's RMSNorm: the variance in fp32, the weight applied in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaLayerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x_BTH: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTH)) * self.up_proj(x_BTH))


class Attention(nn.Module):
    """q/k/v read `input_size` (2H in EAGLE-3's layer 0: `cat(input_layernorm(embedding), hidden)`; H
    elsewhere); o_proj writes H. No biases (vLLM's Llama layer loads none by default). `qk_norm`: Qwen3's
    per-head RMSNorm on queries and keys before RoPE (`q_norm`, `k_norm`; DFlash's layers)."""

    def __init__(self, config: LlamaLayerConfig, input_size: int, qk_norm: bool = False):
        super().__init__()
        h, n, g, d = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = n, g, d
        self.q_proj = nn.Linear(input_size, n * d, bias=False)
        self.k_proj = nn.Linear(input_size, g * d, bias=False)
        self.v_proj = nn.Linear(input_size, g * d, bias=False)
        self.o_proj = nn.Linear(n * d, h, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def project(self, x_BTX: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B, N, T, D], rotated keys and values [B, G, T, D]."""
        b, t, _ = x_BTX.shape
        q_BTND = self.q_proj(x_BTX).view(b, t, self.num_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q_BTND = self.q_norm(q_BTND)
        return (
            apply_rope(q_BTND.transpose(1, 2), cos_BTD, sin_BTD),
            *self.keys_values(x_BTX, cos_BTD, sin_BTD),
        )

    def keys_values(self, x_BTX: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated keys and values [B, G, T, D] of `x` (DFlash also projects the target's context so)."""
        b, t, _ = x_BTX.shape
        k_BTGD = self.k_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "k_norm"):
            k_BTGD = self.k_norm(k_BTGD)
        v_BGTD = self.v_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k_BTGD.transpose(1, 2), cos_BTD, sin_BTD), v_BGTD

    def output(self, attn_BNTD: Tensor) -> Tensor:
        b, _, t, _ = attn_BNTD.shape
        return self.o_proj(attn_BNTD.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer on the pre-norm residual stream (P-EAGLE's layers after the first; with
    `qk_norm`, the Qwen3 layer DFlash stacks).

    `input_layernorm=False` builds vLLM's EAGLE-1 layer 0, whose input norm is the identity: attention reads
    the raw input, and a checkpoint holding `input_layernorm.weight` would fail to load there.
    """

    def __init__(
        self,
        config: LlamaLayerConfig,
        input_size: int | None = None,
        input_layernorm: bool = True,
        qk_norm: bool = False,
    ):
        super().__init__()
        if input_layernorm:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, input_size or config.hidden_size, qk_norm)
        self.window = getattr(config, "sliding_window", None)  # vLLM's per-layer sliding window, or None
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def project(self, hidden_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, ...]:
        """(q_BNTD, k_BGTD, v_BGTD, residual_BTH) for these positions."""
        x_BTH = self.input_layernorm(hidden_BTH) if hasattr(self, "input_layernorm") else hidden_BTH
        return (*self.self_attn.project(x_BTH, cos_BTD, sin_BTD), hidden_BTH)

    def finish(self, attn_BNTD: Tensor, residual_BTH: Tensor) -> Tensor:
        """The layer's pre-norm output: attention and MLP added onto the residual."""
        hidden_BTH = self.self_attn.output(attn_BNTD) + residual_BTH
        return hidden_BTH + self.mlp(self.post_attention_layernorm(hidden_BTH))

    def forward(
        self,
        *inputs: Tensor,
        kv: LayerKV | None = None,
        anchors_BM: Tensor | None = None,
        outputs_BM: Tensor | None = None,
    ) -> Tensor:
        """`project(*inputs)`, the one attention (through `kv` when given), `finish`. With `outputs_BM`, the
        inputs are at every row but only those rows' outputs are computed [B, M, H]: keys and values at
        every row, queries, attention and MLP at M (the last layer, where only some rows have a loss)."""
        q_BNTD, k_BGTD, v_BGTD, residual_BTH = self.project(*inputs)
        if outputs_BM is None:
            return self.finish(attend(q_BNTD, k_BGTD, v_BGTD, kv, anchors_BM, self.window), residual_BTH)
        b, n, t, d = q_BNTD.shape
        at_rows_BMND = outputs_BM[:, None, :, None].expand(b, n, -1, d)
        residual_BMH = residual_BTH.gather(1, outputs_BM[..., None].expand(-1, -1, residual_BTH.shape[2]))
        packed = kv is not None and kv.starts_BS is not None
        if fused_rows(packed, self.window, outputs_BM.shape[1], t):  # every row's attention, taken after
            attn_BNMD = attend(q_BNTD, k_BGTD, v_BGTD, kv, None, self.window).gather(2, at_rows_BMND)
        else:
            attn_BNMD = attend(q_BNTD.gather(2, at_rows_BMND), k_BGTD, v_BGTD, kv, outputs_BM, self.window)
        return self.finish(attn_BNMD, residual_BMH)


def fused_rows(packed: bool, window: int | None, m: int, t: int) -> bool:
    """Whether a call wanting M of its T rows' outputs costs less as a plain causal pass over every row
    through PyTorch's fused kernel, the M rows taken after (then only the MLP runs at M): one sample a row,
    no window, and more than a quarter of the rows wanted. On a 2-core CPU at SmolLM2's widths and 2,048
    rows, the anchored call breaks even at half the rows and takes 0.38x the fused one's time at an eighth
    (forward and backward, one layer)."""
    return not packed and window is None and 4 * m > t


class DraftModel(nn.Module):
    """What every head kind shares: the target's frozen embedding, RoPE, and the loop over its decoder
    layers with an optional cache. A kind adds its layers, `forward` and `logits`."""

    def __init__(self, config: LlamaLayerConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_tokens.requires_grad_(False)  # the target's, frozen; see load_target
        # Not persistent: derived from the config, so it never reaches a checkpoint or the export.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def layer(self) -> DecoderLayer:
        return self.layers[0]

    @property
    def parallel(self) -> bool:
        """True when one forward drafts a whole round (P-EAGLE's mask slots)."""
        return False

    drafting = "chain"  # how a round is drafted: chain | block (DFlash); P-EAGLE is a chain head + `parallel`

    # True when the head's file carries an embedding of its own (speculators' P-EAGLE trains it): vLLM then
    # serves that one, not the target's (llm_base_proposer.py `_maybe_share_embeddings`), and so do we
    own_embedding = False

    @torch.no_grad()
    def load_target_embedding(self, weight_VH: Tensor) -> None:
        if self.own_embedding:
            return
        if tuple(weight_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight_VH.shape)} does not match the draft's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)"
            )
        self.embed_tokens.weight.copy_(weight_VH)

    def embed(self, input_ids_BT: Tensor) -> Tensor:
        return self.embed_tokens(input_ids_BT).to(self.fc.weight.dtype)

    def rope(self, positions_BT: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions_BT)

    def run_layers(
        self,
        first_inputs: tuple[Tensor, ...],
        positions_BT: Tensor,
        cache,
        anchors_BM: Tensor | None,
        outputs_BM: Tensor | None = None,
    ) -> Tensor:
        """Layer 0 on `first_inputs`, every later layer on its predecessor's output: the last pre-norm
        output, at every position or only at the rows `outputs_BM` (the last layer's queries; every earlier
        layer's output is a later one's keys). `cache` (a heads.attention.KVCache, or None: plain causal)
        keeps each layer's keys."""
        cos_BTD, sin_BTD = self.rope(positions_BT)
        kvs = cache.layers if cache is not None else [None] * len(self.layers)
        out_BTH, *later = first_inputs
        for i, (layer, kv) in enumerate(zip(self.layers, kvs)):
            last = outputs_BM if i == len(self.layers) - 1 else None
            inputs = (out_BTH, *later) if i == 0 else (out_BTH,)
            out_BTH = layer(*inputs, cos_BTD, sin_BTD, kv=kv, anchors_BM=anchors_BM, outputs_BM=last)
        return out_BTH


def exported_state_dict(model: DraftModel) -> dict[str, Tensor]:
    """The weights vLLM loads (flat names, no embedding: vLLM shares the target's); `d2t` is the exporter's."""
    return {k: v.detach() for k, v in model.state_dict().items() if k not in EXCLUDED_FROM_EXPORT}


EXCLUDED_FROM_EXPORT = ("embed_tokens.weight",)  # vLLM shares the target's embedding
