"""The eval stage's report: its results dict (eval/main.py) as results.json, report.md, PNG plots
(eval/plots.py) and, optionally, an offline W&B run.

    paths = write_report(results, out_dir)  # out_dir/results.json, report.md, plots/*.png
    log_to_wandb(results, paths, out_dir, project="eagle-heads")  # out_dir/wandb/offline-run-*

report.md holds, per workload, every measured run (acceptance, throughput, speedup, latency), the
per-position acceptance of each head config, predicted vs measured speedup, the recommendations and,
when the runs hold several heads, the heads side by side. Missing or non-finite numbers print as "n/a" and
are written to results.json as null (JSON has no NaN).
"""

from __future__ import annotations

from pathlib import Path

from artifacts import atomic
from eval.plots import write_plots
from eval.results import (
    acceptance,
    best_at_lowest_concurrency,
    clean,
    is_number,
    lowest_concurrency_runs,
    ordered,
    write_json,
)

RUN_COLUMNS = (
    "config, concurrency, mean acceptance length, draft acceptance rate, output tok/s, speedup, TTFT p50, "
    "TPOT p50, ITL p50, ITL p90, ITL p99, failed"
).split(", ")
ECONOMICS_COLUMNS = (
    "config, workload, concurrency, drafting, alpha (i.i.d.), draft cost c, predicted, measured, gap".split(
        ", "
    )
)
RECOMMENDATION_COLUMNS = "head workload best_k best_speedup enable breakeven_concurrency text".split()
LEGEND = (
    "**mean acceptance length (tokens per verify step, incl. bonus)** = 1 + accepted / drafts; "
    "**draft acceptance rate (accepted / drafted)** = accepted / draft tokens; "
    "**speedup** = output tok/s over the baseline's on the same workload and concurrency; "
    "latencies in ms; n/a = not measured."
)


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return format(value, spec) + suffix if is_number(value) else "n/a"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(v) for v in row) + " |" for row in rows]


def runs_section(runs: list[dict], workload: str) -> list[str]:
    rank = {c: i for i, c in enumerate(ordered(r["config"] for r in runs))}
    mine = sorted(
        (r for r in runs if r["workload"] == workload), key=lambda r: (rank[r["config"]], r["concurrency"])
    )
    rows = []
    for r in mine:
        ttft, tpot, itl = (r.get(m) or {} for m in ("ttft_ms", "tpot_ms", "itl_ms"))
        rows.append(
            [
                r["config"],
                r["concurrency"],
                fmt(acceptance(r).get("mean_acceptance_length")),
                fmt(acceptance(r).get("draft_acceptance_rate"), ".3f"),
                fmt(r.get("output_tokens_per_s"), ".1f"),
                fmt(r.get("speedup"), ".2f", "x"),
                fmt(ttft.get("p50"), ".1f"),
                fmt(tpot.get("p50"), ".1f"),
                *(fmt(itl.get(p), ".1f") for p in ("p50", "p90", "p99")),
                f"{r.get('num_failed', 'n/a')}/{r.get('num_requests', 'n/a')}",
            ]
        )
    return [f"### {workload}", "", *table(RUN_COLUMNS, rows)]


def per_position_section(runs: list[dict]) -> list[str]:
    picked = lowest_concurrency_runs(runs)
    if not picked:
        return []
    width = max(len(acceptance(r).get("per_position_acceptance") or []) for r in picked)
    rows = []
    for r in picked:
        for kind, key in (
            ("unconditional p_i", "per_position_acceptance"),
            ("conditional p_i / p_(i-1)", "conditional_per_position_acceptance"),
        ):
            values = acceptance(r).get(key) or []
            cells = [fmt(v, ".3f") for v in values] + [""] * (width - len(values))
            rows.append([r["config"], r["workload"], r["concurrency"], kind, *cells])
    header = ["config", "workload", "concurrency", "acceptance", *(f"position {i + 1}" for i in range(width))]
    return ["## Per-position acceptance", "", *table(header, rows)]


def context_section(runs: list[dict]) -> list[str]:
    """Each run's requests by context length (eval.context_buckets): vLLM's acceptance over each bucket's
    requests (their own counts) and the speedup in time per output token against the baseline's."""
    rows = [
        [r["config"], r["workload"], r["concurrency"], row["bucket"], row["num_requests"],
         "-".join(str(n) for n in row["prompt_tokens"]),
         fmt((row.get("acceptance") or {}).get("mean_acceptance_length")),
         fmt(row.get("tpot_ms"), ".1f"), fmt(row.get("speedup"), ".2f", "x")]
        for r in runs for row in r.get("by_context") or []
    ]  # fmt: skip
    if not any(r["head"] is not None and r.get("by_context") for r in runs):
        return []
    header = ["config", "workload", "concurrency", "context (prompt tokens)", "requests", "range",
              "mean acceptance length", "TPOT mean", "speedup (TPOT)"]  # fmt: skip
    note = ("Each request's own acceptance (vLLM's per-request metrics), summed over the requests whose prompt "
            "falls in the bucket; speedup = the baseline's mean time per output token there over the head's.")  # fmt: skip
    return ["## Acceptance by context length", "", note, "", *table(header, rows)]


def economics_section(runs: list[dict]) -> list[str]:
    rows = [
        [
            r["config"],
            r["workload"],
            r["concurrency"],
            e.get("drafting", "chain"),
            fmt(e.get("alpha"), ".3f"),
            fmt(e.get("draft_cost"), ".3f"),
            fmt(e.get("predicted_speedup"), ".2f", "x"),
            fmt(e.get("measured_speedup"), ".2f", "x"),
            fmt(e.get("gap"), "+.2f"),
        ]
        for r in runs
        if (e := r.get("economics"))
    ]
    if not rows:
        return []
    return [
        "## Predicted vs measured speedup",
        "",
        "Predicted = (1 - alpha^(k+1)) / ((1 - alpha)(n c + 1)) with n = k draft passes per round for chain "
        "drafting, 1 for parallel and block drafting and ngram; alpha solves (1 - alpha^(k+1)) / (1 - alpha) = the "
        "measured mean acceptance length; c from the measured step times (eval/economics.py); gap = "
        "measured - predicted.",
        "",
        *table(ECONOMICS_COLUMNS, rows),
    ]


def estimate_section(runs: list[dict]) -> list[str]:
    """Served acceptance beside train's held-out estimate of it (eval/results.py add_estimates), per head,
    k, workload and temperature, at the lowest measured concurrency."""
    picked = [r for r in lowest_concurrency_runs(runs) if r.get("estimate")]
    if not picked:
        return []
    rows = []
    for r in picked:
        served = acceptance(r)["mean_acceptance_length"]
        rows.append([r["config"], r["workload"], r.get("concurrency"), fmt(r["estimate"]), fmt(served),
                     f"{served / r['estimate'] - 1:+.1%}"])  # fmt: skip
    return [
        "## Served against train's held-out estimate",
        "",
        "Mean acceptance length served, against the estimate train measured on its held-out conversations "
        "(draft_config.json; T=0: the argmax chain; T=1: vLLM's argmax drafts, or sampled ones with "
        "draft_sample_method=probabilistic). The estimate scores contexts of the training answers: a head "
        "trained on greedy answers and served at T=1 meets sampled contexts it was not scored on.",
        "",
        *table(
            ["config", "workload", "concurrency", "held-out estimate", "served", "served vs estimate"], rows
        ),
    ]


def compare_section(runs: list[dict], workloads: list[str]) -> list[str]:
    heads = ordered(r["head"] for r in runs if r["head"] is not None)
    if len(heads) < 2:
        return []
    lines = ["## Heads compared", "", "Each head at its fastest k, at the lowest measured concurrency."]
    for workload in workloads:
        rows = []
        for head in heads:
            r = best_at_lowest_concurrency(runs, head, workload) or {}
            rows.append(
                [
                    head,
                    r.get("k", "n/a"),
                    r.get("concurrency", "n/a"),
                    fmt(acceptance(r).get("mean_acceptance_length")),
                    fmt(r.get("speedup"), ".2f", "x"),
                ]
            )
        header = ["head", "best k", "concurrency", "mean acceptance length", "speedup"]
        lines += ["", f"### {workload}", "", *table(header, rows)]
        if verdict := fastest_verdict(runs, heads, workload):
            lines += ["", verdict]
    return lines


def fastest_verdict(runs: list[dict], heads: list[str], workload: str) -> str | None:
    """Which head is fastest on `workload` (each at its fastest k, lowest concurrency), by how much over
    each other, and why: the tokens a round brings against what a round costs (eval/economics.py)."""
    best = {h: r for h in heads if (r := best_at_lowest_concurrency(runs, h, workload))}
    if len(best) < 2:
        return None
    order = sorted(best, key=lambda h: best[h]["speedup"], reverse=True)
    winner = best[order[0]]

    def round_text(r: dict) -> str:
        cost = (r.get("economics") or {}).get("draft_cost")
        length = acceptance(r).get("mean_acceptance_length")
        return f"{fmt(length)} tokens a round at a draft cost of {fmt(cost)} target steps"

    others = "; ".join(
        f"{h} k={best[h]['k']} {best[h]['speedup']:.2f}x, {1 - best[h]['speedup'] / winner['speedup']:.0%} "
        f"slower ({round_text(best[h])})"
        for h in order[1:]
    )
    return (
        f"**Fastest: {order[0]} k={winner['k']}, {winner['speedup']:.2f}x** ({round_text(winner)}); {others}. "
        "A round pays what it accepts over what it costs: speedup ~ tokens a round / (1 + draft passes x cost)."
    )


def image(plots: dict[str, Path], name: str, caption: str) -> list[str]:
    return ["", f"![{caption}](plots/{name}.png)"] if name in plots else []


def render_report(results: dict, plots: dict[str, Path]) -> str:
    runs = results.get("runs") or []
    workloads = ordered(r["workload"] for r in runs)
    machine = results.get("machine") or {}
    temperatures = (results.get("config") or {}).get("temperature") or ordered(
        r.get("temperature", 0.0) for r in runs
    )
    versions = ", ".join(f"{k} {v}" for k, v in (results.get("versions") or {}).items() if v)
    lines = [
        "# Eval: speculative decoding with draft heads in vLLM",
        "",
        f"{versions}; {machine.get('cpu', '?')} ({machine.get('num_cpus', '?')} CPUs), "
        f"GPU: {machine.get('gpu') or 'none'}.",
        f"Sampling temperature {', '.join(f'{t:g}' for t in temperatures)}"
        + (" (each workload per temperature: `chat T=1`)." if len(temperatures) > 1 else "."),
        "",
        LEGEND,
        *(["", "## Notes", "", *(f"- {note}" for note in results["notes"])] if results.get("notes") else []),
        "",
        "## Runs",
    ]
    for workload in workloads:
        lines += ["", *runs_section(runs, workload)]
    lines += image(plots, "throughput_vs_concurrency", "output tok/s vs concurrency")
    lines += image(plots, "itl_vs_concurrency", "ITL p50 vs concurrency")
    for section, plot, caption in (
        (per_position_section(runs), "acceptance_per_position", "per-position acceptance"),
        (context_section(runs), "acceptance_by_context", "acceptance by context length"),
        (estimate_section(runs), "", ""),
        (economics_section(runs), "speedup_predicted_vs_measured", "predicted vs measured speedup"),
    ):
        if section:
            lines += ["", *section, *image(plots, plot, caption)]
    recommendations = results.get("recommendations") or []
    if recommendations:
        lines += ["", "## Recommendations", "", *(f"- {rec['text']}" for rec in recommendations)]
    if results.get("schedule_note"):
        lines += ["", results["schedule_note"]]
    if compare := compare_section(runs, workloads):
        lines += ["", *compare]
    return "\n".join(lines) + "\n"


def write_report(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json, report.md and plots/*.png under `out_dir`; returns {relative path: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = clean(results)
    write_json(out_dir / "results.json", results)
    plots = write_plots(results.get("runs") or [], out_dir / "plots")
    atomic.write_text(out_dir / "report.md", render_report(results, plots))
    return {
        "results.json": out_dir / "results.json",
        "report.md": out_dir / "report.md",
        **{f"plots/{path.name}": path for path in plots.values()},
    }


def flat_run(r: dict) -> dict:
    """One run as flat columns for a W&B table."""
    row = {
        k: r.get(k) for k in ("config", "head", "k", "workload", "concurrency", "num_requests", "num_failed")
    }
    row |= {k: r.get(k) for k in ("output_tokens", "duration_s", "output_tokens_per_s", "speedup")}
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        row |= {f"{metric}_{stat}": (r.get(metric) or {}).get(stat) for stat in ("mean", "p50", "p90", "p99")}
    a, e = acceptance(r), r.get("economics") or {}
    row |= {k: a.get(k) for k in ("mean_acceptance_length", "draft_acceptance_rate")}
    row["per_position_acceptance"] = ", ".join(fmt(v, ".3f") for v in a.get("per_position_acceptance") or [])
    row |= {k: e.get(k) for k in ("alpha", "draft_cost", "predicted_speedup", "gap")}
    return row


def log_to_wandb(
    results: dict,
    plots: dict[str, Path],
    out_dir: Path,
    project: str,
    mode: str = "offline",
    name: str | None = None,
) -> Path | None:
    """One W&B run holding the runs and recommendations as tables, the plots and the best speedups; returns
    its folder (out_dir/wandb/offline-run-* in offline mode), None when W&B is disabled. `plots` may be
    write_report's return value: only its PNGs are logged."""
    import wandb

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    results = clean(results)
    runs, recommendations = results.get("runs") or [], results.get("recommendations") or []
    run = wandb.init(
        project=project,
        mode=mode,
        dir=str(out_dir),
        name=name,
        config=results.get("config") or {},
        job_type="eval",
        # A report, not a training job: no console capture or system metrics to record.
        settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
    )
    rows = [flat_run(r) for r in runs]
    columns = list(rows[0]) if rows else []
    logged = {"runs": wandb.Table(columns=columns, data=[list(row.values()) for row in rows])}
    if recommendations:
        data = [[rec.get(c) for c in RECOMMENDATION_COLUMNS] for rec in recommendations]
        logged["recommendations"] = wandb.Table(columns=RECOMMENDATION_COLUMNS, data=data)
    for path in map(Path, plots.values()):
        if path.suffix == ".png" and path.exists():
            logged[f"plots/{path.stem}"] = wandb.Image(str(path))
    run.log(logged)
    for workload in ordered(r["workload"] for r in runs):
        speedups = [r["speedup"] for r in runs if r["workload"] == workload and is_number(r.get("speedup"))]
        if speedups:
            run.summary[f"{workload}/best_speedup"] = max(speedups)
    for rec in recommendations:
        run.summary[f"{rec['workload']}/{rec['head']}/best_k"] = rec.get("best_k")
        run.summary[f"{rec['workload']}/{rec['head']}/enable"] = rec.get("enable")
    run_dir = None if run.settings.mode == "disabled" else Path(run.dir).parent  # run.dir: <run>/files
    run.finish()
    return run_dir
