"""The GPU check: what this project can prove on a GPU in under 8 minutes, run first whenever one is lent
(`make gpu-check`; docs/gpu.md records what it printed, with the GPU, the date and the command).

    python3 tests/gpu_check.py --out runs/gpu_check.json        # on a CUDA machine (make gpu-check)
    python3 tests/gpu_check.py --cpu                            # tiny shapes on a CPU (the default tests)

Sections, each timed, each run whatever the others did (the exit status says whether all passed):
1. memory: one training step per head kind at the llama31_8b recipe's shapes with random weights - step
   time, tokens/s, peak memory against the memory model (train/benchmark_memory.py); then EAGLE-3 online,
   beside a random bf16 8B-shaped target;
2. pipeline: the smoke pipeline on the device - data_prep through transformers (no vLLM), each head kind
   trained in bf16, EAGLE-3 online, export of each without vLLM's verification;
3. zero2: train under DeepSpeed ZeRO-2 on one rank (bf16);
4. golden: the golden-loss tests (tests/test_train_loop.py -k golden) on the device.
`--cpu`: the same sections at tiny shapes and a few steps, one export, without the golden tests (the test
suite runs those).
Needs no network and no vLLM: the GPU machine has neither.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the GPU machine has no install of this repository: its packages from here
    sys.path.insert(0, str(REPO))
KINDS = {  # tests/helpers.py's small settings for the smoke target
    "eagle3": [],
    "peagle": ["head.kind=peagle", "head.num_layers=2", "head.cod_ratio=0.5"],
    "dflash": [
        "head.kind=dflash",
        "head.num_layers=2",
        "head.block_size=5",
        "head.mask_token_id=5",
        "head.min_block_size=2",
    ],
    "eagle1": ["head.kind=eagle1"],
}


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


def run(section: str, command: list[str], results: list, env: dict | None = None, timeout: int = 600) -> str:
    """Run one step of a section; record its time, status and last lines; return its output."""
    start = time.perf_counter()
    try:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
        ok, output = done.returncode == 0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as error:
        ok, output = False, f"timed out after {timeout} s\n{error.stdout or ''}{error.stderr or ''}"
    seconds = time.perf_counter() - start
    name = " ".join(Path(c).name if c.startswith("/") else c for c in command[1:4])
    results.append({"section": section, "step": name, "ok": ok, "seconds": round(seconds, 1)})
    print(
        f"[{section}] {'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {' '.join(command[1:])[:160]}", flush=True
    )
    if not ok:
        print("\n".join(output.strip().splitlines()[-25:]), flush=True)
    return output


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on a CPU (the test suite's mode)")
    parser.add_argument("--out", type=Path, default=None, help="the results as JSON")
    parser.add_argument("--sections", nargs="+", default=["memory", "pipeline", "zero2", "golden"])
    args = parser.parse_args()
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the tiny CPU mode", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    print(f"gpu check on {device}: torch {torch.__version__}, python {sys.version.split()[0]}", flush=True)
    results, memory = [], []
    py = sys.executable
    steps = ["train.max_steps=2"] if args.cpu else ["train.max_steps=20"]
    quiet = ["train.eval_every=0", "train.save_every=0", "train.log_every=1"]
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))

    if "memory" in args.sections:
        bench = [py, str(REPO / "train" / "benchmark_memory.py"), "--recipe", "llama31_8b"]
        bench += ["--tiny", "--steps", "1"] if args.cpu else ["--steps", "3"]
        for extra in ([], ["--kinds", "eagle3", "--online"]):
            out = work / f"memory{len(memory)}.json"
            run("memory", [*bench, *extra, "--out", str(out)], results)
            memory += json.loads(out.read_text()) if out.exists() else []

    if args.sections != ["memory"]:  # the smoke target and its caches: cached states, and tokens only
        from artifacts.smoke import build_smoke_target

        target = build_smoke_target(work / "smoke_target")
        cached, online = work / "cached", work / "online"
        for run_dir in (cached, online):
            run_dir.mkdir()
            (run_dir / "smoke_target").symlink_to(target)
        run("pipeline", stage("data_prep", cached), results)
        run("pipeline", stage("data_prep", online, "cache.hidden_states=false"), results)

    if "pipeline" in args.sections:
        for kind, overrides in KINDS.items():
            run_dir = linked_run(work / f"train_{kind}", cached)
            run(
                "pipeline",
                stage("train", run_dir, *overrides, *steps, *quiet, "train.mixed_precision=bf16"),
                results,
            )
            if not args.cpu or kind == "dflash":  # on a CPU the suite exports every kind already
                run("pipeline", stage("export", run_dir, *overrides, "export.verify=false", "export.num_speculative_tokens=2"), results)  # fmt: skip
        run("pipeline", stage("train", online, *steps, *quiet, "train.features=online", "train.mixed_precision=bf16"),
            results)  # fmt: skip

    if "zero2" in args.sections:
        run_dir = linked_run(work / "zero2", cached)
        env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
               "ACCELERATE_MIXED_PRECISION": "bf16"}  # fmt: skip
        if args.cpu:
            env["DS_ACCELERATOR"] = "cpu"
        launcher = [py, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
        run("zero2", stage("train", run_dir, *steps, *quiet, "train.mixed_precision=bf16", launcher=launcher), results,
            env)  # fmt: skip

    if "golden" in args.sections and not args.cpu:
        run("golden", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_train_loop.py", "-k", "golden"],
            results)  # fmt: skip

    print("\nper head kind, one training step (train/benchmark_memory.py):")
    for m in memory:
        print(f"  {m['kind']:7s} {m['batch_size']} x {m['seq_len']}{' online' if m['online'] else '       '}: "
              f"{m['step_s']:.3f} s/step, {m['tokens_per_s']:.0f} tokens/s, peak {m['peak_gb']:.2f} GB "
              f"(model {m['predicted_gb']:.2f}), over setup {m['peak_over_setup_gb']:.2f} GB "
              f"(model {m['predicted_over_setup_gb']:.2f})")  # fmt: skip
    failed = [r for r in results if not r["ok"]]
    print(f"\n{len(results) - len(failed)} of {len(results)} steps passed on {device}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": device, "torch": torch.__version__, "steps": results,
                                        "memory": memory}, indent=1))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
