"""The EAGLE-3 draft head for Llama-family targets, with the parameter names vLLM loads.

One Llama decoder layer whose attention reads `cat(input_layernorm(embed(x)), hidden_norm(h))` (width 2H,
embedding first), fed at step 0 by `fc` over the target's concatenated aux hidden states and afterwards by
its own pre-norm output; `norm` + `lm_head` decode into the draft vocabulary. Parameter names equal vLLM's
(`llama_eagle3.py`), so export is a plain state_dict copy minus the frozen target embedding. speculators'
normalisation flags (`norm_before_fc`, `fc_norm`, `norm_output`, `norm_before_residual`) are config fields
with vLLM's meaning and weight names.

P-EAGLE (parallel drafting, DESIGN.md section 8) is this head with `mask_token_id` set: it adds a learned
`mask_hidden` (the fc input width; vLLM passes it through the fc norms and `fc` like the aux states) that
feeds the K-1 mask slots of a round, and may stack several decoder layers (layer 0 reads the 2H
concatenation, later ones are plain H-wide Llama layers, as in vLLM's `llama_eagle3.py`).

This module holds the model and a plain causal forward (one step, what vLLM runs on a prefill); the
training-time-test rollout with its diagonal attention lives in `train/ttt.py`, parallel drafting's
training forward in `train/parallel.py`. Use:

    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target), [2, 15, 27], 32000)
    draft = Eagle3Draft(config)
    draft.load_target_embedding(target.get_input_embeddings().weight)
    out_BTH = draft(input_ids_BT, draft.combine_aux(aux_BTAH), positions_BT)
    logits_BTVd = draft.logits(out_BTH)

Shape legend:
    B batch, T positions, H hidden size (draft = target), A aux layers, N query heads, G key/value heads,
    D head dim, I MLP width, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Rope types whose frequencies do not depend on the sequence length and whose cos/sin are not rescaled:
# transformers and vLLM compute them the same way. Others (dynamic, yarn, longrope) are not verified here.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
EXCLUDED_FROM_EXPORT = ("embed_tokens.weight",)  # vLLM shares the target's embedding
# speculators' normalisation flags, as vLLM 0.32 names and reads them (config fields below).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class Eagle3Config:
    hidden_size: int  # draft width; must equal the target's (the embedding is the target's)
    intermediate_size: int  # SwiGLU MLP width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA when fewer than the query heads)
    head_dim: int  # per-head width
    vocab_size: int  # target vocabulary V (embedding rows)
    draft_vocab_size: int  # draft vocabulary V_d (lm_head rows); V_d == V means no pruning
    aux_layer_ids: list[int]  # target layers feeding `fc`, vLLM ids, ascending (fc input order)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon, copied from the target
    rope_theta: float = 10000.0  # RoPE base, copied from the target
    rope_scaling: dict | None = None  # RoPE scaling dict (rope_type + its fields), None for plain RoPE
    max_position_embeddings: int = 2048  # longest position; >= the target's or vLLM stops drafting there
    # speculators' normalisation flags, each one vLLM 0.32 reads (DESIGN.md section 9):
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of raw h
    norm_before_fc: bool = (
        False  # one RMSNorm (`input_norm`, A*H wide) on the concatenated aux states before fc
    )
    fc_norm: bool = False  # one RMSNorm per aux state (`fc_norm.i`, H wide) before fc
    norm_output: bool = False  # a chain's next step reads norm(out) (post-norm) instead of the pre-norm out
    num_hidden_layers: int = 1  # decoder layers; layer 0 reads cat(embedding, hidden), later ones H wide
    mask_token_id: int | None = None  # P-EAGLE: the token id of the mask slots (None: sequential EAGLE-3)

    def __post_init__(self) -> None:
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids is empty: EAGLE-3 needs at least one target layer for `fc`")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ValueError(
                f"aux_layer_ids={self.aux_layer_ids}: give them ascending without repeats; vLLM sorts and "
                "de-duplicates them, so any other order trains `fc` on a different concatenation"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head dim")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size}: must be in 1..vocab_size={self.vocab_size}"
            )
        if self.num_hidden_layers < 1:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers}: a head needs at least one layer")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id}: not a token id of the {self.vocab_size}-token vocabulary"
            )
        rope_type(self)  # fail at construction, not at the first forward

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def parallel_drafting(self) -> bool:
        return self.mask_token_id is not None

    @classmethod
    def from_target_config(
        cls, target_config, aux_layer_ids: list[int], draft_vocab_size: int, **overrides
    ) -> Eagle3Config:
        """Sizes, RoPE and eps copied from a HF Llama config (transformers 4 or 5 RoPE fields)."""
        t = target_config
        heads = t.num_attention_heads
        # transformers 5 keeps theta and scaling together in `rope_parameters`; 4.x had two attributes.
        rope = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(t, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        values = dict(
            hidden_size=t.hidden_size,
            intermediate_size=t.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", None) or heads,
            head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
            vocab_size=t.vocab_size,
            draft_vocab_size=min(draft_vocab_size, t.vocab_size),
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=t.max_position_embeddings,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Eagle3Config fields in overrides: {sorted(unknown)}")
        if overrides.get("hidden_size", t.hidden_size) != t.hidden_size:
            raise ValueError(
                f"hidden_size={overrides['hidden_size']}: the draft width must equal the target's "
                f"({t.hidden_size}); vLLM feeds the draft the target's own embedding"
            )
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Eagle3Config:
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Eagle3Config fields: {sorted(unknown)}")
        return cls(**values)


def rope_type(config: Eagle3Config) -> str:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {kind!r} is not supported by the EAGLE-3 head yet (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); a RoPE that differs from vLLM's silently lowers acceptance"
        )
    return kind


def rope_inv_freq(config: Eagle3Config) -> torch.Tensor:
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


def rope_cos_sin(inv_freq: torch.Tensor, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, D] in fp32, laid out for `rotate_half` (each frequency used twice, halves)."""
    angles_BTd = positions_BT[..., None].float() * inv_freq.float()
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos(), angles_BTD.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x_BNTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def causal_attention(q_BNTD: torch.Tensor, k_BGTD: torch.Tensor, v_BGTD: torch.Tensor) -> torch.Tensor:
    """Plain causal attention with grouped key/value heads: query head n reads key/value head n // (N/G)."""
    repeats = q_BNTD.shape[1] // k_BGTD.shape[1]
    k_BNTD = k_BGTD.repeat_interleave(repeats, dim=1)
    v_BNTD = v_BGTD.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(q_BNTD, k_BNTD, v_BNTD, is_causal=True)


class Eagle3Attention(nn.Module):
    """q/k/v read `input_size` (2H in layer 0: `cat(embedding, hidden)`; H later); o_proj writes H. No biases."""

    def __init__(self, config: Eagle3Config, input_size: int):
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

    def project(self, x_BTX: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B, N, T, D], rotated keys and values [B, G, T, D]."""
        b, t, _ = x_BTX.shape
        q_BNTD = self.q_proj(x_BTX).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGTD = self.k_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BGTD = self.v_proj(x_BTX).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q_BNTD, cos_BTD, sin_BTD), apply_rope(k_BGTD, cos_BTD, sin_BTD), v_BGTD

    def output(self, attn_BNTD: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn_BNTD.shape
        return self.o_proj(attn_BNTD.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x_BTH: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x_BTH)) * self.up_proj(x_BTH))


class DecoderLayer(nn.Module):
    """A plain Llama decoder layer (the P-EAGLE layers after the first), split around its attention so
    the training forwards can swap in their own key sets; it reads and returns the pre-norm residual stream."""

    def __init__(self, config: Eagle3Config, input_size: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Eagle3Attention(config, input_size or config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def project(
        self, hidden_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q_BNTD, k_BGTD, v_BGTD, residual_BTH) for one step."""
        return (*self.self_attn.project(self.input_layernorm(hidden_BTH), cos_BTD, sin_BTD), hidden_BTH)

    def finish(self, attn_BNTD: torch.Tensor, residual_BTH: torch.Tensor) -> torch.Tensor:
        """The layer's pre-norm output: attention and MLP added onto the residual."""
        hidden_BTH = self.self_attn.output(attn_BNTD) + residual_BTH
        return hidden_BTH + self.mlp(self.post_attention_layernorm(hidden_BTH))


class Eagle3DecoderLayer(DecoderLayer):
    """Layer 0: attention reads `cat(input_layernorm(embedding), hidden_norm(hidden))`, width 2H."""

    def __init__(self, config: Eagle3Config):
        super().__init__(config, 2 * config.hidden_size)
        self.norm_before_residual = config.norm_before_residual
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def project(
        self, embeds_BTH: Tensor, hidden_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(q_BNTD, k_BGTD, v_BGTD, residual_BTH) for one step."""
        normed_BTH = self.hidden_norm(hidden_BTH)
        residual_BTH = normed_BTH if self.norm_before_residual else hidden_BTH
        # Embedding first, as vLLM concatenates it; the other order loads fine and drafts garbage.
        x_BT2H = torch.cat([self.input_layernorm(embeds_BTH), normed_BTH], dim=-1)
        return (*self.self_attn.project(x_BT2H, cos_BTD, sin_BTD), residual_BTH)

    def forward(self, embeds_BTH: Tensor, hidden_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
        q_BNTD, k_BGTD, v_BGTD, residual_BTH = self.project(embeds_BTH, hidden_BTH, cos_BTD, sin_BTD)
        return self.finish(causal_attention(q_BNTD, k_BGTD, v_BGTD), residual_BTH)


class Eagle3Draft(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.requires_grad_(False)  # the target's, frozen; see load_target_embedding
        if config.norm_before_fc:
            self.input_norm = RMSNorm(config.num_aux * h, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(h, config.rms_norm_eps) for _ in range(config.num_aux)])
        self.fc = nn.Linear(config.num_aux * h, h, bias=False)
        self.layers = nn.ModuleList(
            [Eagle3DecoderLayer(config)] + [DecoderLayer(config) for _ in range(config.num_hidden_layers - 1)]
        )
        if config.parallel_drafting:
            # The mask slots' stand-in for the aux states: vLLM passes it through `combine` once at load.
            # Unit scale like the aux states; `hidden_norm` removes the scale after `fc` anyway.
            self.mask_hidden = nn.Parameter(torch.randn(1, config.num_aux * h))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        # Not persistent: derived from the config, so it never reaches a checkpoint or the export.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def layer(self) -> Eagle3DecoderLayer:
        return self.layers[0]

    @torch.no_grad()
    def load_target_embedding(self, weight_VH: torch.Tensor) -> None:
        if tuple(weight_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight_VH.shape)} does not match the draft's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)"
            )
        self.embed_tokens.weight.copy_(weight_VH)

    def combine_aux(self, aux_BTAH: torch.Tensor) -> torch.Tensor:
        """Step-0 hidden [B, T, H]: `fc` over the aux states concatenated in ascending layer order."""
        return self.combine(aux_BTAH.flatten(-2))

    def combine(self, flat_BX: torch.Tensor) -> torch.Tensor:
        """vLLM's `combine_hidden_states` on [..., A*H]: `input_norm` (norm_before_fc), then one norm per
        aux state (fc_norm), then `fc`. vLLM sends `mask_hidden` through it too."""
        x = flat_BX.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, x.chunk(self.config.num_aux, -1))], -1)
        return self.fc(x)

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids_BT).to(self.fc.weight.dtype)

    def rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions_BT)

    def mask_state(self) -> torch.Tensor:
        """[1, 1, H]: the hidden state every mask slot reads, `combine(mask_hidden)` as vLLM computes it."""
        return self.combine(self.mask_hidden)[None]

    def forward(self, input_ids_BT: Tensor, hidden_BTH: Tensor, positions_BT: Tensor) -> Tensor:
        """One causal pass (vLLM's prefill): the last layer's pre-norm output [B, T, H]."""
        cos_BTD, sin_BTD = self.rope(positions_BT)
        out_BTH = self.layer(self.embed(input_ids_BT), hidden_BTH, cos_BTD, sin_BTD)
        for layer in self.layers[1:]:
            q_BNTD, k_BGTD, v_BGTD, residual_BTH = layer.project(out_BTH, cos_BTD, sin_BTD)
            out_BTH = layer.finish(causal_attention(q_BNTD, k_BGTD, v_BGTD), residual_BTH)
        return out_BTH

    def carry(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """What a chain's next draft step reads as its hidden state: the pre-norm output, or with
        `norm_output` the normed one (vLLM's `aux_output`)."""
        return self.norm(out_BTH) if self.config.norm_output else out_BTH

    def logits(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """[B, T, Vd] draft-vocabulary logits of a pre-norm layer output."""
        return self.lm_head(self.norm(out_BTH))


def exported_state_dict(model: Eagle3Draft) -> dict[str, torch.Tensor]:
    """The weights vLLM loads (flat names, no embedding); `d2t` is the exporter's to add."""
    return {k: v.detach() for k, v in model.state_dict().items() if k not in EXCLUDED_FROM_EXPORT}
