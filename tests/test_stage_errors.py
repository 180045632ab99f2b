"""Every failure says its cause: vLLM's root cause quoted from its log (the engine's own error says only "See
root cause above"), a full disk with what to do, an unwritable directory or an interrupt as one line
instead of a traceback (artifacts/errors.py), an interrupt during vLLM's engine start that returns, and a
render.max_length that leaves nothing named."""

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from artifacts.errors import stage_errors
from eval.server import ServerError, VllmServer
from target.vllm import root_cause, vllm_log_file
from tests.helpers import REPO, smoke_config

ENGINE_FAILURE = """INFO 11-26 [core.py:90] Initializing a V1 LLM engine
(EngineCore_DP0 pid=123) ERROR 11-26 [core.py:700] EngineCore failed to start.
(EngineCore_DP0 pid=123) Traceback (most recent call last):
(EngineCore_DP0 pid=123)   File "weight_utils.py", line 500, in safetensors_weights_iterator
(EngineCore_DP0 pid=123) safetensors_rust.SafetensorError: Error while deserializing header: incomplete metadata
Traceback (most recent call last):
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_the_root_cause_is_the_first_error_that_is_not_vllm_pointing_at_it(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(ENGINE_FAILURE)
    assert root_cause(log) == (
        f"root cause (vLLM's log {log}): safetensors_rust.SafetensorError: Error while deserializing header: "
        "incomplete metadata"
    )
    log.write_text(
        ENGINE_FAILURE.replace(
            "safetensors_rust.SafetensorError", "OSError: [Errno 28] No space left on device"
        )
    )
    assert "No space left on device" in root_cause(log) and "rerun the same command" in root_cause(log)
    log.write_text("INFO all fine\nRuntimeError: Engine core initialization failed. See root cause above.\n")
    assert root_cause(log) is None and root_cause(tmp_path / "absent.log") is None


def test_an_engine_error_inside_the_log_file_carries_its_root_cause(tmp_path):
    log = tmp_path / "logs" / "capture.log"
    with pytest.raises(RuntimeError) as raised, vllm_log_file(log):
        log.write_text(
            ENGINE_FAILURE.replace(
                "safetensors_rust.SafetensorError", "OSError: [Errno 28] No space left on device"
            )
        )
        raise RuntimeError("conversation 'c1': vLLM's hidden-states file /x/c1.safetensors was not written")
    message = str(raised.value)
    assert message.startswith("conversation 'c1'") and "No space left on device" in message
    assert str(log) in message and "it resumes from what it finished" in message


def test_a_server_that_dies_is_reported_with_its_root_cause_and_log(tmp_path):
    server = VllmServer("target", tmp_path / "server.log", startup_timeout_s=60)
    script = f"import sys; sys.stdout.write({ENGINE_FAILURE!r}); sys.exit(1)"
    server.command = [sys.executable, "-c", script]
    with pytest.raises(ServerError) as raised:
        server.start()
    message = str(raised.value).splitlines()[0]
    assert "exited with code 1" in message and "SafetensorError: Error while deserializing header" in message
    assert str(tmp_path / "server.log") in message


@pytest.mark.parametrize(
    "error, code, line",
    [
        (KeyboardInterrupt(), 130, "data_prep: interrupted; rerun the same command: it resumes"),
        (
            KeyboardInterrupt("stopped at step 3; checkpoint saved"),
            130,
            "data_prep: stopped at step 3; checkpoint",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "/runs/x/cache"),
            1,
            "may not write /runs/x/cache",
        ),
        (OSError(errno.ENOSPC, "No space left on device", "/runs/x/cache/shard.tmp"), 1, "no space left"),
        (  # what rank 0 raised at its barrier when bench.two_nodes killed the other machine
            RuntimeError(
                "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                "peer [127.0.0.1]:1940. This is typically caused by a remote worker crashing."
            ),
            1,
            "another process of this distributed job stopped (Connection closed by peer)",
        ),
    ],
)
def test_a_stage_stopped_from_outside_says_so_in_one_line(error, code, line, capsys):
    @stage_errors("data_prep")
    def main():
        raise error

    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == code
    err = capsys.readouterr().err
    assert line in err and len(err.strip().splitlines()) == 1


def test_other_errors_keep_their_traceback():
    @stage_errors("train")
    def main():
        raise FileNotFoundError(errno.ENOENT, "No such file", "/x")

    with pytest.raises(FileNotFoundError):
        main()

    @stage_errors("train")
    def fails():
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        fails()


def test_a_run_dir_the_stage_may_not_write_is_one_line(subprocess_env):
    run_dir = "/sys/eagle_cannot_write_here"  # refused even to root
    done = subprocess.run(
        [sys.executable, "data_prep/main.py", "experiment=smoke", f"run_dir={run_dir}"],
        cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"data_prep: may not write {run_dir}" in done.stderr and "choose a run_dir" in done.stderr


def test_a_max_length_that_leaves_nothing_names_the_setting(smoke_target_dir, tmp_path):
    from data_prep.main import run

    shutil.copytree(smoke_target_dir, tmp_path / "smoke_target")
    with pytest.raises(ValueError, match=r"within render.max_length=1 .*raise render.max_length"):
        run(smoke_config(tmp_path, "render.max_length=1"))


# SIGTERM takes the same path as SIGINT (target/vllm.py interrupts_kept): slow, to keep one real engine start.
@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_an_interrupt_while_the_verification_engine_starts_returns_and_leaves_nothing(
    smoke_head, tmp_path, subprocess_env, signum
):
    """Ctrl-C to the process group (or SIGTERM to export alone) while vLLM's engine is starting: export says
    its one line within seconds and nothing of its process group is left running. vLLM 0.32 swallows the
    interrupt in that wait and then waited minutes for the engine the same Ctrl-C had stopped
    (target/vllm.py interrupts_kept; issue 46)."""
    import psutil

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_head, run_dir)
    command = [sys.executable, "export/main.py", "experiment=smoke", f"run_dir={run_dir}", "export.verify=true",
               "export.format=plain"]  # fmt: skip
    export = subprocess.Popen(command, cwd=REPO, env=subprocess_env, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    log = run_dir / "logs" / "export_verify.log"
    deadline = time.monotonic() + 240
    # The engine's configuration is logged just before its process starts; then its start-up, ~10 s here.
    while "Enabled custom fusions" not in (log.read_text() if log.exists() else ""):
        assert export.poll() is None and time.monotonic() < deadline, export.stderr.read()[-3000:]
        time.sleep(0.2)
    time.sleep(2)
    group = [p for p in psutil.process_iter() if p.pid != export.pid and safe_pgid(p.pid) == export.pid]
    assert group, "the engine's process should be starting"
    if signum == signal.SIGINT:
        os.killpg(export.pid, signum)  # Ctrl-C in a terminal reaches the whole foreground group
    else:
        export.send_signal(signum)
    start = time.monotonic()
    try:
        _, stderr = export.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(export.pid, signal.SIGKILL)
    assert time.monotonic() - start < 30
    assert export.returncode == 130
    line = "export: interrupted; rerun" if signum == signal.SIGINT else "export: stopped by SIGTERM"
    # Export's own last word (the engine's spawned process, caught at its start, may print its own).
    assert stderr.strip().splitlines()[-1].startswith(line)
    time.sleep(1)
    assert not [p.pid for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def safe_pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_under_safetensors_or_a_record_is_one_line_naming_the_file(
    tmp_path, monkeypatch, code, capsys
):
    """safetensors' own error (not an OSError) and a write that fails after its file opened (no file name):
    both the OSError they are, naming the file, and one line from the stage."""
    import safetensors.torch
    import torch
    from safetensors import SafetensorError

    from artifacts import atomic

    def full(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    weights = tmp_path / "export" / "model.safetensors"

    @stage_errors("export")
    def main():
        atomic.save_tensors({"w": torch.zeros(2)}, weights)

    with pytest.raises(SystemExit):
        main()
    line = capsys.readouterr().err.strip()
    assert str(weights) in line and "Traceback" not in line

    def write(tmp):
        raise OSError(code, os.strerror(code))  # as a flush on a full disk raises it: no file name

    with pytest.raises(OSError) as raised:
        atomic.save(tmp_path / "export_record.json", write)
    assert raised.value.filename == str(tmp_path / "export_record.json")


def test_a_bench_tool_refuses_an_out_that_exists_before_it_runs(tmp_path, subprocess_env):
    """A result file is never replaced without a word, nor does a directory there fail the tool at its end:
    every tool's --out is refused by argparse before anything runs (issue 62)."""
    from argparse import ArgumentTypeError

    from bench import new_file

    (tmp_path / "taken.json").write_text("{}")
    for out, says in [
        (tmp_path, f"{tmp_path} exists (a directory)"),
        (tmp_path / "taken.json", "exists (a file)"),
        (tmp_path / "taken.json" / "new.json", "which is a file"),
    ]:
        with pytest.raises(ArgumentTypeError, match=re.escape(says)):
            new_file(str(out))
    assert new_file(str(tmp_path / "new.json")) == tmp_path / "new.json"
    assert (tmp_path / "taken.json").read_text() == "{}"
    # every tool writing a result file takes it through new_file; one run end to end (it took minutes, then
    # failed on the directory)
    for tool in (
        "attention",
        "capture",
        "memory",
        "online",
        "padding",
        "peer",
        "regen",
        "saved",
        "train_step",
    ):
        assert '--out", type=new_file' in (REPO / "bench" / f"{tool}.py").read_text(), tool
    done = subprocess.run(
        [sys.executable, "-m", "bench.attention", "--out", str(tmp_path)],
        cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and f"{tmp_path} exists (a directory)" in done.stderr, done.stderr
