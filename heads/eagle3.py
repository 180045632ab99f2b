"""The EAGLE-3 draft head for Llama-family targets, with the parameter names vLLM loads.

One Llama decoder layer whose attention reads `cat(input_layernorm(embed(x)), hidden_norm(h))` (width 2H,
embedding first), fed at step 0 by `fc` over the target's concatenated aux hidden states and afterwards by
its own pre-norm output; `norm` + `lm_head` decode into the draft vocabulary. Parameter names equal vLLM's
(`llama_eagle3.py`), so export is a plain state_dict copy minus the frozen target embedding. speculators'
normalisation flags (`norm_before_fc`, `fc_norm`, `norm_output`, `norm_before_residual`) are config fields
with vLLM's meaning and weight names.

P-EAGLE (parallel drafting, docs/design.md#p-eagle) is this head with `mask_token_id` set: it adds a learned
`mask_hidden` (the fc input width; vLLM passes it through the fc norms and `fc` like the aux states) that
feeds the K-1 mask slots of a round, and may stack several decoder layers (layer 0 reads the 2H
concatenation, later ones are plain H-wide Llama layers, as in vLLM's `llama_eagle3.py`).

`forward` is one drafting step over T positions: a plain causal pass (what vLLM runs on a prefill), or,
with a `heads.attention.KVCache`, a step of the reference decoder's chain or of training-time test
(`train/losses/chain.py` calls it once per TTT step, `train/losses/parallel.py` once per parallel depth). Use:

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

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from heads.attention import KVCache
from heads.config import AuxHeadConfig
from heads.layers import DecoderLayer, DraftModel, RMSNorm

# speculators' normalisation flags, as vLLM 0.32 names and reads them (config fields below).
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass(kw_only=True)
class Eagle3Config(AuxHeadConfig):
    """EAGLE-3's fields beyond `AuxHeadConfig`'s; layer 0 reads cat(embedding, hidden), later ones are H
    wide; `mask_token_id` set makes it P-EAGLE (None: sequential EAGLE-3)."""

    # speculators' normalisation flags, each one vLLM 0.32 reads (docs/design.md#data-scale):
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of raw h
    norm_before_fc: bool = (
        False  # one RMSNorm (`input_norm`, A*H wide) on the concatenated aux states before fc
    )
    fc_norm: bool = False  # one RMSNorm per aux state (`fc_norm.i`, H wide) before fc
    norm_output: bool = False  # a chain's next step reads norm(out) (post-norm) instead of the pre-norm out

    @property
    def parallel_drafting(self) -> bool:
        return self.mask_token_id is not None


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


class Eagle3Draft(DraftModel):
    features = "aux"  # what it reads of the target: its aux layers (`target_layer_ids`)

    def __init__(self, config: Eagle3Config):
        super().__init__(config)
        h = config.hidden_size
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

    @property
    def parallel(self) -> bool:
        return self.config.parallel_drafting

    @property
    def target_layer_ids(self) -> list[int]:
        """The target layers it reads (vLLM ids)."""
        return list(self.config.aux_layer_ids)

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

    def mask_state(self) -> torch.Tensor:
        """[1, 1, H]: the hidden state every mask slot reads, `combine(mask_hidden)` as vLLM computes it."""
        return self.combine(self.mask_hidden)[None]

    def target_hidden(self, aux_BTAH: Tensor) -> Tensor:
        """The hidden state `forward` reads at positions the target has verified: `fc` over its aux states."""
        return self.combine_aux(aux_BTAH)

    def forward(
        self,
        input_ids_BT: Tensor,
        hidden_BTH: Tensor,
        positions_BT: Tensor,
        cache: KVCache | None = None,
        anchors_BM: Tensor | None = None,
        outputs_BM: Tensor | None = None,
    ) -> Tensor:
        """One drafting step over T positions: the last layer's pre-norm output [B, T, H] (or [B, M, H] at
        the rows `outputs_BM` only: training, where only some rows have a loss; keys at every row).

        Position t reads the embedding of `input_ids_BT[t]` beside `hidden_BTH[t]` at RoPE position
        `positions_BT[t]`. Without a cache, one causal pass (vLLM's prefill); with one, the keys it holds
        (heads/attention.py: decoding, or training-time test's steps at `anchors_BM`) are seen too.
        """
        inputs = (self.embed(input_ids_BT), hidden_BTH)
        return self.run_layers(inputs, positions_BT, cache, anchors_BM, outputs_BM)

    def carry(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """What a chain's next draft step reads as its hidden state: the pre-norm output, or with
        `norm_output` the normed one (vLLM's `aux_output`)."""
        return self.norm(out_BTH) if self.config.norm_output else out_BTH

    def logits(self, out_BTH: torch.Tensor) -> torch.Tensor:
        """[B, T, Vd] draft-vocabulary logits of a pre-norm layer output."""
        return self.lm_head(self.norm(out_BTH))
