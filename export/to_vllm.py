"""Write a trained head in the formats vLLM 0.32 loads as they are (docs/design.md#what-vllm-loads).

Both EAGLE-3 formats share the weights file: flat tensor names (`fc`, `layers.0.*`, `norm`, `lm_head`),
`d2t` only when the draft vocabulary is pruned, no `fc.bias`, no embedding (vLLM shares the target's).
- plain: `architectures: [LlamaForCausalLMEagle3]`, layer ids at the top level AND `num_aux_hidden_states`
  (the Llama head sizes `fc` from the latter), the norm flags explicit at the top level (missing = false).
- speculators: `speculators_model_type: eagle3`, the layer config under `transformer_layer_config`, the
  proposal and verifier under `speculators_config`, and every norm flag explicit (a missing
  `norm_before_residual` means TRUE in this format). The norm flags are written at the top level AND in
  `transformer_layer_config`: vLLM's `eagle3` reader takes all four from the top level, its `peagle` reader
  only `norm_before_residual` and `norm_before_fc`, leaving `fc_norm` and `norm_output` to the layer config
  (`vllm/transformers_utils/configs/speculators/algos.py`); a flag in the wrong place loads and is ignored.
  The norms' weights: `input_norm.weight` [A*H] (norm_before_fc), `fc_norm.{i}.weight` [H] (fc_norm).
  The file is also what speculators 0.9 (vLLM's own trainer) loads with `SpeculatorModel.from_pretrained`:
  beside `d2t` it holds `t2d` (bool [V], V_d entries set), which speculators needs and vLLM skips, and the
  verifier is the target as users name it (`verifier_name`): speculators loads the target's embedding and
  layer count from it, and `vllm serve EXPORT` serves it as the target.
P-EAGLE (parallel drafting, docs/design.md#p-eagle) is an EAGLE-3 export plus `mask_hidden` and the mask
token: plain = the EAGLE-3 plain config with `mask_token_id` (served with `parallel_drafting: true` in the
speculative config) and `mask_hidden` [1, A*H]; speculators = `speculators_model_type: peagle` with
`mask_token_id`, which vLLM maps to `PeagleLlamaForCausalLM` with parallel drafting on, and `mask_hidden`
[1, 1, A*H], the shape speculators' model holds (vLLM reads either as `.view(1, -1)`). Both may hold several
decoder layers; vLLM builds a `hidden_norm` in every layer and loads each, so layers after the first ship an
unused all-ones one (speculators reports it unexpected, and loads).
DFlash (block drafting, docs/dflash.md) in both formats. plain, the one z-lab released:
`architectures: [DFlashDraftModel]`, a Qwen3 layer config (`model_type: qwen3`, `head_dim`, no attention
biases, RoPE theta written out: vLLM's DFlash layer defaults it to 1e6 when absent), `draft_vocab_size`,
`target_hidden_size`, and `dflash_config` with `target_layer_ids` (0-based layer outputs: our vLLM aux ids
- 1; vLLM has no default for them), `mask_token_id`, `causal` and, for readers, `block_size`. Weights: `fc`,
`hidden_norm`, `layers.{i}.*` with `self_attn.q_norm`/`k_norm`, `norm`, `lm_head`, `d2t` when pruned; no
embedding (the target's) and no `mask_hidden` (vLLM asserts on one). speculators: `speculators_model_type:
dflash`, the Qwen3 layer under `transformer_layer_config`, `aux_hidden_state_layer_ids` (our aux ids: vLLM
derives target_layer_ids = id - 1), `mask_token_id`, `block_size`, `target_hidden_size`,
`sliding_window_non_causal: true` (vLLM reads it as `causal = not it` for EVERY layer: false would serve a
bidirectional head causally; speculators has no causal full attention, so a causal head is plain-only), no
top-level `model_type` (vLLM then reads it as a Qwen3 model, not the speculators format), `t2d` beside `d2t`.
EAGLE-1 is a plain one-layer Llama config (`architectures: [LlamaForCausalLM]`; vLLM's `method: eagle` maps
it to its EAGLE Llama) with `fc` and `layers.0.*` minus `input_layernorm`, and no `norm` or `lm_head`: any
of the three is a load error. SGLang's formats are decided in export/to_sglang.py.

`read_export` loads an export back into the project's head classes (the round trip the tests check).

    python export/main.py run_dir=runs/default             # the Hydra stage; this module is its library
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from artifacts import atomic
from artifacts.config import sglang_refusal
from artifacts.vocab import load_vocab_map
from export.read_vllm import TRAINED_KS, TRAINED_TEMPERATURES, TRAINED_TEMPLATE_KWARGS
from export.record import RECORD
from export.to_sglang import (
    SGLANG_DIR,
    check_sglang_layers,
    eagle1_sglang_files,
    for_sglang,
    sglang_config_fields,
)
from heads.eagle3 import NORM_FLAGS
from heads.head_file import HeadRecord, read_head
from heads.kinds import head_kind
from target.model import DTYPES, layer_output_ids


def llama_layer_config(head_config: dict, target_config, dtype: str) -> dict:
    """The one-layer Llama config both formats build on: sizes from the head, RoPE/eps from the target."""
    c = head_config
    return {
        "model_type": "llama",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": c.get("num_hidden_layers", 1),
        "hidden_act": "silu",
        "vocab_size": c["vocab_size"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": c["rope_scaling"],
        # Smaller than the target's silently disables drafting on long requests.
        "max_position_embeddings": max(c["max_position_embeddings"], target_config.max_position_embeddings),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    } | sliding_window_fields(c)


def sliding_window_fields(head_config: dict) -> dict:
    """A windowed head's attention as vLLM 0.32 reads it for an EAGLE-3 draft layer (its `layer_types`, one
    entry per draft layer, indexed from the draft's first; and `sliding_window`); nothing without one."""
    window = head_config.get("sliding_window")
    if window is None:
        return {}
    return {
        "layer_types": ["sliding_attention"] * head_config.get("num_hidden_layers", 1),
        "sliding_window": window,
    }


def norm_flags(head_config: dict) -> dict:
    """The four flags, explicit; a head trained before a flag existed lacks it, which means off."""
    return {flag: bool(head_config.get(flag, False)) for flag in NORM_FLAGS}


def eagle3_plain_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of the plain EAGLE-3 format."""
    c = head_config
    parallel = {"mask_token_id": c["mask_token_id"]} if c.get("mask_token_id") is not None else {}
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **llama_layer_config(c, target_config, dtype),
        "draft_vocab_size": c["draft_vocab_size"],
        **norm_flags(c),
        "eagle_aux_hidden_state_layer_ids": list(c["aux_layer_ids"]),
        "num_aux_hidden_states": len(c["aux_layer_ids"]),
        **parallel,
    }


def dflash_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of a DFlash head: vLLM's `DFlashDraftModel` on a Qwen3 layer config."""
    c = head_config
    rope = {**(c["rope_scaling"] or {"rope_type": "default"}), "rope_theta": c["rope_theta"]}
    layer = llama_layer_config(c, target_config, dtype)
    del layer["rope_scaling"]  # transformers 5's Qwen3 config reads RoPE from rope_parameters
    return {
        "architectures": ["DFlashDraftModel"],
        **layer,
        "model_type": "qwen3",
        "attention_bias": False,
        "rope_parameters": rope,
        "draft_vocab_size": c["draft_vocab_size"],
        "target_hidden_size": target_config.hidden_size,
        "block_size": c["block_size"],
        "min_block_size": c["min_block_size"],  # the shortest block trained (vLLM ignores it)
        "dflash_config": {
            "target_layer_ids": layer_output_ids(c["aux_layer_ids"]),
            "mask_token_id": c["mask_token_id"],
            "causal": c["causal"],
            "block_size": c["block_size"],
        },
    }


def dflash_speculators_config(
    head_config: dict, target_config, dtype: str, target_path: str, num_speculative_tokens: int
) -> dict:
    """config.json of a DFlash head in the speculators format (speculators 0.9 `DFlashSpeculator`)."""
    c = head_config
    if c["causal"]:
        raise ValueError(
            "format=speculators: the speculators format has no causal DFlash (its full-attention layers are "
            "always bidirectional); export a head trained with head.causal=true with export.format=plain"
        )
    layer = dflash_config(c, target_config, dtype)  # minus what the speculators format holds at its top
    for key in (
        "architectures",
        "draft_vocab_size",
        "target_hidden_size",
        "block_size",
        "min_block_size",
        "dflash_config",
    ):
        del layer[key]
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": c["draft_vocab_size"],
        "target_hidden_size": target_config.hidden_size,
        "block_size": c["block_size"],
        "min_block_size": c["min_block_size"],  # the shortest block trained (vLLM ignores it)
        "aux_hidden_state_layer_ids": list(c["aux_layer_ids"]),
        "mask_token_id": c["mask_token_id"],
        "sliding_window_non_causal": True,
        "sample_from_anchor": False,
        "speculators_config": speculators_section(
            "dflash", target_config, target_path, num_speculative_tokens
        ),
        "torch_dtype": dtype,
    }


def eagle1_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of an EAGLE-1 head: a plain one-layer Llama."""
    return {"architectures": ["LlamaForCausalLM"], **llama_layer_config(head_config, target_config, dtype)}


def verifier_name(target_path: str) -> str | None:
    """The target as the speculators config names it (`speculators_config.verifier.name_or_path`): a hub id
    as it is, a local directory made absolute, None when no target is named.

    speculators 0.9 loads the target's layer count, embedding and lm_head from it, and `vllm serve EXPORT`
    serves it as the target, so it must be what users load the target by: a hub id works anywhere, a
    directory only where it exists (the embedded SmolLM2 is such a directory: converted from a GGUF, its
    weights are not the hub's HuggingFaceTB/SmolLM2-135M-Instruct, so the hub id would name another target).
    A local directory is told from a hub id as `target.model.target_dir` tells them.
    """
    if not target_path:
        return None
    path = Path(target_path).expanduser()
    return str(path.resolve()) if path.is_dir() else target_path


def eagle3_speculators_config(
    head_config: dict, target_config, dtype: str, target_path: str, num_speculative_tokens: int
) -> dict:
    """config.json of the speculators format (`peagle` for a head with a mask token); `target_path`: the
    target as configured (`target.path`), written as `verifier_name` gives it."""
    layer = {
        **llama_layer_config(head_config, target_config, dtype),
        "num_aux_hidden_states": len(head_config["aux_layer_ids"]),
        **norm_flags(head_config),
    }
    algorithm = "eagle3" if head_config.get("mask_token_id") is None else "peagle"
    parallel = {} if algorithm == "eagle3" else {"mask_token_id": head_config["mask_token_id"]}
    return {
        "speculators_model_type": algorithm,
        "architectures": ["Eagle3Speculator" if algorithm == "eagle3" else "PEagleSpeculator"],
        **parallel,
        "transformer_layer_config": layer,
        "draft_vocab_size": head_config["draft_vocab_size"],
        "target_hidden_size": target_config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head_config["aux_layer_ids"]),
        **norm_flags(head_config),
        "speculators_config": speculators_section(
            algorithm, target_config, target_path, num_speculative_tokens
        ),
        "torch_dtype": dtype,
    }


def speculators_section(algorithm: str, target_config, target_path: str, num_speculative_tokens: int) -> dict:
    """`speculators_config`: the algorithm, greedy proposals of k tokens (vLLM serves that k when the export
    is given as the model) and the verifier (`verifier_name`)."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
        "default_proposal_method": "greedy",
        "verifier": {
            "name_or_path": verifier_name(target_path),
            "architectures": list(target_config.architectures or []),
        },
    }


def speculative_config(kind: str, model: str, num_speculative_tokens: int) -> dict:
    """vLLM's `--speculative-config` for an export of `kind`: P-EAGLE is method eagle3 with parallel drafting
    (explicit, so the plain format serves it too; the speculators `peagle` format turns it on by itself)."""
    head = head_kind(kind)
    config = {"method": head.vllm_method, "model": model, "num_speculative_tokens": num_speculative_tokens}
    return config | ({"parallel_drafting": True} if head.drafting == "parallel" else {})


def export_format(kind: str, requested: str) -> str:
    """The config.json format a `kind` head is written in: `requested` (export.format), or the kind's only
    format when it has one (EAGLE-1: plain); a format the kind lacks is a ValueError."""
    formats = head_kind(kind).export_formats
    fmt = formats[0] if len(formats) == 1 else requested
    if fmt not in formats:
        raise ValueError(f"format={fmt!r}: an {kind} head exports to {' or '.join(formats)}")
    return fmt


def export_head(
    head_dir: Path,
    out_dir: Path,
    target_config,
    dtype: str = "bfloat16",
    fmt: str = "speculators",
    target_path: str = "",
    num_speculative_tokens: int = 3,
    head: tuple[HeadRecord, dict] | None = None,
    allow_unverified_head: bool = False,
    engine: str = "vllm",
) -> Path:
    """Write `out_dir` (config.json + model.safetensors) from a `draft_head/` directory, atomically.

    EAGLE-3, P-EAGLE and DFlash heads go to `fmt` (speculators or plain); EAGLE-1 heads have one, plain.
    `head`: the directory's (record, weights) as `read_head` returned them, when the caller has read them.
    `allow_unverified_head`: export a head whose record holds no checksums (export.allow_unverified_head).
    `engine`: vllm, or sglang / both - an EAGLE-3 plain export SGLang loads too, an EAGLE-1 export with
    SGLang's directory inside (export/to_sglang.py).
    """
    # Checksums, finite and sane weights: a corrupt head is refused here, whoever exports it.
    record, head_weights = head or read_head(head_dir, allow_unverified=allow_unverified_head)
    kind, c = record.kind, record.config.to_dict()
    fmt = export_format(kind, fmt)
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    check_head_fits_target(head_dir, c, target_config)
    if for_sglang(engine):
        refusal = sglang_refusal(kind, fmt, c.get("norm_before_residual", False))
        if refusal is not None:
            setting, value, needed = refusal
            raise ValueError(f"{setting}={value!r}: {needed}")
        check_sglang_layers(c.get("aux_layer_ids", []), target_config.num_hidden_layers)
    weights, sglang = {k: v.to(DTYPES[dtype]) for k, v in head_weights.items()}, None
    weights.pop("fc.bias", None)  # vLLM drops it silently: never ship one
    for i in range(1, c.get("num_hidden_layers", 1) if kind != "dflash" else 1):
        # vLLM's EAGLE-3 loads a (here unused) hidden_norm per layer
        weights[f"layers.{i}.hidden_norm.weight"] = torch.ones(c["hidden_size"], dtype=DTYPES[dtype])
    if "draft_vocab_size" in c:  # EAGLE-3, P-EAGLE, DFlash: their own lm_head over the draft vocabulary
        vocab = load_vocab_map(head_dir / "vocab.safetensors")
        if vocab.d2t is not None:  # only when pruned: vLLM refuses a d2t it does not need
            weights["d2t"] = vocab.d2t.to(torch.int64)
        if fmt == "plain":
            plain = dflash_config if kind == "dflash" else eagle3_plain_config
            config = plain(c, target_config, dtype)
            if for_sglang(engine):
                config |= sglang_config_fields(c)
        else:
            speculators = dflash_speculators_config if kind == "dflash" else eagle3_speculators_config
            config = speculators(c, target_config, dtype, target_path, num_speculative_tokens)
            if vocab.d2t is not None:  # speculators loads the pair or neither; vLLM skips t2d
                weights["t2d"] = vocab.t2d.to(torch.bool)
            if "mask_hidden" in weights:  # speculators' PEagleDraftModel holds [1, 1, A*H]
                weights["mask_hidden"] = weights["mask_hidden"].reshape(1, 1, -1)
    else:
        config = eagle1_config(c, target_config, dtype)
        if for_sglang(engine):
            sglang = eagle1_sglang_files(config, weights)
    if record.trained_ks is not None:  # for eval and readers; vLLM and speculators ignore the key
        config[TRAINED_KS] = record.trained_ks
    if record.trained_temperatures is not None:  # the same, for the temperature served
        config[TRAINED_TEMPERATURES] = record.trained_temperatures
    if record.trained_chat_template_kwargs is not None:  # and for the thinking mode served
        config[TRAINED_TEMPLATE_KWARGS] = record.trained_chat_template_kwargs
    # The old export stays whole until this one replaces it; only an export is ever replaced.
    with atomic.publish_dir(out_dir, kind="export", legacy=(RECORD,)) as tmp:
        write_engine_files(tmp, config, weights)
        if sglang is not None:  # EAGLE-1 for SGLang: a directory of its own (export/to_sglang.py)
            write_engine_files(tmp / SGLANG_DIR, *sglang)
    return out_dir


def write_engine_files(directory: Path, config: dict, weights: dict[str, torch.Tensor]) -> None:
    """config.json and model.safetensors, what an engine reads, into `directory` (created)."""
    directory.mkdir(exist_ok=True)
    atomic.save_tensors({k: v.contiguous() for k, v in weights.items()}, directory / "model.safetensors")
    atomic.write_text(directory / "config.json", json.dumps(config, indent=2) + "\n")  # an error names it


def check_head_fits_target(head_dir: Path, head_config: dict, target_config) -> None:
    """Refuse a head trained for another target: vLLM would fail on a shape, or worse, load it."""
    wanted = {
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "head_dim": getattr(target_config, "head_dim", None)
        or target_config.hidden_size // target_config.num_attention_heads,
    }
    wrong = [f"{k}={head_config[k]} (target: {v})" for k, v in wanted.items() if head_config[k] != v]
    too_deep = [i for i in head_config.get("aux_layer_ids", []) if i > target_config.num_hidden_layers]
    if too_deep:
        wrong.append(f"aux_layer_ids {too_deep} (target has {target_config.num_hidden_layers} layers)")
    if wrong:
        raise ValueError(f"{head_dir} was trained for another target: " + ", ".join(wrong))
