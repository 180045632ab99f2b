"""A real vLLM OpenAI-compatible server (`vllm serve`) as a subprocess: started on a free port, waited for,
logged to a file, and always shut down with its whole process group (engine core and workers included),
also on Ctrl-C, SIGTERM or an error. Its command line comes from target/vllm.py, where every engine the
pipeline starts on the target is defined.

    with VllmServer(target_dir, log_path, args={"max-model-len": 2048},
                    speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3}) as s:
        requests go to s.url (/v1/completions, /metrics, /health)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from target.vllm import root_cause, serve_argv, served_settings


class ServerError(RuntimeError):
    """The server did not come up (or died); the message holds the tail of its log."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, num_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(lines[-num_lines:])


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


class VllmServer:
    def __init__(
        self,
        model: str | Path,
        log_path: Path,
        args: dict | None = None,
        speculative_config: dict | None = None,
        port: int | None = None,
        startup_timeout_s: float = 600.0,
    ):
        self.model, self.log_path = str(model), Path(log_path)
        # The settings the model card prints its serve command from too (export/card.py).
        self.settings = served_settings(self.model, speculative_config, args)
        if speculative_config:  # each response carries its own acceptance: eval buckets it by context length
            self.settings = replace(self.settings, owned={"per_request_spec_decode_metrics": "summary"})
        self.port = port or free_port()
        self.command = serve_argv(self.settings, self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.command) + "\n")
            log.flush()
            # A new session: the server and every process it spawns share one group, stopped together.
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                cause = root_cause(self.log_path) or f"log: {self.log_path}"
                raise ServerError(
                    f"vLLM server for {self.model} exited with code {code} before it was ready; {cause}\n"
                    f"The log's last lines:\n{log_tail(self.log_path)}"
                )
            try:
                http_get(f"{self.url}/health", timeout=2.0)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        raise ServerError(
            f"vLLM server for {self.model} not healthy after {self.startup_timeout_s:.0f} s "
            f"(log: {self.log_path}):\n{log_tail(self.log_path)}"
        )

    def metrics(self) -> str:
        return http_get(f"{self.url}/metrics", timeout=10.0)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the whole group, SIGKILL after `grace_s`; safe to call twice."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is not None:
            self._kill_group(process.pid, signal.SIGKILL)  # children may outlive a crashed parent
            return
        self._kill_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._kill_group(process.pid, signal.SIGKILL)
        process.wait()

    @staticmethod
    def _kill_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
