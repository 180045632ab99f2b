"""The alert rules and the panel the watch writes (watch/alert_rules.py), from a window it judged on
simulated vLLM metrics: their thresholds are the watch's decision, for the watched instance or every one;
Prometheus' own tool checks them and shows them firing for a collapsed replica, a replica slowed down and a
replica half recovered (hysteresis, as the watch) and not for a healthy one nor for an instance not watched
(`promtool test rules`, where Prometheus' tool is installed: make setup unpacks Debian's)."""

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from tests.test_watch_health import ITL_BUCKETS, MEASURED, MODEL, Server, timeline
from tests.test_watch_health import results as results  # noqa: F401 (fixture)
from watch.alert_rules import DEGRADED, LATENCY, NET_NEGATIVE, alert_rules, grafana_panel, thresholds
from watch.expectation import expected_from_results


@pytest.fixture
def judged(results):  # noqa: F811
    """(expected, the watch's verdict on a healthy 60-s window)."""
    expected = expected_from_results(results, "peagle", 2)
    verdict = timeline(Server(seed=4), expected, [(1, {})])[0]
    assert verdict.name == "healthy"
    return expected, verdict


def test_the_rules_are_the_watchs_decision_for_the_watched_instance(judged):
    expected, verdict = judged
    n = verdict.numbers
    t = thresholds(verdict)
    assert t["range_s"] == 60 and t["degraded_below"] == round(n["expected_low"], 4)
    assert t["net_negative_below"] == round(n["break_even"], 4)
    # The rules' bound at the window's own drafts is the watch's upper bound.
    assert n["mean_acceptance_length"] + t["c"] / math.sqrt(n["drafts"]) == pytest.approx(
        n["acceptance_high"]
    )
    # the latency rule counts above the bucket the watch counted above, at its t quantile and dispersion
    assert t["latency"] == {"bound_s": n["itl_bound_s"], "q": n["itl_q"], "dispersion": n["itl_dispersion"]}
    assert n["itl_bound_s"] in ITL_BUCKETS and n["itl_bound_s"] >= n["itl_threshold_ms"] / 1e3
    rules = alert_rules(expected, verdict, MODEL, "gpu7:8000")["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [DEGRADED, NET_NEGATIVE, LATENCY]
    for rule in rules:
        expr = rule["expr"]
        assert expr.count('instance="gpu7:8000"') == expr.count(f'model_name="{MODEL}"') + ("ALERTS" in expr)
        assert (
            ">= 50)" in expr and "[60s]" in expr and "the watched server" in rule["annotations"]["instances"]
        )
    assert (
        'ALERTS{instance="gpu7:8000",alertname=~"' in rules[0]["expr"]
    )  # the way back needs the lower bound
    assert f"{n['itl_q']:.6g}" in rules[2]["expr"] and f"/ {n['itl_dispersion']:.6g})" in rules[2]["expr"]
    # a threshold above the histogram's last finite bound is never counted: no latency rule, as no verdict
    far = replace(verdict, numbers={**n, "itl_bound_s": math.inf})
    assert [r["alert"] for r in alert_rules(expected, far, MODEL)["groups"][0]["rules"]] == [
        DEGRADED,
        NET_NEGATIVE,
    ]
    every = alert_rules(expected, verdict, MODEL)["groups"][0]["rules"]
    assert all("instance=" not in r["expr"].replace("ALERTS{", "") for r in every)
    assert "each judged with the watched server's dispersion" in every[0]["annotations"]["instances"]
    panel = grafana_panel(verdict, MODEL, "gpu7:8000")
    assert panel["targets"][1]["expr"] in rules[0]["expr"] and panel["targets"][0]["expr"] in rules[0]["expr"]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps] == ["red", "orange", "green"]
    assert [s["value"] for s in steps[1:]] == [t["net_negative_below"], t["degraded_below"]]


def series(name, instance, values, **labels):
    extra = "".join(f',{key}="{value}"' for key, value in labels.items())
    return {
        "series": f'{name}{{model_name="{MODEL}",instance="{instance}"{extra}}}',
        "values": " ".join(map(str, values)),
    }


# make setup unpacks Debian's promtool into the venv; one on the PATH serves too
VENV_PROMTOOL = Path(sys.executable).parent / "promtool"
PROMTOOL = str(VENV_PROMTOOL) if VENV_PROMTOOL.exists() else shutil.which("promtool")
ITL = "vllm:inter_token_latency_seconds"


def replicas(verdict) -> list[dict]:
    """Five replicas scraped every 15 s for 30 minutes, 800 verify rounds a minute: "a" serves as measured;
    "b" collapses after 10 minutes; "c" slows down after 10 minutes (80-ms tokens); "d" collapses after 5
    minutes, comes back half-way after 12 (its acceptance L - c / sqrt(n) below the band, L + c / sqrt(n)
    above it) and fully after 22 (its lower bound above the band); "e" likewise around break-even."""
    t = thresholds(verdict)
    se = t["c"] / math.sqrt(800)  # the bounds' half-width over a minute's drafts

    def rates(length: float) -> list[float]:  # conditional rates giving a mean acceptance length
        return [(length - 1) / (1 + MEASURED[1]), MEASURED[1]]

    def served(instance: str, step: int) -> dict:
        minutes = step / 4
        if instance == "b" and minutes > 10 or instance == "d" and 5 < minutes <= 12:
            return {"conditional": [0.05, 0.05]}
        if instance == "c" and minutes > 10:
            return {"itl_s": 0.080}
        if instance == "d" and 12 < minutes <= 22:
            return {"conditional": rates(t["degraded_below"] - 0.3 * se)}
        if instance == "d" and minutes > 22:
            return {"conditional": rates(t["degraded_below"] + 2.5 * se)}
        if instance == "e" and 5 < minutes <= 12:
            return {"conditional": [0.02, 0.02]}  # well below break-even (L + c / sqrt(n) ~1.12 < 1.16)
        if instance == "e" and 12 < minutes <= 22:
            return {"conditional": rates(t["net_negative_below"] + 0.3 * se)}
        if instance == "e" and minutes > 22:
            return {"conditional": rates(t["net_negative_below"] + 2.5 * se)}
        return {}

    inputs = []
    for instance in "abcde":
        server, rows = Server(seed=ord(instance)), []
        for step in range(121):
            server.serve(15.0, 200, **served(instance, step))
            rows.append((server.drafts, server.accepted, list(server.itl)))
        inputs += [
            series("vllm:spec_decode_num_drafts_total", instance, [r[0] for r in rows]),
            series("vllm:spec_decode_num_accepted_tokens_total", instance, [r[1] for r in rows]),
            series(f"{ITL}_count", instance, [r[2][-1] for r in rows]),
        ]
        inputs += [
            series(f"{ITL}_bucket", instance, [r[2][i] for r in rows], le=str(le))
            for i, le in enumerate(ITL_BUCKETS)
        ]
    return inputs


def promtool_test(tmp_path, rules: dict, inputs: list[dict], alerts: list[dict], exprs: list[dict] = ()):
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    tests = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": inputs,
                "alert_rule_test": alerts,
                "promql_expr_test": list(exprs),
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True,
                            text=True)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr + json.dumps(tests)[:2000]


@pytest.mark.skipif(PROMTOOL is None, reason="Prometheus' promtool is not installed (make setup unpacks it)")
def test_prometheus_checks_the_rules_and_fires_them_as_the_watch_would(judged, tmp_path):
    expected, verdict = judged
    rules = alert_rules(expected, verdict, MODEL)
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
    checked = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "alerts.yml")], capture_output=True,
                             text=True)  # fmt: skip
    assert checked.returncode == 0 and "SUCCESS: 3 rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )
    by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}

    def at(minutes: int, name: str, *instances: str) -> dict:
        rule = by_name[name]
        fired = [{"exp_labels": {**rule["labels"], "instance": i}, "exp_annotations": rule["annotations"]}
                 for i in instances]  # fmt: skip
        return {"eval_time": f"{minutes}m", "alertname": name, "exp_alerts": fired}

    t, inputs = thresholds(verdict), replicas(verdict)
    upper = by_name[DEGRADED]["expr"].split(" or ")[0].removeprefix("(").split(f" < {t['degraded_below']}")[0]
    promtool_test(
        tmp_path,
        rules,
        inputs,
        [
            at(4, DEGRADED),
            at(4, NET_NEGATIVE),
            at(4, LATENCY),
            at(9, DEGRADED, "d", "e"),
            at(9, NET_NEGATIVE, "d", "e"),
            at(9, LATENCY),
            at(19, NET_NEGATIVE, "b", "e"),  # e half-way back above break-even: still firing
            at(19, LATENCY, "c"),
            at(19, DEGRADED, "b", "d", "e"),  # d half-way back: its upper bound above the band, still firing
            at(29, DEGRADED, "b", "e"),  # d fully back: resolved; e above break-even, still below the band
            at(29, NET_NEGATIVE, "b"),  # e's lower bound above break-even: resolved
        ],  # fmt: skip
        # at 19 minutes d's upper bound alone is above the band, e's above break-even: only the hysteresis
        # keeps them firing
        [
            {
                "expr": f'({upper} > bool {t["degraded_below"]}) and on (instance) {ITL}_count{{instance="d"}}',
                "eval_time": "19m",
                "exp_samples": [{"labels": '{instance="d"}', "value": 1}],
            },
            {
                "expr": f'({upper} > bool {t["net_negative_below"]}) and on (instance) {ITL}_count{{instance="e"}}',
                "eval_time": "19m",
                "exp_samples": [{"labels": '{instance="e"}', "value": 1}],
            },
        ],  # fmt: skip
    )


@pytest.mark.skipif(PROMTOOL is None, reason="Prometheus' promtool is not installed (make setup unpacks it)")
def test_rules_for_the_watched_instance_fire_for_it_and_for_no_other(judged, tmp_path):
    """Rules for one instance fire when it degrades ("b" collapses after 10 minutes) and never for the
    others, which collapse too ("d", "e") or slow down ("c"); for the healthy "a", never."""
    expected, verdict = judged
    collapsed = {19: (DEGRADED, NET_NEGATIVE), 29: (DEGRADED, NET_NEGATIVE)}
    for watched, firing in (("b", collapsed), ("a", {})):
        rules = alert_rules(expected, verdict, MODEL, watched)
        by_name = {r["alert"]: r for r in rules["groups"][0]["rules"]}
        alerts = [
            {"eval_time": f"{m}m", "alertname": name, "exp_alerts": [
                {"exp_labels": {**by_name[name]["labels"], "instance": watched},
                 "exp_annotations": by_name[name]["annotations"]}
            ] if name in firing.get(m, ()) else []}
            for m in (9, 19, 29) for name in (DEGRADED, NET_NEGATIVE, LATENCY)
        ]  # fmt: skip
        promtool_test(tmp_path, rules, replicas(verdict), alerts)
