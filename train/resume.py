"""Resuming a run: `train.resume` (never | always | auto), the point a run starts from (its latest
checkpoint, refused when written with other trajectory settings unless `train.resume_changed=true`), the
step records a killed run logged past that checkpoint, and the stop request that ends a run resumably
(SIGINT / SIGTERM: checkpoint at the end of the step, then exit).

    python train/main.py run_dir=/runs/x train.resume=true    # continue from /runs/x/ckpt's latest

The checkpoints themselves (what they hold, how they are written) are train/checkpoint.py's.
"""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

from artifacts import atomic
from train.checkpoint import changed_settings, checkpoint_dirs, read_trainer_state, restore_checkpoint

# Settings that decide the head's tensors: a checkpoint's weights fit only a head built with its values.
HEAD_SHAPE_KEYS = ("head.kind", "head.num_layers")

log = logging.getLogger("train")  # the loop's own logger: its lines read `train: ...`


def resume_mode(value) -> str:
    """train.resume as never | always | auto (true/false are accepted for always/never)."""
    mode = {"true": "always", "false": "never"}.get(str(value).lower(), str(value).lower())
    if mode not in ("never", "always", "auto"):
        raise ValueError(f"train.resume={value!r}: choose never, always (true) or auto")
    return mode


def drop_records_after(step: int, *paths: Path) -> None:
    """Remove the records of steps after `step` (logged before a kill, replayed after the resume), so
    that each step is in the logs once."""
    for path in paths:
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= step]  # fmt: skip
            atomic.write_text(path, "".join(kept))


def resume_point(cfg, accelerator, run_dir: Path, settings: dict, optimizer, scheduler) -> tuple[int, int]:
    """(step, epoch) the run starts at: (0, 0), or under train.resume the latest checkpoint's in
    <run_dir>/ckpt, restored into the prepared model, optimizer and scheduler (on every rank).

    `settings` are this run's trajectory settings, compared with those the checkpoint recorded.
    """
    ckpt_dir = run_dir / "ckpt"
    resume = resume_mode(cfg.train.resume)
    checkpoints = checkpoint_dirs(ckpt_dir)
    if checkpoints and resume == "never":
        raise ValueError(
            f"{ckpt_dir} holds checkpoints of an earlier run: continue it with train.resume=true, or use "
            "another run_dir (or delete that ckpt/) to train from scratch"
        )
    if resume == "always" and not checkpoints:
        raise ValueError(f"train.resume=true but {ckpt_dir} has no complete checkpoint to resume from")
    if not checkpoints or resume == "never":
        return 0, 0
    latest = checkpoints[-1]
    state = read_trainer_state(latest)
    recorded = state.get("settings")
    shaped = changed_settings(head_shape(recorded), head_shape(settings))
    if shaped:  # before loading: the weights would not fit, and the error would name a tensor
        raise ValueError(
            f"{latest} holds another head than this run builds:\n  " + "\n  ".join(shaped)
            + "\nResume with the checkpoint's value of those settings (train.resume_changed cannot change "
            "them), or train this head in another run_dir (train.init_from can warm-start it from this one)"
        )  # fmt: skip
    changed = changed_settings(recorded, settings)
    if changed and not cfg.train.resume_changed:
        raise ValueError(
            f"{latest} was written with other settings than this run's:\n  " + "\n  ".join(changed)
            + "\nResume with the checkpoint's values, or add train.resume_changed=true to go on from the "
            "checkpoint's step with these"
        )  # fmt: skip
    restore_checkpoint(accelerator, latest)
    if changed:
        log.warning("resuming with changed settings (train.resume_changed=true):\n  %s", "\n  ".join(changed))
        apply_optim_settings(cfg, optimizer, scheduler)
    log.info("resumed from %s (step %d)", latest, state["step"])
    if accelerator.is_main_process:
        drop_records_after(state["step"], run_dir / "train_steps.jsonl", run_dir / "train_eval.jsonl")
    return state["step"], state["epoch"]


def head_shape(settings: dict | None) -> dict | None:
    """The trajectory settings that decide the head's tensors (None: a checkpoint recording none)."""
    return None if settings is None else {key: settings.get(key) for key in HEAD_SHAPE_KEYS}


def apply_optim_settings(cfg, optimizer, scheduler) -> None:
    """A checkpoint restores the optimizer's hyperparameters and the schedule's peak rate as they were;
    under train.resume_changed the run goes on with this config's instead, so that what the run records
    (train.yaml, draft_config.json) is what it used."""
    for group in optimizer.param_groups:
        group.update(
            betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay, initial_lr=cfg.optim.lr
        )
    scheduler.base_lrs = [cfg.optim.lr] * len(optimizer.param_groups)
    rates = [
        base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)
    ]
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = rates


class StopRequest:
    """While active, SIGINT / SIGTERM set a flag; the loop checkpoints at the end of the step and exits.

    The previous handlers come back on exit, so a run() inside a larger program leaves Ctrl-C as it was.
    """

    def __enter__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        self.requested = True
