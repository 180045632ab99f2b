"""The head file: the one reader and the one writer of a trained head's directory (`<run_dir>/draft_head/`).

    draft_head/
      draft_config.json   the record below: kind, the head's config fields, the target and cache it was
                          trained on, the training run, and the sha256 of the two files beside it
      model.safetensors   the head's weights, fp32, without the target's embedding
      vocab.safetensors   the draft vocabulary (d2t / t2d, artifacts/vocab.py)

train writes it (`write_head`); export, eval, the reference decoder and warm starts read it (`read_head`,
`load_draft`), and every read checks the checksums, that the weights are finite and of sane size, and
names the file at fault.

    record, weights = read_head(run_dir / "draft_head")
    record, draft = load_draft(run_dir / "draft_head")      # an Eagle3Draft / Eagle1Draft with the weights
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from artifacts import atomic
from artifacts.cache import file_sha256
from artifacts.manifest import answer_temperatures
from heads.config import LlamaLayerConfig
from heads.kinds import head_kind, load_weights
from heads.layers import DraftModel

log = logging.getLogger(__name__)

HEAD_CONFIG = "draft_config.json"
HEAD_FILES = ("model.safetensors", "vocab.safetensors")  # checksummed in draft_config.json's "files"
MAX_ABS_WEIGHT = 1e4  # a trained head's weights stay within a few hundred; beyond this they are corrupt


@dataclass
class HeadRecord:
    """draft_config.json."""

    kind: str  # eagle3 | peagle | eagle1 (heads/kinds.py)
    config: LlamaLayerConfig  # the head's architecture: Eagle3Config or Eagle1Config
    target: dict = field(default_factory=dict)  # {"path", "hash"}: the target it drafts for
    cache: dict = field(default_factory=dict)  # identity of the cache it was trained on (aux ids, data, ...)
    training: dict = field(default_factory=dict)  # num_steps, num_processes, settings, held_out metrics
    files: dict | None = None  # sha256 of HEAD_FILES (None: written before checksums existed)

    @property
    def held_out(self) -> dict | None:
        """The final held-out metrics train measured (None: no held-out split)."""
        return self.training.get("held_out")

    @property
    def trained_ks(self) -> list[int] | None:
        """The k (drafts per round) this head was trained for, from its own record; None: any (chain)."""
        if self.kind == "dflash":
            return self.config.trained_ks()
        depths = self.training.get("settings", {}).get("head", {}).get("num_depths")
        return list(range(1, depths + 1)) if self.kind == "peagle" and depths else None

    @property
    def trained_temperatures(self) -> list[float] | None:
        """The temperatures its training answers were generated at (None: the dataset's own answers)."""
        return answer_temperatures(self.cache.get("regeneration"))

    @property
    def trained_chat_template_kwargs(self) -> dict | None:
        """The chat-template kwargs its training answers were rendered with (its thinking mode; {}: the
        template's defaults; None: a cache from before they were recorded)."""
        return self.cache.get("chat_template_kwargs")

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "config": self.config.to_dict()}

    @classmethod
    def from_json(cls, values: dict, where: Path) -> HeadRecord:
        try:
            kind = head_kind(values["kind"], f"{where}: kind")
            config = kind.config_class.from_dict(values["config"])
            return cls(
                kind=kind.name,
                config=config,
                **{k: values[k] for k in ("target", "cache", "training", "files") if k in values},
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"{where}: not a head record ({error!r} missing or wrong)") from error


def check_weights(weights: dict[str, torch.Tensor], where: Path) -> None:
    """Refuse weights no training produces: non-finite values, or magnitudes above MAX_ABS_WEIGHT."""
    for name, tensor in weights.items():
        if not tensor.is_floating_point() or not tensor.numel():
            continue
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(
                f"{where}: tensor {name} holds {bad} non-finite values (NaN or inf): a corrupt head"
            )
        largest = float(tensor.abs().max())
        if largest > MAX_ABS_WEIGHT:
            raise ValueError(
                f"{where}: tensor {name} holds |value| {largest:.3g} > {MAX_ABS_WEIGHT:g}, which no training "
                "produces: a corrupt head"
            )


def read_record(head_dir: Path) -> HeadRecord:
    """draft_config.json alone, parsed and typed (no file checks: for reports that only read it)."""
    config_path = Path(head_dir) / HEAD_CONFIG
    if not config_path.exists():
        raise ValueError(f"{head_dir} holds no trained head ({HEAD_CONFIG}): run train/main.py first")
    try:
        values = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{config_path}: corrupt ({error}); retrain, or restore the head") from error
    return HeadRecord.from_json(values, config_path)


def read_head(head_dir: Path, allow_unverified: bool = True) -> tuple[HeadRecord, dict[str, torch.Tensor]]:
    """A trained head's record and weights, after checking them: each file against the checksum
    `write_head` recorded, the weights finite and of sane size. Raises ValueError naming the file at fault.

    `allow_unverified=False` (export) refuses a record without checksums: an old head, or a forged one - a
    weight zeroed and the checksums deleted passes every other check. True: read it with a warning."""
    from safetensors.torch import load_file

    head_dir = Path(head_dir)
    record = read_record(head_dir)
    if record.files is None and not allow_unverified:
        raise ValueError(
            f"{head_dir / HEAD_CONFIG} records no checksums of {' and '.join(HEAD_FILES)} (a head written before "
            "they existed, or edited after training), so they cannot be checked against what train wrote: "
            "retrain it, or export it unverified with export.allow_unverified_head=true"
        )
    if record.files is None:
        log.warning(
            "%s records no checksums (written before they existed): its files are not checked",
            head_dir / HEAD_CONFIG,
        )
    for name in HEAD_FILES:
        path = head_dir / name
        if not path.exists():
            raise ValueError(f"{path} is missing: the head directory is incomplete; retrain, or restore it")
        if record.files is not None and file_sha256(path) != record.files.get(name):
            raise ValueError(
                f"{path}: checksum mismatch with {head_dir / HEAD_CONFIG} (the file is corrupt or was changed "
                "after training); retrain, or restore the head"
            )
    try:
        weights = load_file(str(head_dir / "model.safetensors"))
    except Exception as error:  # safetensors raises its own error types for truncated or garbled files
        raise ValueError(
            f"{head_dir / 'model.safetensors'}: cannot be read ({error}); a corrupt head"
        ) from error
    check_weights(weights, head_dir / "model.safetensors")
    return record, weights


def load_draft(head_dir: Path, weight_dtype: torch.dtype | None = None) -> tuple[HeadRecord, DraftModel]:
    """The trained head as its model class, in fp32 (without the target's embedding: load it next).

    `weight_dtype` rounds the weights through that dtype first, as an export in it would store them.
    """
    record, weights = read_head(head_dir)
    if weight_dtype is not None:
        weights = {k: v.to(weight_dtype).float() for k, v in weights.items()}
    draft = head_kind(record.kind).build(record.config.to_dict())
    return record, load_weights(draft, weights, Path(head_dir) / "model.safetensors").float()


def write_head(
    directory: Path, record: HeadRecord, weights: dict[str, torch.Tensor], vocab_file: Path
) -> None:
    """The final head, built beside `directory` and renamed into place: a crash leaves the old one whole."""

    with atomic.publish_dir(directory, kind="head", legacy=(HEAD_CONFIG,)) as tmp:
        atomic.save_tensors(
            {k: v.detach().float().contiguous().cpu() for k, v in weights.items()}, tmp / "model.safetensors"
        )
        shutil.copy(vocab_file, tmp / "vocab.safetensors")
        record = dataclasses.replace(record, files={name: file_sha256(tmp / name) for name in HEAD_FILES})
        atomic.write_json(tmp / HEAD_CONFIG, record.to_json())
