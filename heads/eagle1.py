"""The EAGLE-1 draft head for Llama-family targets, with the parameter names vLLM loads.

`fc` maps `cat(embed(x_{t+1}), f_t)` (embedding first, width 2H) to H, where `f_t` is the target's final
hidden state AFTER its final norm; then one Llama decoder layer WITHOUT input_layernorm; no final norm and
no lm_head: the output is a predicted target feature `f_{t+1}`, decoded by the target's own frozen lm_head
and fed back as the next step's feature. Parameter names equal vLLM's (`llama_eagle.py`), so export is a
plain state_dict copy minus the frozen target embedding.

How vLLM runs the layer (`llama_eagle.py`, read for vLLM 0.32): layer 0 is built with
`disable_input_layernorm`, which replaces `input_layernorm` by `nn.Identity()`, so a checkpoint holding
`layers.0.input_layernorm.weight` fails to load. With `residual=None` the Llama layer sets
`residual = fc output`, attends over the un-normed fc output, then the fused
`post_attention_layernorm(h, residual)` adds the attention output onto that residual and normalises it for
the MLP; `LlamaModel.forward` finally adds the MLP output back onto the residual. Hence
`out = x + attn(x) + mlp(post_attention_layernorm(x + attn(x)))` with `x = fc(cat(embed, f))`. Use:

    config = Eagle1Config.from_target_config(AutoConfig.from_pretrained(target))
    draft = Eagle1Draft(config)
    draft.load_target_embedding(target.get_input_embeddings().weight)
    f_pred_BTH = draft(next_ids_BT, final_hidden_BTH, positions_BT)  # next_ids[t] = x_{t+1}
    logits_BTV = f_pred_BTH @ target.lm_head.weight.T

Shape legend:
    B batch, T positions, H hidden size (draft = target), N query heads, G key/value heads, D head dim,
    I MLP width, V target vocab.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from heads.eagle3 import (
    EXCLUDED_FROM_EXPORT,
    RMSNorm,
    SwiGLU,
    apply_rope,
    causal_attention,
    rope_cos_sin,
    rope_inv_freq,
    rope_type,
)


@dataclass
class Eagle1Config:
    hidden_size: int  # draft width; must equal the target's (embedding and lm_head are the target's)
    intermediate_size: int  # SwiGLU MLP width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA when fewer than the query heads)
    head_dim: int  # per-head width
    vocab_size: int  # target vocabulary V (embedding rows; the target's lm_head decodes over all of it)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon, copied from the target
    rope_theta: float = 10000.0  # RoPE base, copied from the target
    rope_scaling: dict | None = None  # RoPE scaling dict (rope_type + its fields), None for plain RoPE
    max_position_embeddings: int = 2048  # longest position; >= the target's or vLLM stops drafting there

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head dim")
        rope_type(self)  # fail at construction, not at the first forward

    @classmethod
    def from_target_config(cls, target_config, **overrides) -> Eagle1Config:
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
            rms_norm_eps=t.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else rope,
            max_position_embeddings=t.max_position_embeddings,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Eagle1Config fields in overrides: {sorted(unknown)}")
        for name in ("hidden_size", "vocab_size"):
            if overrides.get(name, values[name]) != values[name]:
                raise ValueError(
                    f"{name}={overrides[name]}: must equal the target's ({values[name]}); the EAGLE-1 "
                    "head reads the target's embedding and predicts features for the target's lm_head"
                )
        return cls(**{**values, **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Eagle1Config:
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Eagle1Config fields: {sorted(unknown)}")
        return cls(**values)


class Eagle1Attention(nn.Module):
    """Llama attention over the H-wide fc output. No biases (vLLM's Llama layer loads none by default)."""

    def __init__(self, config: Eagle1Config):
        super().__init__()
        h, n, g, d = (
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = n, g, d
        self.q_proj = nn.Linear(h, n * d, bias=False)
        self.k_proj = nn.Linear(h, g * d, bias=False)
        self.v_proj = nn.Linear(h, g * d, bias=False)
        self.o_proj = nn.Linear(n * d, h, bias=False)

    def project(self, x_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated queries [B, N, T, D], rotated keys and values [B, G, T, D]."""
        b, t, _ = x_BTH.shape
        q_BNTD = self.q_proj(x_BTH).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k_BGTD = self.k_proj(x_BTH).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_BGTD = self.v_proj(x_BTH).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(q_BNTD, cos_BTD, sin_BTD), apply_rope(k_BGTD, cos_BTD, sin_BTD), v_BGTD

    def output(self, attn_BNTD: Tensor) -> Tensor:
        b, _, t, _ = attn_BNTD.shape
        return self.o_proj(attn_BNTD.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def forward(self, x_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
        return self.output(causal_attention(*self.project(x_BTH, cos_BTD, sin_BTD)))


class Eagle1DecoderLayer(nn.Module):
    """vLLM's layer 0 of an EAGLE-1 head: a Llama decoder layer whose input_layernorm is the identity."""

    def __init__(self, config: Eagle1Config):
        super().__init__()
        # No `input_layernorm` attribute at all: an exported weight for it would be a vLLM load error.
        self.self_attn = Eagle1Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def finish(self, attn_BNTD: Tensor, residual_BTH: Tensor) -> Tensor:
        """The layer's output: attention and MLP added onto the residual (the raw fc output)."""
        hidden_BTH = self.self_attn.output(attn_BNTD) + residual_BTH
        return hidden_BTH + self.mlp(self.post_attention_layernorm(hidden_BTH))

    def forward(self, x_BTH: Tensor, cos_BTD: Tensor, sin_BTD: Tensor) -> Tensor:
        # The residual is the raw fc output, and attention reads it un-normed too (vLLM's Identity norm).
        return self.finish(causal_attention(*self.self_attn.project(x_BTH, cos_BTD, sin_BTD)), x_BTH)


class Eagle1Draft(nn.Module):
    def __init__(self, config: Eagle1Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.requires_grad_(False)  # the target's, frozen; see load_target_embedding
        self.fc = nn.Linear(2 * h, h, bias=False)  # vLLM builds it without a bias and drops a saved one
        self.layers = nn.ModuleList([Eagle1DecoderLayer(config)])
        # Not persistent: derived from the config, so it never reaches a checkpoint or the export.
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def layer(self) -> Eagle1DecoderLayer:
        return self.layers[0]

    @torch.no_grad()
    def load_target_embedding(self, weight_VH: torch.Tensor) -> None:
        if tuple(weight_VH.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(
                f"target embedding {tuple(weight_VH.shape)} does not match the draft's "
                f"{tuple(self.embed_tokens.weight.shape)} (vocab_size x hidden_size)"
            )
        self.embed_tokens.weight.copy_(weight_VH)

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids_BT).to(self.fc.weight.dtype)

    def rope(self, positions_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions_BT)

    def carry(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """What a chain's next draft step reads: the predicted features themselves."""
        return out_BTH

    def forward(self, input_ids_BT: Tensor, features_BTH: Tensor, positions_BT: Tensor) -> Tensor:
        """Predicted next features [B, T, H]: `input_ids_BT[t]` is the token AFTER the one `features_BTH[t]`
        came from (x_{t+1} beside f_t); the output at t estimates f_{t+1}. One causal pass, as vLLM's
        prefill; positions are those of the features (t), as vLLM passes them."""
        features_BTH = features_BTH.to(self.fc.weight.dtype)
        # Embedding first, as vLLM concatenates it; the other order loads fine and drafts garbage.
        x_BTH = self.fc(torch.cat([self.embed(input_ids_BT), features_BTH], dim=-1))
        cos_BTD, sin_BTD = self.rope(positions_BT)
        return self.layer(x_BTH, cos_BTD, sin_BTD)


def exported_state_dict(model: Eagle1Draft) -> dict[str, torch.Tensor]:
    """The weights vLLM loads (flat names): fc and layers.0.*, no embedding, norm or lm_head."""
    return {k: v.detach() for k, v in model.state_dict().items() if k not in EXCLUDED_FROM_EXPORT}
