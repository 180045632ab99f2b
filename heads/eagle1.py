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

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from heads.attention import KVCache
from heads.config import LlamaLayerConfig
from heads.layers import DecoderLayer, DraftModel


@dataclass(kw_only=True)
class Eagle1Config(LlamaLayerConfig):
    """The Llama layer fields only: the embedding and the lm_head that decodes are the target's."""

    SAME_AS_TARGET = ("hidden_size", "vocab_size")


class Eagle1Draft(DraftModel):
    features = "final"  # what it reads of the target: its final (post-norm) hidden state

    def __init__(self, config: Eagle1Config):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)  # vLLM builds it without a bias and drops a saved one
        # No `input_layernorm` at all: an exported weight for it would be a vLLM load error.
        self.layers = nn.ModuleList([DecoderLayer(config, input_layernorm=False)])
        # The target's lm_head decodes the predicted features; set by `load_target_lm_head` (not trained,
        # not saved: the training loss holds its own reference).
        self.register_buffer("target_lm_head", None, persistent=False)

    @property
    def target_layer_ids(self) -> list[int]:
        """No aux layers: the head reads the target's final state."""
        return []

    @torch.no_grad()
    def load_target_lm_head(self, weight_VH: Tensor) -> None:
        self.target_lm_head = weight_VH.detach()

    def target_hidden(self, final_BTH: Tensor) -> Tensor:
        """What `forward` reads at positions the target has verified: the target's final features."""
        return final_BTH

    def forward(
        self,
        input_ids_BT: Tensor,
        features_BTH: Tensor,
        positions_BT: Tensor,
        cache: KVCache | None = None,
        anchors_BM: Tensor | None = None,
    ) -> Tensor:
        """Predicted next features [B, T, H]: `input_ids_BT[t]` is the token AFTER the one `features_BTH[t]`
        came from (x_{t+1} beside f_t); the output at t estimates f_{t+1}. Without a cache one causal pass,
        as vLLM's prefill; positions are those of the features (t), as vLLM passes them."""
        features_BTH = features_BTH.to(self.fc.weight.dtype)
        # Embedding first, as vLLM concatenates it; the other order loads fine and drafts garbage.
        x_BTH = self.fc(torch.cat([self.embed(input_ids_BT), features_BTH], dim=-1))
        return self.run_layers((x_BTH,), positions_BT, cache, anchors_BM)

    def carry(self, out_BTH: Tensor) -> Tensor:
        """What a chain's next draft step reads: the predicted features themselves."""
        return out_BTH

    def logits(self, out_BTH: Tensor) -> Tensor:
        """[B, T, V] target-vocabulary logits of predicted features, through the target's lm_head."""
        if self.target_lm_head is None:
            raise ValueError("an EAGLE-1 head decodes with the target's lm_head: load_target_lm_head first")
        return out_BTH.to(self.target_lm_head.dtype) @ self.target_lm_head.T
