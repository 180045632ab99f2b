"""Benchmark EAGLE-3 training steps: tokens/s and peak memory per TTT depth K, and the cost of K=7 over K=1.

    python -m bench.train_step --out runs/bench/train_smoke.json -- experiment=smoke run_dir=runs/bench/smoke
    python -m bench.train_step --num-batches 2 -- run_dir=runs/bench/smollm2 train.batch_size=2   # SmolLM2

Everything after `--` is a pipeline config override, as for train/main.py; the cache in <run_dir>/cache
must exist (data_prep with the same overrides makes it). The head is built as train builds it
(`build_draft`, the target's embedding and lm_head, `DraftWithLoss`, AdamW, the same Accelerator, so
`train.mixed_precision` autocasts as in training and `train.num_threads` applies). A fixed set of
micro-batches (the first `--num-batches` of epoch 0's plan, collated once) is trained on with full
optimizer steps - forward through DraftWithLoss, backward, grad clip, AdamW step - for each K of
`--steps-list`, interleaved and repeated in one process after a warm-up pass; the best pass counts.
Each micro-batch is one optimizer step; logging, eval, checkpoints and loading from the cache are left
out (the load time of the same batches is reported on its own, `load_s_per_step`).

Reported per K: seconds per optimizer step, training tokens/s (real tokens, the attention_mask sum),
peak memory; then time(K) / time(K=1), which must stay near K or below (the diagonal attention must not
make later TTT steps costlier than the first), and K=1's step split into the teacher (`teacher_probs`,
timed alone on the same batches) and the rest.

Peak memory is measured for each K in a fresh child process (this script with `--memory-child K`) that
does the same setup and one pass over the batches. On CUDA: `torch.cuda.max_memory_allocated`, the
most tensor memory held at once. On CPU, where torch tracks no allocations: the peak resident set size
(Linux VmHWM, reset to the current RSS just before the pass), i.e. what the OS had to provide, allocator
slack included; a fresh process per K because memory the allocator keeps after another K's pass would
stay resident and be counted. `peak_over_setup_mb` subtracts what the process held before its first
step (runtime, weights, frozen target matrices, batches): the step's activations, gradients and AdamW
state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from artifacts.cache import CacheSplit
from artifacts.config import compose
from artifacts.manifest import read_manifest
from artifacts.vocab import load_vocab_map
from bench import new_file
from target.launch import make_accelerator
from target.model import load_config, load_embedding_and_lm_head
from train.data import check_cache_matches_target, micro_batch, plan_epoch
from train.losses import teacher_probs
from train.model import DraftWithLoss, build_draft

MB = 2**20


def autocast(device, precision: str):
    """The forward's autocast as train's Accelerator sets it from `train.mixed_precision`: bf16 or fp16, or
    none with `no` (fp32: on a CPU without bf16 units, whose bf16 products take PyTorch's scalar reference
    GEMM - docs/benchmarks.md#half-precision-on-a-cpu-without-it)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return torch.autocast(torch.device(device).type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def setup(cfg, num_batches: int):
    """(accelerator, model, optimizer, batches, (split, rows, packed)): the head, its optimizer and fixed
    micro-batches (packed with train.pack_length)."""
    accelerator = make_accelerator(cfg.process_group_timeout_s, mixed_precision=cfg.train.mixed_precision)
    cache_dir = Path(cfg.run_dir).resolve() / "cache"
    cache_manifest = read_manifest(cache_dir)
    target_config = load_config(cfg.target)
    check_cache_matches_target(cache_manifest, cfg, target_config)
    train_split = CacheSplit(cache_dir, "train")
    vocab = load_vocab_map(cache_dir / "vocab.safetensors")

    draft = build_draft(cfg, target_config, cache_manifest, vocab)
    embed, lm_head = load_embedding_and_lm_head(cfg.target)
    draft.load_target_embedding(embed.float())
    model = DraftWithLoss(draft, lm_head, vocab.draft_to_target, cfg, cache_manifest["aux_layer_ids"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    plan = plan_epoch(train_split.lengths, cfg.train.batch_size, 1, 1, cfg.seed, 0, cfg.train.pack_length)
    batch_rows = [step[0][0] for step in plan[:num_batches]]
    packed = cfg.train.pack_length is not None
    batches = [micro_batch(train_split, rows, accelerator.device, packed=packed) for rows in batch_rows]
    return accelerator, model, optimizer, batches, (train_split, batch_rows, packed)


def set_num_ttt_steps(accelerator, model, num_steps: int) -> None:
    accelerator.unwrap_model(model).num_steps = num_steps


def train_step(accelerator, model, optimizer, batch, max_grad_norm: float) -> None:
    """One optimizer step on one micro-batch, as `fit` runs it (each depth's loss the mean over this
    batch's predictions)."""
    with accelerator.autocast():
        loss, _ = model(batch)
        accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def current_rss() -> int | None:
    """Resident set size now, in bytes (Linux); None where /proc is missing."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """Peak resident set size of this process image, in bytes.

    Linux: VmHWM, which starts afresh at exec. Not ru_maxrss: Linux carries the parent's RSS at fork into
    an exec'd child's ru_maxrss, so a child of a large benchmark process would report the parent's size.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS


def reset_peak_rss() -> bool:
    """Lower the peak RSS mark to the current RSS (Linux >= 4.0), so a setup transient is not counted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def mark_memory(device) -> tuple[int | None, bool]:
    """Start a peak measurement: (what is held now, whether the peak mark could be reset). CUDA: allocated
    tensors, the peak counter reset; CPU: the resident set, VmHWM lowered to it (`reset_peak_rss`)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device), True
    reset = reset_peak_rss()
    return current_rss(), reset


def peak_memory(device) -> int:
    """The peak since `mark_memory`: torch.cuda.max_memory_allocated, or the peak RSS on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return peak_rss()


def measure_memory(cfg, num_steps: int, num_batches: int) -> dict:
    """In a fresh process: memory before the first step and at the peak of one pass over the batches."""
    accelerator, model, optimizer, batches, _ = setup(cfg, num_batches)
    set_num_ttt_steps(accelerator, model, num_steps)
    cuda = accelerator.device.type == "cuda"
    before, reset = mark_memory(accelerator.device)
    for batch in batches:
        train_step(accelerator, model, optimizer, batch, cfg.optim.max_grad_norm)
    peak = peak_memory(accelerator.device)
    if cuda:
        result = {"measure": "torch.cuda.max_memory_allocated", "peak_mb": peak / MB}
    else:
        result = {"measure": "peak RSS (VmHWM) of a fresh process", "peak_mb": peak / MB}
        # Without the reset the peak may be a setup transient: then it bounds the pass's peak from above.
        result["peak_reset_before_pass"] = reset
    result["setup_mb"] = None if before is None else before / MB
    result["peak_over_setup_mb"] = None if before is None else (peak - before) / MB
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in result.items()}


def memory_in_child(num_steps: int, num_batches: int, overrides: list[str]) -> dict:
    command = [sys.executable, "-m", "bench.train_step", "--memory-child", str(num_steps)]
    command += ["--num-batches", str(num_batches), "--", *overrides]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement for K={num_steps} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_is_finished(cfg) -> bool:
    manifest = Path(cfg.run_dir).resolve() / "cache" / "manifest.json"
    return manifest.exists() and bool(json.loads(manifest.read_text()).get("complete"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-batches", type=int, default=4, help="micro-batches per timed pass")
    parser.add_argument("--steps-list", default="1,7", help="TTT depths K to compare, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the batches, per K")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory child processes")
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument("--memory-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="pipeline config overrides (as for train/main.py)")
    args = parser.parse_args()
    cfg = compose("config", args.overrides)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    if args.memory_child is not None:
        print(json.dumps(measure_memory(cfg, args.memory_child, args.num_batches)))
        return
    if not cache_is_finished(cfg):
        print(
            f"no finished cache in {Path(cfg.run_dir).resolve() / 'cache'}; make it first with\n"
            f"  python data_prep/main.py {shlex.join(args.overrides)}",
            file=sys.stderr,
        )
        sys.exit(2)
    if cfg.head.kind not in ("eagle3", "peagle"):
        raise ValueError(
            f"head.kind={cfg.head.kind!r}: the benchmark compares the drafting depths of eagle3 (TTT) and "
            "peagle (parallel) heads"
        )
    ks = sorted({int(k) for k in args.steps_list.split(",")})
    if ks[0] < 1:
        raise ValueError(f"--steps-list={args.steps_list}: TTT depths start at 1")

    accelerator, model, optimizer, batches, (train_split, batch_rows, packed) = setup(cfg, args.num_batches)
    inner = accelerator.unwrap_model(model)
    if len(batches) < args.num_batches:
        print(f"note: the train split fills only {len(batches)} micro-batches", file=sys.stderr)
    num_tokens = sum(int(b["attention_mask"].sum()) for b in batches)

    def training_pass(k: int):
        def run():
            set_num_ttt_steps(accelerator, model, k)
            for batch in batches:
                train_step(accelerator, model, optimizer, batch, cfg.optim.max_grad_norm)

        return run

    @torch.no_grad()
    def teacher_pass():
        for batch in batches:
            with accelerator.autocast():
                teacher_probs(
                    batch["final_hidden"], inner.target_lm_head, inner.draft_to_target, inner.chunk_size
                )

    def load_pass():
        for rows in batch_rows:
            micro_batch(train_split, rows, accelerator.device, packed=packed)

    passes = {f"k{k}": training_pass(k) for k in ks} | {"teacher": teacher_pass, "load": load_pass}
    for fn in passes.values():  # warm-up: first-call allocations, AdamW state, kernel selection
        fn()
    times = {name: [] for name in passes}
    for _ in range(args.repeats):  # interleaved, so drift in machine load hits every K alike
        for name, fn in passes.items():
            times[name].append(timed(fn))
    best = {name: min(values) / len(batches) for name, values in times.items()}  # seconds per step

    memory = {} if args.no_memory else {k: memory_in_child(k, len(batches), args.overrides) for k in ks}
    draft = inner.draft
    per_k = {
        str(k): {
            "s_per_step": round(best[f"k{k}"], 4),
            "tokens_per_s": round(num_tokens / len(batches) / best[f"k{k}"], 1),
            "peak_memory_mb": memory[k]["peak_mb"] if memory else None,
            "peak_over_setup_mb": memory[k]["peak_over_setup_mb"] if memory else None,
        }
        for k in ks
    }
    first = ks[0]
    ratios = {f"k{k}_over_k{first}": round(best[f"k{k}"] / best[f"k{first}"], 3) for k in ks[1:]}
    draft_s = best[f"k{first}"] - best["teacher"]
    # Each TTT step after the first costs (t_K - t_first) / (K - first); compared with the first step's
    # draft work (teacher excluded, it is paid once), > 1 means later steps are costlier than the first.
    marginal = {
        f"k{k}": round((best[f"k{k}"] - best[f"k{first}"]) / (k - first) / draft_s, 3) for k in ks[1:]
    }
    result = {
        "target": cfg.target.path,
        "mixed_precision": cfg.train.mixed_precision,
        "device": str(accelerator.device),
        "hidden_size": draft.config.hidden_size,
        "vocab_size": draft.config.vocab_size,
        "draft_vocab_size": draft.config.draft_vocab_size,
        "num_trainable_params": sum(p.numel() for p in draft.parameters() if p.requires_grad),
        "batch_size": cfg.train.batch_size,
        "num_batches": len(batches),
        "num_tokens": num_tokens,
        "num_padded_tokens": sum(b["attention_mask"].numel() for b in batches),
        "num_loss_tokens": sum(int(b["loss_mask"].sum()) for b in batches),
        "per_k": per_k,
        "step_time_ratio": ratios,
        "marginal_step_over_first_step": marginal,
        f"k{first}_teacher_s_per_step": round(best["teacher"], 4),
        f"k{first}_rest_s_per_step": round(draft_s, 4),
        "load_s_per_step": round(best["load"], 4),
        "memory_measure": next(iter(memory.values()))["measure"] if memory else None,
        "memory_children": {str(k): v for k, v in memory.items()},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    parts = [
        f"K={k} {per_k[str(k)]['s_per_step']:.3f} s/step {per_k[str(k)]['tokens_per_s']:.0f} tok/s"
        + (f" peak {per_k[str(k)]['peak_memory_mb']:.0f} MB" if memory else "")
        for k in ks
    ]
    parts += [
        f"time K={k}/K={first} = {ratios[f'k{k}_over_k{first}']:.2f} (limit ~{k / first:.0f}), "
        f"each later step {marginal[f'k{k}']:.2f}x the first's draft work"
        for k in ks[1:]
    ]
    print(
        f"\n{cfg.target.path} ({cfg.train.mixed_precision}, batch {cfg.train.batch_size}): "
        + "; ".join(parts)
        + f"; K={first} teacher {best['teacher']:.3f} s + rest {draft_s:.3f} s per step"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
