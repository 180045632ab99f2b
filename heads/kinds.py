"""The head kinds, each named once: `head.kind` in the config, "kind" in draft_config.json, the export and
the reports all say `eagle3`, `peagle`, `dflash` or `eagle1`. vLLM's own vocabularies (its `method`, the
speculators `speculators_model_type`) are derived here and nowhere else.

    kind = head_kind("peagle")
    draft = kind.build(config_fields)       # an Eagle3Draft with a mask token
    kind.vllm_method, kind.drafting         # "eagle3", "parallel"
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heads.config import LlamaLayerConfig
from heads.dflash import DFlashConfig, DFlashDraft
from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.eagle3 import Eagle3Config, Eagle3Draft
from heads.layers import EXCLUDED_FROM_EXPORT, DraftModel


@dataclass(frozen=True)
class HeadKind:
    name: str  # eagle3 | peagle | dflash | eagle1
    title: str  # how reports and the model card write it
    config_class: type[LlamaLayerConfig]
    model_class: type[DraftModel]
    vllm_method: str  # the `method` of vLLM's speculative config
    # chain (k draft passes per round) | parallel (one pass drafts the round) | block (one pass over the
    # anchor and k mask slots, the target's context as keys: DFlash)
    drafting: str
    export_formats: tuple[str, ...]  # config.json formats vLLM reads for it, the default first
    speculators_type: str | None  # `speculators_model_type` in the speculators format

    def build(self, fields: dict) -> DraftModel:
        """A freshly initialised head from its config fields (draft_config.json's "config")."""
        config = self.config_class.from_dict(fields)
        if self.name == "peagle" and config.mask_token_id is None:
            raise ValueError("a peagle head needs a mask_token_id (its mask slots' token)")
        return self.model_class(config)


KINDS = {
    "eagle3": HeadKind(
        "eagle3", "EAGLE-3", Eagle3Config, Eagle3Draft, "eagle3", "chain", ("speculators", "plain"), "eagle3"
    ),
    "peagle": HeadKind(
        "peagle",
        "P-EAGLE",
        Eagle3Config,
        Eagle3Draft,
        "eagle3",
        "parallel",
        ("speculators", "plain"),
        "peagle",
    ),
    "dflash": HeadKind(
        "dflash", "DFlash", DFlashConfig, DFlashDraft, "dflash", "block", ("speculators", "plain"), "dflash"
    ),
    "eagle1": HeadKind("eagle1", "EAGLE-1", Eagle1Config, Eagle1Draft, "eagle", "chain", ("plain",), None),
}


def head_kind(name: str, where: str = "head.kind") -> HeadKind:
    """The kind called `name`; `where` names the setting or file at fault in the error."""
    if name not in KINDS:
        raise ValueError(f"{where}={name!r}: unknown head kind; choose {', '.join(KINDS)}")
    return KINDS[name]


def load_weights(draft: DraftModel, weights: dict[str, torch.Tensor], where) -> DraftModel:
    """Every weight the head has, none it lacks (the target's embedding aside), or a ValueError naming
    `where` (the file) and the tensors at fault."""
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in EXCLUDED_FROM_EXPORT]
    if missing or unexpected:
        raise ValueError(f"{where}: missing {missing}, unexpected {unexpected}")
    return draft
