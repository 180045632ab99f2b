"""Speculative-decoding economics (Leviathan et al.; docs/design.md#acceptance-metrics-and-economics):
predict the speedup from the measured acceptance and draft cost, set it beside the measured speedup, and
recommend k per workload.

With per-position acceptance alpha (i.i.d. model), k drafts and draft cost c (one draft pass over one
target step): tokens per verify step = (1 - alpha^(k+1)) / (1 - alpha), speedup = that / (k c + 1) for
chain drafting (EAGLE-3: k passes per round) and that / (c + 1) for parallel drafting (P-EAGLE: one pass
per round), block drafting (DFlash: one pass over the bonus token and k mask slots) and ngram (prompt
lookup: no model pass; c is what verifying k+1 tokens costs).

What is measured here, per run with a head, against the baseline on the same prompts and concurrency:
- alpha: the i.i.d. rate that solves (1 - alpha^(k+1)) / (1 - alpha) = the measured mean acceptance
  length (docs/design.md#acceptance-metrics-and-economics) - never a geometric mean of per-position
  rates, which is 0 as soon as one position was never accepted;
- c (effective): a verify step lasts TPOT x mean acceptance length; over the baseline's TPOT (one target
  step) it is 1 + (draft passes) c. On a GPU the k+1 verified tokens ride on idle compute; on a CPU, or at
  high concurrency, verifying them costs more than one step, and this c carries that cost too.

`recommend` turns the measured best k per concurrency into the setting a user deploys: vLLM 0.32's
`num_speculative_tokens_per_batch_size` schedule, k=0 where speculation stops paying.
"""

from __future__ import annotations

import json
import math


def tokens_per_verify(alpha: float, k: int) -> float:
    """Expected tokens per verify step (bonus included) for i.i.d. acceptance alpha and k drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_passes(k: int, drafting: str) -> int:
    """Draft model passes per verify round: k for chain drafting, one for parallel and block drafting (one
    forward over the round's slots), one (the lookup) for ngram."""
    return {"chain": k, "parallel": 1, "block": 1, "ngram": 1}[drafting]


def predicted_speedup(alpha: float, k: int, draft_cost: float, drafting: str = "chain") -> float:
    return tokens_per_verify(alpha, k) / (draft_passes(k, drafting) * draft_cost + 1.0)


def iid_alpha(mean_acceptance_length: float, k: int) -> float:
    """The i.i.d. alpha whose expected tokens per verify step at k drafts equal the measured mean acceptance
    length: the root in [0, 1] of (1 - a^(k+1)) / (1 - a) = L (increasing in a), by bisection."""
    if math.isnan(mean_acceptance_length) or k < 1:
        return float("nan")
    if mean_acceptance_length <= 1.0:
        return 0.0
    if mean_acceptance_length >= k + 1:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if tokens_per_verify(middle, k) < mean_acceptance_length else (low, middle)
    return (low + high) / 2


def effective_draft_cost(
    tpot_head_s: float, mean_acceptance_length: float, tpot_base_s: float, k: int, drafting: str = "chain"
) -> float:
    """c from step times: a verify step (TPOT x tokens per step) = (1 + passes x c) baseline steps."""
    return (tpot_head_s * mean_acceptance_length / tpot_base_s - 1.0) / draft_passes(k, drafting)


def economics(
    acceptance: dict, k: int, tpot_head_s: float, tpot_base_s: float, measured: float, drafting: str = "chain"
) -> dict:
    """Predicted vs measured speedup for one run with a head (`acceptance`: AcceptanceCounts.summary())."""
    length = acceptance["mean_acceptance_length"]
    alpha = iid_alpha(length, k)
    cost = effective_draft_cost(tpot_head_s, length, tpot_base_s, k, drafting)
    predicted = predicted_speedup(alpha, k, cost, drafting)
    return {
        "drafting": drafting,
        "alpha": alpha,
        "draft_cost": cost,
        "predicted_tokens_per_verify": tokens_per_verify(alpha, k),
        "measured_tokens_per_verify": acceptance["mean_acceptance_length"],
        "predicted_speedup": predicted,
        "measured_speedup": measured,
        "gap": measured - predicted,
    }


def k_schedule(best_k_by_concurrency: dict[int, int]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size`, [[start, end, k], ...] with inclusive batch-size
    ranges from 1: each measured concurrency covers the batch sizes above the one before it, the last one
    everything above (vLLM carries the last k on); neighbours with the same k are merged."""
    schedule: list[list[int]] = []
    start = 1
    levels = sorted(best_k_by_concurrency)
    for i, concurrency in enumerate(levels):
        end = concurrency if i < len(levels) - 1 else max(concurrency, 1024)
        k = best_k_by_concurrency[concurrency]
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = end
        else:
            schedule.append([start, end, k])
        start = end + 1
    return schedule


def recommend(
    runs: list[dict], threshold: float, speculative_configs: dict[str, dict] | None = None
) -> list[dict]:
    """Per (head, workload): the best k at the lowest concurrency, whether to enable it (speedup at least
    `threshold`), the first measured concurrency where that k stops paying (speedup below 1.0), and the
    config to deploy: the head's speculative config with a k schedule over batch sizes (the best k at each
    measured concurrency, 0 where no k reaches 1.0x). `speculative_configs`: head -> its speculative config."""
    out = []
    # Fixed-k runs with a speedup: a served schedule is the recommendation's outcome, not an input to it.
    fixed = [r for r in runs if r["head"] is not None and r["speedup"] and not r.get("schedule")]
    for head, workload in sorted({(r["head"], r["workload"]) for r in fixed}):
        mine = [r for r in fixed if r["head"] == head and r["workload"] == workload]
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
        best_k = {}
        for concurrency in sorted({r["concurrency"] for r in mine}):
            fastest = max((r for r in mine if r["concurrency"] == concurrency), key=lambda r: r["speedup"])
            best_k[concurrency] = fastest["k"] if fastest["speedup"] >= 1.0 else 0
        schedule = k_schedule(best_k)
        deploy = None
        if enable and speculative_configs and head in speculative_configs and max(best_k.values()) > 0:
            deploy = {**speculative_configs[head], "num_speculative_tokens": max(k for *_, k in schedule)}
            if len({k for *_, k in schedule}) > 1:
                deploy["num_speculative_tokens_per_batch_size"] = schedule
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
                "best_k_by_concurrency": best_k,
                "k_schedule": schedule,
                "deploy": deploy,
                "text": f"{workload}: {verdict} ({best['speedup']:.2f}x at concurrency {lowest} with k="
                f"{best['k']}; threshold {threshold:.2f}x); it {reach}"
                + (f"; deploy --speculative-config '{json.dumps(deploy)}'" if deploy else ""),
            }
        )
    return out
