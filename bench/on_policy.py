"""On-policy training (train.stage=on_policy) beside continued supervised training at matched wall time, both
from the same supervised head, each judged by the acceptance it decodes at on held-out prompts.

    make runs/smollm2_quick/.done-train PROFILE=quick
    python -m bench.on_policy --run-dir runs/smollm2_quick --seeds 0 1 -- experiment=smollm2_quick
    python -m bench.on_policy --run-dir runs/smollm2_quick --seeds 0 --tag forward_only \\
        --on-policy-override on_policy.rejected_loss=kl -- experiment=smollm2_quick
    python -m bench.on_policy --run-dir runs/smollm2_quick --out runs/smollm2_quick/on_policy_bench_t1 \\
        -- experiment=smollm2_quick on_policy.temperature=1

In <run_dir>/on_policy_bench/ (--out), for each seed:
- on_policy[-<tag>]_s<seed>/: the on-policy stage from <run_dir>/draft_head (the command's overrides, then
  --on-policy-override's); its compute is what its iterations' rollouts and replays took (on_policy.jsonl),
  the held-out rollouts it measures after every iteration left out;
- supervised_s<seed>/: train/main.py warm-started from the same head (train.init_from) on a link to the
  run's cache, for as many optimizer steps as that compute buys at the step time of the head's own training
  (its train_steps.jsonl: the same machine, the same data); a tag's on-policy run gets no supervised twin;
then the reference decoder (the fp32 HF target drafting with the head: the acceptance vLLM serves the head
at, export verification proves the two equal) on --prompts held-out prompts at the stage's k and
temperature (sampled: prompt i's stream seeded i for every head): the start head and every head trained. A head already measured is not trained or measured again; an
interrupted run resumes (train.resume=auto). results.json and results.md gather them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from artifacts import atomic
from bench.peer_heads import run


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def on_policy(args, seed: int, out: Path, overrides: list[str]) -> dict:
    """The on-policy stage in `out`; its compute (rollouts and replays) and its held-out curve."""
    stage = [*overrides, f"seed={seed}", "train.stage=on_policy", f"on_policy.out_dir={out}",
             f"on_policy.init_from={args.run_dir.resolve() / 'draft_head'}", "train.resume=auto",
             *args.on_policy_override]  # fmt: skip
    run([sys.executable, "train/main.py", *stage], out / "logs" / "train.log", "a")
    iterations = records(out / "on_policy.jsonl")
    done = [r for r in iterations if "rollouts" in r]
    return {
        "head_dir": str(out / "draft_head"),
        "num_steps": done[-1]["step"],
        "rollout_seconds": sum(r["rollouts"]["seconds"] for r in done),
        "replay_seconds": sum(r["replay"]["seconds"] for r in done),
        "rollout_tokens": sum(r["rollouts"]["tokens"] for r in done),
        "curve": [
            [r["step"], r["held_out"]["mean_acceptance_length"]] for r in iterations if "held_out" in r
        ],
    }


def supervised(args, seed: int, out: Path, overrides: list[str], seconds: float) -> dict:
    """Continued supervised training in `out` for the steps `seconds` buys at the head's own step time."""
    steps = records(args.run_dir / "train_steps.jsonl")
    step_s = statistics.median(s["seconds"] for s in steps)
    num_steps = max(1, math.ceil(seconds / step_s))
    if not (out / "cache").exists():
        (out / "cache").symlink_to(args.run_dir.resolve() / "cache", target_is_directory=True)
    # as many epochs as steps, so that train.max_steps decides (an epoch is at least a step)
    stage = [*overrides, f"run_dir={out}", f"seed={seed}", f"train.max_steps={num_steps}", "train.resume=auto",
             f"train.num_epochs={num_steps}", f"train.init_from={args.run_dir.resolve() / 'draft_head'}",
             "train.eval_every=0"]  # fmt: skip
    run([sys.executable, "train/main.py", *stage], out / "logs" / "train.log", "a")
    own = {s["step"]: s["seconds"] for s in records(out / "train_steps.jsonl")}  # a replayed step once
    return {
        "head_dir": str(out / "draft_head"),
        "num_steps": num_steps,
        "start_step_s": step_s,
        "step_seconds": sum(own.values()),
    }


def acceptance(args, head_dir: Path, overrides: list[str]) -> dict:
    """The reference decoder's acceptance of the head on the cache's first --prompts held-out prompts, 16
    decoded together (train/rollouts.py `roll_out_all`: a test holds its decisions equal to batch 1's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from artifacts.config import compose
    from artifacts.prompts import held_out_prompts, stop_token_ids
    from heads.acceptance import AcceptanceCounts
    from heads.reference_decoder import inference_device, load_head
    from target.model import load_tokenizer, target_dir
    from train.rollouts import roll_out_all

    cfg = compose("config", [f"run_dir={args.run_dir}", *overrides])
    tokenizer = load_tokenizer(cfg.target)
    prompts = held_out_prompts(args.run_dir / "cache", tokenizer, args.prompts)
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg.target), dtype=torch.float32)
    target = target.eval().requires_grad_(False).to(inference_device())
    head, k = load_head(head_dir, target), cfg.on_policy.num_speculative_tokens
    stops = stop_token_ids(tokenizer, target_dir(cfg.target))
    temperature = cfg.on_policy.temperature  # sampled: prompt i's stream seeded i, the same for every head
    rollouts = roll_out_all(target, head, prompts, k, args.max_new_tokens, stops, temperature)
    counts = sum((r.counts() for r in rollouts), AcceptanceCounts())
    return {"num_prompts": len(prompts), "k": k, "temperature": temperature, **counts.summary()}


def measured(args, name: str, train, overrides: list[str]) -> dict:
    """A head's summary (trained by `train`, then measured), kept in <bench>/<name>/summary.json."""
    out = args.out / name
    path = out / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    summary = {"name": name, **train(out)}
    summary["held_out"] = acceptance(args, Path(summary["head_dir"]), overrides)
    atomic.write_json(path, summary)
    return summary


def table(rows: list[dict]) -> str:
    lines = [
        "| head | optimizer steps | compute s (rollouts + replay, or steps) | rollout tokens | tokens a round "
        "| per position | curve (step, held-out tokens a round) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        held = r["held_out"]
        seconds = (
            f"{r['rollout_seconds']:.0f} + {r['replay_seconds']:.0f}" if "rollout_seconds" in r
            else f"{r.get('step_seconds', 0):.0f}"
        )  # fmt: skip
        lines.append(
            f"| {r['name']} | {r.get('num_steps', '-')} | {seconds} | {r.get('rollout_tokens', '-')} "
            f"| {held['mean_acceptance_length']:.3f} "
            f"| {' / '.join(f'{p:.3f}' for p in held['per_position_acceptance'])} "
            f"| {' '.join(f'({s}, {a:.3f})' for s, a in r.get('curve', []))} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="a run whose train stage has finished")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--tag", help="names an on-policy variant (with --on-policy-override)")
    parser.add_argument("--on-policy-override", nargs="*", default=[], help="on_policy.* / train.* settings")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts the heads decode")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, help="where the runs and results go (<run-dir>/on_policy_bench)")
    parser.add_argument("overrides", nargs="*", help="after --: the run's overrides (experiment=...)")
    args = parser.parse_args()
    args.out = args.out or args.run_dir / "on_policy_bench"
    if not (args.run_dir / "draft_head" / "draft_config.json").exists():
        sys.exit(f"{args.run_dir / 'draft_head'}: no supervised head; train the run first")
    from artifacts.config import compose
    from target.model import target_dir

    overrides = [*args.overrides, f"run_dir={args.run_dir.resolve()}"]
    # resolved here: a target path relative to the run directory stays valid in the supervised runs' own
    overrides.append(f"target.path={target_dir(compose('config', overrides).target)}")
    rows = [measured(args, "start", lambda out: {"head_dir": str(args.run_dir / "draft_head")}, overrides)]
    for seed in args.seeds:
        name = f"on_policy{'-' + args.tag if args.tag else ''}_s{seed}"
        opd = measured(args, name, lambda out, s=seed: on_policy(args, s, out, overrides), overrides)
        rows.append(opd)
        if not args.tag:
            seconds = opd["rollout_seconds"] + opd["replay_seconds"]
            rows.append(
                measured(
                    args, f"supervised_s{seed}",
                    lambda out, s=seed, t=seconds: supervised(args, s, out, overrides, t), overrides,
                )
            )  # fmt: skip
    bench = args.out
    every = [json.loads(p.read_text()) for p in sorted(bench.glob("*/summary.json"))]
    atomic.write_json(bench / "results.json", every)
    atomic.write_text(bench / "results.md", table(every))
    print(table(rows))


if __name__ == "__main__":
    main()
