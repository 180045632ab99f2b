"""The target's hidden states from the vLLM engine that serves it (docs/design.md#capture).

vLLM's speculative method `extract_hidden_states` keeps the states of chosen layers for every token the
engine computes, and a KV connector writes them per request when it finishes - the prompt's tokens, or the
prompt's and the generated ones (`include_output_tokens`): regeneration and capture in one pass. A target
too large for one device is captured as it is served, tensor-parallel across devices.

    with CaptureEngine(settings, layers, storage_dir, transfer="file") as engine:
        outputs = engine.generate(prompt_ids, sampling_params)   # vLLM's RequestOutputs
        aux_TNH, final_TH = engine.states(outputs[0], expected_ids, "conversation 17")

Layer ids: vLLM's id k is the residual stream entering decoder layer k (HF's `hidden_states[k]`); id L
(= num_hidden_layers) is the last layer's output before the final norm. `cache.aux_layer_ids` uses the same
convention (target/model.py), so `CaptureLayers` only adds L and applies the target's final norm to it:
the final state the cache stores, as transformers computes it.

Transfer: the files are read through `hs-connectors` (the library vLLM's own trainer, speculators, reads
them with), whose backends are named settings (`capture.transfer`: file, fp8; not mooncake, docs/gpu.md);
on vLLM's CPU build the `file` backend's writer is our `target/capture_connector.py`, since vLLM's fails
there.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch

from target.vllm import EngineSettings, target_dtype_extra

log = logging.getLogger(__name__)

CPU_CONNECTOR = {
    "kv_connector": "SyncHiddenStatesConnector",
    "kv_connector_module_path": "target.capture_connector",
}


@dataclass(frozen=True)
class CaptureLayers:
    """Which states an engine captures and how they become the cache's aux and final states."""

    aux_layer_ids: list[int]  # vLLM ids, ascending (resolve_aux_layer_ids)
    num_hidden_layers: int
    final_norm_weight: torch.Tensor  # [H], the target's final RMSNorm (target/model.load_final_norm)
    final_norm_eps: float
    final_norm_style: str = "llama"  # how the target applies the weight: FINAL_NORM_STYLES[model_type]

    @property
    def captured_ids(self) -> list[int]:
        """What the engine is asked for: the aux ids and L, sorted and de-duplicated as vLLM does."""
        return sorted({*self.aux_layer_ids, self.num_hidden_layers})

    def split(self, states_TNH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Aux states [T, n_aux, H] and final post-norm states [T, H] from a captured [T, n_captured, H]."""
        ids = self.captured_ids
        aux = states_TNH[:, [ids.index(i) for i in self.aux_layer_ids]]
        pre_norm = states_TNH[:, ids.index(self.num_hidden_layers)].float()
        normed = pre_norm * torch.rsqrt(pre_norm.pow(2).mean(-1, keepdim=True) + self.final_norm_eps)
        if self.final_norm_style == "gemma":  # (1 + w) on the fp32 statistics, then the cast
            final = normed * (1.0 + self.final_norm_weight.float())
        else:  # Llama: the normed state cast to the activation dtype first, then the weight
            final = self.final_norm_weight.float() * normed.to(states_TNH.dtype).float()
        return aux, final.to(states_TNH.dtype)


# The final norms the capture path reproduces, by the target's `model_type` (transformers 5.x, read from its
# modeling files). "llama": LlamaRMSNorm, `w * normed.to(dtype)`; "gemma": `(normed * (1 + w)).to(dtype)`,
# the weight stored as an offset from one. Any other target (LayerNorms with a bias or a mean - phi, cohere,
# stablelm, starcoder2, nemotron, olmo -, a norm stored under another name) is refused by name: a wrong
# final state would make a silently wrong teacher.
FINAL_NORM_STYLES = {
    **dict.fromkeys(
        "llama mistral ministral mistral3 mixtral qwen2 qwen2_moe qwen3 qwen3_moe qwen3_vl qwen3_vl_text phi3 "
        "smollm3 granite granitemoe deepseek_v2 deepseek_v3 glm glm4 glm4_moe olmoe exaone4 ernie4_5 "
        "ernie4_5_moe seed_oss apertus hunyuan_v1_dense hunyuan_v1_moe dots1 minimax minimax_m2 llama4_text "
        "olmo2 olmo3 gpt_oss helium".split(),
        "llama",
    ),
    **dict.fromkeys(
        "gemma gemma2 gemma3 gemma3_text qwen3_next qwen3_5 qwen3_5_text qwen3_5_moe qwen3_5_moe_text".split(),
        "gemma",
    ),
}


def final_norm_style(target_config) -> str:
    """The target's entry in FINAL_NORM_STYLES, or a ValueError naming its model_type."""
    model_type = getattr(target_config, "model_type", None)
    if model_type not in FINAL_NORM_STYLES:
        raise ValueError(
            f"target model_type={model_type!r}: capture.engine=vllm recomputes the final state from the last "
            f"layer's output with the target's final norm, and reproduces only the RMSNorms of "
            f"{sorted(FINAL_NORM_STYLES)}; use capture.engine=hf for this target"
        )
    if getattr(target_config, "rms_norm_eps", None) is None:
        raise ValueError(
            f"target model_type={model_type!r}: its config has no rms_norm_eps for the final norm"
        )
    return FINAL_NORM_STYLES[model_type]


def speculative_config(layers: CaptureLayers) -> dict:
    """vLLM's speculative config that makes an engine capture `layers` (one proposed token: the sampled one)."""
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers.captured_ids}},
    }


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int] | None = None) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for a tensor-parallel engine on vLLM's CPU build: this process's CPUs
    split evenly between the ranks ("0|1" for TP2 on 2 cores). vLLM's own `auto` binding gives each rank a
    NUMA node of its own and refuses more ranks than nodes (one node on a laptop or this project's CI)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if len(cpus) < tensor_parallel_size:
        raise ValueError(
            f"capture.tensor_parallel_size={tensor_parallel_size}: vLLM's CPU build needs a core per rank, "
            f"and this process may use {len(cpus)}"
        )
    share = len(cpus) // tensor_parallel_size
    return "|".join(
        ",".join(str(c) for c in cpus[r * share : (r + 1) * share]) for r in range(tensor_parallel_size)
    )


def transfer_args(name: str, storage_dir: Path, overrides: dict | None = None) -> argparse.Namespace:
    """The settings of hs-connectors backend `name`: its own defaults, the storage directory, `overrides`."""
    backend = transfer_backend(name)
    parser = argparse.ArgumentParser(add_help=False)
    backend.add_launch_args(parser)
    backend.add_train_args(parser)
    args = parser.parse_args([])
    args.hidden_states_path = str(storage_dir)
    for key, value in (overrides or {}).items():
        setattr(args, key.replace("-", "_"), value)
    return args


def transfer_backend(name: str):
    from hs_connectors import HiddenStatesBackend

    if name not in HiddenStatesBackend.registry:
        raise ValueError(
            f"capture.transfer={name!r}: choose one of hs-connectors' backends "
            f"{sorted(HiddenStatesBackend.registry)}"
        )
    return HiddenStatesBackend.registry[name]


def kv_transfer_config(name: str, args: argparse.Namespace, on_cpu: bool) -> dict:
    """The engine's `kv_transfer_config` for backend `name`; vLLM's CPU build writes through our connector."""
    config = transfer_backend(name).build_kv_transfer_config(args)
    if on_cpu:
        if name != "file":
            raise ValueError(
                f"capture.transfer={name!r}: on vLLM's CPU build only the file transfer writes (the others "
                "need an accelerator's copy streams)"
            )
        config = {**config, **CPU_CONNECTOR}
    return config


def capture_settings(
    model: str,
    layers: CaptureLayers,
    storage_dir: Path,
    extra: dict,
    source: str,
    transfer: str = "file",
    transfer_overrides: dict | None = None,
    tensor_parallel_size: int = 1,
    seed: int | None = None,
    on_cpu: bool | None = None,
    dtype: str | None = None,
) -> EngineSettings:
    """The one engine definition (target/vllm.py) for an engine that captures `layers`, computing in
    `dtype` (the target's: what the cache records) when given."""
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    args = transfer_args(transfer, storage_dir, transfer_overrides)
    owned = {
        "kv_transfer_config": kv_transfer_config(transfer, args, on_cpu),
        # A prefix served from the cache is never computed, so its states would be missing from the file.
        "enable_prefix_caching": False,
    }
    if tensor_parallel_size > 1:
        owned["tensor_parallel_size"] = tensor_parallel_size
    if dtype is not None:
        extra = target_dtype_extra(extra, dtype, source)
    return EngineSettings(
        model, speculative_config(layers), extra, source, dtype=dtype, seed=seed, owned=owned
    )


class CaptureEngine:
    """A vLLM engine that captures hidden states, and the reader of its files.

    The storage directory is this engine's alone: emptied when it starts and removed when it stops, so no
    file outlives the engine (and a rerun after a kill starts from an empty one).
    """

    def __init__(self, settings: EngineSettings, layers: CaptureLayers, storage_dir: Path, transfer="file",
                 transfer_overrides: dict | None = None, devices: tuple[int, int] | None = None):  # fmt: skip
        self.settings, self.layers, self.storage_dir = settings, layers, Path(storage_dir)
        self.transfer_name, self.transfer_overrides = transfer, transfer_overrides
        self.devices = devices  # (local rank, devices per engine): target/launch.engine_devices; None: CPU
        self.llm = None
        self.running = ExitStack()  # the engine's running_llm (target/vllm.py), closed on exit

    def __enter__(self) -> CaptureEngine:
        from target.vllm import running_llm

        shutil.rmtree(self.storage_dir, ignore_errors=True)
        self.storage_dir.mkdir(parents=True)
        args = transfer_args(self.transfer_name, self.storage_dir, self.transfer_overrides)
        self.reader = transfer_backend(self.transfer_name).from_train_args(args, str(self.storage_dir))
        try:
            self.reader.setup()
            self.llm = self.running.enter_context(running_llm(self.settings, self.devices or (None, 1)))
        except BaseException:  # a failed start (no memory, a bad argument, Ctrl-C) leaves no scratch files
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.running.close()
        self.llm = None
        shutil.rmtree(self.storage_dir, ignore_errors=True)

    def generate(self, prompts: list[list[int]], params, with_output_tokens: bool = False, progress=False):
        """vLLM's outputs for token-id `prompts`; each request's states are captured (prompt only, or with
        the generated tokens but the last, which no forward pass has read). `progress`: vLLM's bar."""
        from vllm.inputs import TokensPrompt

        if with_output_tokens:  # `params`: one SamplingParams for all, or a list of one per prompt
            params = (
                [with_output_states(p) for p in params]
                if isinstance(params, list)
                else with_output_states(params)
            )
        return self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=progress
        )

    def states(self, output, expected_ids: list[int], what: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The aux [T, n_aux, H] and final [T, H] states of one request, checked against the tokens it was
        meant to compute (`what` names the record in errors); its file is deleted once read."""
        params = output.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(f"{what}: vLLM returned no hidden-states file (kv_transfer_params={params})")
        try:
            data = self.reader.get_generated(params)
        finally:
            self.discard(output)
        if data is None:
            raise RuntimeError(f"{what}: vLLM's hidden-states file {path} was not written")
        return check_and_split(data, expected_ids, self.layers, what)

    def discard(self, output) -> None:
        """Delete a request's file (and lock) without reading it."""
        path = (output.kv_transfer_params or {}).get("hidden_states_path")
        if path:
            Path(path).unlink(missing_ok=True)
            Path(path + ".lock").unlink(missing_ok=True)


def check_and_split(data: dict, expected_ids: list[int], layers: CaptureLayers, what: str):
    """Refuse a captured file that is not what was asked for, naming the record; else split its states."""
    token_ids = data["token_ids"].tolist()
    if token_ids != list(expected_ids):
        first = next((i for i, (a, b) in enumerate(zip(token_ids, expected_ids)) if a != b), None)
        first = min(len(token_ids), len(expected_ids)) if first is None else first
        raise ValueError(
            f"{what}: the captured token ids differ from the rendered sample's at position {first} "
            f"({len(token_ids)} captured, {len(expected_ids)} rendered): the states belong to other tokens"
        )
    states = data["hidden_states"]
    expected_shape = (len(expected_ids), len(layers.captured_ids))
    if tuple(states.shape[:2]) != expected_shape:
        raise ValueError(
            f"{what}: captured states of shape {tuple(states.shape)}, expected {expected_shape} x H"
        )
    if not torch.isfinite(states).all():
        raise ValueError(f"{what}: the captured hidden states hold NaN or inf")
    if not states.any(dim=-1).all():
        raise ValueError(f"{what}: the captured hidden states are all zero for some token and layer")
    return layers.split(states)


def with_output_states(params):
    """A copy of vLLM SamplingParams whose request also captures the states of its generated tokens."""
    extra = dict(params.extra_args or {})
    extra["kv_transfer_params"] = {"include_output_tokens": True}
    params = params.clone()
    params.extra_args = extra
    return params
