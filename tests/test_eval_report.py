"""eval/report.py on a synthetic results dict shaped like eval/main.py's: files, JSON without NaN, the
report's tables and plots, and an offline W&B run. CPU only, no vLLM, no network."""

import json
import math
import re
import time

import pytest

from eval.report import log_to_wandb, write_report
from heads.acceptance import AcceptanceCounts
from tests.helpers import wandb_items, wandb_records

BASELINE_TOK_S = {("chat", 1): 50.2, ("chat", 4): 160.0, ("code", 1): 48.0, ("code", 4): 150.0}
PLOTS = {
    "acceptance_per_position",
    "throughput_vs_concurrency",
    "itl_vs_concurrency",
    "speedup_predicted_vs_measured",
}


def latency(mean: float) -> dict:
    return {"mean": mean, "p50": mean * 0.9, "p90": mean * 1.5, "p99": mean * 2.5}


def make_run(head: str | None, k: int, workload: str, concurrency: int, tok_s: float, accepted=None) -> dict:
    run = {
        "config": f"{head} k={k}" if head else "baseline",
        "head": head,
        "k": k,
        "workload": workload,
        "concurrency": concurrency,
        "num_requests": 8,
        "num_failed": 0,
        "output_tokens": 512,
        "duration_s": 512 / tok_s,
        "output_tokens_per_s": tok_s,
        "ttft_ms": latency(40.0 * concurrency),
        "tpot_ms": latency(1000.0 / tok_s * concurrency),
        "itl_ms": latency(1000.0 / tok_s * concurrency * 1.2),
        "acceptance": None,
        "speedup": None,
        "economics": None,
    }
    if head is None:
        return run
    counts = AcceptanceCounts(100, 100 * k, sum(accepted), list(accepted))
    speedup = tok_s / BASELINE_TOK_S[(workload, concurrency)]
    predicted = speedup * 1.1
    run["acceptance"] = counts.summary()
    run["speedup"] = speedup
    run["economics"] = {
        "alpha": 0.55,
        "draft_cost": 0.08,
        "predicted_speedup": predicted,
        "measured_speedup": speedup,
        "gap": speedup - predicted,
    }
    return run


def synthetic_results(num_heads: int = 2, baseline_only: bool = False) -> dict:
    runs = [make_run(None, 0, w, c, tok_s) for (w, c), tok_s in BASELINE_TOK_S.items()]
    recommendations = []
    heads = [] if baseline_only else [("general", 1.0), ("code", 0.8)][:num_heads]
    for head, scale in heads:
        for k in (2, 3):
            for workload in ("chat", "code"):
                accepted = [int(60 * scale), int(40 * scale), int(20 * scale)][:k]
                # Throughput gain falls with load; at concurrency 4 "general k=3" on code is slower.
                runs.append(make_run(head, k, workload, 1, 65.3 * scale + k, accepted))
                runs.append(make_run(head, k, workload, 4, 155.0 * scale - 10 * k + 20, accepted))
        recommendations += [
            {
                "head": head,
                "workload": w,
                "best_k": 3,
                "best_speedup": 1.3,
                "enable": True,
                "threshold": 1.05,
                "breakeven_concurrency": 4 if w == "code" else None,
                "text": f"{w}: enable {head} with k=3 (1.30x at concurrency 1 with k=3; threshold 1.05x)",
            }
            for w in ("chat", "code")
        ]
    for r in runs:
        if r["config"] == "general k=3" and r["workload"] == "chat" and r["concurrency"] == 4:
            r["itl_ms"]["p99"] = float("nan")  # a percentile over no gaps
    return {
        "versions": {"vllm": "0.32.0", "torch": "2.13.0", "python": "3.12.3"},
        "machine": {"cpu": "Test CPU", "num_cpus": 2, "gpu": None},
        "config": {"concurrency": [1, 4], "heads": [h for h, _ in heads]},
        "runs": runs,
        "recommendations": recommendations,
        "headline": [],
    }


def find_run(results: dict, config: str, workload: str, concurrency: int) -> dict:
    return next(
        r
        for r in results["runs"]
        if (r["config"], r["workload"], r["concurrency"]) == (config, workload, concurrency)
    )


def section(text: str, heading: str) -> str:
    """The markdown under `heading` up to the next heading of any level."""
    start = text.index(heading + "\n")
    following = re.search(r"^#", text[start + len(heading) :], flags=re.M)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def row_cells(text: str, *first_cells: str) -> list[str]:
    prefix = "| " + " | ".join(first_cells) + " |"
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return [cell.strip() for cell in line.strip("|").split("|")]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The two-head results, their files (read-only) and report.md's text; written once (plots take ~1 s)."""
    results = synthetic_results()
    out = tmp_path_factory.mktemp("eval")
    paths = write_report(results, out)
    return results, paths, (out / "report.md").read_text()


def test_files_are_written_and_returned(report):
    _, paths, _ = report
    out = paths["report.md"].parent
    assert paths["results.json"] == out / "results.json"
    assert paths["report.md"] == out / "report.md"
    assert {p.stem for name, p in paths.items() if name.startswith("plots/")} == PLOTS
    assert all(p.exists() for p in paths.values())
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_results_json_round_trips_with_nan_as_null(report):
    results, paths, _ = report
    text = paths["results.json"].read_text()
    assert "NaN" not in text
    loaded = json.loads(text)
    assert find_run(loaded, "general k=3", "chat", 4)["itl_ms"]["p99"] is None
    # Everything else survives unchanged; the caller's dict is not modified.
    assert math.isnan(find_run(results, "general k=3", "chat", 4)["itl_ms"]["p99"])
    assert loaded["runs"][5] == results["runs"][5]
    assert loaded["recommendations"] == results["recommendations"]


def test_report_has_a_runs_table_per_workload(report):
    results, _, text = report
    for workload in ("chat", "code"):
        table = section(text, f"### {workload}")
        for config in ("baseline", "general k=2", "general k=3", "code k=2", "code k=3"):
            for concurrency in (1, 4):
                run = find_run(results, config, workload, concurrency)
                cells = row_cells(table, config, str(concurrency))
                assert cells[4] == f"{run['output_tokens_per_s']:.1f}"
                assert cells[10] == (
                    "n/a" if math.isnan(run["itl_ms"]["p99"]) else f"{run['itl_ms']['p99']:.1f}"
                )
    run = find_run(results, "general k=3", "chat", 1)
    # 100 drafts, 60 + 40 + 20 accepted of 300 drafted: 2.20 tokens per verify step, rate 0.400.
    assert row_cells(section(text, "### chat"), "general k=3", "1")[:6] == [
        "general k=3",
        "1",
        "2.20",
        "0.400",
        "68.3",
        f"{run['speedup']:.2f}x",
    ]
    assert row_cells(section(text, "### chat"), "general k=3", "4")[10] == "n/a"  # the NaN p99
    slower = find_run(results, "general k=3", "code", 4)["speedup"]
    assert slower < 1.0 and row_cells(section(text, "### code"), "general k=3", "4")[5] == f"{slower:.2f}x"
    assert row_cells(section(text, "### chat"), "baseline", "1")[2:4] == ["n/a", "n/a"]


def test_report_names_both_acceptance_metrics_and_holds_the_other_sections(report):
    results, _, text = report
    assert "mean acceptance length (tokens per verify step, incl. bonus)" in text
    assert "draft acceptance rate (accepted / drafted)" in text
    assert "vllm 0.32.0" in text and "Test CPU" in text
    for rec in results["recommendations"]:
        assert f"- {rec['text']}" in section(text, "## Recommendations")
    per_position = section(text, "## Per-position acceptance")
    assert row_cells(per_position, "general k=3", "chat", "1", "unconditional p_i")[4:] == [
        "0.600",
        "0.400",
        "0.200",
    ]
    assert row_cells(per_position, "general k=3", "chat", "1", "conditional p_i / p_(i-1)")[4:] == [
        "0.600",
        "0.667",
        "0.500",
    ]
    assert row_cells(per_position, "general k=2", "code", "1", "unconditional p_i")[4:] == [
        "0.600",
        "0.400",
        "",
    ]
    economics = section(text, "## Predicted vs measured speedup")
    e = find_run(results, "code k=2", "code", 4)["economics"]
    assert row_cells(economics, "code k=2", "code", "4")[6:] == [
        f"{e['predicted_speedup']:.2f}x",
        f"{e['measured_speedup']:.2f}x",
        f"{e['gap']:+.2f}",
    ]


def test_compare_table_only_with_two_heads(report, tmp_path):
    results, _, text = report
    compare = text[text.index("## Heads compared") :]
    best = find_run(results, "general k=3", "chat", 1)
    assert row_cells(section(compare, "### chat"), "general")[1:] == [
        "3",
        "1",
        "2.20",
        f"{best['speedup']:.2f}x",
    ]
    assert row_cells(section(compare, "### code"), "code")[1:3] == ["3", "1"]
    # Per workload, the fastest head and by how much the others trail it, with what a round brings and costs.
    slower = find_run(results, "code k=3", "chat", 1)
    trail = 1 - slower["speedup"] / best["speedup"]
    assert (
        f"**Fastest: general k=3, {best['speedup']:.2f}x** (2.20 tokens a round at a draft cost of 0.08 "
        f"target steps); code k=3 {slower['speedup']:.2f}x, {trail:.0%} slower"
        in section(compare, "### chat")
    )

    write_report(synthetic_results(num_heads=1), tmp_path / "one_head")
    assert "## Heads compared" not in (tmp_path / "one_head" / "report.md").read_text()


def test_every_referenced_plot_is_a_png(report):
    _, paths, text = report
    linked = re.findall(r"!\[[^\]]*\]\((plots/[^)]+)\)", text)
    assert {name.removeprefix("plots/").removesuffix(".png") for name in linked} == PLOTS
    for name in linked:
        assert (paths["report.md"].parent / name).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_baseline_only_results_have_no_plots(tmp_path):
    paths = write_report(synthetic_results(baseline_only=True), tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert set(paths) == {"results.json", "report.md"}
    assert "plots/" not in text and not list(tmp_path.glob("plots/*.png"))
    assert row_cells(section(text, "### code"), "baseline", "4")[4] == "150.0"
    assert "## Heads compared" not in text and "## Per-position acceptance" not in text


def test_wandb_offline_run_holds_the_report(report, tmp_path, monkeypatch):
    results, paths, _ = report
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = log_to_wandb(results, paths, tmp_path, project="eagle-test", name="report-test")
    assert run_dir is not None and run_dir.is_dir()
    assert run_dir.parent == tmp_path / "wandb" and run_dir.name.startswith("offline-run-")
    # wandb's service process may still be flushing the run file when finish() returns.
    deadline = time.time() + 60
    while time.time() < deadline:
        files = list(run_dir.glob("run-*.wandb"))
        if files and any(r.HasField("exit") for r in wandb_records(files[0])):
            break
        time.sleep(0.25)
    (file,) = run_dir.glob("run-*.wandb")
    data = file.read_bytes()
    for key in (b"recommendations", b"throughput_vs_concurrency"):  # the tables and plots, by name
        assert key in data, key
    # The summary's values: the best speedup of each workload and each head's best k, as results hold them.
    records = wandb_records(file)
    summary = {}
    for record in records:
        if record.HasField("summary"):
            summary |= wandb_items(record.summary.update)
    for workload in ("chat", "code"):
        speedups = [r["speedup"] for r in results["runs"] if r["workload"] == workload and r.get("speedup")]
        assert summary[f"{workload}/best_speedup"] == pytest.approx(max(speedups))
    for rec in results["recommendations"]:
        assert summary[f"{rec['workload']}/{rec['head']}/best_k"] == rec["best_k"]
        assert summary[f"{rec['workload']}/{rec['head']}/enable"] == rec["enable"]


def test_the_report_notes_what_was_not_as_asked(report, tmp_path):
    from types import SimpleNamespace

    from eval.workloads import shortfalls

    workloads = [SimpleNamespace(name="chat", source="chat", num_prompts=10),
                 SimpleNamespace(name="mtbench", source="mtbench", num_prompts=1000),
                 SimpleNamespace(name="code", source="code", num_prompts=4)]  # fmt: skip
    notes = shortfalls(workloads, {"chat": [1] * 5, "mtbench": [1] * 80, "code": [1] * 4})
    assert notes == [
        "workload chat: 5 prompts measured, 10 asked (eval.workloads num_prompts): chat holds no more",
        "workload mtbench: 80 conversations measured, 1000 asked (eval.workloads num_prompts): mtbench holds "
        "no more",
    ]
    results = {**synthetic_results(), "notes": [*notes, "head h: /x/export was not verified (why)"]}
    write_report(results, tmp_path)
    text = section((tmp_path / "report.md").read_text(), "## Notes")
    assert all(f"- {note}" in text for note in results["notes"])
    assert "## Notes" not in report[2]  # none without notes


def test_served_acceptance_stands_beside_trains_held_out_estimate(report, tmp_path):
    """Each head run gets its head record's estimate at its k and temperature (T=1: vLLM's argmax drafts,
    or sampled ones for draft_sample_method=probabilistic; none at other temperatures), and the report
    puts served beside it at the lowest concurrency."""
    from eval.results import add_estimates

    results = synthetic_results()
    for r in results["runs"]:
        r["temperature"] = 1.0 if r["workload"] == "code" else 0.0
    held_out = {"general": {"eval/accept_len_k2": 1.8, "eval/accept_len_k3": 2.0, "eval/accept_len_t1_k3": 1.5,
                            "eval/accept_len_t1_sampled_k3": 1.6}}  # fmt: skip
    add_estimates(results["runs"], held_out, {"general": "greedy", "code": "greedy"})
    estimates = {(r["config"], r["workload"], r["concurrency"]): r["estimate"] for r in results["runs"]}
    assert estimates[("general k=3", "chat", 1)] == 2.0 and estimates[("general k=2", "chat", 4)] == 1.8
    assert estimates[("general k=3", "code", 1)] == 1.5 and estimates[("general k=2", "code", 1)] is None
    assert estimates[("code k=3", "chat", 1)] is None and estimates[("baseline", "chat", 1)] is None
    add_estimates(results["runs"], held_out, {"general": "probabilistic"})
    assert find_run(results, "general k=3", "code", 1)["estimate"] == 1.6
    results["runs"][0]["temperature"] = 0.7
    add_estimates(results["runs"][:1], held_out, {})  # a baseline at T=0.7: no estimate, no error

    write_report(results, tmp_path)
    text = section((tmp_path / "report.md").read_text(), "## Served against train's held-out estimate")
    served = find_run(results, "general k=3", "chat", 1)["acceptance"]["mean_acceptance_length"]
    assert row_cells(text, "general k=3", "chat", "1")[3:] == [
        "2.00",
        f"{served:.2f}",
        f"{served / 2 - 1:+.1%}",
    ]
    assert "| general k=2 | code |" not in text and "| code k=3 |" not in text
    assert "held-out estimate" not in report[2]  # none without estimates


def test_acceptance_by_context_length_is_reported_plotted_and_compared_with_the_baseline(tmp_path):
    from eval.results import add_context_speedups

    results = synthetic_results(num_heads=1)
    base, head = find_run(results, "baseline", "chat", 1), find_run(results, "general k=2", "chat", 1)
    base["by_context"] = [
        {"bucket": "<=512", "num_requests": 4, "prompt_tokens": [40, 480], "output_tokens": 256, "tpot_ms": 20.0,
         "acceptance": None},
        {"bucket": "2049-4096", "num_requests": 4, "prompt_tokens": [2100, 4000], "output_tokens": 256,
         "tpot_ms": 30.0, "acceptance": None},
    ]  # fmt: skip
    head["by_context"] = [
        {**base["by_context"][0], "tpot_ms": 10.0, "acceptance": {"mean_acceptance_length": 2.4}},
        {**base["by_context"][1], "tpot_ms": 40.0, "acceptance": {"mean_acceptance_length": 1.2}},
    ]
    add_context_speedups(head, base)
    assert [row["speedup"] for row in head["by_context"]] == [2.0, 0.75]
    paths = write_report(results, tmp_path)
    text = section((tmp_path / "report.md").read_text(), "## Acceptance by context length")
    assert row_cells(text, "general k=2", "chat", "1", "2049-4096") == [
        "general k=2", "chat", "1", "2049-4096", "4", "2100-4000", "1.20", "40.0", "0.75x"
    ]  # fmt: skip
    assert paths["plots/acceptance_by_context.png"].exists()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert find_run(saved, "general k=2", "chat", 1)["by_context"][1]["speedup"] == 0.75
    # without per-request buckets (an older results file): no section, no plot
    no_buckets = tmp_path / "none"
    assert "plots/acceptance_by_context.png" not in write_report(synthetic_results(num_heads=1), no_buckets)
    assert "## Acceptance by context length" not in (no_buckets / "report.md").read_text()
