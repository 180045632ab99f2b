"""watch/main.py against a stand-in vLLM server (an HTTP server answering /metrics and /v1/models as vLLM
0.32 does, its counters advancing at every scrape): verdicts, exit codes, the files it writes, and the errors
for bad input. The real-server run is in tests/test_watch_vllm.py."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from artifacts.config import compose
from tests.helpers import REPO
from tests.test_watch_health import MEASURED, MODEL, Server, eval_counts
from tests.test_watch_health import results as results  # noqa: F401 (fixture)
from watch.alert_rules import le_pattern
from watch.main import WatchError, watch


class LocalServer:
    """An HTTP server on a free local port, answered by a handler class, in a thread (`with`: shut down)."""

    def serve(self, handler):
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.http.shutdown()


class Stub(LocalServer):
    """A served model whose acceptance is `conditional` per position, 800 rounds per scrape."""

    def __init__(self, conditional=MEASURED, model=MODEL, vllm=True, models=None):
        self.server, self.conditional, self.model, self.vllm = Server(), conditional, model, vllm
        self.models = models if models is not None else [{"id": model, "root": model}]
        self.last, self.scrapes, self.down = time.time(), 0, ()  # `down`: scrape numbers answered 503
        self.restart_at = None  # the scrape at which a new server process, already past the old one, answers
        self.concurrency = 1.0  # requests in flight
        self.restart_k = 2  # the new server process' k
        self.switch = {}  # {scrape: conditional}: the acceptance from that scrape on

    def __enter__(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    stub.scrapes += 1
                    stub.conditional = stub.switch.get(stub.scrapes, stub.conditional)
                    if stub.scrapes == stub.restart_at:
                        stub.server = Server(seed=9, started=1.8e9, k=stub.restart_k).serve(
                            1.0, 40000, conditional=stub.conditional
                        )
                    if stub.scrapes in stub.down:
                        self.send_error(503)
                        return
                    now = time.time()  # in flight all along: `concurrency` by Little's law
                    stub.server.serve(
                        now - stub.last, 800, conditional=stub.conditional, concurrency=stub.concurrency
                    )
                    stub.last = now
                    body = stub.server.metrics() if stub.vllm else "# TYPE up gauge\nup 1.0\n"
                elif self.path == "/v1/models":
                    body = json.dumps({"data": stub.models})
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        return self.serve(Handler)


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
    assert record["verdict"] == "healthy" and record["actions"] == []
    assert record["drafts"] == 800 * 20 and record["dispersion"] < 3  # 20 scrapes of 800 rounds each
    rules = yaml.safe_load((out / "alerts.yml").read_text())["groups"][0]["rules"]
    assert [r["alert"] for r in rules] == [
        "SpeculativeHeadDegraded", "SpeculativeHeadNetNegative", "SpeculativeHeadLatency"
    ]  # fmt: skip
    # for the watched server only: Prometheus' instance label of a static target is the URL's host:port
    instance = stub.url.removeprefix("http://").rstrip("/")
    assert all(f'model_name="{MODEL}",instance="{instance}"' in r["expr"] for r in rules)
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

    # Below break-even and below the band (a base upgrade, the server judged by the model it serves): turn
    # it off now, then retrain for the served model.
    with Stub(conditional=[0.02, 0.02]) as stub:
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.once=true",
                     f"watch.target={MODEL}")  # fmt: skip
        assert watch(cfg, ["experiment=smoke", f"watch.target={MODEL}"]) == 2
    record = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    assert record["verdict"] == "net-negative" and len(record["actions"]) == 5
    assert record["actions"][0].startswith("vllm serve ")
    assert f"experiment=smoke target.path={MODEL} run_dir=" in record["actions"][1]
    assert all(f"target.path={MODEL}" in command for command in record["actions"][1:])


def test_several_windows_until_the_count(tmp_path, head, results):  # noqa: F811
    with Stub() as stub:
        cfg = config(
            tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle", "watch.windows=5"
        )
        assert watch(cfg) == 0
    lines = (head.parent / "watch" / "timeline.jsonl").read_text().splitlines()
    assert [json.loads(line)["verdict"] for line in lines] == ["healthy"] * 5


def test_a_net_negative_head_that_falls_below_its_band_is_told_to_retrain(tmp_path, head, results):  # noqa: F811
    # At concurrency 4 eval measured the head at 0.85x: net-negative from the first window, as measured (turn
    # it off). After a base upgrade its acceptance collapses: the verdict stays net-negative, and the
    # retrain is said then, at the first window below the band, not only at the verdict's first window; a
    # window back in the band does not take it back (nor say "turn it off" again).
    with Stub() as stub:
        stub.concurrency = 4.0
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.windows=4", f"watch.target={MODEL}")  # fmt: skip
        # after the baseline and two windows of 20 scrapes; one window later, back as measured
        stub.switch = {42: [0.02, 0.02], 62: MEASURED}
        assert watch(cfg, ["experiment=smoke", f"watch.target={MODEL}"]) == 2
    records = [
        json.loads(line) for line in (head.parent / "watch" / "timeline.jsonl").read_text().splitlines()
    ]
    assert [r["verdict"] for r in records] == ["net-negative"] * 4
    assert [r["acceptance_high"] < r["expected_low"] for r in records] == [False, False, True, False]
    assert [len(r["actions"]) for r in records] == [1, 0, 5, 0]
    assert records[0]["actions"][0].startswith("vllm serve ")  # turn it off
    assert "train.init_from=" in records[2]["actions"][2]


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
        ("unreachable", r"watch.url=http://127.0.0.1:9: no answer from http://127.0.0.1:9/metrics"),
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


def test_an_outage_and_a_restart_are_verdicts_and_the_watch_goes_on(tmp_path, head, results):  # noqa: F811
    """Scrapes 25-34 unanswered (a server restarting): `down` once, then `restarted` with a new baseline
    from its first answer; a restart whose counters passed the old ones by the next scrape is `restarted`
    by its start time. Neither ends the watch or counts as a judged window."""
    with Stub() as stub:
        stub.down = range(25, 35)
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.windows=2")  # fmt: skip
        assert watch(cfg) == 0
    names = [json.loads(line)["verdict"] for line in (head.parent / "watch" / "timeline.jsonl").open()]
    assert names == ["healthy", "down", "restarted", "healthy"]

    # restarted with another k: said on its first answer, and judged against the record at that k (this
    # record has none at k=3)
    with Stub() as stub:
        stub.down = range(25, 35)
        stub.restart_at = 35
        stub.restart_k, stub.switch = 3, {35: [*MEASURED, 0.05]}
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.windows=2", f"watch.out_dir={tmp_path / 'k3'}")  # fmt: skip
        assert watch(cfg) == 3  # could not judge
    records = [json.loads(line) for line in (tmp_path / "k3" / "timeline.jsonl").open()]
    assert [r["verdict"] for r in records[:4]] == ["healthy", "down", "restarted", "unmeasured"]
    assert records[2]["k"] == 3 and "drafting k=3 (it drafted k=2)" in records[2]["reason"]

    with Stub() as stub:
        stub.restart_at = 25
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.windows=2")  # fmt: skip
        assert watch(cfg) == 0
    lines = (head.parent / "watch" / "timeline.jsonl").read_text().splitlines()[4:]
    records = [json.loads(line) for line in lines]
    assert [r["verdict"] for r in records].count("restarted") == 1
    assert "process_start_time_seconds" in next(r["reason"] for r in records if r["verdict"] == "restarted")


def test_the_model_check_compares_paths_and_says_when_only_names_agree():
    """/data/runB/final is not /data/runA/final although both end in `final` (issue 62: judged the same);
    a hub id and a path of the same name cannot be compared from here, which the watch says."""
    from watch.main import same_model

    assert same_model("/data/runA/final", "/data/runA/final/") is True
    assert same_model("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B") is True
    assert same_model("/data/runB/final", "/data/runA/final") is None
    assert same_model("/models/Llama-3.1-8B", "meta-llama/Llama-3.1-8B") is None
    assert same_model("/models/Qwen3-8B", "/models/SmolLM2-135M-Instruct") is False


def test_the_served_model_is_checked_for_every_export_format(tmp_path, head, results, caplog):  # noqa: F811
    """A plain export (no speculators verifier): its record names the target; an empty model list, and LoRA
    adapters beside the base model (warned: their traffic is in the counters)."""
    (head / "config.json").write_text(json.dumps({"architectures": ["Eagle3LlamaForCausalLM"]}))
    (head / "export_record.json").write_text(json.dumps({"verified": True, "target": MODEL, "files": {}}))
    with Stub(model="/models/Qwen3-8B") as stub:
        with pytest.raises(WatchError, match=r"serves '/models/Qwen3-8B'; the head was trained for"):
            watch(config(tmp_path, head, stub.url, f"watch.results={results}", "watch.once=true"))
    # Only the name agrees (the path is on no host here): judged, and said so
    with Stub(model="/elsewhere/" + MODEL.rstrip("/").rsplit("/", 1)[-1]) as stub:
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.once=true")  # fmt: skip
        assert watch(cfg) == 0
    assert "only their names agree. The watch cannot tell from here" in caplog.text
    with Stub(models=[]) as stub:
        with pytest.raises(WatchError, match=r"/v1/models lists no model"):
            watch(config(tmp_path, head, stub.url, f"watch.results={results}", "watch.once=true"))


def test_an_interrupted_publication_lora_adapters_and_an_out_dir_under_a_file(
    tmp_path,
    head,
    results,
    caplog,  # noqa: F811
):
    """The export left aside by a publication killed between its renames is recovered, as eval does; LoRA
    adapters beside the base model are warned about; an out_dir under a file is one line."""
    from artifacts.atomic import old_path

    head.rename(old_path(head))
    lora = {"id": "sql-lora", "root": "/adapters/sql", "parent": MODEL}
    with Stub(models=[{"id": MODEL, "root": MODEL}, lora]) as stub:
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.once=true")  # fmt: skip
        assert watch(cfg) == 0
        assert (head / "config.json").exists() and not old_path(head).exists()
        assert "also serves LoRA adapters ['sql-lora']" in caplog.text
        (tmp_path / "file").write_text("")
        with pytest.raises(WatchError, match=r"watch.out_dir=.*file/watch: cannot be a directory"):
            watch(config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                         "watch.once=true", f"watch.out_dir={tmp_path / 'file' / 'watch'}"))  # fmt: skip


def test_rules_and_panel_are_written_from_the_judged_window(tmp_path, head, results):  # noqa: F811
    with Stub() as stub:
        cfg = config(tmp_path, head, stub.url, f"watch.results={results}", "watch.eval_head=peagle",
                     "watch.once=true")  # fmt: skip
        assert watch(cfg) == 0
    out = head.parent / "watch"
    window = json.loads((out / "timeline.jsonl").read_text().splitlines()[-1])
    rules = yaml.safe_load((out / "alerts.yml").read_text())["groups"][0]["rules"]
    assert [float(r["expr"].split(" < ")[1].split()[0]) for r in rules[:2]] == [
        round(window["expected_low"], 4),
        round(window["break_even"], 4),
    ]
    assert (
        f'le=~"{le_pattern(window["itl_bound_s"])}"' in rules[2]["expr"]
    )  # the bucket the watch counted above
    assert f"{window['drafts']:.0f} drafts" in rules[0]["annotations"]["window"]


def test_exit_codes_never_read_as_a_verdict(tmp_path, head, results, subprocess_env):  # noqa: F811
    """A bad setting, a head name eval never measured, an override Hydra cannot parse or an unreadable
    record: exit 64 (never 1, "retrain", nor 3, "could not judge"); SIGTERM (turned into Ctrl-C's
    KeyboardInterrupt): a quiet stop, exit 130."""
    import signal
    import subprocess
    import sys

    def run(*overrides, eval_head="peagle"):
        command = [sys.executable, str(REPO / "watch/main.py"), "experiment=smoke", f"run_dir={head.parent}",
                   f"watch.results={results}", f"watch.eval_head={eval_head}", *overrides]  # fmt: skip
        return subprocess.Popen(command, env=subprocess_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)  # fmt: skip

    with Stub() as stub:
        bad = tmp_path / "truncated_results.json"
        bad.write_text(results.read_text()[:40])
        # The three watches start together (each spends its first seconds importing).
        bad_setting = run(f"watch.url={stub.url}", "watch.z=inf")
        bad_record = run(f"watch.url={stub.url}", f"watch.results={bad}")
        watching = run(f"watch.url={stub.url}", "watch.interval_s=0.2")
        typo = run(f"watch.url={stub.url}", "watch.once=true", eval_head="pegale")
        unparsed = run(f"watch.url={stub.url}", "watch.once=maybe")
        assert typo.wait(timeout=120) == 64
        line = typo.stderr.read().strip().splitlines()[-1]
        assert (
            line.startswith("watch: watch.eval_head=pegale:") and "measured no such head (['peagle'" in line
        )
        assert unparsed.wait(timeout=120) == 64
        assert "watch.once" in unparsed.stderr.read()
        assert bad_setting.wait(timeout=120) == 64
        line = bad_setting.stderr.read().strip().splitlines()[-1]
        assert line.startswith("watch: watch.z=inf: must be in (0, 10]")
        assert bad_record.wait(timeout=120) == 64
        line = bad_record.stderr.read().strip().splitlines()[-1]
        assert line.startswith(f"watch: {bad}: not readable eval results") and "Traceback" not in line
        timeline = head.parent / "watch" / "timeline.jsonl"
        deadline = time.monotonic() + 120
        while not timeline.exists() and time.monotonic() < deadline and watching.poll() is None:
            time.sleep(0.2)
        watching.send_signal(signal.SIGTERM)  # the handler raises Ctrl-C's KeyboardInterrupt: both paths
        # communicate, not wait: it drains both pipes, so a watch that has printed a pipe's worth is not left
        # blocked on a write (Popen.wait's documented deadlock). The test once timed out here in the suite
        # with its pipes undrained; that this was the cause is not confirmed.
        _, err = watching.communicate(timeout=30)
        assert watching.returncode == 130
        assert err.strip().splitlines()[-1] == "watch: stopped"


class CompletionsStub(LocalServer):
    """/v1/completions streaming `Answer <n>.` to request n, HTTP 500 to request 1."""

    def __enter__(self):
        stub, self.count = self, 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n, stub.count = stub.count, stub.count + 1
                if n == 1:
                    self.send_error(500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for piece in ["Answer", f" {n}", "."]:
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args):
                pass

        return self.serve(Handler)


def test_traffic_logs_each_served_answer_as_a_record_data_prep_reads(tmp_path):
    """bench/traffic.py: the questions sent in order (starting over after the last), each answered one
    logged with its served answer; a failed request counted, not logged; the log is what the watch's retrain
    commands hand data_prep (data.format=openai), every record a usable conversation."""
    from artifacts.config import DataConfig
    from artifacts.smoke import build_tokenizer
    from bench.traffic import Traffic
    from data_prep.sources import load_conversations

    tokenizer = build_tokenizer()
    conversations = [
        {"id": f"q{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]} for i in range(3)
    ]
    log = tmp_path / "requests.jsonl"
    with CompletionsStub() as stub:
        with Traffic(stub.url, "m", tokenizer, conversations, log, start=1) as traffic:
            while traffic.requests + traffic.failed < 5:
                time.sleep(0.01)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert traffic.failed == 1 and traffic.requests == len(records) >= 4
    assert [r["id"] for r in records[:4]] == ["q1", "q0", "q1", "q2"]  # request 1 (q2) failed
    assert [r["messages"][1] for r in records[:2]] == [
        {"role": "assistant", "content": "Answer 0."},
        {"role": "assistant", "content": "Answer 2."},
    ]
    assert records[0]["messages"][0] == {"role": "user", "content": "Question 1?"}
    loaded = load_conversations(DataConfig(source=str(log), format="openai", id_field="id"))
    assert len(loaded.conversations) == len(records) and not loaded.skipped
    assert traffic.position == traffic.requests + traffic.failed + 1


def test_retraining_regenerates_the_answers_at_the_served_temperature(tmp_path):
    """A run regenerated at another temperature than the server samples at (watch.temperature): the retrain
    commands regenerate at the served one, and each composes to a valid config."""
    import shlex

    from artifacts.config import check_config
    from watch.actions import retrain_commands

    def commands(run_overrides, served):
        watched = [f"watch.temperature={served}", "watch.traffic=/logs/requests.jsonl"]
        cfg = compose("config", [*run_overrides, f"run_dir={tmp_path}", *watched])
        return retrain_commands(cfg, run_overrides)

    greedy = ["experiment=smoke_regen"]
    for command in commands(greedy, 1):
        assert " regen.temperature=1" in command
        check_config(compose("config", shlex.split(command)[2:]))
    sampled = ["experiment=smoke_regen", "regen.temperature=0.7", "regen.samples_per_prompt=4"]
    data_prep = commands(sampled, 0)[0]
    assert "regen.temperature=0.7" not in data_prep and "samples_per_prompt=4" not in data_prep
    assert data_prep.endswith("regen.temperature=0 regen.samples_per_prompt=1 regen.include_greedy=false run_dir="
                              f"{tmp_path}_retrained data.source=/logs/requests.jsonl data.format=openai")  # fmt: skip
    served_as_trained = commands(sampled[:2], 0.7)  # the run's own setting, nothing added
    assert all(c.count("regen.temperature") == 1 and "regen.temperature=0.7" in c for c in served_as_trained)
    assert all("regen.temperature" not in c for c in commands(["experiment=smoke"], 1))  # no regeneration


def test_a_head_served_in_another_thinking_mode_is_named_and_retrained_in_the_served_one(tmp_path):
    """The thinking mode (chat-template kwargs) the traffic is served with against the head's: eval's and
    the watch's note says what the mismatch costs, and the retrain commands render with the served mode."""
    import shlex

    from artifacts.config import check_config
    from export.read_vllm import thinking_note
    from watch.actions import retrain_commands

    assert thinking_note("h", {"enable_thinking": True}, {"enable_thinking": True}) is None
    assert thinking_note("h", None, {"enable_thinking": False}) is None  # not recorded: nothing to compare
    note = thinking_note("h", {}, {"enable_thinking": False})
    assert "{'enable_thinking': False}" in note and "9.49" in note and "render.chat_template_kwargs" in note

    # docs/watch.md's forms as bash passes them (quotes removed), each read as the same object
    from watch.actions import served_kwargs_of

    doc = (REPO / "docs" / "watch.md").read_text()
    typed = re.findall(r"`('watch\.chat_template_kwargs=[^`]*')`", doc)
    assert len(typed) == 2
    for form in typed:
        settings = compose("config", [f"run_dir={tmp_path}", *shlex.split(form)]).watch
        assert served_kwargs_of(settings) == {"enable_thinking": False}, form

    run = ["experiment=smoke_regen", "++render.chat_template_kwargs={enable_thinking:true}"]
    served = [
        """watch.chat_template_kwargs='{"enable_thinking": false}'""",
        "watch.traffic=/logs/requests.jsonl",
    ]
    commands = retrain_commands(compose("config", [*run, f"run_dir={tmp_path}", *served]), run)
    for command in commands:
        assert "enable_thinking:true" not in command
        assert "'++render.chat_template_kwargs={enable_thinking:false}'" in command
        cfg = compose("config", shlex.split(command)[2:])
        check_config(cfg)
        assert dict(cfg.render.chat_template_kwargs) == {"enable_thinking": False}
    same = [
        """watch.chat_template_kwargs='{"enable_thinking": true}'""",
        "watch.traffic=/logs/requests.jsonl",
    ]
    assert all(
        "false" not in c
        for c in retrain_commands(compose("config", [*run, f"run_dir={tmp_path}", *same]), run)
    )
