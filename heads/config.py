"""The config fields every draft head shares: the Llama decoder layer it copies from its target.

Each head kind's config (`Eagle3Config`, `DFlashConfig`, `Eagle1Config`) extends `LlamaLayerConfig` with its
own fields (the heads that read the target's aux layers through `fc` share `AuxHeadConfig`);
`from_target_config` copies sizes, RoPE and eps from a transformers config, and `to_dict` / `from_dict`
are what the head file (heads/head_file.py) stores under "config".

    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target), aux_layer_ids=[2, 15, 27],
                                             draft_vocab_size=32000)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Rope types whose frequencies do not depend on the sequence length and whose cos/sin are not rescaled:
# transformers and vLLM compute them the same way. Others (dynamic, yarn, longrope) are not verified here.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(kw_only=True)
class LlamaLayerConfig:
    hidden_size: int  # draft width; must equal the target's (the embedding is the target's)
    intermediate_size: int  # SwiGLU MLP width
    num_attention_heads: int  # query heads
    num_key_value_heads: int  # key/value heads (GQA when fewer than the query heads)
    head_dim: int  # per-head width
    vocab_size: int  # target vocabulary V (embedding rows)
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon, copied from the target
    rope_theta: float = 10000.0  # RoPE base, copied from the target
    rope_scaling: dict | None = None  # RoPE scaling dict (rope_type + its fields), None for plain RoPE
    max_position_embeddings: int = 2048  # longest position; >= the target's or vLLM stops drafting there
    # sliding-window attention in every layer: a query sees its own position and the window - 1 before it
    # (vLLM 0.32's per-layer `layer_types` / `sliding_window`); None: full causal attention
    sliding_window: int | None = None

    # Fields that must equal the target's, whatever a caller overrides (each head reads target tensors).
    SAME_AS_TARGET = ("hidden_size",)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim}: RoPE needs an even head dim")
        rope_type(self)  # fail at construction, not at the first forward
        if self.sliding_window is not None and self.sliding_window < 2:
            raise ValueError(f"sliding_window={self.sliding_window}: a window holds at least 2 positions")

    @classmethod
    def from_target_config(cls, target_config, **fields):
        """Sizes, RoPE and eps copied from a HF Llama config (transformers 4 or 5 RoPE fields), plus the
        kind's own `fields`."""
        t = target_config
        heads = t.num_attention_heads
        # transformers 5 keeps theta and scaling together in `rope_parameters`; 4.x had two attributes.
        rope = dict(getattr(t, "rope_parameters", None) or getattr(t, "rope_scaling", None) or {})
        theta = rope.pop("rope_theta", getattr(t, "rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        copied = dict(
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
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields in overrides: {sorted(unknown)}")
        for name in cls.SAME_AS_TARGET:
            if fields.get(name, copied[name]) != copied[name]:
                raise ValueError(
                    f"{name}={fields[name]}: must equal the target's ({copied[name]}); the draft reads the "
                    "target's own embedding" + (" and lm_head" if name == "vocab_size" else "")
                )
        return cls(**{**copied, **fields})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict):
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
        return cls(**values)


def rope_type(config: LlamaLayerConfig) -> str:
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_scaling type {kind!r} is not supported by the draft heads yet (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}); a RoPE that differs from vLLM's silently lowers acceptance"
        )
    return kind


@dataclass(kw_only=True)
class AuxHeadConfig(LlamaLayerConfig):
    """The fields of a head that reads the target's aux layers through `fc` and decodes into its own draft
    vocabulary (EAGLE-3, P-EAGLE, DFlash)."""

    draft_vocab_size: int  # draft vocabulary V_d (lm_head rows); V_d == V means no pruning
    aux_layer_ids: list[int]  # target layers feeding `fc`, vLLM ids, ascending (fc input order)
    num_hidden_layers: int = 1  # decoder layers
    mask_token_id: int | None = None  # the token id of the mask slots (None: no mask slots)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids is empty: the head needs at least one target layer for `fc`")
        if list(self.aux_layer_ids) != sorted(set(self.aux_layer_ids)):
            raise ValueError(
                f"aux_layer_ids={self.aux_layer_ids}: give them ascending without repeats; vLLM sorts and "
                "de-duplicates them, so any other order trains `fc` on a different concatenation"
            )
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

    @classmethod
    def from_target_config(cls, target_config, aux_layer_ids=None, draft_vocab_size=None, **fields):
        """Sizes, RoPE and eps from the target; the draft vocabulary capped at the target's."""
        return super().from_target_config(
            target_config,
            aux_layer_ids=[int(i) for i in aux_layer_ids],
            draft_vocab_size=min(draft_vocab_size, target_config.vocab_size),
            **fields,
        )

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)
