"""data_prep's hidden states from the vLLM engine (`capture.engine=vllm`; target/capture.py has the engine).

Two passes use it:
- with `regen.enabled`, regeneration and capture are one pass: each chunk of conversations the target
  answers is written straight to cache shards - its held-out samples to `eval/shard-<chunk>`, the others
  to `train/shard-<chunk>` - before the chunk's file, so a chunk whose file exists and whose shards verify
  is finished (the resume unit of data_prep/regenerate.py), and a rerun after a kill redoes only the rest;
- without it, a prompt-only pass over the rendered samples (data_prep/hidden_states.vllm_states), sharded
  as the transformers pass is.
Each rank starts its own engine (data parallel), each engine spans `capture.tensor_parallel_size` devices.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

import torch

from artifacts.cache import read_complete_shard_info, shard_path, write_shard
from data_prep.regenerate import select_devices
from data_prep.render import RenderedSample, fit_length
from data_prep.sources import is_held_out
from target.capture import (
    CaptureEngine,
    CaptureLayers,
    capture_settings,
    cpu_thread_binding,
    final_norm_style,
)
from target.model import load_final_norm

log = logging.getLogger(__name__)


def storage_dir(cache_dir: Path, rank: int) -> Path:
    """Where rank `rank`'s engine writes its files: emptied when it starts, removed when it stops (or by
    the reaper, when the stage dies)."""
    return cache_dir / f".capture-rank{rank}"


def capture_layers(cfg, target_config, aux_layer_ids) -> CaptureLayers:
    style = final_norm_style(target_config)  # refuses, by model_type, a norm the capture cannot reproduce
    return CaptureLayers(
        aux_layer_ids,
        target_config.num_hidden_layers,
        load_final_norm(cfg.target),
        float(target_config.rms_norm_eps),
        style,
    )


def capture_engine(
    cfg, target_path: str, layers: CaptureLayers, storage: Path, device_index, regenerating: bool
):
    """A capture engine on this rank's devices, with the user's engine arguments: `regen.vllm_kwargs` when
    it regenerates, `capture.vllm_kwargs` for a prompt-only pass."""
    source = "regen.vllm_kwargs" if regenerating else "capture.vllm_kwargs"
    extra = dict(cfg.regen.vllm_kwargs if regenerating else cfg.capture.vllm_kwargs)
    limit = extra.get("max_model_len", extra.get("max-model-len"))
    if not regenerating and limit is not None and limit <= cfg.render.max_length:
        # vLLM refuses a prompt that leaves no room for the one token a prompt-only pass samples.
        raise ValueError(
            f"capture.vllm_kwargs.max_model_len={limit}: a prompt-only capture reads samples of up to "
            f"render.max_length={cfg.render.max_length} tokens and samples one more; set it above "
            f"{cfg.render.max_length} (or leave it out: the target's own limit)"
        )
    select_devices(device_index, cfg.capture.tensor_parallel_size)
    if cfg.capture.tensor_parallel_size > 1 and not torch.cuda.is_available():
        if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto":  # the engine inherits it
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(cfg.capture.tensor_parallel_size)
    settings = capture_settings(
        target_path,
        layers,
        storage,
        extra,
        source,
        transfer=cfg.capture.transfer,
        transfer_overrides=dict(cfg.capture.transfer_args),
        tensor_parallel_size=cfg.capture.tensor_parallel_size,
        seed=cfg.regen.seed if regenerating else None,
    )
    return CaptureEngine(settings, layers, storage, cfg.capture.transfer, dict(cfg.capture.transfer_args))


def capture_record(cfg, layers: CaptureLayers) -> dict:
    """What the manifest records about the engine that computed the states."""
    if cfg.capture.engine == "hf":
        return {"engine": "hf", "dtype": cfg.target.dtype}
    import vllm

    return {
        "engine": "vllm",
        "vllm_version": vllm.__version__,
        "tensor_parallel_size": cfg.capture.tensor_parallel_size,
        "pipeline_parallel_size": cfg.capture.pipeline_parallel_size,
        "transfer": cfg.capture.transfer,
        "captured_layer_ids": layers.captured_ids,
        "regenerated_in_same_pass": bool(cfg.regen.enabled),
    }


class CapturedChunks:
    """Regenerated chunks written as cache shards, for data_prep/regenerate.regenerate_rank_share."""

    def __init__(self, cfg, target_path: str, layers: CaptureLayers, cache_dir: Path, rank: int):
        self.cfg, self.target_path, self.layers, self.cache_dir = cfg, target_path, layers, cache_dir
        self.storage = storage_dir(cache_dir, rank)
        self.engine: CaptureEngine | None = None

    def start(self, device_index) -> CaptureEngine:
        engine = capture_engine(self.cfg, self.target_path, self.layers, self.storage, device_index, True)
        self.engine = engine.__enter__()
        return self.engine

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.__exit__(None, None, None)
            self.engine = None

    def write(self, chunk: int, samples: list[dict], counts: Counter) -> dict:
        """Write chunk `chunk`'s samples (after the max-length policy, counted in `counts`) as one shard per
        split that has any; returns {split: shard file name}."""
        kept = {"train": [], "eval": []}
        for sample in samples:
            rendered = fit_length(
                RenderedSample(sample["id"], sample["input_ids"], sample["loss_mask"]),
                self.cfg.render.max_length,
                self.cfg.render.overlong,
                counts,
            )
            if rendered is None:
                continue
            counts["truncated"] += rendered.truncated
            n = len(rendered.input_ids)
            sample = {**sample, "input_ids": rendered.input_ids, "loss_mask": rendered.loss_mask,
                      "aux_hidden": sample["aux_hidden"][:n], "final_hidden": sample["final_hidden"][:n]}  # fmt: skip
            held_out = is_held_out(sample["conversation"], self.cfg.data.eval_fraction)
            kept["eval" if held_out else "train"].append(sample)
        shards = {}
        for split, split_samples in kept.items():
            if split_samples:
                path = shard_path(self.cache_dir / split, chunk)
                path.parent.mkdir(parents=True, exist_ok=True)
                write_shard(
                    path, [{k: v for k, v in s.items() if k != "conversation"} for s in split_samples]
                )
                shards[split] = path.name
        return shards

    def verify(self, shards: dict | None) -> bool:
        """Whether a chunk's shards are all present and intact."""
        return shards is not None and all(
            read_complete_shard_info(self.cache_dir / split / name) is not None
            for split, name in shards.items()
        )
