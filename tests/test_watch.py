"""eval/watch.py against a stand-in vLLM server (an HTTP server answering /metrics and /v1/models as vLLM
0.32 does, its counters advancing at every scrape): verdicts, exit codes, the files it writes, and the errors
for bad input. The real-server run is in tests/test_watch_vllm.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from artifacts.config import compose
from eval.watch import WatchError, watch
from tests.test_watch_health import MEASURED, MODEL, Server, eval_counts
from tests.test_watch_health import results as results  # noqa: F401 (fixture)


class Stub:
    """A served model whose acceptance is `conditional` per position, 800 rounds per scrape."""

    def __init__(self, conditional=MEASURED, model=MODEL, vllm=True):
        self.server, self.conditional, self.model, self.vllm = Server(), conditional, model, vllm
        self.last = time.time()

    def __enter__(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    now = time.time()  # in flight all along: concurrency 1 by Little's law
                    stub.server.serve(now - stub.last, 800, conditional=stub.conditional)
                    stub.last = now
                    body = stub.server.metrics() if stub.vllm else "# TYPE up gauge\nup 1.0\n"
                elif self.path == "/v1/models":
                    body = json.dumps({"data": [{"id": stub.model, "root": stub.model}]})
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.http.shutdown()


@pytest.fixture
def head(tmp_path):
    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    verifier = {"verifier": {"name_or_path": MODEL}}
    (export / "config.json").write_text(json.dumps({"speculators_config": verifier}))
    return export


def config(tmp_path, head, url, *overrides):
    return compose(
        "config",
        [
            "experiment=smoke",
            f"run_dir={head.parent}",
            f"watch.url={url}",
            "watch.interval_s=0.01",
            *overrides,
        ],
    )


def test_one_window_exit_codes_and_what_it_writes(tmp_path, head, results):  # noqa: F811
    with Stub() as stub:
        cfg = config(
            tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.once=true"
        )
        assert watch(cfg) == 0
    out = head.parent / "watch"
    record = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    assert record["verdict"] == "healthy" and record["drafts"] == 800 and record["actions"] == []
    rules = yaml.safe_load((out / "alerts.yml").read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == ["SpeculativeHeadDegraded", "SpeculativeHeadNetNegative"]
    assert f'model_name="{MODEL}"' in rules[0]["expr"]
    panel = json.loads((out / "grafana_panel.json").read_text())
    assert [s["color"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]] == [
        "red",
        "orange",
        "green",
    ]

    with Stub(conditional=[0.22, 0.08]) as stub:
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.once=true",
                     "watch.traffic=/logs/requests.jsonl")  # fmt: skip
        assert watch(cfg, ["experiment=smoke", f"run_dir={head.parent}", "watch.once=true"]) == 1
    record = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    assert record["verdict"] == "degraded"
    assert record["actions"][0].startswith("python data_prep/main.py experiment=smoke run_dir=")
    assert "data.source=/logs/requests.jsonl" in record["actions"][0]
    assert f"train.init_from={head.parent / 'draft_head'}" in record["actions"][1]

    with Stub(conditional=[0.02, 0.02]) as stub:
        cfg = config(
            tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.once=true"
        )
        assert watch(cfg) == 2


def test_several_windows_until_the_count(tmp_path, head, results):  # noqa: F811
    with Stub() as stub:
        cfg = config(
            tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.windows=5"
        )
        assert watch(cfg) == 0
    lines = (head.parent / "watch" / "timeline.jsonl").read_text().splitlines()
    assert [json.loads(line)["verdict"] for line in lines] == ["healthy"] * 5


def test_without_eval_results_verification_is_the_record(tmp_path, head, caplog):
    (head / "verification.json").write_text(
        json.dumps({"num_speculative_tokens": 2, "vllm": eval_counts(MEASURED).summary()})
    )
    with Stub() as stub:
        assert watch(config(tmp_path, head, stub.url, "watch.once=true")) == 0
    assert "judging against export verification's acceptance" in caplog.text


@pytest.mark.parametrize(
    "case, message",
    [
        ("unreachable", r"watch.url=http://127.0.0.1:9: /v1/models did not list a model"),
        ("not vllm", r"no vllm: metrics in this /metrics text: not a vLLM server"),
        (
            "other model",
            r"serves '/models/Qwen3-8B'; the head was trained for '/models/SmolLM2-135M-Instruct'",
        ),
        ("no export", r"watch.head=.*nowhere: not an export"),
        ("no record", r"results.json does not exist and .*verification.json neither"),
        ("no url", r"watch.url is not set"),
    ],
)
def test_bad_input_is_refused_naming_what_is_wrong(tmp_path, head, case, message):
    stub = Stub(vllm=case != "not vllm", model="/models/Qwen3-8B" if case == "other model" else MODEL)
    with stub:
        url = {"unreachable": "http://127.0.0.1:9", "no url": "null"}.get(case, stub.url)
        extra = [f"watch.head={tmp_path / 'nowhere'}"] if case == "no export" else []
        with pytest.raises(WatchError, match=message):
            watch(config(tmp_path, head, url, "watch.once=true", *extra))
