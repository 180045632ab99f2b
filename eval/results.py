"""The runs of eval's results dict (eval/main.py): compared with the baseline (each head's speedup on the
same workload and concurrency, with its economics from eval/economics.py), the headline rows (the
recommended k per head, workload and concurrency) and the console's words for them; read the same way by the
report (eval/report.py) and its figures (eval/plots.py): which runs to show, which numbers are real, and
results.json written as valid JSON (NaN and infinities as null).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from artifacts import atomic
from eval.economics import economics


def clean(value):
    """`value` with every NaN or infinite float replaced by None, so that it is valid JSON."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data: dict) -> None:
    # Written whole then renamed: a reader (or a crash) never sees half a results.json.
    atomic.write_text(path, json.dumps(clean(data), indent=2, allow_nan=False) + "\n")


def is_number(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def ordered(items) -> list:
    """Distinct items in order of first appearance (eval measures the baseline first, then k ascending)."""
    return list(dict.fromkeys(items))


def acceptance(run: dict) -> dict:
    return run.get("acceptance") or {}


def lowest_concurrency_runs(runs: list[dict]) -> list[dict]:
    """Per (head config, workload): the run with acceptance counts at the lowest concurrency (1 when
    measured), where the head's acceptance is least mixed with batching effects."""
    best: dict[tuple, dict] = {}
    with_heads = [r for r in runs if r["head"] is not None and acceptance(r)]
    for r in sorted(with_heads, key=lambda r: r["concurrency"]):
        best.setdefault((r["config"], r["workload"]), r)
    return list(best.values())


def best_at_lowest_concurrency(runs: list[dict], head: str, workload: str) -> dict | None:
    """The head's fastest k at the lowest concurrency that has a speedup (eval/economics.recommend's pick)."""
    mine = [
        r for r in runs if r["head"] == head and r["workload"] == workload and is_number(r.get("speedup"))
    ]
    if not mine:
        return None
    lowest = min(r["concurrency"] for r in mine)
    return max((r for r in mine if r["concurrency"] == lowest), key=lambda r: r["speedup"])


def add_comparisons(runs: list[dict]) -> None:
    """Speedup against the baseline (same workload and concurrency) and the economics, in place."""
    base = {(r["workload"], r["concurrency"]): r for r in runs if r["head"] is None}
    for r in runs:
        r["speedup"], r["economics"] = None, None
        b = base.get((r["workload"], r["concurrency"]))
        if r["head"] is None or b is None or not b["output_tokens_per_s"] or not r["output_tokens_per_s"]:
            continue
        r["speedup"] = r["output_tokens_per_s"] / b["output_tokens_per_s"]
        add_context_speedups(r, b)
        tpot_head, tpot_base = r["tpot_ms"]["mean"], b["tpot_ms"]["mean"]
        # A schedule's k changes with the batch: no single-k economics for it.
        if r["acceptance"] and tpot_head and tpot_base and not r.get("schedule"):
            drafting = r.get("drafting", "chain")
            r["economics"] = economics(r["acceptance"], r["k"], tpot_head, tpot_base, r["speedup"], drafting)


def add_context_speedups(run: dict, base: dict) -> None:
    """Each context bucket's speedup: the baseline's mean time per output token over the head's, on the
    same workload's requests of that bucket (the same prompts, as both runs send every prompt)."""
    base_tpot = {row["bucket"]: row.get("tpot_ms") for row in base.get("by_context") or []}
    for row in run.get("by_context") or []:
        b, h = base_tpot.get(row["bucket"]), row.get("tpot_ms")
        row["speedup"] = b / h if is_number(b) and is_number(h) and h > 0 else None


# train's held-out estimate that predicts a served run (train/metrics.py ESTIMATES): at T=0 the argmax
# chain; at T=1 the argmax drafts vLLM makes by default, or the sampled ones of draft_sample_method
# probabilistic. Other temperatures have none.
ESTIMATE_KEYS = {(0.0, "greedy"): "accept_len", (0.0, "probabilistic"): "accept_len",
                 (1.0, "greedy"): "accept_len_t1", (1.0, "probabilistic"): "accept_len_t1_sampled"}  # fmt: skip


def add_estimates(runs: list[dict], held_out: dict[str, dict], sampling: dict[str, str]) -> None:
    """Each head run's `estimate`: its head's held-out estimate at the run's k and temperature (`held_out`:
    head name -> the head record's final held-out metrics; `sampling`: head name -> draft_sample_method),
    None where the record or the temperature has none. In place."""
    for r in runs:
        metrics = held_out.get(r["head"]) or {}
        key = ESTIMATE_KEYS.get((float(r.get("temperature", 0.0)), sampling.get(r["head"], "greedy")))
        r["estimate"] = metrics.get(f"eval/{key}_k{r['k']}") if key and not r.get("schedule") else None


def headline(runs: list[dict], recommendations: list[dict]) -> list[dict]:
    """Per (head, workload): the recommended k at each measured concurrency, and its k schedule if served."""
    rows = []
    for rec in recommendations:
        for r in sorted(runs, key=lambda r: (bool(r.get("schedule")), r["concurrency"])):
            if (r["head"], r["workload"]) != (rec["head"], rec["workload"]):
                continue
            if r.get("schedule") or r["k"] == rec["best_k"]:
                acceptance = r["acceptance"] or {}
                rows.append(
                    {
                        "workload": r["workload"],
                        "head": r["head"],
                        "k": "schedule" if r.get("schedule") else r["k"],
                        "concurrency": r["concurrency"],
                        "mean acceptance length": acceptance.get("mean_acceptance_length"),
                        "output tok/s": r["output_tokens_per_s"],
                        "speedup": r["speedup"],
                    }
                )
    return rows


def headline_table(rows: list[dict]) -> str:
    """The headline rows as a Markdown table for the console (the report has every run)."""
    lines = [
        "| workload | head | k | concurrency | mean acceptance length | output tok/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        length, tok_s, speedup = row["mean acceptance length"], row["output tok/s"], row["speedup"]
        lines.append(
            f"| {row['workload']} | {row['head']} | {row['k']} | {row['concurrency']} | "
            + (f"{length:.2f}" if length is not None else "-")
            + (f" | {tok_s:.1f} | " if tok_s else " | - | ")
            + (f"{speedup:.2f}x" if speedup is not None else "-")
            + " |"
        )
    return "\n".join(lines)


def run_line(r: dict) -> str:
    """One run in words, with both acceptance numbers named."""
    parts = [f"{r['workload']} | {r['config']} | concurrency {r['concurrency']}"]
    if r["acceptance"]:
        a = r["acceptance"]
        parts.append(
            f"mean acceptance length {a['mean_acceptance_length']:.2f} | "
            f"draft acceptance rate {a['draft_acceptance_rate']:.1%}"
        )
    if r["output_tokens_per_s"]:
        parts.append(f"{r['output_tokens_per_s']:.1f} output tok/s")
    if r.get("speedup"):
        parts.append(f"speedup {r['speedup']:.2f}x")
    if r["num_failed"]:
        parts.append(f"{r['num_failed']}/{r['num_requests']} requests failed")
    return " | ".join(parts)
