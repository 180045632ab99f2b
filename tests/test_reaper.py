"""target/reaper.py: what a stage starts does not outlive it, whether the stage exits, raises, is killed or
hung up, and however it was launched (foreground, detached from a subshell, under setsid)."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import target.reaper
from target.reaper import (
    alive,
    descendants,
    leash,
    record_path,
    refuse_live_run,
    start_time,
    stop_dead_runs,
    write_record,
)
from tests.helpers import REPO

# An owner that starts a process tree under a leash - a child in its own session (as eval's vLLM server),
# and a grandchild that the child detaches from (as vLLM's engine core from its server); both ignore SIGHUP,
# so only the leash can stop them after a hang-up - prints the tree's pids and its own, then waits.
OWNER = textwrap.dedent(
    """
    import subprocess, sys, time
    from pathlib import Path
    from target.reaper import leash
    with leash(Path(sys.argv[1]), "stage", interval=float(sys.argv[2])):
        time.sleep(float(sys.argv[4]))
        child = subprocess.Popen(
            ["sh", "-c", "trap '' HUP; sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
            start_new_session=sys.argv[3] == "session",
        )
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


def start_owner(run_dir, env, interval=0.1, child="group", launch=(), delay=0.0):
    """The owner started through `launch` (e.g. setsid), its child `delay` s after the leash; returns the
    owner, its tree and its record."""
    owner = subprocess.Popen(
        [*launch, sys.executable, "-c", OWNER, str(run_dir), str(interval), child, str(delay)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    pids = [int(p) for p in owner.stdout.readline().split()]
    tree = [[pid, start_time(pid)] for pid in pids]
    return owner, tree, record_path(run_dir, "stage")


def recorded(record, tree) -> bool:
    return record.exists() and all(p in json.loads(record.read_text())["processes"] for p in tree)


def assert_nothing_left(tree, record):
    assert wait_until(lambda: not any(alive(*p) for p in tree), 15), "processes outlived their owner"
    assert wait_until(lambda: not record.exists(), 5), "the record outlived the processes it names"


def test_a_killed_owners_processes_are_stopped_although_the_owner_is_never_reaped(tmp_path, subprocess_env):
    # Nobody waits for the killed owner: it stays a zombie, as a detached stage under a PID 1 that does
    # not reap. Its tree must still be stopped.
    owner, tree, record = start_owner(tmp_path, subprocess_env)
    assert wait_until(lambda: recorded(record, tree), 10)
    owner.send_signal(signal.SIGKILL)
    assert_nothing_left(tree, record)
    owner.wait()


def test_a_detached_owner_killed_from_outside_leaves_nothing(tmp_path, subprocess_env):
    # `( python eval/main.py ... & )`: the subshell exits at once and the stage belongs to no shell.
    (tmp_path / "owner.py").write_text(OWNER)
    script = f"({sys.executable} {tmp_path / 'owner.py'} {tmp_path} 0.1 session 0 > {tmp_path / 'out'} &)"
    subprocess.run(["bash", "-c", script], cwd=REPO, env=subprocess_env, check=True)
    out = tmp_path / "out"
    assert wait_until(lambda: out.exists() and out.read_text().endswith("\n"), 30)
    tree = [[pid, start_time(pid)] for pid in map(int, out.read_text().split())]
    record = record_path(tmp_path, "stage")
    assert wait_until(lambda: recorded(record, tree), 10)
    owner = json.loads(record.read_text())["owner"][0]
    os.kill(owner, signal.SIGKILL)
    assert_nothing_left(tree, record)


def test_a_hang_up_of_a_setsid_stage_stops_its_children(tmp_path, subprocess_env):
    # `setsid python data_prep/main.py ...`, then the session hangs up (a closed terminal or ssh session).
    owner, tree, record = start_owner(tmp_path, subprocess_env, launch=["setsid"])
    assert wait_until(lambda: recorded(record, tree), 10)
    os.killpg(owner.pid, signal.SIGHUP)
    assert owner.wait(timeout=30) != 0
    assert_nothing_left(tree, record)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_stage_as_ctrl_c_does(tmp_path, subprocess_env, signum):
    owner, tree, record = start_owner(tmp_path, subprocess_env, child="session")
    assert wait_until(lambda: recorded(record, tree), 10)
    owner.send_signal(signum)
    assert owner.wait(timeout=30) == -signal.SIGINT  # KeyboardInterrupt, raised through the clean-up
    assert_nothing_left(tree, record)


def test_a_kill_before_any_snapshot_still_finds_what_the_stage_started(tmp_path, subprocess_env):
    # Killed while starting (its child started after the reaper's first snapshot, the next 60 s away): the
    # child, in its own session and reparented at once, is found by the token it inherited.
    owner, tree, record = start_owner(tmp_path, subprocess_env, interval=60, child="session", delay=1.0)
    assert not recorded(record, tree)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    # The reaper sleeps out its interval before it looks again; the rerun below does not wait for it.
    time.sleep(0.5)
    with leash(tmp_path, "another_stage"):
        pass
    assert_nothing_left(tree, record)


@pytest.mark.parametrize("stage", ["eval", "export"])
def test_a_rerun_of_any_stage_stops_what_an_earlier_killed_run_left(tmp_path, caplog, stage):
    # An earlier run and its reaper both died (say, a power cut of the container): its record remains.
    leftover = subprocess.Popen(["sleep", "300"], start_new_session=True)
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    record = record_path(tmp_path, "eval")
    record.parent.mkdir()
    write_record(record, dead_owner.pid, 12345.0, [[leftover.pid, start_time(leftover.pid)]])
    with (
        caplog.at_level(logging.WARNING, logger="target.reaper"),
        leash(tmp_path, stage),
    ):  # the same or another
        assert leftover.poll() is not None  # stopped (and reaped by the leash: its exit status is gone)
    assert f"a dead eval run left running: pids [{leftover.pid}]" in caplog.text
    assert not record.exists()


def test_a_live_run_in_the_same_directory_is_not_touched(tmp_path):
    record = record_path(tmp_path, "stage")
    record.parent.mkdir()
    write_record(record, os.getpid(), start_time(os.getpid()), [])
    with pytest.raises(RuntimeError, match=r"another run of this stage \(pid \d+\) is still running"):
        refuse_live_run(record)


def test_a_normal_exit_stops_what_the_block_started_and_leaves_no_reaper_or_record(tmp_path):
    kept = subprocess.Popen(["sleep", "300"])  # started before the leash: not the leash's to stop
    before = descendants(os.getpid())
    try:
        with leash(tmp_path, "stage"):
            assert len(descendants(os.getpid())) == len(before) + 1  # the reaper
            forgotten = subprocess.Popen(["sleep", "300"], start_new_session=True)
        assert forgotten.poll() is not None  # stopped by the leash on the way out
        assert descendants(os.getpid()) == before
        assert not (record_path(tmp_path, "stage")).exists()
        assert kept.poll() is None
    finally:
        kept.kill()
        kept.wait()


def test_two_hosts_on_one_run_directory_keep_their_own_records(tmp_path, monkeypatch):
    """A rank on node B must not take node A's live record for a dead run: pids mean nothing across hosts."""
    dead_owner = subprocess.Popen(["true"])
    dead_owner.wait()
    here = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        monkeypatch.setattr(target.reaper, "host_name", lambda: "node-a")
        record_a = record_path(tmp_path, "data_prep-rank0")
        record_a.parent.mkdir()
        # Node A's live rank: its owner's pid does not exist on node B, and its engine's pid may be anyone's.
        write_record(record_a, dead_owner.pid, 12345.0, [[here.pid, start_time(here.pid)]])
        monkeypatch.setattr(target.reaper, "host_name", lambda: "node-b")
        assert record_path(tmp_path, "data_prep-rank0") != record_a  # one record per host, same stage name
        assert stop_dead_runs(tmp_path / "logs") == {}
        assert record_a.exists() and here.poll() is None  # node A's record and processes untouched
        monkeypatch.setattr(target.reaper, "host_name", lambda: "node-a")  # node A's own rerun: its dead run
        assert stop_dead_runs(tmp_path / "logs") == {"data_prep-rank0": [here.pid]}
        assert not record_a.exists()
    finally:
        here.kill()
        here.wait()
