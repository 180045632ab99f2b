"""eval end to end on real vLLM servers (the CPU build): the smoke target without and with a smoke head;
reports hold consistent numbers; bad heads, dead servers and failing requests are handled; nothing is
left running."""

import json
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from eval.economics import tokens_per_verify
from eval.main import run as evaluate
from eval.server import ServerError, VllmServer
from export.main import run as export
from export.record import RECORD
from target.reaper import record_path
from tests.helpers import REPO, smoke_config

pytest.importorskip("vllm")

EVAL = [
    "eval.heads=[{name:head,num_speculative_tokens:[3]}]",
    "eval.concurrency=[1,4]",
]


def server_processes(marker: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or []) and "api_server" in " ".join(
                p.info["cmdline"]
            ):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def eval_run(regen_head, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    shutil.copytree(regen_head, run_dir, ignore=shutil.ignore_patterns("export*", "ckpt"))
    export(smoke_config(run_dir, experiment="smoke_regen"))
    # A third workload whose second prompt is longer than the server's max-model-len: that request fails.
    (run_dir / "mixed.jsonl").write_text(
        json.dumps({"prompt": "Say hello."}) + "\n" + json.dumps({"prompt": "long " * 1500}) + "\n"
    )
    return run_dir


@pytest.mark.slow  # ~6 min on a 2-core AVX2 CPU (compiled servers); the main job serves this shape
def test_eval_serves_a_parallel_head_ngram_and_a_k_schedule(regen_peagle_head, tmp_path):
    """A P-EAGLE export (parallel drafting) beside vLLM's free ngram drafter, then a per-batch-size k
    schedule for the P-EAGLE head served on its own server."""
    from eval.grid import schedule_configs
    from eval.measure import served_runs

    run_dir = tmp_path / "run"
    shutil.copytree(regen_peagle_head, run_dir, ignore=shutil.ignore_patterns("export*", "ckpt"))
    export(smoke_config(run_dir, experiment="smoke_regen"))
    overrides = [
        "eval.heads=[{name:peagle,num_speculative_tokens:[3]},{name:ngram,method:ngram,num_speculative_tokens:[3]}]",
        "eval.workloads=[{name:chat,source:chat,num_prompts:4,max_tokens:32}]",
        "eval.concurrency=[1,2]",
    ]
    cfg = smoke_config(run_dir, *overrides, experiment="smoke_regen")
    results = evaluate(cfg)
    runs = {(r["config"], r["concurrency"]): r for r in results["runs"] if not r.get("schedule")}
    assert set(runs) == {(c, n) for c in ("baseline", "peagle k=3", "ngram k=3") for n in (1, 2)}
    peagle, ngram = runs[("peagle k=3", 1)], runs[("ngram k=3", 1)]
    assert peagle["drafting"] == "parallel" and peagle["economics"]["drafting"] == "parallel"
    assert peagle["acceptance"]["mean_acceptance_length"] >= 1.25  # the parallel head drafts in vLLM
    assert ngram["acceptance"]["num_drafts"] > 0 and ngram["drafting"] == "ngram"
    for r in (peagle, ngram):
        assert r["output_tokens"] == runs[("baseline", 1)]["output_tokens"]  # lossless
        alpha = r["economics"]["alpha"]
        assert 0 < alpha < 1 and tokens_per_verify(alpha, 3) == pytest.approx(
            r["acceptance"]["mean_acceptance_length"]
        )
    assert {rec["head"] for rec in results["recommendations"]} == {"peagle", "ngram"}
    report = (run_dir / "eval" / "report.md").read_text()
    assert "ngram k=3" in report and "peagle k=3" in report

    # A schedule as eval would recommend it: k=3 at batch size 1, no speculation above.
    spec = {**peagle_spec(run_dir), "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 1024, 0]]}
    recommendation = {"head": "peagle", "workload": "chat", "deploy": spec}
    schedules = schedule_configs([recommendation], cfg.eval.workloads[0].name)
    assert schedules[0]["config"] == "peagle schedule" and schedules[0]["k"] == 3
    prompts = {"chat": workload_prompts(cfg, run_dir)}
    measured = served_runs(cfg, schedules, prompts, run_dir / "smoke_target", tmp_path)
    by_concurrency = {r["concurrency"]: r for r in measured}
    assert by_concurrency[1]["acceptance"]["num_drafts"] > 0  # k=3 at batch size 1
    # At batch size 2 the schedule turns speculation off: drafts only while one request runs alone.
    drafts_at_2 = (by_concurrency[2]["acceptance"] or {}).get("num_drafts", 0)
    assert drafts_at_2 < by_concurrency[1]["acceptance"]["num_drafts"] / 2
    assert not server_processes(str(run_dir)), "a vLLM server outlived eval"


def peagle_spec(run_dir):
    return {
        "method": "eagle3",
        "model": str(run_dir / "export"),
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
    }


def workload_prompts(cfg, run_dir):
    from eval.workloads import workload_prompts as prompts
    from target.model import load_tokenizer

    return prompts("chat", load_tokenizer(cfg.target), run_dir / "cache", 4)


def test_eval_measures_baseline_and_head(eval_run):
    workloads = (
        "eval.workloads=[{name:chat,source:chat,num_prompts:6,max_tokens:32},"
        "{name:code,source:code,num_prompts:4,max_tokens:32},"
        f"{{name:mixed,source:{eval_run / 'mixed.jsonl'},num_prompts:2,max_tokens:16}}]"
    )
    cfg = smoke_config(eval_run, *EVAL, workloads, experiment="smoke_regen")
    results = evaluate(cfg)
    out = eval_run / "eval"
    assert not server_processes(str(eval_run)), "a vLLM server outlived eval"

    runs = results["runs"]
    assert {(r["config"], r["workload"], r["concurrency"]) for r in runs} == {
        (c, w, n) for c in ("baseline", "head k=3") for w in ("chat", "code", "mixed") for n in (1, 4)
    }
    for r in runs:
        acc = r["acceptance"]
        if r["head"] is None:
            assert acc is None and r["speedup"] is None
            continue
        # Acceptance length is 1 + accepted / drafts of the raw counter deltas; per-position rates fall.
        assert acc["mean_acceptance_length"] == pytest.approx(
            1 + acc["num_accepted_tokens"] / acc["num_drafts"]
        )
        assert acc["num_draft_tokens"] == 3 * acc["num_drafts"]
        assert sum(acc["accepted_per_position"]) == acc["num_accepted_tokens"]
        assert all(a >= b for a, b in zip(acc["per_position_acceptance"], acc["per_position_acceptance"][1:]))
        base = next(
            b
            for b in runs
            if b["head"] is None and (b["workload"], b["concurrency"]) == (r["workload"], r["concurrency"])
        )
        assert r["speedup"] == pytest.approx(r["output_tokens_per_s"] / base["output_tokens_per_s"])
        # Greedy and lossless: the head changes the speed, not the answers' lengths.
        assert r["output_tokens"] == base["output_tokens"]
    chat = [r for r in runs if r["workload"] == "chat" and r["head"]]
    assert all(r["acceptance"]["mean_acceptance_length"] >= 1.5 for r in chat)  # a head that drafts
    mixed = [r for r in runs if r["workload"] == "mixed"]
    assert all(r["num_failed"] == 1 and r["num_requests"] == 2 and r["output_tokens"] > 0 for r in mixed)
    assert all(r["ttft_ms"]["p50"] > 0 and r["tpot_ms"]["p50"] > 0 for r in runs)
    econ = next(r["economics"] for r in chat if r["concurrency"] == 1)
    assert econ["measured_speedup"] == pytest.approx(
        next(r["speedup"] for r in chat if r["concurrency"] == 1)
    )

    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == len(runs) and saved["recommendations"]
    report = (out / "report.md").read_text()
    assert "mean acceptance length" in report and "draft acceptance rate" in report
    assert all(rec["text"] in report for rec in results["recommendations"])
    for name in ("acceptance_per_position", "throughput_vs_concurrency", "itl_vs_concurrency"):
        assert (out / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in (out / "logs").iterdir()} == {"baseline.log", "head_k3.log"}
    card = (eval_run / "export" / "README.md").read_text()  # the model card now carries eval's headline
    assert "## Serving measurements (eval)" in card and "| chat | head | 3 | 1 |" in card
    assert all(f"- {rec['text']}" in card for rec in results["recommendations"])  # the advice per workload

    # Without vLLM, the reference decoder on the export gives the served figures of concurrency 1.
    offline = evaluate(
        smoke_config(eval_run, *EVAL, workloads, "eval.offline=true", experiment="smoke_regen")
    )
    assert (eval_run / "eval_offline" / "report.md").exists()
    for estimate in offline["runs"]:
        if estimate["workload"] == "mixed":
            continue  # served, its over-long prompt failed; the reference decoder has no such limit
        served = next(
            r for r in runs if r["head"] and (r["workload"], r["concurrency"]) == (estimate["workload"], 1)
        )
        assert estimate["acceptance"]["mean_acceptance_length"] == pytest.approx(
            served["acceptance"]["mean_acceptance_length"], rel=0.02
        ), estimate["workload"]

    # A rerun reuses every finished run: no server starts.
    start = time.perf_counter()
    again = evaluate(cfg)
    assert time.perf_counter() - start < 30 and again["runs"] == results["runs"]


@pytest.mark.slow  # three compiled servers (~3 min on a 2-core CPU)
def test_eval_sweeps_temperatures_and_serves_probabilistic_drafts(eval_run, tmp_path):
    """eval.temperature=[0,1]: every workload measured, compared and recommended per temperature, the
    baseline at each; a head served with draft_sample_method=probabilistic drafts as the greedy one at
    temperature 0 (both take the argmax) and is served at 1."""
    heads = (
        "eval.heads=[{name:greedy,num_speculative_tokens:[3]},"
        "{name:sampled,num_speculative_tokens:[3],draft_sample_method:probabilistic}]"
    )
    overrides = [
        heads,
        "eval.workloads=[{name:chat,source:chat,num_prompts:4,max_tokens:32}]",
        "eval.concurrency=[1]",
        "eval.temperature=[0,1]",
        "eval.serve_schedule=false",
        f"eval.out_dir={tmp_path / 'eval'}",
    ]
    results = evaluate(smoke_config(eval_run, *overrides, experiment="smoke_regen"))
    runs = {(r["config"], r["workload"]): r for r in results["runs"]}
    labels = ("chat T=0", "chat T=1")
    assert set(runs) == {(c, w) for c in ("baseline", "greedy k=3", "sampled k=3") for w in labels}
    assert {r["temperature"] for r in results["runs"]} == {0.0, 1.0}
    assert all(
        r["speedup"] for r in results["runs"] if r["head"]
    )  # each against its own temperature's baseline
    greedy, sampled = runs[("greedy k=3", "chat T=0")], runs[("sampled k=3", "chat T=0")]
    assert (
        sampled["output_tokens"] == greedy["output_tokens"] == runs[("baseline", "chat T=0")]["output_tokens"]
    )
    assert sampled["acceptance"]["num_accepted_tokens"] == greedy["acceptance"]["num_accepted_tokens"]
    assert runs[("sampled k=3", "chat T=1")]["acceptance"]["num_drafts"] > 0
    assert {(rec["head"], rec["workload"]) for rec in results["recommendations"]} == {
        (h, w) for h in ("greedy", "sampled") for w in labels
    }
    report = (tmp_path / "eval" / "report.md").read_text()
    assert "Sampling temperature 0, 1" in report and "chat T=1" in report
    with pytest.raises(ValueError, match=r"eval.temperature=\[0.0, 1.0\]: must be \[0\] with eval.offline"):
        evaluate(smoke_config(eval_run, *overrides, "eval.offline=true", experiment="smoke_regen"))


def test_a_head_for_another_target_is_refused_before_any_server(eval_run, tmp_path):
    head = tmp_path / "head"
    shutil.copytree(eval_run / "export", head)
    config = json.loads((head / "config.json").read_text())
    config["transformer_layer_config"]["hidden_size"] = 512
    (head / "config.json").write_text(json.dumps(config))
    (head / RECORD).unlink()  # edited by hand: its record would refuse it as changed, before this check
    cfg = smoke_config(
        eval_run,
        f"eval.heads=[{{name:x,path:{head}}}]",
        f"eval.out_dir={tmp_path / 'out'}",
        experiment="smoke_regen",
    )
    with pytest.raises(ValueError, match=r"trained for another target: hidden_size=512 \(target: 256\)"):
        evaluate(cfg)
    assert not (tmp_path / "out" / "logs").exists()


def test_a_server_that_cannot_start_is_reported_with_its_log(eval_run, tmp_path):
    server = VllmServer(
        eval_run / "smoke_target", tmp_path / "bad.log", {"max-model-len": "many"}, startup_timeout_s=120
    )
    with pytest.raises(ServerError, match=r"exited with code \d+ before it was ready[\s\S]*max.model.len"):
        server.start()
    assert server.process is None and not server_processes(str(tmp_path))


@pytest.mark.slow  # ~21 s (one more server); a server that cannot start is reported by the test above
def test_a_taken_port_is_reported(eval_run, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = VllmServer(
            eval_run / "smoke_target", tmp_path / "port.log", port=port, startup_timeout_s=180
        )
        with pytest.raises(
            ServerError, match=r"exited with code \d+ before it was ready[\s\S]*already in use"
        ):
            server.start()
    assert not server_processes(str(eval_run))


def test_sigterm_stops_eval_and_its_server(eval_run, tmp_path, subprocess_env):
    out = tmp_path / "out"
    command = [
        sys.executable, str(REPO / "eval/main.py"), "experiment=smoke_regen", f"run_dir={eval_run}",
        f"eval.out_dir={out}", "eval.baseline=true", "eval.heads=[]", "eval.concurrency=[1]",
        "eval.workloads=[{name:chat,source:chat,num_prompts:10,max_tokens:512}]",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not server_processes(str(eval_run)):
            time.sleep(1)
        assert server_processes(str(eval_run)), "the server never started"
        time.sleep(5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) != 0
    finally:
        process.kill()
    time.sleep(1)
    assert not server_processes(str(eval_run)), "SIGTERM left a vLLM server behind"


def recorded_processes(record, at_least: int, timeout_s: float) -> list[list[int]]:
    """The processes the reaper has recorded for a stage, once there are `at_least` of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if record.exists():
            processes = json.loads(record.read_text())["processes"]
            if len(processes) >= at_least:
                return processes
        time.sleep(0.5)
    raise AssertionError(f"{record} never listed {at_least} processes")


def sigkill_leaves_nothing(command, record, at_least, subprocess_env):
    """SIGKILL the stage once its vLLM processes run; none of them may survive it by more than seconds."""
    from target.reaper import alive

    process = subprocess.Popen(
        command, env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        processes = recorded_processes(record, at_least, 240)
        time.sleep(3)  # let vLLM's processes start their own children
        processes = json.loads(record.read_text())["processes"]
        process.send_signal(signal.SIGKILL)
        process.wait()
    finally:
        process.kill()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(alive(*p) for p in processes):
        time.sleep(0.2)
    survivors = [p for p in processes if alive(*p)]
    assert not survivors, f"processes outlived the SIGKILLed stage: {survivors}"


@pytest.mark.slow  # ~30 s; the reaper's SIGKILL path runs by default in the export verification test below
def test_sigkill_of_eval_leaves_no_server_engine_or_worker(eval_run, tmp_path, subprocess_env):
    command = [
        sys.executable, str(REPO / "eval/main.py"), "experiment=smoke_regen", f"run_dir={eval_run}",
        f"eval.out_dir={tmp_path / 'out'}", "eval.heads=[]", "eval.concurrency=[1]",
        "eval.workloads=[{name:chat,source:chat,num_prompts:10,max_tokens:512}]",
    ]  # fmt: skip
    # The server and its engine core at least.
    sigkill_leaves_nothing(command, record_path(eval_run, "eval"), 2, subprocess_env)
    assert not server_processes(str(eval_run))


def test_sigkill_of_export_verification_leaves_no_engine(eval_run, tmp_path, subprocess_env):
    command = [
        sys.executable, str(REPO / "export/main.py"), "experiment=smoke_regen", f"run_dir={eval_run}",
        f"export.out_dir={tmp_path / 'export'}", "export.verify=true",
    ]  # fmt: skip
    sigkill_leaves_nothing(command, record_path(eval_run, "export"), 1, subprocess_env)


def test_the_serve_command_of_the_model_card_runs_as_printed(eval_run, tmp_path):
    import os
    import shlex

    from eval.server import free_port, http_get

    card = (eval_run / "export" / "README.md").read_text()
    printed = card.split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert "--speculative-config" in printed and str((eval_run / "export").resolve()) in printed
    port = free_port()  # the one addition: another test's server may hold vLLM's default port
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [*shlex.split(printed), "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and server.poll() is None:
            try:
                http_get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        assert server.poll() is None, f"the printed command exited: {log.read_text()[-3000:]}"
        models = json.loads(http_get(f"http://127.0.0.1:{port}/v1/models"))
        assert models["data"], "the server answers but serves no model"
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.mark.slow  # ~2 min: one more server (the default suite's budget); the stand-in server covers the rest
def test_watch_holds_a_real_server_serving_the_head_against_evals_record(eval_run):
    """The smoke head served by vLLM under eval's chat traffic: the watch reads the real /metrics, finds
    the server's k and concurrency, and judges its windows against the results eval wrote for the same
    head - which measured it slower than no speculation on the tiny smoke target."""
    from artifacts.prompts import read_conversations
    from bench.traffic import Traffic
    from eval.grid import server_configs
    from target.model import load_config, load_tokenizer, target_dir
    from watch.main import watch

    chat = "eval.workloads=[{name:chat,source:chat,num_prompts:6,max_tokens:32}]"
    results = eval_run / "eval" / "results.json"
    if not results.exists():  # run alone: eval first, as a user would
        evaluate(smoke_config(eval_run, *EVAL, chat, "eval.concurrency=[1]", experiment="smoke_regen"))
    cfg = smoke_config(eval_run, *EVAL, chat, experiment="smoke_regen")
    target = target_dir(cfg.target)
    head = next(c for c in server_configs(cfg, eval_run, load_config(cfg.target)) if c["head"])
    conversations = read_conversations(eval_run / "cache" / "eval_conversations.jsonl")[:6]
    log = eval_run / "watch" / "requests.jsonl"
    with VllmServer(
        target, eval_run / "watch_server.log", dict(cfg.eval.server_args), head["speculative_config"]
    ) as server:
        with Traffic(server.url, str(target), load_tokenizer(cfg.target), conversations, log, max_tokens=32):
            watched = smoke_config(
                eval_run, f"watch.url={server.url}", "watch.interval_s=10", "watch.windows=3",
                "watch.workload=chat", "watch.z=4", experiment="smoke_regen",
            )  # fmt: skip
            status = watch(watched)
    timeline = [json.loads(line) for line in (eval_run / "watch" / "timeline.jsonl").open()]
    timeline = [r for r in timeline if not r.get("window_open")]  # judged windows (not still growing)
    assert len(timeline) == 3 and all(r["drafts"] > 0 and r["requests"] > 0 for r in timeline)
    # It accepts what eval measured (inside the band), and says what eval's speedup says: the smoke head on
    # its tiny target measures anywhere from 0.7x to 1.4x between runs (one CPU step is ~10 ms there), so the
    # verdict is held to this run's eval - net-negative below 1x, healthy above - with break-even derived
    # from it, L_eval / speedup_eval.
    chat = next(
        r for r in json.loads(results.read_text())["runs"]
        if r["head"] == "head" and r["workload"] == "chat" and r["concurrency"] == 1
    )  # fmt: skip
    break_even = chat["acceptance"]["mean_acceptance_length"] / chat["speedup"]
    assert all(r["acceptance_high"] >= r["expected_low"] for r in timeline), timeline
    assert all(r["break_even"] == pytest.approx(break_even) for r in timeline), timeline
    if chat["speedup"] < 0.9:
        assert [r["verdict"] for r in timeline] == ["net-negative"] * 3 and status == 2, timeline
    elif chat["speedup"] > 1.1:
        assert [r["verdict"] for r in timeline] == ["healthy"] * 3 and status == 0, timeline
    assert all(
        len(r["per_position"]) == 3 and 0.8 < r["concurrency"] < 1.2 and r["dispersion"] >= 1
        for r in timeline
    )  # k, c from vLLM
    # eval recorded its requests' spread; the server's histogram of generated tokens gives the window's
    # drafts per request (the dispersion says which estimate was the wider)
    assert chat["request_spread"]["requests"] >= 2, chat["request_spread"]
    assert all(r["dispersion_from"] for r in timeline)
    assert (
        any("eval's spread" in r["dispersion_from"] for r in timeline)
        or chat["request_spread"]["intraclass"] < 0.05
    )
    assert len(read_conversations(log)) >= 3  # the request log, with the answers served
