"""The GPU check: what this project can prove on a lent GPU in one call of under 9 minutes, run first whenever
one is lent (docs/gpu.md#the-gpu-check records what it printed, with the GPU, the date and the command).

    python3 -m bench.gpu_check --out $OUT            # the GPU machine (no make, no venv: its own python3)
    python3 -m bench.gpu_check --cpu --out runs/gpu_check   # tiny shapes on a CPU (a slow test)
    python3 -m bench.gpu_check --sections imports    # the first step alone (the restricted-import test)

It writes `<out>/gpu_check.json` after every step (a time-out or a crash keeps every number measured before
it) and `<out>/gpu_check.log` (every step's whole output). Its sections, each with its own time budget
inside the whole (`--budget`; SECTIONS below, docs/gpu.md#the-gpu-check says what each measures): imports,
memory (bench/memory.py: each kind and lever profiled), peer (bench/peer.py: ours against speculators), then
pipeline, zero2 and golden with the time the others left.
A step that would start with less than MIN_STEP_S of either left is skipped, and the output and the JSON
say so; a module that fails to import skips the sections that need it. `--cpu`: the same at tiny shapes and
a step or two, one export, without the golden tests (the suite runs them). Needs no network and no vLLM:
the GPU machine has neither. Exit status: 0 when every step ran and passed, 1 when one failed, 3 when one
was skipped for time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (budget in seconds on a GPU, on a CPU in --cpu mode; the modules the section's commands import).
SECTIONS = {
    "imports": (60, 180, []),
    # The speed sections first (issue 59: a profiled step per kind and lever, ours against speculators);
    # the correctness sections after, with what they left (each passed on an H200: docs/gpu.md).
    "memory": (240, 420, ["bench.memory", "bench.profile", "train.data"]),
    # speculators' first compiled steps (its Triton autotuning) took over 150 s at K=3 on an H200
    # (2026-11-27): K=3 only, its first steps timed apart.
    "peer": (270, 420, ["bench.peer", "speculators.train.trainer", "speculators.train.cli"]),
    "pipeline": (240, 600, ["artifacts.smoke", "data_prep.main", "train.main", "export.main"]),
    "zero2": (60, 180, ["artifacts.smoke", "data_prep.main", "train.main", "deepspeed", "accelerate"]),
    "golden": (60, 0, ["pytest", "train.main"]),
}
BUDGET_S = {"gpu": 540, "cpu": 1800}  # the whole check: a 600-s call returns with time for its files
MIN_STEP_S = 15  # no step starts with less left: a process start alone takes seconds
# The packages whose versions the first step prints (a distribution name each).
VERSIONS = ["torch", "transformers", "accelerate", "hydra-core", "omegaconf", "datasets", "deepspeed",
            "speculators", "safetensors", "tokenizers", "huggingface-hub", "numpy", "pyarrow", "pandas",
            "fsspec", "pydantic", "typing-extensions", "triton"]  # fmt: skip
KINDS = {  # tests/helpers.py's small settings for the smoke target
    "eagle3": [],
    "peagle": ["head.kind=peagle", "head.num_layers=2", "head.cod_ratio=0.5"],
    "dflash": ["head.kind=dflash", "head.num_layers=2", "head.block_size=5", "head.mask_token_id=5",
               "head.min_block_size=2"],
    "eagle1": ["head.kind=eagle1"],
}  # fmt: skip


class Check:
    """The results so far, written after every step; each step a process run within the budgets left."""

    def __init__(self, out: Path, mode: str, budget_s: float):
        self.out, self.mode = out, mode
        out.mkdir(parents=True, exist_ok=True)
        self.log = open(out / "gpu_check.log", "a", buffering=1)  # noqa: SIM115 - open for the whole check
        self.deadline = time.monotonic() + budget_s
        self.section_deadline = self.deadline
        self.section = None
        self.result = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": datetime.now(UTC).isoformat(timespec="seconds"),
            "mode": mode, "budget_s": budget_s, "device": None, "versions": {}, "sections": {}, "steps": [],
            "memory": [], "peer": {"results": [], "ratios": []}, "finished": False,
        }  # fmt: skip

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def save(self) -> None:
        path = self.out / "gpu_check.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1))
        os.replace(tmp, path)

    def begin(self, name: str, skip_reason: str | None = None) -> bool:
        """Open a section with its own budget; False (and said) when it is skipped."""
        gpu_s, cpu_s, _ = SECTIONS[name]
        budget = gpu_s if self.mode == "gpu" else cpu_s
        self.section = name
        entry = {"budget_s": budget, "seconds": 0.0, "status": "running"}
        self.result["sections"][name] = entry
        left = self.deadline - time.monotonic()
        if skip_reason is None and left < MIN_STEP_S:
            skip_reason = f"the check's budget of {self.result['budget_s']} s is spent"
        if skip_reason:
            entry["status"] = f"skipped: {skip_reason}"
            self.say(f"[{name}] skipped: {skip_reason}")
            self.save()
            return False
        self.section_deadline = min(self.deadline, time.monotonic() + budget)
        self.section_start = time.monotonic()
        self.say(f"[{name}] budget {budget} s (the check has {left:.0f} s left)")
        return True

    def end(self) -> None:
        entry = self.result["sections"][self.section]
        steps = [s for s in self.result["steps"] if s["section"] == self.section]
        entry["seconds"] = round(time.monotonic() - self.section_start, 1)
        failed = [s["step"] for s in steps if s["status"] == "failed"]
        skipped = [s["step"] for s in steps if s["status"].startswith("skipped")]
        entry["status"] = (
            f"failed: {', '.join(failed)}" if failed
            else f"partial: skipped for time: {', '.join(skipped)}" if skipped
            else "passed"
        )  # fmt: skip
        self.say(f"[{self.section}] {entry['status']} in {entry['seconds']:.0f} s of {entry['budget_s']}")
        self.save()

    def record(self, step: str, seconds: float, status: str, command: list[str] | None = None, why: str = ""):
        assert step not in {s["step"] for s in self.result["steps"]}, f"step name {step} used twice"
        self.result["steps"].append({
            "section": self.section, "step": step, "ok": status == "passed", "status": status,
            "seconds": round(seconds, 1), "command": " ".join(command) if command else None, "why": why,
        })  # fmt: skip
        self.save()

    def run(self, step: str, command: list[str], env: dict | None = None) -> str | None:
        """Run one step in its own process group within the time left; its output, or None if it did not
        run or failed."""
        left = min(self.section_deadline, self.deadline) - time.monotonic()
        shown = " ".join(Path(c).name if c == sys.executable else c for c in command)
        if left < MIN_STEP_S:
            why = "section" if self.section_deadline < self.deadline else "check"
            self.say(f"[{self.section}] skip {step}: the {why}'s budget is spent ({left:.0f} s left)")
            self.record(step, 0.0, f"skipped: the {why}'s budget is spent", command)
            return None
        path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
        start = time.monotonic()
        process = subprocess.Popen(
            command, cwd=REPO, env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = process.communicate(timeout=left)
            status = "passed" if process.returncode == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            kill_group(process)
            output, _ = process.communicate()
            status = f"failed: timed out after {left:.0f} s (the budget left)"
        except BaseException:  # an interrupt: stop the step's whole tree, keep what was measured
            kill_group(process)
            self.record(step, time.monotonic() - start, "failed", command, "interrupted")
            raise
        seconds = time.monotonic() - start
        ok = status == "passed"
        self.log.write(f"----- {step}: {status}, {seconds:.1f} s: {shown}\n{output}\n")
        self.say(f"[{self.section}] {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {step}")
        if not ok:
            self.say(f"  {status}: {shown[:300]}\n" + "\n".join(output.strip().splitlines()[-25:]))
        self.record(step, seconds, "passed" if ok else "failed", command, "" if ok else status)
        return output if ok else None

    def run_json(self, step: str, command: list[str]) -> dict | None:
        """A step whose last line of output is its result as JSON; that result, or None."""
        output = self.run(step, command)
        if output is None:
            return None
        try:
            return json.loads(output.strip().splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            self.result["steps"][-1].update(ok=False, status="failed", why="no JSON result on its last line")
            self.say(f"[{self.section}] FAIL {step}: no JSON result on its last line")
            self.save()
            return None


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_imports(check: Check, sections: list[str]) -> dict[str, str]:
    """The first step: import every module the chosen sections need (every section's when none is chosen
    but this one), in this process (seconds), and print the versions. {module: why it failed} for those that
    did not import."""
    start = time.monotonic()
    check.result["versions"] = versions = {}
    for name in VERSIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    import torch

    cuda = torch.cuda.is_available()
    check.result["device"] = torch.cuda.get_device_name(0) if cuda else (platform.processor() or "cpu")
    versions["python"] = sys.version.split()[0]
    versions["cuda"] = torch.version.cuda
    failed = {}
    for module in dict.fromkeys(m for s in (sections[1:] or SECTIONS) for m in SECTIONS[s][2]):
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - any import error is the finding: named, not raised
            missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
            failed[module] = (
                f"{missing or 'import error'} (importing {module}: {type(error).__name__}: {error})"
            )
    check.say(f"on {check.result['device']}: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    for module, why in failed.items():
        check.say(f"[imports] FAIL {module}: needs {why}")
    check.record(
        "imports", time.monotonic() - start, "failed" if failed else "passed", why="; ".join(failed.values())
    )
    return failed


# The memory section's steps: (setting, the benchmark's arguments), each the llama31_8b recipe's EAGLE-3
# unless named otherwise; the levers of issue 59 one at a time against the first.
MEMORY_STEPS = [
    ("eagle3", ["--profile"]),
    ("eagle3-compiled", ["--profile", "--override", "train.compile=true"]),
    ("eagle3-flex", ["--profile", "--override", "train.attention=flex"]),
    ("eagle3-packed", ["--profile", "--override", "train.pack_length=2048"]),
    ("eagle3-packed-flex", ["--profile", "--override", "train.pack_length=2048", "train.attention=flex"]),
    ("peagle", ["--profile"]),
    ("dflash", ["--profile"]),
    ("eagle3-unfused", ["--profile", "--override", "train.fused_loss=false"]),
    ("eagle3-online", ["--online"]),
]


def memory_section(check: Check, cpu: bool) -> None:
    """One step per head kind and lever (MEMORY_STEPS), each the benchmark's child mode (one process, its
    result as a JSON line), profiled (bench/profile.py)."""
    bench = [sys.executable, "-m", "bench.memory", "--recipe", "llama31_8b"]
    bench += ["--tiny", "--steps", "1"] if cpu else ["--steps", "3"]
    for setting, extra in MEMORY_STEPS:
        if cpu and "flex" in setting:  # FlexAttention has no backward on a CPU
            continue
        result = check.run_json(f"memory {setting}", [*bench, "--child", setting.split("-")[0], *extra])
        if result:
            check.result["memory"].append({**result, "setting": setting})
            check.save()


# The peer section's steps: (trainer, K, our overrides), in order; speculators at K=3, its published
# setting, against ours as the recipe trains and with every lever on.
PEER_STEPS = [
    ("ours", 3, []),
    ("speculators", 3, []),
    ("ours", 3, ["train.compile=true", "train.attention=flex"]),
    ("ours", 7, ["train.compile=true", "train.attention=flex"]),
]


def peer_section(check: Check, cpu: bool) -> None:
    """One step per trainer, K and setting, so that each result is kept as soon as it is measured."""
    from bench.peer import ratios

    peer = check.result["peer"]
    for trainer, k, overrides in PEER_STEPS:
        if cpu and any("flex" in o for o in overrides):
            overrides = [o for o in overrides if "flex" not in o]
        command = [sys.executable, "-m", "bench.peer", "--child", trainer, "--ttt-steps", str(k)]
        command += ["--override", *overrides] if overrides else []
        setting = " ".join(overrides) or "default"
        result = check.run_json(
            f"peer {trainer} K={k} ({setting})",
            command + (["--tiny", "--steps", "1", "--warmup", "1"] if cpu else []),
        )
        if result:
            peer["results"].append(result)
            peer["ratios"] = ratios(peer["results"])
            check.save()


def stage(name: str, run_dir: Path, *overrides: str, launcher: list[str] = ()) -> list[str]:
    """The command of one pipeline stage on the smoke target."""
    return [*(launcher or [sys.executable]), str(REPO / name / "main.py"), "experiment=smoke", f"run_dir={run_dir}",
            *overrides]  # fmt: skip


def linked_run(run_dir: Path, source: Path) -> Path:
    """A run directory whose entries (target, cache) are links to `source`'s: each stage writes its own."""
    run_dir.mkdir()
    for item in source.iterdir():
        (run_dir / item.name).symlink_to(item)
    return run_dir


def smoke_caches(check: Check, work: Path) -> tuple[Path, Path] | None:
    """The smoke target and its two caches (cached states; tokens only), or None if data_prep failed."""
    from artifacts.smoke import build_smoke_target

    target = build_smoke_target(work / "smoke_target")
    cached, online = work / "cached", work / "online"
    for run_dir in (cached, online):
        run_dir.mkdir()
        (run_dir / "smoke_target").symlink_to(target)
    ok = check.run("data_prep cached", stage("data_prep", cached)) is not None
    ok &= check.run("data_prep online", stage("data_prep", online, "cache.hidden_states=false")) is not None
    return (cached, online) if ok else None


def pipeline_section(check: Check, work: Path, caches: tuple[Path, Path], cpu: bool) -> None:
    cached, online = caches
    steps = ["train.max_steps=2"] if cpu else ["train.max_steps=20"]
    quiet = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "train.mixed_precision=bf16"]
    for kind, overrides in KINDS.items():
        run_dir = linked_run(work / f"train_{kind}", cached)
        trained = check.run(f"train {kind}", stage("train", run_dir, *overrides, *steps, *quiet))
        if trained is not None and (not cpu or kind == "dflash"):  # on a CPU the suite exports every kind
            check.run(f"export {kind}", stage("export", run_dir, *overrides, "export.verify=false",
                                              "export.num_speculative_tokens=2"))  # fmt: skip
    check.run("train eagle3 online", stage("train", online, *steps, *quiet, "train.features=online"))


def zero2_section(check: Check, work: Path, cached: Path, cpu: bool) -> None:
    run_dir = linked_run(work / "zero2", cached)
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
           "ACCELERATE_MIXED_PRECISION": "bf16"}  # fmt: skip
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    steps = ["train.max_steps=2"] if cpu else ["train.max_steps=20"]
    quiet = ["train.eval_every=0", "train.save_every=0", "train.log_every=1", "train.mixed_precision=bf16"]
    check.run("train zero2", stage("train", run_dir, *steps, *quiet, launcher=launcher), env)


def report(check: Check) -> None:
    """The numbers at the end of the output (the part a machine that returns only the output's tail keeps)."""
    result = check.result
    if result["peer"]["results"]:  # bench.peer imported (its steps ran)
        from bench.peer import ratio_line, result_line

        check.say("\nours beside speculators' trainer (bench/peer.py):")
        for line in [
            *map(result_line, result["peer"]["results"]),
            *map(ratio_line, result["peer"]["ratios"]),
        ]:
            check.say("  " + line)
    if result["memory"]:
        from bench.memory import result_line
        from bench.profile import profile_line

        check.say("per head kind, one training step (bench/memory.py, bench/profile.py):")
        for m in result["memory"]:
            check.say(f"  [{m.get('setting', m['kind'])}] " + result_line(m))
            if "split" in m:
                check.say("    " + profile_line(m))
    for name, entry in result["sections"].items():
        check.say(f"  {name:8s} {entry['status']} ({entry['seconds']:.0f} s of {entry['budget_s']})")
    steps = result["steps"]
    passed = sum(s["ok"] for s in steps)
    check.say(f"{passed} of {len(steps)} steps passed on {result['device']}; JSON and log in {check.out}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU (the test suite's mode)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check", help="a directory")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole check")
    args = parser.parse_args()
    mode = "cpu" if args.cpu else "gpu"
    check = Check(args.out, mode, args.budget or BUDGET_S[mode])
    signal.signal(signal.SIGTERM, interrupt)  # a time-out's kill: kept as an interrupt, the JSON written
    sections = ["imports", *(s for s in SECTIONS if s in args.sections and s != "imports")]
    check.say(f"gpu check ({mode}): {check.result['command']}")
    check.begin("imports")
    failed = check_imports(check, sections)
    check.end()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        check.say("no CUDA device: run with --cpu for the tiny CPU mode")
        return 2
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    caches = None
    try:
        for name in sections[1:]:
            needs = [failed[m] for m in SECTIONS[name][2] if m in failed]
            why = f"needs {needs[0]}" if needs else None
            if name == "golden" and args.cpu:
                why = "the test suite runs the golden tests on a CPU"
            if not check.begin(name, why):
                continue
            if name == "peer":
                peer_section(check, args.cpu)
            elif name == "memory":
                memory_section(check, args.cpu)
            elif name in ("pipeline", "zero2"):
                caches = caches or smoke_caches(check, work)
                if caches and name == "pipeline":
                    pipeline_section(check, work, caches, args.cpu)
                elif caches:
                    zero2_section(check, work, caches[0], args.cpu)
            elif name == "golden":
                check.run("golden losses", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                            "tests/test_train_loop.py", "-k", "golden"])  # fmt: skip
            check.end()
    except KeyboardInterrupt:
        check.say("interrupted: the JSON holds every step measured so far")
        check.save()
        return 130
    check.result["finished"] = True
    report(check)
    check.save()
    if any(s["status"] == "failed" for s in check.result["steps"]):
        return 1
    statuses = [entry["status"] for entry in check.result["sections"].values()]
    return 3 if any(s.startswith(("partial", "skipped: the check's budget")) for s in statuses) else 0


if __name__ == "__main__":
    sys.exit(main())
