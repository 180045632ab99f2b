"""The hidden-state cache on disk: safetensors shards of many samples each, read lazily.

Layout of `<run_dir>/cache/`:
    manifest.json                      identity (target, tokenizer, layers, data) + stats + shard checksums
    vocab.safetensors                  draft vocabulary map (t2d, d2t, token_counts)
    eval_conversations.jsonl           the held-out conversations (prompts for eval)
    {train,eval}/shard-00000.safetensors
    {train,eval}/shard-00000.json      sidecar: checksum and counts, written after the shard

A shard holds its samples back to back (n samples, N tokens in all):
    input_ids      [N] uint16 (int32 when an id is >= 65536)
    loss_mask_bits [ceil(N/8)] uint8  the loss mask packed 8 per byte, little-endian bit order;
                                      1 = assistant token (trained on)
    aux_hidden     [N - n, n_aux, H] bf16  residual stream entering each aux layer (vLLM ids, ascending),
                                      for every position but each sample's last (no next token to pair
                                      it with in training, so it is never read)
    final_hidden   [N, H] bf16        the target's last hidden state after its final norm
    sample_offsets [n+1] int64        sample i is tokens [offsets[i], offsets[i+1])
and the format name and sample ids in its metadata (one JSON string under the key `eagle`). Packing ids
and the mask and dropping the never-used rows keeps a shard within 2 x (n_aux + 1) x H bytes per token.
A cache made for online training (`cache.hidden_states=false`, manifest `"hidden_states": false`) has
shards without aux_hidden and final_hidden: a few bytes per token; train computes the states itself.
Files are memory-mapped: reading a sample reads only its rows.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save

from artifacts import atomic
from artifacts.manifest import read_manifest

SHARD_FORMAT = "eagle-hidden-cache-v1"
HIDDEN_DTYPE = torch.bfloat16


def shard_path(split_dir: Path, index: int, part: int | None = None) -> Path:
    """Shard `index` of a split; `part` numbers the shards of one regeneration chunk (one-pass capture)."""
    suffix = "" if part is None else f"-{part:03d}"
    return split_dir / f"shard-{index:05d}{suffix}.safetensors"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_shard(path: Path, samples: list[dict]) -> dict:
    """Write samples ({id, input_ids, loss_mask[, aux_hidden, final_hidden]}) as one shard, atomically.

    The sidecar with the checksum is written after the shard is in place, so a shard without a valid
    sidecar is never taken for complete, whenever the process dies.
    """
    lengths = torch.tensor([len(s["input_ids"]) for s in samples], dtype=torch.int64)
    input_ids = torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int64) for s in samples])
    loss_mask = np.concatenate([np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples])
    tensors = {
        "input_ids": input_ids.to(torch.uint16 if int(input_ids.max()) < 2**16 else torch.int32),
        "loss_mask_bits": torch.from_numpy(np.packbits(loss_mask, bitorder="little")),
        "sample_offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
    }
    if "final_hidden" in samples[0]:
        tensors["aux_hidden"] = torch.cat([s["aux_hidden"][:-1].to(HIDDEN_DTYPE) for s in samples])
        tensors["final_hidden"] = torch.cat([s["final_hidden"].to(HIDDEN_DTYPE) for s in samples])
    # One metadata key: safetensors writes several in hash-map order, which differs from run to run.
    metadata = {"eagle": json.dumps({"format": SHARD_FORMAT, "sample_ids": [s["id"] for s in samples]})}
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    info = {
        "file": path.name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "num_samples": len(samples),
        "num_tokens": int(lengths.sum()),
        "num_loss_tokens": int(loss_mask.sum()),
        "num_bytes": len(data),
    }
    free = shutil.disk_usage(path.parent).free
    if len(data) > free:  # refused before a byte is written; a disk filled by another writer is caught below
        raise OSError(
            errno.ENOSPC,
            f"{path}: this {len(data) / 1e6:.1f} MB shard does not fit the {free / 1e6:.1f} MB free on its disk. "
            "Every finished shard is kept: free some space (or move run_dir to a larger disk), then rerun "
            "to continue",
        )
    try:
        atomic.write_bytes(path, data)
        atomic.write_json(sidecar_path(path), info)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        free = shutil.disk_usage(path.parent).free
        raise OSError(
            errno.ENOSPC,
            f"{path}: the disk is full writing this {len(data) / 1e6:.1f} MB shard ({free / 1e9:.2f} GB free). "
            "Every finished shard is kept: free some space (or move run_dir to a larger disk), then rerun "
            "the same command to resume",
        ) from error
    return info


def read_shard_sidecar(path: Path) -> dict | None:
    """The sidecar (checksum and counts) of a shard, or None when either file is missing or unreadable."""
    sidecar = sidecar_path(path)
    if not (path.exists() and sidecar.exists()):
        return None
    try:
        return json.loads(sidecar.read_text())
    except json.JSONDecodeError:
        return None


def read_complete_shard_info(path: Path) -> dict | None:
    """The sidecar of a finished, intact shard (checksum verified); None when missing, unfinished or corrupt."""
    info = read_shard_sidecar(path)
    return info if info is not None and file_sha256(path) == info.get("sha256") else None


def read_shard_tokens(path: Path) -> list:
    """The samples of one shard as (id, input_ids, loss_mask) records, states left unread."""
    from types import SimpleNamespace

    with safe_open(str(path), framework="pt") as f:
        ids = json.loads(f.metadata()["eagle"])["sample_ids"]
        offsets = f.get_tensor("sample_offsets").tolist()
        tokens = f.get_tensor("input_ids").to(torch.int64).tolist()
        mask = np.unpackbits(f.get_tensor("loss_mask_bits").numpy(), bitorder="little")[
            : offsets[-1]
        ].tolist()
    return [
        SimpleNamespace(id=i, input_ids=tokens[a:b], loss_mask=mask[a:b])
        for i, a, b in zip(ids, offsets[:-1], offsets[1:])
    ]


class CacheSplit:
    """One split (`train` or `eval`) of a finished cache, indexed by sample, read lazily.

    `verify=True` checks every shard against the checksum in the manifest first.
    """

    def __init__(self, cache_dir: str | Path, split: str = "train", verify: bool = True):
        self.cache_dir = Path(cache_dir)
        self.manifest = read_manifest(self.cache_dir)
        if not self.manifest.get("complete"):
            raise ValueError(f"{self.cache_dir}: the cache is unfinished; run data_prep again to complete it")
        if split not in self.manifest["splits"]:
            raise ValueError(f"{self.cache_dir}: no split {split!r} (have {sorted(self.manifest['splits'])})")
        self.split_dir = self.cache_dir / split
        self.hidden_states = self.manifest.get("hidden_states", True)  # False: train computes them online
        self.shards = self.manifest["splits"][split]["shards"]
        self._handles: dict[int, object] = {}
        self.ids: list[str] = []
        self.lengths: list[int] = []
        self._where: list[
            tuple[int, int, int, int]
        ] = []  # sample -> (shard, first token, end token, first aux row)
        for shard_index, info in enumerate(self.shards):
            path = self.split_dir / info["file"]
            if not path.exists():
                raise ValueError(f"cache shard {path} is missing; run data_prep again to rebuild it")
            if verify and file_sha256(path) != info["sha256"]:
                raise ValueError(
                    f"cache shard {path}: checksum mismatch (the file is corrupt or was changed after the cache "
                    "was written); delete it and run data_prep again to rebuild it"
                )
            handle = self._handle(shard_index)
            offsets = handle.get_tensor("sample_offsets").tolist()
            self.ids += json.loads(handle.metadata()["eagle"])["sample_ids"]
            for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
                self._where.append((shard_index, start, end, start - i))
                self.lengths.append(end - start)

    def _handle(self, shard_index: int):
        if shard_index not in self._handles:
            path = self.split_dir / self.shards[shard_index]["file"]
            self._handles[shard_index] = safe_open(str(path), framework="pt")
        return self._handles[shard_index]

    def __getstate__(self):
        # File handles do not cross process boundaries (DataLoader workers): reopen there.
        return {**self.__dict__, "_handles": {}}

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """One sample: input_ids [T] int64, loss_mask [T] bool, aux_hidden [T, n_aux, H] (the last row,
        never used in training, is zeros), final_hidden [T, H]; the last two only in a cache with hidden
        states."""
        shard_index, start, end, aux_start = self._where[index]
        handle = self._handle(shard_index)
        bits = handle.get_slice("loss_mask_bits")[start // 8 : (end + 7) // 8].numpy()
        loss_mask = np.unpackbits(bits, bitorder="little")[start % 8 : start % 8 + end - start]
        sample = {
            "input_ids": handle.get_slice("input_ids")[start:end].to(torch.int64),
            "loss_mask": torch.from_numpy(loss_mask.astype(bool)),
        }
        if self.hidden_states:
            aux = handle.get_slice("aux_hidden")[aux_start : aux_start + end - start - 1]
            sample["aux_hidden"] = torch.cat([aux, aux.new_zeros(1, *aux.shape[1:])])
            sample["final_hidden"] = handle.get_slice("final_hidden")[start:end]
        return sample
