"""The alert rules and the panel the watch writes (watch/alert_rules.py), from a window it judged on
simulated vLLM metrics: their thresholds are the watch's decision, per instance; Prometheus' own tool checks
them and shows them firing for a collapsed replica beside a healthy one and not for the healthy one
(`promtool test rules`, where Prometheus' tool is installed: `apt-get install prometheus`)."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_watch_health import MEASURED, MODEL, Server, timeline
from tests.test_watch_health import results as results  # noqa: F401 (fixture)
from watch.alert_rules import alert_rules, grafana_panel, thresholds
from watch.expectation import expected_from_results


@pytest.fixture
def judged(results):  # noqa: F811
    """(expected, the watch's verdict on a healthy 60-s window)."""
    expected = expected_from_results(results, "peagle", 2)
    verdict = timeline(Server(seed=4), expected, [(1, {})])[0]
    assert verdict.name == "healthy"
    return expected, verdict


def test_the_rules_are_the_watchs_decision_per_instance(judged):
    expected, verdict = judged
    n = verdict.numbers
    t = thresholds(verdict)
    assert t["range_s"] == 60 and t["degraded_below"] == round(n["expected_low"], 4)
    assert t["net_negative_below"] == round(n["break_even"], 4)
    # The rules' bound at the window's own drafts is the watch's upper bound.
    assert n["mean_acceptance_length"] + t["c"] / math.sqrt(n["drafts"]) == pytest.approx(
        n["acceptance_high"]
    )
    rules = alert_rules(expected, verdict, MODEL)["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == ["SpeculativeHeadDegraded", "SpeculativeHeadNetNegative"]
    for rule in rules:
        expr = rule["expr"]
        assert expr.count("sum by (instance)") == 4 and expr.count("[60s]") == 4
        assert f'model_name="{MODEL}"' in expr and ">= 50)" in expr
    panel = grafana_panel(verdict, MODEL)
    assert panel["targets"][1]["expr"] in rules[0]["expr"] and panel["targets"][0]["expr"] in rules[0]["expr"]
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    assert [s["color"] for s in steps] == ["red", "orange", "green"]
    assert [s["value"] for s in steps[1:]] == [t["net_negative_below"], t["degraded_below"]]


def series(name, instance, values):
    return {
        "series": f'{name}{{model_name="{MODEL}",instance="{instance}"}}',
        "values": " ".join(map(str, values)),
    }


# make setup unpacks Debian's promtool into the venv; one on the PATH serves too
VENV_PROMTOOL = Path(sys.executable).parent / "promtool"
PROMTOOL = str(VENV_PROMTOOL) if VENV_PROMTOOL.exists() else shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="Prometheus' promtool is not installed (make setup unpacks it)")
def test_prometheus_checks_the_rules_and_fires_them_for_the_collapsed_replica_only(judged, tmp_path):
    expected, verdict = judged
    (tmp_path / "alerts.yml").write_text(
        yaml.safe_dump(alert_rules(expected, verdict, MODEL), sort_keys=False)
    )
    checked = subprocess.run([PROMTOOL, "check", "rules", str(tmp_path / "alerts.yml")], capture_output=True,
                             text=True)  # fmt: skip
    assert checked.returncode == 0 and "SUCCESS: 2 rules found" in checked.stdout, (
        checked.stdout + checked.stderr
    )

    # Two replicas scraped every 15 s for 20 minutes: "a" serves as measured; "b" collapses after 10 minutes.
    recorded = {}
    for instance, collapse in (("a", None), ("b", 40)):
        server, drafts, accepted = Server(seed=ord(instance)), [], []
        for step in range(81):
            conditional = [0.05, 0.05] if collapse is not None and step > collapse else MEASURED
            server.serve(15.0, 200, conditional=conditional)
            drafts.append(server.drafts)
            accepted.append(server.accepted)
        recorded[instance] = (drafts, accepted)
    inputs = [
        s
        for instance, (drafts, accepted) in recorded.items()
        for s in (
            series("vllm:spec_decode_num_drafts_total", instance, drafts),
            series("vllm:spec_decode_num_accepted_tokens_total", instance, accepted),
        )
    ]
    rules = {r["alert"]: r for r in alert_rules(expected, verdict, MODEL)["groups"][0]["rules"]}

    def fired(name, instance):
        rule = rules[name]
        return [
            {"exp_labels": {**rule["labels"], "instance": instance}, "exp_annotations": rule["annotations"]}
        ]

    tests = {
        "rule_files": ["alerts.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": inputs,
                "alert_rule_test": [
                    {"eval_time": "9m", "alertname": "SpeculativeHeadNetNegative", "exp_alerts": []},
                    {"eval_time": "9m", "alertname": "SpeculativeHeadDegraded", "exp_alerts": []},
                    {
                        "eval_time": "19m",
                        "alertname": "SpeculativeHeadNetNegative",
                        "exp_alerts": fired("SpeculativeHeadNetNegative", "b"),
                    },
                    {
                        "eval_time": "19m",
                        "alertname": "SpeculativeHeadDegraded",
                        "exp_alerts": fired("SpeculativeHeadDegraded", "b"),
                    },
                ],  # fmt: skip
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = subprocess.run([PROMTOOL, "test", "rules", "tests.yml"], cwd=tmp_path, capture_output=True,
                            text=True)  # fmt: skip
    assert tested.returncode == 0, tested.stdout + tested.stderr + json.dumps(tests)[:2000]
