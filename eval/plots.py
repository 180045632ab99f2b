"""The eval report's figures (PNG): per-position acceptance, throughput and ITL against concurrency,
predicted against measured speedup and acceptance by context length - each drawn only when the runs hold
something to draw.

    paths = write_plots(results["runs"], out_dir / "plots")  # {name: path}; eval/report.py links them
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

from eval.results import acceptance, is_number, lowest_concurrency_runs, ordered

matplotlib.use("Agg")  # eval runs on headless servers; set before pyplot picks a backend
import matplotlib.pyplot as plt  # noqa: E402


def plot_acceptance(runs: list[dict]):
    picked = [r for r in lowest_concurrency_runs(runs) if acceptance(r).get("per_position_acceptance")]
    if not picked:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in picked:
        values = [v if is_number(v) else math.nan for v in acceptance(r)["per_position_acceptance"]]
        label = f"{r['config']} / {r['workload']} (c={r['concurrency']})"
        ax.plot(range(1, len(values) + 1), values, marker="o", label=label)
    ax.set(xlabel="draft position", ylabel="unconditional acceptance p_i", ylim=(0, 1.05))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(fontsize=7)
    return fig


def plot_vs_concurrency(runs: list[dict], value: Callable[[dict], float | None], ylabel: str):
    if not any(r["head"] is not None for r in runs):
        return None  # these plots compare heads with the baseline; the runs table says the rest
    if not any(is_number(value(r)) for r in runs):
        return None  # nothing measured (eval.offline: acceptance only)
    workloads = ordered(r["workload"] for r in runs)
    head_of = {r["config"]: r["head"] for r in runs}
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = sorted((r for r in runs if r["workload"] == workload), key=lambda r: r["concurrency"])
        for config in ordered(r["config"] for r in mine):
            points = [
                (r["concurrency"], value(r)) for r in mine if r["config"] == config and is_number(value(r))
            ]
            if not points:
                continue
            style = {"color": "black", "linestyle": "--"} if head_of[config] is None else {}
            ax.plot(*zip(*points), marker="o", label=config, **style)
        ticks = ordered(r["concurrency"] for r in mine)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.minorticks_off()
        ax.set(title=workload, xlabel="concurrency", ylabel=ylabel)
        ax.legend(fontsize=7)
    return fig


def plot_by_context(runs: list[dict]):
    """Mean acceptance length per context-length bucket, a line per head run (its lowest concurrency)."""
    picked = [r for r in lowest_concurrency_runs(runs) if r["head"] is not None and r.get("by_context")]
    picked = [
        r
        for r in picked
        if any((row.get("acceptance") or {}).get("mean_acceptance_length") for row in r["by_context"])
    ]
    if not picked:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in picked:
        rows = [row for row in r["by_context"] if row.get("acceptance")]
        values = [row["acceptance"]["mean_acceptance_length"] for row in rows]
        ax.plot([row["bucket"] for row in rows], values, marker="o", label=f"{r['config']} / {r['workload']}")
    ax.axhline(1.0, color="black", linewidth=0.5)  # no draft accepted
    ax.set(xlabel="context (prompt tokens)", ylabel="mean acceptance length")
    ax.legend(fontsize=7)
    return fig


def plot_speedups(runs: list[dict]):
    points = [
        (r, e["predicted_speedup"], e["measured_speedup"])
        for r in runs
        if (e := r.get("economics"))
        and is_number(e.get("predicted_speedup"))
        and is_number(e.get("measured_speedup"))
    ]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(5, 5))
    for workload in ordered(r["workload"] for r, _, _ in points):
        mine = [(r, p, m) for r, p, m in points if r["workload"] == workload]
        ax.scatter([p for _, p, _ in mine], [m for _, _, m in mine], label=workload)
        for r, p, m in mine:
            label = f"{r['config']} c={r['concurrency']}"
            ax.annotate(label, (p, m), xytext=(3, 3), textcoords="offset points", fontsize=6)
    values = [v for _, p, m in points for v in (p, m)]
    lo, hi = min(*values, 1.0) * 0.9, max(*values, 1.0) * 1.1
    ax.plot([lo, hi], [lo, hi], color="gray", linestyle=":", label="measured = predicted")
    ax.axhline(1.0, color="black", linewidth=0.5)  # below this line the head slows serving down
    ax.set(xlabel="predicted speedup", ylabel="measured speedup", xlim=(lo, hi), ylim=(lo, hi))
    ax.legend(fontsize=7)
    return fig


def write_plots(runs: list[dict], plots_dir: Path) -> dict[str, Path]:
    """The plots there is something to draw for, as {name: path}."""
    figures = {
        "acceptance_per_position": plot_acceptance(runs),
        "throughput_vs_concurrency": plot_vs_concurrency(
            runs, lambda r: r.get("output_tokens_per_s"), "output tok/s"
        ),
        "itl_vs_concurrency": plot_vs_concurrency(
            runs, lambda r: (r.get("itl_ms") or {}).get("p50"), "ITL p50 (ms)"
        ),
        "speedup_predicted_vs_measured": plot_speedups(runs),
        "acceptance_by_context": plot_by_context(runs),
    }
    paths = {}
    for name, fig in figures.items():
        if fig is None:
            continue
        plots_dir.mkdir(parents=True, exist_ok=True)
        paths[name] = plots_dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(paths[name], dpi=120)
        plt.close(fig)  # pyplot keeps every open figure alive otherwise
    return paths
