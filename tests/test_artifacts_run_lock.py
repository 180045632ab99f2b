"""artifacts/run_lock.py: one stage writes a run directory at a time; the lock dies with its holder."""

import re
import signal
import subprocess
import sys
import time

import pytest

from artifacts.config import compose
from artifacts.run_lock import hold_run_dir
from tests.helpers import REPO

HOLDER = (
    "import sys, time\n"
    "from artifacts.run_lock import hold_run_dir\n"
    "with hold_run_dir(sys.argv[1], 'data_prep'):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(300)\n"
)


def start_holder(run_dir, env):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_stage_on_a_held_run_dir_is_refused_naming_the_holder(tmp_path, subprocess_env):
    from train.main import run

    run_dir = tmp_path / "fresh" / "run"  # not there yet: the holder creates it
    holder = start_holder(run_dir, subprocess_env)
    try:
        message = f"run_dir={run_dir}: data_prep (pid {holder.pid}, since "
        with pytest.raises(ValueError, match=re.escape(message) + ".*wait for it to finish or stop it"):
            run(compose("config", ["experiment=smoke", f"run_dir={run_dir}"]))
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # nothing written by the refused run
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel dropped the killed holder's lock: nothing stale to clear.
    with hold_run_dir(run_dir, "train"):
        with hold_run_dir(run_dir, "export"):  # a stage running another in-process holds it once
            pass


def test_the_lock_is_free_again_once_its_holder_exits(tmp_path):
    with hold_run_dir(tmp_path, "eval"):
        time.sleep(0.01)
    probe = subprocess.run(
        [sys.executable, "-c", HOLDER.replace("time.sleep(300)", "pass"), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO)},
    )
    assert probe.stdout.strip() == "held", probe.stderr
