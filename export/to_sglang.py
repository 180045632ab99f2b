"""What SGLang 0.5.23 loads as it is, decided here (docs/sglang.md): `export.engine=sglang|both`.

Read in SGLang's own code (installed by `make setup` into .venv/sglang; paths below relative to its
`sglang/srt/`), and checked by its own loader (export/sglang_check.py, in a subprocess):
- EAGLE-3: the plain format's config and weights are what `LlamaForCausalLMEagle3` reads
  (models/llama_eagle3.py: `fc`, `layers.{i}.*` with q/k/v and gate/up packed on load, `norm`, `lm_head`,
  `d2t` read as target id = draft id + d2t[id] as vLLM does, `t2d` dropped; `draft_vocab_size` must be a key:
  :306), with one addition that leaves vLLM's reading unchanged, so one directory serves both engines:
  - `eagle_config.eagle_aux_hidden_state_layer_ids`: the target side reads the layer ids from there only
    (model_executor/model_runner_components/spec_aux_hidden_state.py:185-196; without it SGLang captures its
    default layers), in SGLang's convention, the layers' outputs (`target.model.layer_output_ids`: vLLM's id
    minus one); vLLM reads the top-level ids first.
- Not served by SGLang, refused by name when the config is composed (artifacts/config/combinations.py
  `sglang_refusal`) and by `export_head`: P-EAGLE (no parallel
  drafting), `head.norm_before_residual=true` (SGLang reads no such flag: its residual is always the fc
  output before `hidden_norm`, llama_eagle3.py:97-102), aux ids 0 or L (SGLang captures layer outputs 0..L-2
  only: an id of L - 1 is never reached, models/llama.py:486-499), DFlash heads as this pipeline trains them
  (SGLang's DFlash drafts with the target's lm_head over the whole vocabulary and has no d2t:
  speculative/dflash_worker_v2.py:136-138), and the speculators format (SGLang reads no `speculators_config`).
- EAGLE-1: SGLang's class is `LlamaForCausalLMEagle` (models/llama_eagle.py), a name vLLM does not know, and
  vLLM's EAGLE-1 config (`LlamaForCausalLM`) loads in SGLang as a plain Llama whose layer weights miss: so
  SGLang gets a directory of its own, `<export>/sglang/` (SGLANG_DIR), beside vLLM's, which verification
  serves. The same tensors and names (SGLang prefixes `model.` to all but `lm_head`, :146-150; layer 0 has no
  `input_layernorm`, :53-55; no final norm), plus a zero `fc.bias`: SGLang's `fc` has a bias (:91) that
  would otherwise stay uninitialised; ours has none. The embedding and lm_head are the target's
  (speculative/eagle_worker_v2.py:371-378), and the target passes its final states after its norm, as
  vLLM's does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from target.model import layer_output_ids

SGLANG_DIR = "sglang"  # an EAGLE-1 export's SGLang directory, inside vLLM's


def for_sglang(engine: str) -> bool:
    return engine in ("sglang", "both")


def check_sglang_layers(aux_layer_ids, num_target_layers: int) -> None:
    """SGLang captures the outputs of decoder layers 0..L-2 only (an id of L - 1 is never reached: its
    capture loop ends with the layers, models/llama.py:486-499): not the embedding, not the last output."""
    unreachable = [i for i in aux_layer_ids if not 1 <= i <= num_target_layers - 1]
    if unreachable:
        raise ValueError(
            f"cache.aux_layer_ids={list(aux_layer_ids)}: SGLang cannot capture {unreachable} "
            f"(export.engine=sglang|both needs ids in 1..{num_target_layers - 1})"
        )


def sglang_config_fields(head_config: dict) -> dict:
    """What the EAGLE-3 plain config gains for SGLang: the aux ids where and as SGLang's target reads them."""
    return {
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": layer_output_ids(head_config["aux_layer_ids"]),
            "use_aux_hidden_state": True,
        }
    }


def eagle1_sglang_files(vllm_config: dict, weights: dict) -> tuple[dict, dict]:
    """(config.json, tensors) of an EAGLE-1 head's SGLang directory, from vLLM's."""
    fc = weights["fc.weight"]
    bias = torch.zeros(fc.shape[0], dtype=fc.dtype)
    return {**vllm_config, "architectures": ["LlamaForCausalLMEagle"]}, {**weights, "fc.bias": bias}


def sglang_export(export_dir: Path, export_config: dict) -> tuple[Path, str] | None:
    """(the directory SGLang serves, its --speculative-algorithm) for an export, or None where the export
    was written for vLLM only."""
    if (Path(export_dir) / SGLANG_DIR / "config.json").exists():
        return Path(export_dir) / SGLANG_DIR, "EAGLE"
    if "eagle_config" in export_config:
        return Path(export_dir), "EAGLE3"
    return None


def sglang_serve_command(
    target: str, export_dir: str, algorithm: str, num_steps: int, topk: int, num_draft_tokens: int
) -> str:
    """SGLang's server with this head and EAGLE-2 tree settings."""
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {export_dir} --speculative-num-steps {num_steps} "
        f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {num_draft_tokens}"
    )
