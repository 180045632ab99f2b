"""Speculative-decoding economics (Leviathan et al.; DESIGN.md section 6): predict the speedup from the
measured acceptance and draft cost, set it beside the measured speedup, and recommend k per workload.

With per-position acceptance alpha (i.i.d. model), k drafts and draft cost c (one draft step over one
target step): tokens per verify step = (1 - alpha^(k+1)) / (1 - alpha), speedup = that / (k c + 1).

What is measured here, per run with a head, against the baseline on the same prompts and concurrency:
- alpha: the geometric mean of the conditional per-position acceptance rates (= the i.i.d. rate that
  gives the same chance of accepting all k drafts);
- c (effective): a verify step lasts TPOT x mean acceptance length; over the baseline's TPOT (one target
  step) it is 1 + k c. On a GPU the k+1 verified tokens ride on idle compute; on a CPU, or at high
  concurrency, verifying them costs more than one step, and this c carries that cost too.
"""

from __future__ import annotations

import math


def tokens_per_verify(alpha: float, k: int) -> float:
    """Expected tokens per verify step (bonus included) for i.i.d. acceptance alpha and k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, draft_cost: float) -> float:
    return tokens_per_verify(alpha, k) / (k * draft_cost + 1.0)


def iid_alpha(conditional_per_position: list[float]) -> float:
    """The i.i.d. alpha equivalent to the measured conditional rates (their geometric mean)."""
    rates = [r for r in conditional_per_position if not math.isnan(r)]
    if not rates:
        return float("nan")
    if min(rates) <= 0.0:
        return 0.0
    return math.exp(sum(math.log(r) for r in rates) / len(rates))


def effective_draft_cost(
    tpot_head_s: float, mean_acceptance_length: float, tpot_base_s: float, k: int
) -> float:
    """c from step times: a verify step (TPOT x tokens per step) = (1 + k c) baseline steps."""
    return (tpot_head_s * mean_acceptance_length / tpot_base_s - 1.0) / k


def economics(acceptance: dict, k: int, tpot_head_s: float, tpot_base_s: float, measured: float) -> dict:
    """Predicted vs measured speedup for one run with a head (`acceptance`: AcceptanceCounts.summary())."""
    alpha = iid_alpha(acceptance["conditional_per_position_acceptance"])
    cost = effective_draft_cost(tpot_head_s, acceptance["mean_acceptance_length"], tpot_base_s, k)
    predicted = predicted_speedup(alpha, k, cost)
    return {
        "alpha": alpha,
        "draft_cost": cost,
        "predicted_tokens_per_verify": tokens_per_verify(alpha, k),
        "measured_tokens_per_verify": acceptance["mean_acceptance_length"],
        "predicted_speedup": predicted,
        "measured_speedup": measured,
        "gap": measured - predicted,
    }


def recommend(runs: list[dict], threshold: float) -> list[dict]:
    """Per (head, workload): the best k at the lowest concurrency, whether to enable it (speedup at least
    `threshold`), and the first measured concurrency where that k stops paying (speedup below 1.0)."""
    out = []
    keys = sorted({(r["head"], r["workload"]) for r in runs if r["head"] is not None and r["speedup"]})
    for head, workload in keys:
        mine = [r for r in runs if r["head"] == head and r["workload"] == workload and r["speedup"]]
        lowest = min(r["concurrency"] for r in mine)
        best = max((r for r in mine if r["concurrency"] == lowest), key=lambda r: r["speedup"])
        curve = sorted((r for r in mine if r["k"] == best["k"]), key=lambda r: r["concurrency"])
        breakeven = next((r["concurrency"] for r in curve if r["speedup"] < 1.0), None)
        enable = best["speedup"] >= threshold
        top = curve[-1]["concurrency"]
        reach = (
            f"is below 1.0x from concurrency {breakeven}"
            if breakeven is not None
            else f"stays above 1.0x up to concurrency {top}"
        )
        verdict = f"enable {head} with k={best['k']}" if enable else f"do not enable {head}"
        out.append(
            {
                "head": head,
                "workload": workload,
                "best_k": best["k"],
                "best_speedup": best["speedup"],
                "enable": enable,
                "threshold": threshold,
                "breakeven_concurrency": breakeven,
                "text": f"{workload}: {verdict} ({best['speedup']:.2f}x at concurrency {lowest} with k="
                f"{best['k']}; threshold {threshold:.2f}x); it {reach}",
            }
        )
    return out
