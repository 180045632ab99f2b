"""The DFlash draft head (block drafting), with the parameter names vLLM 0.32's `DFlashDraftModel` loads
(`qwen3_dflash.py`; docs/dflash.md).

The target's states at its aux layers, concatenated, go through `fc` and `hidden_norm` once per verified
position: the context. Every decoder layer (Qwen3-style: q/k norms before RoPE) projects that one context
with its own `k_proj`/`v_proj` (+ `k_norm`, RoPE at the context's positions) into keys and values; the
context never passes through the layer stack. A round drafts a block of J = 1 + K tokens in one forward:
the anchor (the last known token: the target's bonus token when served) and K mask slots at the positions
after it, embedded by the target's embedding; the block attends to the context before its anchor and to
itself (all of it, or causally with `causal`); `norm` + `lm_head` decode each slot into the draft
vocabulary, the slot at position a + k predicting the token at a + k. Served with the k it was trained for
(`trained_ks`: a bidirectional block of another length changes every slot's output).

    config = DFlashConfig.from_target_config(target_config, [2, 9, 15, 21, 28], 32000, mask_token_id=2)
    draft = DFlashDraft(config)
    context_BTH = draft.target_hidden(aux_BTAH)                   # fc over the aux states
    out_BMJH = draft(block_ids_BMJ, starts_BM, context_BTH)      # M blocks, block m at starts[m]..
    logits_BMJVd = draft.logits(out_BMJH)

Training (`train/losses/block.py` `block_loss`) calls `forward` once with every block of a batch (random
anchors); the reference decoder calls it once per round with a `heads.attention.KVCache` holding the
context's keys.

Shape legend: B batch, T / S context positions, M blocks, J tokens per block, Q = M*J, A aux layers,
H hidden, N query heads, G key/value heads, D head dim, Vd draft vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from artifacts.config import dflash_trained_ks
from heads.attention import KVCache, block_attention, document_positions
from heads.config import AuxHeadConfig
from heads.layers import DecoderLayer, DraftModel, RMSNorm


@dataclass(kw_only=True)
class DFlashConfig(AuxHeadConfig):
    """DFlash's fields beyond `AuxHeadConfig`'s (whose `mask_token_id` it requires)."""

    block_size: int = (
        8  # tokens per block: the anchor and block_size - 1 mask slots (served k = block_size - 1)
    )
    causal: bool = False  # attention inside a block: bidirectional (DFlash's default) or causal
    # the shortest block trained: blocks were min_block_size..block_size long (None: full blocks only)
    min_block_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mask_token_id is None:
            raise ValueError("a dflash head needs a mask_token_id (its mask slots' token)")
        if self.block_size < 2:
            raise ValueError(
                f"block_size={self.block_size}: a block is the anchor and at least one mask slot"
            )
        if self.min_block_size is not None and not 2 <= self.min_block_size <= self.block_size:
            raise ValueError(
                f"min_block_size={self.min_block_size}: must be in 2..block_size={self.block_size}"
            )

    def trained_ks(self) -> list[int]:
        """The k (mask slots per round) this head drafts as it was trained (`dflash_trained_ks`)."""
        return dflash_trained_ks(self.block_size, self.min_block_size, self.causal)


class DFlashDraft(DraftModel):
    features = "aux"  # what it reads of the target: its aux layers (`target_layer_ids`)
    drafting = "block"  # one forward over [anchor, k mask slots] drafts the round

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(config.num_aux * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, qk_norm=True) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)

    @property
    def target_layer_ids(self) -> list[int]:
        """The target layers it reads (vLLM aux ids: DFlash's `target_layer_ids` + 1)."""
        return list(self.config.aux_layer_ids)

    def target_hidden(self, aux_BTAH: Tensor) -> Tensor:
        """The context rows [B, T, H] of verified positions: `fc` over their aux states in ascending order."""
        return self.fc(aux_BTAH.flatten(-2).to(self.fc.weight.dtype))

    def forward(
        self,
        block_ids_BMJ: Tensor,
        starts_BM: Tensor,
        context_BSH: Tensor,
        cache: KVCache | None = None,
        lengths_BM: Tensor | None = None,
        documents_BS: Tensor | None = None,
    ) -> Tensor:
        """Pre-norm outputs [B, M, J, H] of M blocks; block m holds tokens at positions starts[m] .. + J - 1.
        With `lengths_BM` block m is lengths[m] <= J tokens long, as a block served with k = lengths[m] - 1:
        its tokens see none after that (the outputs there are padding).

        Without a cache the context rows are positions 0..S-1 and block m sees those < starts[m] (training).
        With one (decoding) the rows are the next positions after the cached ones, their keys join the
        cache, and a block starting after all of them sees every cached position.
        """
        b, m, j = block_ids_BMJ.shape
        offset = cache.length if cache is not None else 0
        device = block_ids_BMJ.device
        context_positions_BS = torch.arange(offset, offset + context_BSH.shape[1], device=device).expand(
            b, -1
        )
        block_starts_BM, context_starts_BM = starts_BM, None
        if documents_BS is not None:
            context_positions_BS = document_positions(documents_BS)
            block_starts_BM = context_positions_BS.gather(1, starts_BM)
            context_starts_BM = documents_BS.gather(1, starts_BM)
        context_cos, context_sin = self.rope(context_positions_BS)
        context_BSH = self.hidden_norm(context_BSH.to(self.fc.weight.dtype))
        positions_BQ = (block_starts_BM[..., None] + torch.arange(j, device=device)).reshape(b, m * j)
        cos_BQD, sin_BQD = self.rope(positions_BQ)
        hidden_BQH = self.embed(block_ids_BMJ.reshape(b, m * j))
        kvs = cache.layers if cache is not None else [None] * len(self.layers)
        for layer, kv in zip(self.layers, kvs):
            context_k_BGSD, context_v_BGSD = layer.self_attn.keys_values(
                context_BSH, context_cos, context_sin
            )
            if kv is not None:
                context_k_BGSD, context_v_BGSD = kv.append(context_k_BGSD, context_v_BGSD)
            q_BNQD, k_BGQD, v_BGQD, residual_BQH = layer.project(hidden_BQH, cos_BQD, sin_BQD)
            attn_BNQD = block_attention(
                q_BNQD,
                k_BGQD,
                v_BGQD,
                context_k_BGSD,
                context_v_BGSD,
                starts_BM,
                self.config.causal,
                lengths_BM,
                context_starts_BM,
            )
            hidden_BQH = layer.finish(attn_BNQD, residual_BQH)
        return hidden_BQH.view(b, m, j, -1)

    def logits(self, out_BXH: Tensor) -> Tensor:
        """Draft-vocabulary logits [..., Vd] of pre-norm outputs."""
        return self.lm_head(self.norm(out_BXH))
