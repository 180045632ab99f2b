"""Nothing a stage starts outlives it: vLLM servers, engine cores and workers are stopped however the stage
dies - an exception, Ctrl-C, or SIGKILL, which no code in the dying process can react to.

`with leash(run_dir, "eval"):` around the part of a stage that starts vLLM:

1. stops what an earlier run of that stage left behind in this run directory (its record names processes
   whose owner is dead: a reaper that was itself killed, or a machine that lost power mid-run);
2. starts a reaper, a small process in its own session that watches the stage from outside. While the
   stage lives, the reaper snapshots the stage's descendants every `interval` seconds into
   `<run_dir>/logs/<name>.processes.json`; once the stage is gone, it sends SIGTERM to each snapshotted
   process still alive (matched by pid and start time, so a reused pid is never hit), then SIGKILL after
   a grace period. vLLM's children are reparented to PID 1 when their parent dies, so they can no longer
   be found from the tree then - hence the snapshots while it is whole.
3. On a normal exit the reaper is told to stop and the record is removed.

Linux only (/proc); elsewhere the leash does nothing but say so.

    python -m target.reaper OWNER_PID OWNER_START RECORD [INTERVAL [DIR...]]   (started by `leash`)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

GRACE_S = 5.0  # SIGTERM first (vLLM shuts its engine down cleanly), SIGKILL after this


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(fields[19])


def parents() -> dict[int, int]:
    """pid -> parent pid of every process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return found


def descendants(root: int) -> list[list[int]]:
    """[pid, start time] of every process below `root`."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents().items():
        children.setdefault(parent, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        start = start_time(pid)
        if start is not None:
            found.append([pid, start])
        todo += children.get(pid, [])
    return sorted(found)


def alive(pid: int, start: int) -> bool:
    return start_time(pid) == start


def stop_processes(processes: list[list[int]], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each process still alive, SIGKILL what remains after `grace_s`; returns the pids signalled."""
    living = [(pid, start) for pid, start in processes if alive(pid, start)]
    for pid, _ in living:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(pid, start) for pid, start in living):
        time.sleep(0.1)
    for pid, start in living:
        if alive(pid, start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    return [pid for pid, _ in living]


def write_record(record: Path, owner: int, owner_start: int, processes: list[list[int]]) -> None:
    tmp = record.with_name(f".{record.name}.tmp")
    tmp.write_text(json.dumps({"owner": [owner, owner_start], "processes": processes}))
    os.replace(tmp, record)


def stop_leftovers(record: Path) -> list[int]:
    """Stop the processes an earlier, dead owner recorded in `record`; returns their pids."""
    if not record.exists():
        return []
    try:
        earlier = json.loads(record.read_text())
        owner, owner_start = earlier["owner"]
        processes = earlier["processes"]
    except (ValueError, KeyError, TypeError):
        record.unlink(missing_ok=True)  # unreadable: nothing can be matched safely
        return []
    if alive(owner, owner_start):
        raise RuntimeError(
            f"{record}: another run of this stage (pid {owner}) is still running in this run directory; "
            "wait for it or stop it first"
        )
    stopped = stop_processes(processes)
    record.unlink(missing_ok=True)
    return stopped


def watch(owner: int, owner_start: int, record: Path, interval: float, remove: list[Path] = ()) -> None:
    """The reaper's loop: snapshot while the owner lives, then stop what is left and delete `remove`.
    SIGUSR1 (the owner's normal exit) ends it without stopping or deleting anything."""
    released = []
    signal.signal(signal.SIGUSR1, lambda *_: released.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is the owner's to handle
    snapshot: list[list[int]] = []
    while not released and alive(owner, owner_start):
        current = descendants(owner)
        if current:
            # Keep processes seen earlier that are still alive: a child may already be reparented.
            merged = {tuple(p) for p in current} | {tuple(p) for p in snapshot if alive(*p)}
            current = sorted(list(p) for p in merged if p[0] != os.getpid())
        if current != snapshot:
            snapshot = current
            write_record(record, owner, owner_start, snapshot)
        time.sleep(interval)
    if released:
        return
    stop_processes(snapshot)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)
    record.unlink(missing_ok=True)


@contextlib.contextmanager
def leash(run_dir: Path, name: str, interval: float = 0.5, remove: list[Path] = ()):
    """While inside, every process this one starts is stopped if this process dies (see the module doc),
    and the directories `remove` (scratch files of those processes, e.g. captured hidden states) deleted."""
    if not Path("/proc/self/stat").exists():
        log.warning("no /proc: processes started by %s are not watched (Linux only)", name)
        yield
        return
    record = Path(run_dir) / "logs" / f"{name}.processes.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    stopped = stop_leftovers(record)
    if stopped:
        log.warning(
            "stopped %d processes an earlier, killed %s run left running: pids %s",
            len(stopped),
            name,
            stopped,
        )
    owner, owner_start = os.getpid(), start_time(os.getpid())
    write_record(record, owner, owner_start, [])
    reaper = subprocess.Popen(
        [sys.executable, "-m", "target.reaper", str(owner), str(owner_start), str(record), str(interval)]
        + [str(Path(path).resolve()) for path in remove],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the stage's process group: a group kill must not take it along
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    try:
        yield
    finally:
        reaper.send_signal(signal.SIGUSR1)
        reaper.wait()
        record.unlink(missing_ok=True)


if __name__ == "__main__":
    watch(
        int(sys.argv[1]),
        int(sys.argv[2]),
        Path(sys.argv[3]),
        float(sys.argv[4]) if len(sys.argv) > 4 else 0.5,
        [Path(path) for path in sys.argv[5:]],
    )
