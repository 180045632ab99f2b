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
from target.vllm import vllm_version

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
        dtype=cfg.target.dtype,
    )
    return CaptureEngine(
        settings,
        layers,
        storage,
        cfg.capture.transfer,
        dict(cfg.capture.transfer_args),
        devices=None if device_index is None else (device_index, cfg.capture.tensor_parallel_size),
    )


def capture_identity(cfg) -> dict:
    """What decides the captured states beyond the target and the data, part of the cache's identity: the
    engine, the dtype it computes in, and for vLLM its version, tensor-parallel size (the all-reduce order)
    and the transfer (fp8 rounds the states)."""
    if cfg.capture.engine == "hf":
        return {"engine": "hf", "dtype": cfg.target.dtype}
    return {
        "engine": "vllm",
        "dtype": cfg.target.dtype,
        "vllm_version": vllm_version(),
        "tensor_parallel_size": cfg.capture.tensor_parallel_size,
        "transfer": cfg.capture.transfer,
    }


def capture_record(cfg, layers: CaptureLayers | None) -> dict:
    """What the manifest records about the engine that computed the states; a tokens-only cache
    (cache.hidden_states=false: no layers captured) records that none did."""
    if layers is None and not cfg.cache.hidden_states:
        return {"engine": None, "hidden_states": False}
    record = capture_identity(cfg)
    if cfg.capture.engine == "vllm":
        record |= {
            "pipeline_parallel_size": cfg.capture.pipeline_parallel_size,
            "captured_layer_ids": layers.captured_ids,
            "regenerated_in_same_pass": bool(cfg.regen.enabled),
        }
    return record


class CapturedChunks:
    """Regenerated chunks written as cache shards, for data_prep/regenerate.regenerate_rank_share."""

    def __init__(self, cfg, target_path: str, layers: CaptureLayers, cache_dir: Path, rank: int):
        self.cfg, self.target_path, self.layers, self.cache_dir = cfg, target_path, layers, cache_dir
        self.storage = storage_dir(cache_dir, rank)

    def engine(self, device_index) -> CaptureEngine:
        """The capture engine that regenerates (a context: stopped with its files when it leaves)."""
        return capture_engine(self.cfg, self.target_path, self.layers, self.storage, device_index, True)

    def chunk_writer(self, chunk: int) -> ChunkShards:
        """Where chunk `chunk`'s samples go, as the engine's files are read."""
        return ChunkShards(self.cfg, self.cache_dir, chunk)

    def verify(self, shards: dict | None) -> bool:
        """Whether a chunk's shards are all present and intact."""
        return shards is not None and all(
            read_complete_shard_info(self.cache_dir / split / name) is not None
            for split, names in shards.items()
            for name in shard_names(names)
        )


def shard_names(names: str | list[str]) -> list[str]:
    """A chunk's shards of one split, as its chunk file lists them (a name: one shard, before parts)."""
    return [names] if isinstance(names, str) else list(names)


class ChunkShards:
    """One regeneration chunk's samples written as they are captured, into shards of at most
    `cache.max_shard_mb` per split (`shard-<chunk>-<part>`): a chunk holds no more than one shard of states
    per split in memory, however many conversations it has."""

    def __init__(self, cfg, cache_dir: Path, chunk: int):
        self.cfg, self.cache_dir, self.chunk = cfg, cache_dir, chunk
        self.max_bytes = cfg.cache.max_shard_mb * 2**20
        self.pending = {split: [] for split in ("train", "eval")}
        self.pending_bytes = dict.fromkeys(self.pending, 0)
        self.shards = {split: [] for split in self.pending}
        self.counts = Counter()

    def add(self, sample: dict) -> None:
        """Take one captured sample (after the max-length policy, counted in `counts`); write its split's
        shard once it holds `max_shard_mb`."""
        rendered = fit_length(
            RenderedSample(sample["id"], sample["input_ids"], sample["loss_mask"]),
            self.cfg.render.max_length,
            self.cfg.render.overlong,
            self.counts,
        )
        if rendered is None:
            return
        self.counts["truncated"] += rendered.truncated
        n = len(rendered.input_ids)
        split = "eval" if is_held_out(sample["conversation"], self.cfg.data.eval_fraction) else "train"
        sample = {"id": sample["id"], "input_ids": rendered.input_ids, "loss_mask": rendered.loss_mask,
                  "aux_hidden": sample["aux_hidden"][:n], "final_hidden": sample["final_hidden"][:n]}  # fmt: skip
        self.pending[split].append(sample)
        self.pending_bytes[split] += sum(sample[k].nbytes for k in ("aux_hidden", "final_hidden")) + 9 * n
        if self.pending_bytes[split] >= self.max_bytes:
            self.flush(split)

    def flush(self, split: str) -> None:
        if self.pending[split]:
            path = shard_path(self.cache_dir / split, self.chunk, len(self.shards[split]))
            path.parent.mkdir(parents=True, exist_ok=True)
            write_shard(path, self.pending[split])
            self.shards[split].append(path.name)
        self.pending[split], self.pending_bytes[split] = [], 0

    def close(self) -> dict:
        """Write what is left; {split: [shard file names]} for the splits that have any."""
        for split in self.pending:
            self.flush(split)
        return {split: names for split, names in self.shards.items() if names}
