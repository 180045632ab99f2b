"""Prometheus alerting rules and a Grafana panel that make the watch's decision (watch/health.py `judge`)
where operators already look, rewritten by the watch after every window it judges (watch/main.py).

The watch judges a window's confidence bounds L +- q sqrt(phi Var(A) / n) against the expected band and
break-even. The rules compute the same bounds in PromQL over the range of the last judged window, for the
watched server only (`instance`, its Prometheus label: the watch's URL's host:port unless
`watch.instance` says otherwise; its dispersion and band are that server's traffic's) or, with
`watch.instance=''`, for every instance serving the model, each apart (`by (instance)`) and said so in the
annotations. With n the drafts in that range and c = q sqrt(phi Var(A)) that window's (its t quantile,
dispersion and per-draft variance):

- SpeculativeHeadDegraded: L + c / sqrt(n) < band, or - as the watch, which stays `degraded` until its
  lower bound is back in the band - L - c / sqrt(n) < band while this or the net-negative alert fires
  (Prometheus' own ALERTS series);
- SpeculativeHeadNetNegative: L + c / sqrt(n) < break-even at the window's observed concurrency, or - as the
  watch - L - c / sqrt(n) < break-even while it fires;
- SpeculativeHeadLatency: the share of inter-token latencies above the watch's threshold (eval's p99 x (1 +
  margin), counted above the histogram bucket the watch counts above), its Wilson lower bound at the
  watch's t quantile over drafts as dispersed as the window's batches say, above 1%;

each with n >= MIN_DRAFTS drafts. The panel plots L and its upper bound over the same range, with the
thresholds as its steps.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import yaml

from artifacts import atomic
from watch.expectation import Expected
from watch.health import MIN_DRAFTS, Verdict
from watch.scrape import ITL

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DEGRADED, NET_NEGATIVE, LATENCY = (
    "SpeculativeHeadDegraded",
    "SpeculativeHeadNetNegative",
    "SpeculativeHeadLatency",
)


def selector(model: str, instance: str = "", **more: str) -> str:
    """A PromQL label selector: the model's series, of one instance where `instance` is not empty;
    `more` are regular-expression matchers."""
    labels = [f'model_name="{model}"'] + ([f'instance="{instance}"'] if instance else [])
    labels += [f'{name}=~"{pattern}"' for name, pattern in more.items()]
    return "{" + ",".join(labels) + "}"


def promql(model: str, range_s: int, c: float, instance: str = "") -> tuple[str, str, str, str]:
    """(mean acceptance length, its upper bound, its lower bound, drafts) per instance over the last
    `range_s` seconds."""
    chosen, over = selector(model, instance), f"[{range_s}s]"
    length = (
        f"(1 + sum by (instance) (rate({ACCEPTED}{chosen}{over})) / "
        f"sum by (instance) (rate({DRAFTS}{chosen}{over})))"
    )
    drafts = f"sum by (instance) (increase({DRAFTS}{chosen}{over}))"
    return length, f"{length} + {c:.6g} / sqrt({drafts})", f"{length} - {c:.6g} / sqrt({drafts})", drafts


def le_pattern(bound: float) -> str:
    """A bucket bound as a PromQL regular expression matching both of its spellings ("1" and "1.0": vLLM's
    exposition and Prometheus 3's normalized label), escaped for a PromQL string."""
    text = repr(float(bound)).removesuffix(".0")
    return (re.escape(text) + r"(\.0)?").replace("\\", "\\\\")


def latency_low(
    model: str, range_s: int, bound_s: float, q: float, dispersion: float, instance: str = ""
) -> str:
    """The Wilson lower bound of the share of inter-token latencies above `bound_s` (a bucket bound), at
    `q` over their number divided by `dispersion` (watch/health.py `judge`), per instance."""
    chosen, over = selector(model, instance), f"[{range_s}s]"
    below = selector(model, instance, le=le_pattern(bound_s))
    p = (
        f"(1 - sum by (instance) (rate({ITL}_bucket{below}{over})) / "
        f"sum by (instance) (rate({ITL}_count{chosen}{over})))"
    )
    n = f"(sum by (instance) (increase({ITL}_count{chosen}{over})) / {dispersion:.6g})"
    z2 = f"{q * q:.6g}"
    return (
        f"(({p} + {z2} / (2 * {n}) - {q:.6g} * sqrt({p} * (1 - {p}) / {n} + {z2} / (4 * {n} ^ 2)))"
        f" / (1 + {z2} / {n}))"
    )


def thresholds(verdict: Verdict) -> dict:
    """The rules' numbers from a judged window: its range, c = q sqrt(phi Var(A)), the band, break-even,
    and the latency rule's (None without eval's p99)."""
    n = verdict.numbers
    return {
        "range_s": max(60, math.ceil(n["seconds"] / 60) * 60),
        "c": (n["acceptance_high"] - n["mean_acceptance_length"]) * math.sqrt(n["drafts"]),
        "degraded_below": round(n["expected_low"], 4),
        "net_negative_below": None if n.get("break_even") is None else round(n["break_even"], 4),
        "latency": None  # no eval p99, or a threshold above the histogram's last finite bound (never counted)
        if n.get("itl_bound_s") is None or math.isinf(n["itl_bound_s"])
        else {"bound_s": n["itl_bound_s"], "q": n["itl_q"], "dispersion": n["itl_dispersion"]},
    }


def alert_rules(expected: Expected, verdict: Verdict, model: str, instance: str = "") -> dict:
    """The rule group for the last judged window (`thresholds`), for `instance` ('': every instance)."""
    t = thresholds(verdict)
    _, upper, lower, drafts = promql(model, t["range_s"], t["c"], instance)
    enough = f"and on (instance) ({drafts} >= {MIN_DRAFTS})"
    numbers = verdict.numbers
    source = {
        "source": expected.source,
        "window": f"{t['range_s']} s, {numbers['drafts']:.0f} drafts, dispersion {numbers['dispersion']:.1f}, "
        f"t quantile {numbers['q']:.2f}, concurrency {numbers['concurrency']:.1f}",
        "instances": f"instance {instance}, the watched server"
        if instance
        else "every instance serving this model, each judged with the watched server's dispersion and band",
    }

    def rule(alert: str, expr: str, severity: str, summary: str) -> dict:
        return {
            "alert": alert,
            "expr": expr,
            "for": "1m",
            "labels": {"severity": severity},
            "annotations": {"summary": summary, **source},
        }

    def firing(alerts: str) -> str:  # Prometheus' ALERTS series of the watched instance's firing `alerts`
        labels = [f'instance="{instance}"'] if instance else []
        return ",".join([*labels, f'alertname=~"{alerts}"', 'alertstate="firing"'])

    band = t["degraded_below"]
    rules = [
        rule(
            DEGRADED,
            f"({upper} < {band} {enough}) or "
            f"({lower} < {band} {enough} and on (instance) ALERTS{{{firing(f'{DEGRADED}|{NET_NEGATIVE}')}}})",
            "warning",
            "draft head accepts less than it was measured to: retrain it on current traffic",
        )
    ]
    if t["net_negative_below"] is not None:
        even = t["net_negative_below"]
        rules.append(
            rule(
                NET_NEGATIVE,
                f"({upper} < {even} {enough}) or "
                f"({lower} < {even} {enough} and on (instance) ALERTS{{{firing(NET_NEGATIVE)}}})",
                "critical",
                "speculation makes serving slower than without it: turn it off",
            )
        )
    if t["latency"] is not None:
        latency = t["latency"]
        low = latency_low(
            model, t["range_s"], latency["bound_s"], latency["q"], latency["dispersion"], instance
        )
        rules.append(
            rule(
                LATENCY,
                f"{low} > 0.01 {enough}",
                "warning",
                f"more than 1% of inter-token latencies above {numbers['itl_threshold_ms']:.1f} ms (eval's p99 "
                "plus the watch's margin): look at the load and the draft's cost",
            )
        )
    return {"groups": [{"name": "speculative-decoding", "rules": rules}]}


def grafana_panel(verdict: Verdict, model: str, instance: str = "") -> dict:
    """A time-series panel of the same per-instance acceptance length and upper bound, over the same range,
    with the rules' thresholds as its steps (ascending: red below break-even, orange below the band, green
    above)."""
    t = thresholds(verdict)
    length, bound, _, _ = promql(model, t["range_s"], t["c"], instance)
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


def write_rules(out_dir: Path, expected: Expected, verdict: Verdict, model: str, instance: str = "") -> None:
    """alerts.yml and grafana_panel.json in `out_dir`, from the window just judged."""
    rules = alert_rules(expected, verdict, model, instance)
    atomic.write_text(out_dir / "alerts.yml", yaml.safe_dump(rules, sort_keys=False))
    panel = grafana_panel(verdict, model, instance)
    atomic.write_text(out_dir / "grafana_panel.json", json.dumps(panel, indent=2))
