"""Checkpoints (resumable training state) and warm starts from an older head.

    <run_dir>/ckpt/step-000200/     accelerate state (weights, optimizer, RNG of every rank, scheduler)
                                    + trainer_state.json (step, epoch), written last

A checkpoint is built in a staging directory beside it and swapped in when complete (artifacts/atomic.py),
so a kill at any moment leaves the previous one intact. The final head (`<run_dir>/draft_head/`) is the
head file's, read and written only by heads/head_file.py.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from artifacts import atomic
from artifacts.vocab import VocabMap, load_vocab_map
from heads.eagle3 import NORM_FLAGS
from heads.head_file import HEAD_CONFIG, check_weights, read_head, read_record

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


def checkpoint_dirs(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (with what a killed save or removal left recovered first)."""
    if not ckpt_dir.exists():
        return []
    atomic.recover_dirs(ckpt_dir, "step-*")
    found = [p for p in ckpt_dir.glob("step-*") if (p / STATE_FILE).exists()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


TRAJECTORY_KEYS = ("seed", "head", "optim", "train.num_epochs", "train.max_steps", "train.num_samples",
                   "train.batch_size", "train.pack_length", "train.gradient_accumulation_steps",
                   "train.mixed_precision", "train.init_from", "train.loss", "train.lk_eta",
                   "train.alpha_on")  # fmt: skip


def trajectory_settings(cfg, world_size: int, dataset_fingerprint: str | None) -> dict:
    """Every setting that shapes a run's steps, flattened to dotted keys: what a resume must not change
    silently (the checkpoint's schedule, data order and batches would go on regardless)."""
    from omegaconf import OmegaConf

    def flatten(prefix: str, value) -> dict:
        if isinstance(value, dict):
            return {k: v for key, sub in value.items() for k, v in flatten(f"{prefix}.{key}", sub).items()}
        return {prefix: value}

    settings = {"world_size": world_size, "data.dataset_fingerprint": dataset_fingerprint}
    for key in TRAJECTORY_KEYS:
        value = OmegaConf.select(cfg, key)
        settings |= flatten(
            key, OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        )
    return settings


def changed_settings(recorded: dict | None, current: dict) -> list[str]:
    """`key: checkpoint X, this run Y` per setting that differs (none for a checkpoint recording none)."""
    if recorded is None:
        return []
    return [
        f"{key}: checkpoint {recorded.get(key)!r}, this run {current.get(key)!r}"
        for key in sorted(set(recorded) | set(current))
        if recorded.get(key) != current.get(key)
    ]


def save_checkpoint(
    accelerator, ckpt_dir: Path, step: int, epoch: int, keep_last: int, settings: dict | None = None
) -> Path:
    """Every rank saves its part; the main rank completes and publishes the checkpoint (with `settings`,
    the run's trajectory settings, in its trainer state)."""
    final = ckpt_dir / f"step-{step:06d}"
    tmp = atomic.staging_path(final)  # the same on every rank: each writes its part into it
    if accelerator.is_main_process:
        atomic.begin_publish(final, kind="checkpoint", legacy=(STATE_FILE,))
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
    except (OSError, RuntimeError) as error:  # a full disk surfaces as ENOSPC, or torch's "unexpected pos"
        raise OSError(
            f"writing checkpoint {tmp} failed ({error}); {shutil.disk_usage(ckpt_dir).free / 1e9:.2f} GB free "
            f"on that disk. The previous checkpoint in {ckpt_dir} is intact: free space, then resume"
        ) from error
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        atomic.write_json(tmp / STATE_FILE, {"step": step, "epoch": epoch, "settings": settings})
        atomic.finish_publish(tmp, final, kind="checkpoint", legacy=(STATE_FILE,))
        for old in checkpoint_dirs(ckpt_dir)[:-keep_last]:
            atomic.remove_dir(old, kind="checkpoint", legacy=(STATE_FILE,))
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(path: Path) -> dict:
    """The trainer state (step, epoch, settings) of a checkpoint written by `save_checkpoint`."""
    state_file = path / STATE_FILE
    if not state_file.exists():
        raise ValueError(f"{path} is not a complete checkpoint (no {STATE_FILE}); pick another or start over")
    return json.loads(state_file.read_text())


def restore_checkpoint(accelerator, path: Path) -> None:
    """Restore the model, optimizer, scheduler and RNG states of a checkpoint written by `save_checkpoint`
    (its trainer state: `read_trainer_state`)."""
    try:
        accelerator.load_state(str(path))
    except Exception as error:
        raise ValueError(
            f"checkpoint {path} cannot be loaded ({error}); delete it to resume from an older one"
        ) from error


def read_head_weights(path: Path) -> dict[str, torch.Tensor]:
    """Trainable head weights from a final head directory or a checkpoint directory (for warm starts)."""
    path = Path(path)
    atomic.recover_dir(path)  # a head or checkpoint whose publication was killed: the old one back in place
    if (path / HEAD_CONFIG).exists():
        return read_head(path)[1]
    if (path / STATE_FILE).exists():
        weights_file = path / "model.safetensors"
        if not weights_file.exists():
            raise ValueError(
                f"{path}: checkpoint has no model.safetensors (DeepSpeed checkpoints: export the head first)"
            )
        with safe_open(str(weights_file), framework="pt") as f:
            # The checkpoint holds the training wrapper; the head's weights are under `draft.`.
            weights = {k.removeprefix("draft."): f.get_tensor(k) for k in f.keys() if k.startswith("draft.")}
        check_weights(weights, weights_file)
        return weights
    raise ValueError(
        f"train.init_from={str(path)!r}: neither a head directory ({HEAD_CONFIG}) nor a checkpoint ({STATE_FILE})"
    )


def warm_start_vocab(path: Path) -> VocabMap | None:
    """The draft vocabulary an older head was trained with: its own file, or its run's cache's."""
    for candidate in (path / "vocab.safetensors", path.parent.parent / "cache" / "vocab.safetensors"):
        if candidate.exists():
            return load_vocab_map(candidate)
    return None


def warm_start_flags(path: Path) -> dict | None:
    """The norm flags an older head was trained with: its draft_config.json, or for a checkpoint its run's
    train.yaml (None when neither says; a flag either lacks means off, as before the flag existed)."""
    if (path / HEAD_CONFIG).exists():
        config = read_record(path).config.to_dict()
    elif (path.parent.parent / "train.yaml").exists():
        import yaml

        config = (yaml.safe_load((path.parent.parent / "train.yaml").read_text()) or {}).get("head", {})
    else:
        return None
    return {flag: bool(config.get(flag, False)) for flag in NORM_FLAGS}


def check_warm_start_flags(model: torch.nn.Module, path: Path) -> None:
    """Refuse an older head whose norm flags differ: its weights were fitted to another function (a norm
    added or removed before fc, another residual or carried state), so they would start the run wrong."""
    config = getattr(model, "config", None)
    old = warm_start_flags(path)
    if old is None or not all(hasattr(config, flag) for flag in NORM_FLAGS):
        return  # EAGLE-1 heads have no such flags
    differing = [f for f in NORM_FLAGS if old[f] != bool(getattr(config, f))]
    if differing:
        raise ValueError(
            f"train.init_from={str(path)!r} was trained with other norm flags: "
            + ", ".join(
                f"head.{f}: older head {old[f]}, this run {bool(getattr(config, f))}" for f in differing
            )
            + ". Warm-start with the older head's flags (e.g. "
            + " ".join(f"head.{f}={str(old[f]).lower()}" for f in differing)
            + "), or train the new recipe from scratch"
        )


def remap_lm_head(old_VdH: torch.Tensor, old_ids: torch.Tensor, new_VdH: torch.Tensor, new_ids: torch.Tensor):
    """The new lm_head: the old row of every draft token both vocabularies hold, the new (fresh) row of
    the others. Returns (weights, number of rows carried over)."""
    old_row = {int(token): row for row, token in enumerate(old_ids.tolist())}
    rows = [(new_row, old_row[token]) for new_row, token in enumerate(new_ids.tolist()) if token in old_row]
    out = new_VdH.detach().clone()
    if rows:
        new_rows, old_rows = (torch.tensor(r) for r in zip(*rows))
        out[new_rows] = old_VdH[old_rows].to(out.dtype)
    return out, len(rows)


def load_warm_start(model: torch.nn.Module, path: Path, vocab: VocabMap | None = None) -> None:
    """Copy an older head's weights into `model`, refusing any tensor whose shape differs and an older head
    trained with other norm flags.

    When both heads have an lm_head over a draft vocabulary and the two vocabularies differ (a new domain
    or data set picks other frequent tokens), the lm_head is carried over token by token instead.
    """
    path = Path(path)
    weights = read_head_weights(path)
    check_warm_start_flags(model, path)
    own = {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"}
    old_vocab = warm_start_vocab(path)
    if (
        vocab is not None
        and old_vocab is not None
        and "lm_head.weight" in own
        and "lm_head.weight" in weights
        and weights["lm_head.weight"].shape[1:] == own["lm_head.weight"].shape[1:]
    ):
        old_ids, new_ids = old_vocab.draft_to_target, vocab.draft_to_target
        if not torch.equal(old_ids, new_ids):
            weights["lm_head.weight"], num_kept = remap_lm_head(
                weights["lm_head.weight"], old_ids, own["lm_head.weight"], new_ids
            )
            log.info(
                "warm start: the draft vocabulary changed; %d of %d lm_head rows carried over by token id",
                num_kept, new_ids.numel(),
            )  # fmt: skip
    missing = sorted(set(own) - set(weights))
    fresh = [k for k in missing if k == "mask_hidden" or (k.startswith("layers.") and k.split(".")[1] != "0")]
    if fresh:
        # An EAGLE-3 head (one layer, no mask state) warm-starts a P-EAGLE head: the parallel parts start fresh.
        log.info(
            "warm start: %d tensors the older head lacks start fresh (%s)", len(fresh), ", ".join(fresh[:4])
        )
        missing = [k for k in missing if k not in fresh]
    mismatched = [
        f"  {k}: old {tuple(weights[k].shape)}, new {tuple(v.shape)}"
        for k, v in own.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or mismatched:
        raise ValueError(
            f"train.init_from={str(path)!r} does not fit this head (another target size, draft vocabulary or "
            "aux layer count?):\n" + "\n".join(mismatched + [f"  {k}: missing" for k in missing])
        )
    model.load_state_dict({k: weights[k] for k in own if k in weights}, strict=False)
