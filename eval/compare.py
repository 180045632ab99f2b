"""Compare the measured runs: each head's speedup against the baseline on the same workload and
concurrency, with its economics (eval/economics.py); the headline rows (the recommended k per head,
workload and concurrency) and the console's words for runs and headline.
"""

from __future__ import annotations

from eval.economics import economics


def add_comparisons(runs: list[dict]) -> None:
    """Speedup against the baseline (same workload and concurrency) and the economics, in place."""
    base = {(r["workload"], r["concurrency"]): r for r in runs if r["head"] is None}
    for r in runs:
        r["speedup"], r["economics"] = None, None
        b = base.get((r["workload"], r["concurrency"]))
        if r["head"] is None or b is None or not b["output_tokens_per_s"] or not r["output_tokens_per_s"]:
            continue
        r["speedup"] = r["output_tokens_per_s"] / b["output_tokens_per_s"]
        tpot_head, tpot_base = r["tpot_ms"]["mean"], b["tpot_ms"]["mean"]
        # A schedule's k changes with the batch: no single-k economics for it.
        if r["acceptance"] and tpot_head and tpot_base and not r.get("schedule"):
            drafting = r.get("drafting", "chain")
            r["economics"] = economics(r["acceptance"], r["k"], tpot_head, tpot_base, r["speedup"], drafting)


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
