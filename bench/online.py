"""Benchmark online training (train.features=online) against training from the hidden-state cache.

    python -m bench.online --out runs/bench/online_smoke.json -- experiment=smoke
    python -m bench.online --steps 12 --out runs/bench/online_smollm2.json -- \
        data.num_samples=200 regen.enabled=false render.max_length=1024          # SmolLM2 + ShareGPT

Everything after `--` is a pipeline config override (no run_dir: `--work-dir` holds the two runs). For each
mode, in turn and alone on the machine (one process each, as the real stages run):
  cache   data_prep with hidden states, then train/main.py reading them (train.features=cache)
  online  data_prep with cache.hidden_states=false (tokens only), then train/main.py computing the states
          with the frozen target in each step (train.features=online)
Both train the same head on the same data for `--steps` optimizer steps (no held-out eval, no checkpoint
until the last step). Reported per mode: data_prep seconds, bytes of the cache on disk (all files under
<run>/cache), training tokens/s over the steps after `--warmup` (each step's real tokens and wall time as
train_steps.jsonl records them: loading, online target and optimizer step included); then the trade-off:
seconds of target forward that online adds per training token, against the one-time caching cost and the
bytes per token the cache keeps - the number of epochs at which online has spent as much time as caching did.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import new_file

REPO = Path(__file__).resolve().parent.parent
MODES = {"cache": "true", "online": "false"}  # train.features -> cache.hidden_states


def run_stage(script: str, overrides: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / script), *overrides], cwd=REPO, check=True)
    return time.perf_counter() - start


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def measure(mode: str, run_dir: Path, overrides: list[str], steps: int, warmup: int) -> dict:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    # Both modes on the transformers target: online training runs it (it refuses vLLM states), so the
    # cached side computes its states the same way.
    common = [*overrides, f"run_dir={run_dir}", f"cache.hidden_states={MODES[mode]}", "capture.engine=hf"]
    prep_s = run_stage("data_prep/main.py", common)
    cache_dir = run_dir / "cache"
    shard_bytes = sum(f.stat().st_size for f in cache_dir.rglob("shard-*.safetensors"))
    run_stage(
        "train/main.py",
        [*common, f"train.features={mode}", f"train.max_steps={steps}", "train.eval_every=0",
         "train.save_every=0", "train.log_every=1000"],
    )  # fmt: skip
    records = [json.loads(line) for line in (run_dir / "train_steps.jsonl").open()][warmup:]
    tokens, seconds = sum(r["tokens"] for r in records), sum(r["seconds"] for r in records)
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    return {
        "data_prep_s": round(prep_s, 1),
        "cache_bytes": disk_bytes(cache_dir),
        "shard_bytes": shard_bytes,
        "cached_tokens": sum(manifest["num_tokens"].values()),
        "train_steps_timed": len(records),
        "train_tokens": tokens,
        "train_s": round(seconds, 2),
        "train_tok_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps trained in each mode")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--work-dir", default="runs/bench/online", help="where the two runs go (replaced)")
    parser.add_argument("--out", type=new_file, help="write the results as JSON here")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    if any(o.startswith("run_dir=") for o in overrides):
        parser.error("give --work-dir, not run_dir=: the benchmark makes one run directory per mode")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    work_dir = (REPO / args.work_dir).resolve()
    results = {m: measure(m, work_dir / m, overrides, args.steps, args.warmup) for m in MODES}
    cache, online = results["cache"], results["online"]
    # What online adds per training token (the target's forward) against what caching cost once per token.
    online_extra_s = 1 / online["train_tok_per_s"] - 1 / cache["train_tok_per_s"]
    caching_s = (cache["data_prep_s"] - online["data_prep_s"]) / cache["cached_tokens"]
    summary = {
        "online_over_cache_tok_per_s": round(online["train_tok_per_s"] / cache["train_tok_per_s"], 3),
        "disk_cache_over_online": round(cache["cache_bytes"] / online["cache_bytes"], 1),
        "cache_bytes_per_token": round(cache["shard_bytes"] / cache["cached_tokens"], 1),
        "online_bytes_per_token": round(online["shard_bytes"] / online["cached_tokens"], 2),
        "online_extra_s_per_token": online_extra_s,
        "caching_s_per_token": caching_s,
        "break_even_epochs": round(caching_s / online_extra_s, 2) if online_extra_s > 0 else None,
    }
    report = {
        "overrides": overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": results,
        "summary": summary,
    }
    for mode, r in results.items():
        print(
            f"{mode:>6}: data_prep {r['data_prep_s']:.1f} s, cache {r['cache_bytes'] / 1e6:.2f} MB on disk, "
            f"train {r['train_tok_per_s']:.0f} tok/s ({r['train_tokens']} tokens in {r['train_s']:.1f} s)"
        )
    print(
        f"online / cache: {summary['online_over_cache_tok_per_s']:.2f}x the training speed, "
        f"1/{summary['disk_cache_over_online']:.0f} of the disk; online spends as much extra time as caching "
        f"took after {summary['break_even_epochs']} epochs"
    )
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
