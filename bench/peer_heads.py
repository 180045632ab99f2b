"""Our heads beside the reference trainer's: the same cache trained by our trainer and by speculators 0.9's
own (bench/speculators_train.py), each head exported, proven in vLLM and estimated on the held-out split
the same way, so that a difference is the recipe's.

    python data_prep/main.py experiment=smollm2_quick run_dir=runs/peer
    python -m bench.peer_heads --run-dir runs/peer --kind peagle --seeds 0 1 -- experiment=smollm2_quick
    python eval/main.py experiment=smollm2_peer run_dir=runs/peer       # both served in one run

Each head is a directory <run_dir>/peer/<kind>/<trainer>[-<tag>]_s<seed>/ holding `export/` (what vLLM
serves; ours written by export/main.py, speculators' by its own `save_pretrained`) and `summary.json`:
- ours: train/main.py with the command's overrides and `seed=<seed>` on a link to the run's cache, then
  export/main.py export.verify=true (vLLM's acceptance against our reference decoder on our head);
- speculators: bench/speculators_train.py (its CLI's defaults, our head's shape and epochs), then the same
  verification with the reference decoder drafting from the export read back as vLLM reads it
  (export/verify.py, head_dir=None) - and the collapse check against the head's held-out estimate, so a
  wrong adapter shows up as a head that serves far below what it estimates, not as a weak recipe;
- both: the held-out estimate at k (train's metrics, train/held_out.py `held_out_of`) of the export read
  back as vLLM reads it, and the wall time per optimizer step on this machine, with its dtypes.
`--tag NAME --ours-override ... / --speculators-arg ...` trains a variant (an ablation) beside the others.
A head whose summary.json exists is not trained again; after an interruption a head's finished training
is kept and the rest redone (an interrupted speculators training is refused: delete its directory). <run_dir>/peer/results.json and results.md gather every head there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from artifacts import atomic

REPO = Path(__file__).resolve().parent.parent
TRAINERS = ("ours", "speculators")
# train.mixed_precision, as the table says it: fp32 master weights either way
PRECISIONS = {"no": "float32", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}


def head_dir(run_dir: Path, kind: str, trainer: str, tag: str | None, seed: int) -> Path:
    return run_dir / "peer" / kind / f"{trainer}{'-' + tag if tag else ''}_s{seed}"


def run(command: list[str], log: Path, mode: str = "w") -> None:
    """A stage as a subprocess, its output in `log` (mode "a": after an earlier run's); its failure raised
    with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, mode) as out:
        done = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({done.returncode}); its log {log}:\n"
                           + log.read_text()[-3000:])  # fmt: skip


def train_ours(run_dir: Path, out: Path, kind: str, seed: int, overrides: list[str]) -> dict:
    """train/main.py then export/main.py export.verify=true in `out`, on a link to the run's cache."""
    from artifacts.config import compose
    from target.model import target_dir

    if (out / "export" / "verification.json").exists():  # trained, exported and verified before a stop
        return ours_summary(out, overrides)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "cache").exists():
        (out / "cache").symlink_to(run_dir / "cache", target_is_directory=True)
    target = target_dir(compose("config", [f"run_dir={run_dir}", *overrides]).target)
    stage_args = [*overrides, f"run_dir={out}", f"head.kind={kind}", f"seed={seed}", f"target.path={target}"]
    python = sys.executable
    run([python, "train/main.py", *stage_args, "train.resume=auto"], out / "logs" / "train.log")
    run([python, "export/main.py", *stage_args, "export.verify=true"], out / "logs" / "export.log")
    return ours_summary(out, overrides)


def ours_summary(out: Path, overrides: list[str]) -> dict:
    from artifacts.config import compose

    steps = [json.loads(line) for line in (out / "train_steps.jsonl").read_text().splitlines()]
    return {
        "num_steps": len(steps),
        "step_s_median": statistics.median(s["seconds"] for s in steps),
        "tokens_per_step_mean": statistics.mean(s["tokens"] for s in steps),
        "compute_dtype": PRECISIONS[compose("config", [f"run_dir={out}", *overrides]).train.mixed_precision],
        "verification": json.loads((out / "export" / "verification.json").read_text()),
    }


def train_speculators(run_dir: Path, out: Path, kind: str, seed: int, overrides: list[str], extra: list[str]):
    """bench/speculators_train.py, then its export verified in vLLM against the reference decoder."""
    command = [sys.executable, "-m", "bench.speculators_train", "--run-dir", str(run_dir), "--out", str(out),
               "--kind", kind, "--seed", str(seed), *[f"--speculators-arg={a}" for a in extra], "--", *overrides]  # fmt: skip
    if not (out / "speculators.json").exists():  # not trained before a stop
        out.mkdir(parents=True, exist_ok=True)
        run(command, out / "logs" / "train.log")
    record = json.loads((out / "speculators.json").read_text())
    return {
        "num_steps": record["num_steps"],
        "step_s_median": record["step_s_median"],
        "tokens_per_step_mean": statistics.mean(record["tokens_per_step"]),
        "compute_dtype": record["compute_dtype"],
        "settings": record["settings"],
    }


def estimate(run_dir: Path, export_dir: Path, kind: str, k: int, overrides: list[str]) -> dict:
    """Train's held-out metrics at k of the export as vLLM reads it (either trainer's head alike)."""
    from artifacts.config import compose
    from artifacts.manifest import read_manifest
    from export.read_vllm import read_export
    from target.model import load_embedding_and_lm_head
    from train.held_out import held_out_of

    cfg = compose("config", [f"run_dir={run_dir}", *overrides])
    draft, draft_to_target = read_export(export_dir, load_embedding_and_lm_head(cfg.target)[0])
    depth = "num_depths" if kind == "peagle" else "num_ttt_steps"
    return held_out_of(
        draft, draft_to_target, read_manifest(run_dir / "cache")["aux_layer_ids"],
        run_dir, k, [*overrides, f"head.kind={kind}", f"head.{depth}={k}"],
    )  # fmt: skip


def verify_peer(
    run_dir: Path, export_dir: Path, kind: str, k: int, held_out_estimate: float, overrides
) -> dict:
    """export/verify.py on a head trained elsewhere: vLLM against the reference decoder drafting from the
    export as vLLM reads it, the collapse check against its held-out estimate; as export/main.py runs it."""
    from omegaconf import OmegaConf

    from artifacts.config import compose
    from artifacts.prompts import held_out_prompts, stop_token_ids
    from export.record import record_export
    from export.verify import VerificationError, verify_export
    from target.model import load_tokenizer, target_dir

    cfg = compose("config", [f"run_dir={run_dir}", *overrides])
    tokenizer = load_tokenizer(cfg.target)
    target = target_dir(cfg.target)
    prompts = held_out_prompts(run_dir / "cache", tokenizer, cfg.export.verify_num_prompts,
                               OmegaConf.to_container(cfg.render.chat_template_kwargs, resolve=True))  # fmt: skip
    try:
        report = verify_export(
            target, None, export_dir, kind, prompts, stop_token_ids(tokenizer, target), k,
            cfg.export.verify_max_new_tokens, cfg.export.verify_tolerance, cfg.export.verify_dtype, "bfloat16",
            OmegaConf.to_container(cfg.export.vllm_kwargs, resolve=True),
            log_path=export_dir.parent / "logs" / "verify.log", estimate=held_out_estimate,
        )  # fmt: skip
    except VerificationError as error:
        atomic.write_text(export_dir.parent / "verification_failed.json", json.dumps(error.report, indent=1))
        raise
    atomic.write_text(export_dir / "verification.json", json.dumps(report, indent=1))
    note = "trained by speculators (bench/peer_heads.py): vLLM's acceptance equals the reference decoder's"
    record_export(export_dir, True, note, str(target))  # eval and the watch check its files against it
    return report


def train_head(args, trainer: str, seed: int, overrides: list[str]) -> dict:
    """One head trained, exported, verified and estimated (or its summary, when it is done already)."""
    out = head_dir(args.run_dir, args.kind, trainer, args.tag, seed)
    summary_path = out / "summary.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    if trainer == "ours":
        ours = [*overrides, *args.ours_override]
        summary = train_ours(args.run_dir, out, args.kind, seed, ours)
    else:
        summary = train_speculators(args.run_dir, out, args.kind, seed, overrides, args.speculators_arg)
    held_out = estimate(args.run_dir, out / "export", args.kind, args.k, overrides)
    if trainer == "speculators":
        summary["verification"] = verify_peer(
            args.run_dir, out / "export", args.kind, args.k, held_out[f"eval/accept_len_k{args.k}"], overrides
        )
    summary = {"trainer": trainer, "tag": args.tag, "kind": args.kind, "seed": seed, "k": args.k,
               "export": str(out / "export"), "held_out": held_out, **summary}  # fmt: skip
    atomic.write_text(summary_path, json.dumps(summary, indent=1))
    return summary


def gather(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "peer").glob("*/*/summary.json"))]


def table(summaries: list[dict]) -> str:
    """results.md: one row per head, then per (kind, trainer, tag) the mean and spread over seeds."""
    rows = ["| kind | trainer | seed | steps | s/step | compute dtype | held-out accept len | at T=1 | acc per depth | vLLM = reference |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in summaries:
        k, v = s["k"], s["verification"]
        accs = " / ".join(f"{s['held_out'].get(f'eval/acc_{i}', float('nan')):.3f}" for i in range(k))
        rows.append(
            f"| {s['kind']} | {s['trainer']}{'-' + s['tag'] if s['tag'] else ''} | {s['seed']} | {s['num_steps']} | "
            f"{s['step_s_median']:.2f} | {s['compute_dtype']} | {s['held_out'][f'eval/accept_len_k{k}']:.3f} | "
            f"{s['held_out'].get(f'eval/accept_len_t1_k{k}', float('nan')):.3f} | {accs} | {v['vllm']['mean_acceptance_length']:.4f} = {v['reference']['mean_acceptance_length']:.4f} "
            f"(gap {v['parity']['mean_acceptance_length_relative_gap']:.2%}) |"
        )  # fmt: skip
    groups: dict[tuple, list[float]] = {}
    for s in summaries:
        key = (s["kind"], s["trainer"] + ("-" + s["tag"] if s["tag"] else ""))
        t1 = s["held_out"].get(f"eval/accept_len_t1_k{s['k']}", float("nan"))
        groups.setdefault(key, []).append((s["held_out"][f"eval/accept_len_k{s['k']}"], t1))
    rows += [
        "",
        "| kind | trainer | seeds | held-out accept len, mean | spread (max - min) | at T=1, mean | spread |",
        "|---|---|---|---|---|---|---|",
    ]
    for (kind, trainer), pairs in sorted(groups.items()):
        t0, t1 = zip(*pairs)
        rows.append(f"| {kind} | {trainer} | {len(pairs)} | {statistics.mean(t0):.3f} | {max(t0) - min(t0):.3f} | "
                    f"{statistics.mean(t1):.3f} | {max(t1) - min(t1):.3f} |")  # fmt: skip
    return "\n".join(rows) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="a run with a finished data_prep cache")
    parser.add_argument("--kind", choices=["eagle3", "peagle"], required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--trainers", nargs="+", choices=TRAINERS, default=list(TRAINERS))
    parser.add_argument("--k", type=int, default=3, help="drafts per round: verified and estimated at this k")
    parser.add_argument("--tag", default=None, help="a variant's name (its overrides below)")
    parser.add_argument("--ours-override", action="append", default=[], help="one more override for ours")
    parser.add_argument("--speculators-arg", action="append", default=[],
                        help="one more speculators CLI argument (repeat: --speculators-arg=--optimizer "
                        "--speculators-arg=adamw)")  # fmt: skip
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    args.run_dir = args.run_dir.resolve()
    if not (args.run_dir / "cache" / "manifest.json").exists():
        raise SystemExit(f"{args.run_dir}/cache: no finished cache; run data_prep/main.py on it first")
    for seed in args.seeds:
        for trainer in args.trainers:
            s = train_head(args, trainer, seed, overrides)
            print(f"{s['kind']} {trainer} seed {seed}: held out {s['held_out'][f'eval/accept_len_k{args.k}']:.3f} "
                  f"at k={args.k}, {s['num_steps']} steps of {s['step_s_median']:.2f} s, vLLM "
                  f"{s['verification']['vllm']['mean_acceptance_length']:.4f} = reference "
                  f"{s['verification']['reference']['mean_acceptance_length']:.4f}", flush=True)  # fmt: skip
    summaries = gather(args.run_dir)
    atomic.write_text(args.run_dir / "peer" / "results.json", json.dumps(summaries, indent=1))
    atomic.write_text(args.run_dir / "peer" / "results.md", table(summaries))
    print(table(summaries))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
