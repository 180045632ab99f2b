"""Write a trained head in the formats vLLM 0.32 loads as they are (DESIGN.md section 5).

Both EAGLE-3 formats share the weights file: flat tensor names (`fc`, `layers.0.*`, `norm`, `lm_head`),
`d2t` only when the draft vocabulary is pruned, no `fc.bias`, no embedding (vLLM shares the target's).
- plain: `architectures: [LlamaForCausalLMEagle3]`, layer ids at the top level AND `num_aux_hidden_states`
  (the Llama head sizes `fc` from the latter), `norm_before_residual` explicit (missing means false).
- speculators: `speculators_model_type: eagle3`, the layer config under `transformer_layer_config`, the
  proposal and verifier under `speculators_config`, and every norm flag explicit (a missing
  `norm_before_residual` means TRUE in this format).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle.vocab import load_vocab_map

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def eagle3_plain_config(head_config: dict, target_config, dtype: str) -> dict:
    """config.json of the plain EAGLE-3 format, sizes from the head and rope settings from the target."""
    c = head_config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "vocab_size": c["vocab_size"],
        "draft_vocab_size": c["draft_vocab_size"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": c["rope_scaling"],
        # Smaller than the target's silently disables drafting on long requests.
        "max_position_embeddings": max(c["max_position_embeddings"], target_config.max_position_embeddings),
        "norm_before_residual": c["norm_before_residual"],
        "eagle_aux_hidden_state_layer_ids": list(c["aux_layer_ids"]),
        "num_aux_hidden_states": len(c["aux_layer_ids"]),
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def eagle3_speculators_config(
    head_config: dict, target_config, dtype: str, target_path: str, num_speculative_tokens: int
) -> dict:
    """config.json of the speculators format."""
    layer = eagle3_plain_config(head_config, target_config, dtype)
    for key in (
        "architectures",
        "draft_vocab_size",
        "norm_before_residual",
        "eagle_aux_hidden_state_layer_ids",
    ):
        layer.pop(key)
    return {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": head_config["draft_vocab_size"],
        "target_hidden_size": target_config.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(head_config["aux_layer_ids"]),
        "norm_before_residual": head_config["norm_before_residual"],
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": target_path,
                "architectures": list(target_config.architectures or []),
            },
        },
        "torch_dtype": dtype,
    }


def export_eagle3(
    head_dir: Path,
    out_dir: Path,
    target_config,
    dtype: str = "bfloat16",
    fmt: str = "speculators",
    target_path: str = "",
    num_speculative_tokens: int = 3,
) -> Path:
    """Write `out_dir` (config.json + model.safetensors) from a `draft_head/` directory, atomically."""
    if fmt not in ("speculators", "plain"):
        raise ValueError(f"format={fmt!r}: choose speculators or plain")
    head_config = json.loads((head_dir / "draft_config.json").read_text())
    if head_config["kind"] != "eagle3":
        raise ValueError(f"{head_dir}: a {head_config['kind']} head, not eagle3")
    c = head_config["config"]
    if c["hidden_size"] != target_config.hidden_size or c["vocab_size"] != target_config.vocab_size:
        raise ValueError(
            f"{head_dir} was trained for hidden_size={c['hidden_size']}, vocab_size={c['vocab_size']}; the "
            f"target has {target_config.hidden_size}, {target_config.vocab_size}"
        )
    weights = {k: v.to(DTYPES[dtype]) for k, v in load_file(str(head_dir / "model.safetensors")).items()}
    weights.pop("fc.bias", None)  # vLLM drops it silently: never ship one
    vocab = load_vocab_map(head_dir / "vocab.safetensors")
    if vocab.d2t is not None:  # only when pruned: vLLM refuses a d2t it does not need
        weights["d2t"] = vocab.d2t.to(torch.int64)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    if fmt == "plain":
        config = eagle3_plain_config(c, target_config, dtype)
    else:
        config = eagle3_speculators_config(c, target_config, dtype, target_path, num_speculative_tokens)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
