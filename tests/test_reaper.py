"""target/reaper.py: what a stage starts does not outlive it, whether the stage exits, raises or is killed."""

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from target.reaper import alive, descendants, leash, start_time, stop_leftovers, write_record
from tests.conftest import REPO

# An owner that starts a process tree under a leash (a child, and a grandchild that the child detaches
# from, as vLLM's engine core is to its server), prints the tree's pids, then waits to be killed.
OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from target.reaper import leash
    with leash(Path(sys.argv[1]), "stage", interval=0.1):
        child = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        grandchild = int(child.stdout.readline())
        print(child.pid, grandchild, flush=True)
        time.sleep(300)
    """
)


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def start_owner(run_dir, subprocess_env):
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(run_dir)],
        cwd=REPO,
        env=subprocess_env,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in owner.stdout.readline().split()]
    tree = [[pid, start_time(pid)] for pid in pids]
    record = run_dir / "logs" / "stage.processes.json"
    # The reaper has seen the whole tree before the kill.
    assert wait_until(
        lambda: record.exists() and all(p in json.loads(record.read_text())["processes"] for p in tree), 10
    )
    return owner, tree, record


def test_a_killed_owners_processes_are_stopped_within_seconds(tmp_path, subprocess_env):
    owner, tree, record = start_owner(tmp_path, subprocess_env)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_until(lambda: not any(alive(*p) for p in tree), 10), "processes outlived their killed owner"
    assert wait_until(lambda: not record.exists(), 5)


def test_a_rerun_stops_what_an_earlier_killed_run_left(tmp_path):
    # An earlier run and its reaper both died (say, a power cut of the container): its record remains.
    leftover = subprocess.Popen(["sleep", "300"], start_new_session=True)
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    record = tmp_path / "logs" / "stage.processes.json"
    record.parent.mkdir()
    write_record(record, dead_owner.pid, 12345, [[leftover.pid, start_time(leftover.pid)]])
    with leash(tmp_path, "stage"):
        assert leftover.wait(timeout=10) == -signal.SIGTERM
    assert not record.exists()


def test_a_live_run_in_the_same_directory_is_not_touched(tmp_path):
    import os

    record = tmp_path / "stage.processes.json"
    write_record(record, os.getpid(), start_time(os.getpid()), [])
    with pytest.raises(RuntimeError, match=r"another run of this stage \(pid \d+\) is still running"):
        stop_leftovers(record)


def test_a_normal_exit_leaves_no_reaper_and_no_record(tmp_path):
    import os

    before = descendants(os.getpid())
    with leash(tmp_path, "stage"):
        assert len(descendants(os.getpid())) == len(before) + 1  # the reaper
    assert descendants(os.getpid()) == before
    assert not (tmp_path / "logs" / "stage.processes.json").exists()
