"""Prometheus alerting rules and a Grafana panel that make the watch's decision (watch/health.py `judge`)
where operators already look, rewritten by the watch after every window it judges (watch/main.py).

The watch judges a window's upper confidence bound L + q sqrt(phi Var(A) / n) against the expected band and
break-even. The rules compute the same bound in PromQL, per server (`by (instance)`: one bad replica is not
averaged away by healthy ones), over the range of the last judged window, with n the drafts in that range
and c = q sqrt(phi Var(A)) that window's (its t quantile, dispersion and per-draft variance):

    L + c / sqrt(n) < threshold   and   n >= MIN_DRAFTS

`threshold` is the band's bottom (SpeculativeHeadDegraded) or break-even at the window's observed
concurrency (SpeculativeHeadNetNegative). The panel plots L and that bound over the same range, with the
thresholds as its steps.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from artifacts import atomic
from watch.expectation import Expected
from watch.health import MIN_DRAFTS, Verdict

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"


def promql(model: str, range_s: int, c: float) -> tuple[str, str, str]:
    """(mean acceptance length, its upper bound, drafts) per instance of `model`'s servers over the last
    `range_s` seconds."""
    selector, over = f'{{model_name="{model}"}}', f"[{range_s}s]"
    length = (
        f"(1 + sum by (instance) (rate({ACCEPTED}{selector}{over})) / "
        f"sum by (instance) (rate({DRAFTS}{selector}{over})))"
    )
    drafts = f"sum by (instance) (increase({DRAFTS}{selector}{over}))"
    return length, f"{length} + {c:.6g} / sqrt({drafts})", drafts


def thresholds(verdict: Verdict) -> dict:
    """The rules' numbers from a judged window: its range, c = q sqrt(phi Var(A)), the band and break-even."""
    n = verdict.numbers
    return {
        "range_s": max(60, math.ceil(n["seconds"] / 60) * 60),
        "c": (n["acceptance_high"] - n["mean_acceptance_length"]) * math.sqrt(n["drafts"]),
        "degraded_below": round(n["expected_low"], 4),
        "net_negative_below": None if n.get("break_even") is None else round(n["break_even"], 4),
    }


def alert_rules(expected: Expected, verdict: Verdict, model: str) -> dict:
    """The rule group for the last judged window (`thresholds`)."""
    t = thresholds(verdict)
    _, bound, drafts = promql(model, t["range_s"], t["c"])
    enough = f"and on (instance) ({drafts} >= {MIN_DRAFTS})"
    source = {
        "source": expected.source,
        "window": f"{t['range_s']} s, {verdict.numbers['drafts']:.0f} drafts, dispersion "
        f"{verdict.numbers['dispersion']:.1f}, t quantile {verdict.numbers['q']:.2f}, concurrency "
        f"{verdict.numbers['concurrency']:.1f}",
    }
    rules = [
        {
            "alert": "SpeculativeHeadDegraded",
            "expr": f"{bound} < {t['degraded_below']} {enough}",
            "for": "1m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "draft head accepts less than it was measured to: retrain it on current traffic",
                **source,
            },
        }
    ]
    if t["net_negative_below"] is not None:
        rules.append(
            {
                "alert": "SpeculativeHeadNetNegative",
                "expr": f"{bound} < {t['net_negative_below']} {enough}",
                "for": "1m",
                "labels": {"severity": "critical"},
                "annotations": {
                    "summary": "speculation makes serving slower than without it: turn it off",
                    **source,
                },
            }
        )
    return {"groups": [{"name": "speculative-decoding", "rules": rules}]}


def grafana_panel(verdict: Verdict, model: str) -> dict:
    """A time-series panel of the same per-instance acceptance length and upper bound, over the same range,
    with the rules' thresholds as its steps (ascending: red below break-even, orange below the band, green
    above)."""
    t = thresholds(verdict)
    length, bound, _ = promql(model, t["range_s"], t["c"])
    degraded, net_negative = t["degraded_below"], t["net_negative_below"]
    steps = [{"color": "red" if net_negative is not None else "orange", "value": None}]
    if net_negative is not None and net_negative < degraded:
        steps.append({"color": "orange", "value": net_negative})
    steps.append({"color": "green", "value": max(degraded, net_negative or -math.inf)})
    return {
        "type": "timeseries",
        "title": "Mean acceptance length (speculative decoding)",
        "targets": [
            {"expr": length, "legendFormat": "{{instance}} acceptance length"},
            {"expr": bound, "legendFormat": "{{instance}} upper bound (alerts below a threshold)"},
        ],
        "fieldConfig": {
            "defaults": {
                "thresholds": {"mode": "absolute", "steps": steps},
                "custom": {"thresholdsStyle": {"mode": "line"}},
            }
        },
    }


def write_rules(out_dir: Path, expected: Expected, verdict: Verdict, model: str) -> None:
    """alerts.yml and grafana_panel.json in `out_dir`, from the window just judged."""
    atomic.write_text(
        out_dir / "alerts.yml", yaml.safe_dump(alert_rules(expected, verdict, model), sort_keys=False)
    )
    atomic.write_text(out_dir / "grafana_panel.json", json.dumps(grafana_panel(verdict, model), indent=2))
