"""One writer per run directory: `with hold_run_dir(run_dir, "data_prep"):` around a stage's work.

A second stage started on the same run_dir while one writes it (two data_prep runs started together on a
fresh directory, an eval started while export still verifies) is refused at once with who holds it, instead
of failing later on a half-built target or cache. The lock is an `flock` on `<run_dir>/.lock`: the kernel
drops it when its holder exits, however it exits (SIGKILL and power loss included), so no stale lock is ever
left to clear by hand. Under `accelerate launch` the main process (RANK 0) holds it for all ranks; a stage
that runs another in-process (tests, grid) holds it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import time
from pathlib import Path

_held: dict[Path, int] = {}  # run directories this process holds -> nesting depth


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, stage: str):
    """Hold `run_dir` (created if absent) for `stage` while inside; ValueError if another process holds it."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if run_dir in _held or os.environ.get("RANK", "0") != "0":
        _held[run_dir] = _held.get(run_dir, 0) + 1
        try:
            yield
        finally:
            _held[run_dir] -= 1
            if not _held[run_dir]:
                del _held[run_dir]
        return
    path = run_dir / ".lock"
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            try:
                holder = json.loads(handle.read())
                who = f"{holder['stage']} (pid {holder['pid']}, since {holder['since']})"
            except (ValueError, KeyError):
                who = "another run"
            raise ValueError(
                f"run_dir={run_dir}: {who} is writing this run directory; wait for it to finish or stop it, "
                "or give this run another run_dir"
            ) from None
        handle.seek(0)
        handle.truncate()
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        handle.write(json.dumps({"stage": stage, "pid": os.getpid(), "since": since}))
        handle.flush()
        _held[run_dir] = 1
        try:
            yield
        finally:
            del _held[run_dir]
    finally:
        handle.close()  # releases the lock


def holds_run_dir(stage: str):
    """Decorates a stage's `run(cfg)`: the whole run holds `cfg.run_dir`."""

    def decorate(run):
        @functools.wraps(run)
        def held(cfg, *args, **kwargs):
            with hold_run_dir(Path(cfg.run_dir), stage):
                return run(cfg, *args, **kwargs)

        return held

    return decorate
