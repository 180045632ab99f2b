"""An export read back as vLLM 0.32 reads it: the kind and head fields from its config.json in any of the
three formats (`read_export_config`), the norm flags vLLM's readers serve (`served_norm_flags`), the k the
head was trained to draft (`export_trained_ks`), its weights, and the draft rebuilt from them alone
(`read_export`). Export's verification compares this with the trained head; eval and the watch read exports
through it. Written by export/to_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from heads.eagle3 import NORM_FLAGS
from heads.kinds import head_kind, load_weights

LAYER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "max_position_embeddings",
)


# config.json's key for the k the head was trained to draft (written by export_head, read by eval).
TRAINED_KS = "trained_num_speculative_tokens"


# config.json's key for the temperatures the head's training answers were generated at (HeadRecord
# trained_temperatures; absent: the dataset's own answers, or an export written elsewhere).
TRAINED_TEMPERATURES = "trained_temperatures"


def export_trained_temperatures(export_dir: Path) -> list[float] | None:
    """The temperatures an export's head was trained for (its TRAINED_TEMPERATURES); None: not said."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    return config.get(TRAINED_TEMPERATURES)


def temperature_note(name: str, trained: list[float] | None, served: list[float]) -> str | None:
    """What eval and the watch say when a head is served at temperatures its training answers were not
    generated at (None: it was, or its export does not say). A head trained on greedy answers has never
    seen the target's sampled text as context, and one trained on samples dilutes the greedy answer."""
    other = [t for t in served if trained is not None and not any(abs(t - x) < 1e-6 for x in trained)]
    if not other:
        return None
    return (
        f"head {name}: served at temperature {', '.join(f'{t:g}' for t in other)}; its training answers were "
        f"generated at {', '.join(f'{t:g}' for t in trained)} (retrain with regen.temperature for that traffic: "
        "docs/recipe.md#temperature)"
    )


# config.json's key for the chat-template kwargs the head's training answers were rendered with (HeadRecord
# trained_chat_template_kwargs: its thinking mode; absent: not recorded).
TRAINED_TEMPLATE_KWARGS = "trained_chat_template_kwargs"
# What serving a head in another thinking mode than it was trained in cost, measured (docs/recipe.md#agents).
THINKING_MISMATCH_COST = (
    "a DFlash head trained on thinking answers accepted 9.49 tokens a round served with thinking and 2.71-3.86 "
    "without, slower than no speculation (z-lab/dflash#60)"
)


def export_trained_template_kwargs(export_dir: Path) -> dict | None:
    """The chat-template kwargs an export's head was trained with (its TRAINED_TEMPLATE_KWARGS); None: not
    said."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    return config.get(TRAINED_TEMPLATE_KWARGS)


def thinking_note(name: str, trained: dict | None, served: dict) -> str | None:
    """What eval and the watch say when a head is served with other chat-template kwargs (thinking on or
    off, a reasoning effort) than its training answers were rendered with (None: the same, or not said)."""
    if trained is None or dict(trained) == dict(served):
        return None
    return (
        f"head {name}: served with chat_template_kwargs {dict(served)}, trained on answers rendered with "
        f"{dict(trained)}: a thinking-mode mismatch ({THINKING_MISMATCH_COST}); retrain with "
        "render.chat_template_kwargs as served (docs/recipe.md#agents)"
    )


def export_trained_ks(export_dir: Path) -> list[int] | None:
    """The k an export's head was trained to draft (its TRAINED_KS); None where the export does not say
    (written before this key, by another trainer, or a chain head)."""
    config = json.loads((Path(export_dir) / "config.json").read_text())
    return config.get(TRAINED_KS)


def read_export_config(export_dir: Path) -> tuple[str, dict]:
    """(kind, head config fields) from an export's config.json, in any of the three formats."""
    path = Path(export_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"{export_dir} is not an export: no config.json (run export/main.py)")
    config = json.loads(path.read_text())
    layer = config.get("transformer_layer_config", config)  # speculators nests the layer
    fields = {k: layer[k] for k in LAYER_FIELDS if k in layer}
    if "dflash_config" in config or config.get("speculators_model_type") == "dflash":
        return "dflash", fields | dflash_fields(config, layer)
    if "eagle_aux_hidden_state_layer_ids" not in config:
        return "eagle1", fields
    fields |= {
        "draft_vocab_size": config["draft_vocab_size"],
        "aux_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
        "num_hidden_layers": layer.get("num_hidden_layers", 1),
        **served_norm_flags(config),
        "sliding_window": served_window(layer),
    }
    if config.get("mask_token_id") is None:
        return "eagle3", fields
    return "peagle", {**fields, "mask_token_id": config["mask_token_id"]}


def dflash_fields(config: dict, layer: dict) -> dict:
    """A DFlash config.json's head fields beyond the layer sizes, as vLLM 0.32 serves either format."""
    rope = dict(layer["rope_parameters"])
    fields = {
        "rope_theta": rope.pop("rope_theta"),
        "rope_scaling": None if rope.get("rope_type") == "default" else rope,
        "draft_vocab_size": config["draft_vocab_size"],
        "num_hidden_layers": layer["num_hidden_layers"],
        "mask_token_id": config.get("mask_token_id"),
        "block_size": config["block_size"],
        "min_block_size": config.get("min_block_size"),  # absent: written before it, or by another trainer
    }
    if "speculators_model_type" in config:  # vLLM: target_layer_ids = id - 1, causal = not the flag
        ids, causal = config["aux_hidden_state_layer_ids"], not config.get("sliding_window_non_causal", True)
    else:
        dflash = config["dflash_config"]
        ids, causal = [i + 1 for i in dflash["target_layer_ids"]], dflash.get("causal", False)
        fields["mask_token_id"] = dflash.get("mask_token_id", fields["mask_token_id"])
    return fields | {"aux_layer_ids": ids, "causal": causal}


def served_window(layer: dict) -> int | None:
    """The sliding window vLLM 0.32 serves an EAGLE-3 draft layer with: `sliding_window` where its
    `layer_types` entry says `sliding_attention` (one window for every layer, as this project writes it)."""
    types = layer.get("layer_types") or []
    if "sliding_attention" not in types:
        return None
    if set(types) != {"sliding_attention"}:
        raise ValueError(f"layer_types={types}: a draft mixing windowed and full layers is not read here")
    return layer["sliding_window"]


def served_norm_flags(config: dict) -> dict:
    """The norm flags vLLM 0.32 serves an EAGLE-3 / P-EAGLE config.json with (its readers, emulated)."""
    algorithm = config.get("speculators_model_type")
    if algorithm is None:  # plain: read off the config's attributes; norm_before_fc may sit in eagle_config
        flags = {flag: config.get(flag, False) for flag in NORM_FLAGS}
        flags["norm_before_fc"] = (config.get("eagle_config") or {}).get(
            "norm_before_fc", flags["norm_before_fc"]
        )
    else:  # speculators: the layer config, overridden by what the algorithm's reader copies from the top
        layer = config.get("transformer_layer_config", {})
        flags = {flag: layer.get(flag, False) for flag in NORM_FLAGS}
        flags["norm_before_residual"] = config.get("norm_before_residual", algorithm == "eagle3")
        flags["norm_before_fc"] = config.get("norm_before_fc", False)
        if algorithm == "eagle3":
            flags |= {flag: config.get(flag, False) for flag in ("fc_norm", "norm_output")}
    return {flag: bool(value) for flag, value in flags.items()}


def read_export_weights(export_dir: Path) -> dict[str, torch.Tensor]:
    """An export's model.safetensors as vLLM 0.32's EAGLE-3 loader takes it: `t2d` skipped, `mask_hidden`
    read as [1, A*H] (its `.view(1, -1)`, so the speculators format's [1, 1, A*H] serves the same)."""
    weights = load_file(str(Path(export_dir) / "model.safetensors"))
    weights.pop("t2d", None)
    if "mask_hidden" in weights:
        weights["mask_hidden"] = weights["mask_hidden"].reshape(1, -1)
    return weights


def read_export(export_dir: Path, target_embedding_VH: torch.Tensor):
    """An export loaded back into the project's head class, in fp32: (draft, draft_to_target or None).

    Reads only what vLLM reads (config.json and model.safetensors), so a field the writer drops or
    misnames shows up as a different head here.
    """
    kind, fields = read_export_config(export_dir)
    weights = read_export_weights(export_dir)
    d2t = weights.pop("d2t", None)
    for i in range(1, fields.get("num_hidden_layers", 1)):
        weights.pop(f"layers.{i}.hidden_norm.weight", None)  # vLLM's unused one
    draft = head_kind(kind).build(fields)
    load_weights(draft, {k: v.float() for k, v in weights.items()}, export_dir / "model.safetensors")
    # vLLM serves an embedding the file carries (the target's is shared only when the two are equal: the
    # same values either way); ours never carry one, speculators' do (its P-EAGLE trains it)
    draft.own_embedding = "embed_tokens.weight" in weights
    draft.load_target_embedding(target_embedding_VH.float())
    draft_to_target = None if d2t is None else torch.arange(len(d2t)) + d2t
    return draft.float().eval(), draft_to_target
