"""SGLang's own loader on our exports: SGLang 0.5.23 (`make setup` installs it into .venv/sglang, apart from
vLLM's packages) builds each export's draft model on the CPU with its `ModelConfig` + `get_model` and loads
the weights, as its server does; this reports, per export, where every tensor landed against the export's
file, the hot-token map, and the target layers SGLang will capture. Run it in a subprocess
(`check_with_sglang`), never in a process that goes on: importing sglang patches transformers, sets cache
variables and holds a process group.

    python export/sglang_check.py EXPORT [EXPORT ...]      # one JSON report per line, ~25 s for the import

A report: {"export", "architecture", "landed": [names], "mismatched": {name: why}, "not_loaded": [SGLang
parameters no tensor of ours filled, the target's embedding aside], "dropped": [our tensors SGLang did not
read], "hot_token_map_equal": bool, "capture_layers": [vLLM-convention ids SGLang's target captures, None
where it reads none: its defaults for EAGLE-3, the final states for EAGLE-1]}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SGLANG_DIR = Path(__file__).resolve().parent.parent / ".venv" / "sglang"
PACKED = {  # SGLang's fused parameters and the checkpoint tensors packed into them, in order
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
NOT_OURS = ("embed_tokens.weight",)  # SGLang shares the target's (eagle_worker_v2.py:336-378)
HEAD_NOT_OURS = {"LlamaForCausalLMEagle": ("lm_head.weight",)}  # EAGLE-1: the target's lm_head too (:371-378)


def check_with_sglang(export_dirs: list[Path], timeout_s: float = 600.0) -> list[dict]:
    """Run this file on `export_dirs` in a fresh interpreter with SGLang on its path; one report each."""
    if not (SGLANG_DIR / "sglang").is_dir():
        raise FileNotFoundError(f"{SGLANG_DIR}: SGLang is not installed there (make setup installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SGLANG_DIR), str(Path(__file__).parent.parent)]))
    done = subprocess.run(
        [sys.executable, __file__, *map(str, export_dirs)],
        capture_output=True, text=True, env=env, timeout=timeout_s,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"SGLang's loader failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def stub_imports() -> None:
    """`import sglang` imports IPython.display (sglang/utils.py:25) and torchvision (via its multimodal
    configs); neither is installed beside vLLM. Stubs answer those imports only - installed after
    transformers has looked for torchvision, so transformers still finds none."""
    import importlib.abc
    import importlib.machinery
    from unittest.mock import MagicMock

    import transformers  # noqa: F401

    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            if module.__name__ == "IPython.display":
                module.HTML = lambda *args, **kwargs: None
                module.display = lambda *args, **kwargs: None
            module.__getattr__ = lambda name: MagicMock(name=f"{module.__name__}.{name}")

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname.split(".")[0] in ("IPython", "torchvision"):
                return importlib.machinery.ModuleSpec(fullname, Loader(), is_package=True)
            return None

    sys.meta_path.insert(0, Finder())


def expected_tensor(name: str, ours: dict):
    """The tensor of ours SGLang's parameter `name` should hold: packed ones concatenated, `model.` off."""
    import torch

    key = name.removeprefix("model.")
    for fused, parts in PACKED.items():
        if f".{fused}." in f".{key}":
            return torch.cat([ours[key.replace(fused, part)] for part in parts]), [
                key.replace(fused, part) for part in parts
            ]
    return ours.get(key), [key]


def check_export(export_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader import get_model
    from sglang.srt.models.llama import LlamaForCausalLM

    ours = {name: tensor.float() for name, tensor in load_file(str(export_dir / "model.safetensors")).items()}
    model_config = ModelConfig(model_path=str(export_dir), is_draft_model=True, dtype="float32")
    model = get_model(model_config=model_config, load_config=LoadConfig(), device_config=DeviceConfig("cpu"))
    landed, mismatched, not_loaded, used = [], {}, [], set()
    shared = NOT_OURS + HEAD_NOT_OURS.get(type(model).__name__, ())
    for name, param in model.named_parameters():
        if name.endswith(shared):
            continue
        expected, sources = expected_tensor(name, ours)
        if expected is None:
            not_loaded.append(name)
            continue
        used.update(sources)
        rows = expected.shape[0]  # SGLang pads vocabulary rows to a multiple of 64, zeros
        if param.shape[1:] != expected.shape[1:] or param.shape[0] < rows:
            mismatched[name] = f"shape {tuple(param.shape)} against ours {tuple(expected.shape)}"
        elif not torch.equal(param[:rows].float(), expected) or param[rows:].abs().sum() > 0:
            mismatched[name] = "values differ"
        else:
            landed.append(name)
    d2t = ours.get("d2t")
    hot = getattr(model, "hot_token_id", None)
    hot_equal = (
        hot is None
        if d2t is None
        else hot is not None and torch.equal(hot, torch.arange(len(d2t)) + d2t.long())
    )
    if d2t is not None:
        used.add("d2t")
    # The target side reads the ids from the draft's hf_config as its server does
    # (model_executor/model_runner_components/spec_aux_hidden_state.py:185-196), then the target model's
    # own method turns them into the layers it captures (models/llama.py:929-941), run here on a stand-in
    # of the target holding only what that method touches.
    eagle_config = getattr(model_config.hf_config, "eagle_config", None)
    try:
        ids = eagle_config["eagle_aux_hidden_state_layer_ids"]
    except (TypeError, KeyError):
        ids = None
    captured = None  # without ids SGLang captures its own default layers, whatever the head was trained on
    if ids is not None:
        target = type("Target", (), {})()
        target.pp_group = type("PP", (), {"is_last_rank": True})()
        target.model = type("Model", (), {})()
        LlamaForCausalLM.set_eagle3_layers_to_capture(target, ids)
        captured = list(target.model.layers_to_capture)
    return {
        "export": str(export_dir),
        "architecture": type(model).__name__,
        "landed": landed,
        "mismatched": mismatched,
        "not_loaded": not_loaded,
        "dropped": sorted(set(ours) - used),
        "hot_token_map_equal": hot_equal,
        "capture_layers": captured,
    }


def main() -> None:
    import socket

    stub_imports()
    from sglang.test.layer_ut_utils import init_single_process_dist

    with socket.socket() as s:  # a free port for the one-process gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_single_process_dist(master_port=port, backend="gloo")
    for export_dir in sys.argv[1:]:
        print(json.dumps(check_export(Path(export_dir))), flush=True)


if __name__ == "__main__":
    main()
