"""Held-out learning curves of several training runs side by side: a Markdown table and a PNG plot.

    python train/curves.py runs/smollm2_upgrade runs/smollm2_upgrade_scratch --out runs/upgrade_curves.png

Reads each run's `train_eval.jsonl` (train's held-out evaluation every `train.eval_every` steps; a warm
start also has step 0, the older head before any step) and reports the offline acceptance length for a
chain of k drafts and acc@0 per step, plus the first step at which each run reaches the others' best -
"how many steps did the warm start need" in numbers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(run_dir: Path) -> list[dict]:
    path = run_dir / "train_eval.jsonl"
    if not path.exists():
        raise ValueError(f"{path} is missing: train writes it when train.eval_every > 0")
    by_step = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record  # a step evaluated twice (after a resume) keeps its last value
    return [by_step[s] for s in sorted(by_step)]


def first_step_reaching(curve: list[dict], key: str, value: float) -> int | None:
    return next((r["step"] for r in curve if r.get(key, float("-inf")) >= value), None)


def table(curves: dict[str, list[dict]], key: str) -> str:
    steps = sorted({r["step"] for curve in curves.values() for r in curve})
    lines = ["| step | " + " | ".join(curves) + " |", "|---" * (len(curves) + 1) + "|"]
    for step in steps:
        cells = []
        for curve in curves.values():
            record = next((r for r in curve if r["step"] == step), None)
            cells.append(f"{record[key]:.3f}" if record and key in record else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(curves: dict[str, list[dict]], key: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        points = [(r["step"], r[key]) for r in curve if key in r]
        ax.plot(*zip(*points), marker="o", label=name)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"held-out {key.removeprefix('eval/')}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--k", type=int, default=3, help="chain length of the acceptance estimate")
    parser.add_argument("--out", type=Path, default=None, help="PNG plot of the acceptance curves")
    args = parser.parse_args(argv)

    key = f"eval/accept_len_k{args.k}"
    curves = {str(run_dir): read_curve(run_dir) for run_dir in args.run_dirs}
    print(f"held-out acceptance length estimate, k={args.k} (train's offline estimate):\n")
    print(table(curves, key) + "\n")
    for name, curve in curves.items():
        best = max(r.get(key, float("-inf")) for r in curve)
        reached = {other: first_step_reaching(c, key, best) for other, c in curves.items() if other != name}
        print(f"{name}: best {best:.3f}; first step reaching it: {reached}")
    if args.out:
        plot(curves, key, args.out)
        print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
