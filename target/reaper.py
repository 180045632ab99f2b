"""Nothing a stage starts outlives it: vLLM servers, engine cores and workers are stopped however the stage
dies - an exception, Ctrl-C, SIGTERM, SIGHUP (a closed terminal or ssh session), or SIGKILL, which no code in
the dying process can react to - and however it was launched (in the foreground, in the background of a
subshell that exits at once, under `setsid`).

`with leash(run_dir, "eval"):` around the part of a stage that starts vLLM:

1. stops what earlier, dead runs of any stage left behind in this run directory: every
   `<run_dir>/logs/*.processes.json` whose owner is gone names processes to stop, and the leash says so;
2. starts a reaper, a small process in its own session that watches the stage from outside, and waits
   until it watches. While the stage lives, the reaper adds the stage's descendants to the record
   `<run_dir>/logs/<name>@<host>.processes.json` every `interval` seconds (vLLM's children are reparented to PID 1
   when their parent dies, so they can no longer be found from the tree then - hence the record while it is
   whole). Every process the stage starts also carries the record's token in its environment, which finds
   the ones started and orphaned between two snapshots. Once the stage is gone (a zombie counts as gone: a
   detached stage may never be reaped), the reaper sends SIGTERM to each recorded process still alive
   (matched by pid and start time, so a reused pid is never hit), then SIGKILL after a grace period;
3. SIGTERM and SIGHUP in the stage raise KeyboardInterrupt, as Ctrl-C does, so its own clean-up runs;
4. on any exit of the block, the stage stops what is still alive of its record itself, then releases the
   reaper. The record is deleted only once every process it names is gone.

    python -m target.reaper OWNER_PID OWNER_START RECORD INTERVAL [DIR...]   (started by `leash`)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

GRACE_S = 5.0  # SIGTERM first (vLLM shuts its engine down cleanly), SIGKILL after this
TOKEN_VARIABLE = "EAGLE_PIPELINE_LEASH"  # environment variable every process a stage starts inherits


def start_time(pid: int) -> float | None:
    """The process's start time (seconds since the epoch, psutil's `create_time`); None when gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def alive(pid: int, start: float) -> bool:
    """Whether the process `pid` that started at `start` still runs (a zombie has finished running)."""
    try:
        process = psutil.Process(pid)
        return process.create_time() == start and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def descendants(root: int) -> list[list]:
    """[pid, start time] of every process below `root`."""
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        with contextlib.suppress(psutil.Error):
            found.append([child.pid, child.create_time()])
    return sorted(found)


def carrying(token: str) -> list[list]:
    """[pid, start time] of every process of this user whose environment holds the leash `token`."""
    found = []
    for process in psutil.process_iter(["pid", "create_time"]):
        with contextlib.suppress(psutil.Error):
            if process.pid != os.getpid() and process.environ().get(TOKEN_VARIABLE) == token:
                found.append([process.pid, process.info["create_time"]])
    return sorted(found)


def stop_processes(processes: list[list], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each process still alive, SIGKILL what remains after `grace_s`; returns the pids signalled."""
    living = []
    for pid, start in processes:
        if alive(pid, start):
            with contextlib.suppress(psutil.Error):
                living.append(psutil.Process(pid))
    for process in living:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, remaining = psutil.wait_procs(living, timeout=grace_s)
    for process in remaining:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(remaining, timeout=grace_s)
    return [process.pid for process in living]


def host_name() -> str:
    """This machine's name: pids and start times mean something only on the host that recorded them."""
    return socket.gethostname()


def record_path(run_dir: Path, name: str) -> Path:
    """Where a leashed run of `name` on this host keeps its record: one per host, since ranks of several
    nodes may share a run directory and each must stop only its own host's processes."""
    return Path(run_dir) / "logs" / f"{name}@{host_name()}.processes.json"


def write_record(
    record: Path,
    owner: int,
    owner_start: float,
    processes: list[list],
    token: str = "",
    reaper: int | None = None,
) -> None:
    """The record of a leashed run: its owner, its token, the reaper watching it (None until one does) and
    the processes it started."""
    from artifacts.atomic import write_json

    values = {
        "host": host_name(),
        "owner": [owner, owner_start],
        "token": token,
        "reaper": reaper,
        "processes": processes,
    }
    write_json(record, values)


def read_record(record: Path) -> dict | None:
    try:
        values = json.loads(record.read_text())
        values["owner"] = list(values["owner"])
        values.setdefault("host", host_name())  # a record from before hosts were recorded: this one's
        values.setdefault("token", "")
        values.setdefault("reaper", None)
        values["processes"] = [list(p) for p in values["processes"]]
        return values
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stop_record(record: Path) -> list[int]:
    """Stop every process `record` names (and every one carrying its token); delete the record once none
    of them is left. Returns the pids stopped."""
    values = read_record(record)
    if values is None:
        record.unlink(missing_ok=True)  # unreadable: nothing can be matched safely
        return []
    processes = values["processes"] + (carrying(values["token"]) if values["token"] else [])
    stopped = stop_processes(processes)
    if not any(alive(pid, start) for pid, start in processes):
        record.unlink(missing_ok=True)
    return stopped


def refuse_live_run(record: Path) -> None:
    """Refuse to start while the owner of `record` (an earlier run of this stage here) still runs."""
    values = read_record(record) if record.exists() else None
    if values is not None and alive(*values["owner"]):
        raise RuntimeError(
            f"{record}: another run of this stage (pid {values['owner'][0]}) is still running in this run "
            "directory; wait for it or stop it first"
        )


def stop_dead_runs(logs: Path) -> dict[str, list[int]]:
    """Stop what every dead run recorded under `logs` left running: record name -> pids stopped."""
    stopped = {}
    for record in sorted(logs.glob("*.processes.json")):
        values = read_record(record)
        if values is not None and values["host"] != host_name():
            continue  # another node's (a shared run directory): its pids mean nothing here
        if values is not None and alive(*values["owner"]):
            continue  # a live run (another rank of this stage, say) owns it
        pids = stop_record(record)
        if pids:
            stopped[record.name.removesuffix(".processes.json").rsplit("@", 1)[0]] = pids
    return stopped


def watch(owner: int, owner_start: float, record: Path, interval: float, remove: list[Path] = ()) -> None:
    """The reaper's loop: record while the owner lives, then stop what is left and delete `remove`.
    SIGUSR1 (the owner's own exit, after it stopped its processes) ends it without stopping anything."""
    released = []
    signal.signal(signal.SIGUSR1, lambda *_: released.append(True))
    for ignored in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hang-up is the owner's to handle
        signal.signal(ignored, signal.SIG_IGN)
    token = (read_record(record) or {"token": ""})["token"]
    recorded: list[list] = []
    write_record(record, owner, owner_start, recorded, token, reaper=os.getpid())  # the owner waits for this
    while not released and alive(owner, owner_start):
        # Keep every process seen: one that has left the tree (reparented) may still be running.
        current = {tuple(p) for p in descendants(owner) + recorded}
        current = sorted(list(p) for p in current if p[0] != os.getpid())
        if current != recorded:
            recorded = current
            write_record(record, owner, owner_start, recorded, token, reaper=os.getpid())
        time.sleep(interval)
    if released:
        return
    while stop_record(record) or record.exists():  # until nothing it names is left
        time.sleep(interval)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def stop_signals_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt in the main thread while inside, as Ctrl-C does."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread: signals cannot be handled here
        for signum in (signal.SIGTERM, signal.SIGHUP):
            previous[signum] = signal.signal(signum, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def leash(run_dir: Path, name: str, interval: float = 0.25, remove: list[Path] = ()):
    """While inside, every process this one starts is stopped if this process dies (see the module doc),
    and the directories `remove` (scratch files of those processes, e.g. captured hidden states) deleted."""
    record = record_path(run_dir, name)
    logs = record.parent
    logs.mkdir(parents=True, exist_ok=True)
    refuse_live_run(record)
    for earlier, pids in stop_dead_runs(logs).items():
        log.warning("stopped %d processes a dead %s run left running: pids %s", len(pids), earlier, pids)
    owner, owner_start = os.getpid(), start_time(os.getpid())
    before = {tuple(p) for p in descendants(owner)}  # started outside the leash: not its to stop
    token = uuid.uuid4().hex
    write_record(record, owner, owner_start, [], token)
    reaper = subprocess.Popen(
        [sys.executable, "-m", "target.reaper", str(owner), repr(owner_start), str(record), str(interval)]
        + [str(Path(path).resolve()) for path in remove],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the stage's session: a group kill or a hang-up must not take it along
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
    )
    while reaper.poll() is None and not watched(record):  # nothing may start before the reaper watches
        time.sleep(0.02)
    if reaper.poll() is not None:
        log.warning(
            "the reaper of %s exited at once (%s): a kill of this stage may leave processes",
            name,
            reaper.returncode,
        )
    previous_token = os.environ.get(TOKEN_VARIABLE)
    os.environ[TOKEN_VARIABLE] = token
    try:
        with stop_signals_interrupt():
            yield
    finally:
        if previous_token is None:
            os.environ.pop(TOKEN_VARIABLE, None)
        else:
            os.environ[TOKEN_VARIABLE] = previous_token
        values = read_record(record) or {"processes": []}
        started = values["processes"] + descendants(owner) + carrying(token)
        started = [p for p in started if tuple(p) not in before and p[0] != reaper.pid]
        stop_processes(started)
        reaper.send_signal(signal.SIGUSR1)
        reaper.wait()
        if not any(alive(*p) for p in started):
            record.unlink(missing_ok=True)


def watched(record: Path) -> bool:
    """Whether the reaper has started watching (it marks the record when it does)."""
    values = read_record(record)
    return values is not None and values["reaper"] is not None


if __name__ == "__main__":
    watch(
        int(sys.argv[1]),
        float(sys.argv[2]),
        Path(sys.argv[3]),
        float(sys.argv[4]),
        [Path(path) for path in sys.argv[5:]],
    )
