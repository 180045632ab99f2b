"""The acceptance watch's verdicts (watch/health.py) on recorded metric sequences: `/metrics` texts in vLLM
0.32's exposition format (counters with _total and _created, engine and model_name labels, the per-position
counter's position label, histogram buckets), from a server whose acceptance holds, drops, drifts,
restarts or does not draft."""

import json
import math
import random
import statistics
from dataclasses import replace

import pytest

from heads.acceptance import AcceptanceCounts
from watch.dispersion import MIN_BATCHES
from watch.expectation import NotMeasured, expected_from_results, expected_from_verification, request_counts
from watch.health import Watcher, judge, wilson_low, window
from watch.main import status_line
from watch.scrape import Histogram, Snapshot, read_snapshot, restart_reason

MODEL = "/models/SmolLM2-135M-Instruct"
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
MEASURED = [0.36, 0.10]  # the head's conditional acceptance at positions 0 and 1 (k=2), as eval measured


class Server:
    """Cumulative counters of a simulated vLLM server with a k=2 head, rendered as its /metrics text:
    requests of `request_rounds` verify rounds, one after another (at `concurrency`, each lasts that many
    times longer)."""

    def __init__(self, seed=0, speculating=True, request_rounds=40, started=1.7e9, k=2):
        self.rng = random.Random(seed)
        self.speculating, self.request_rounds, self.started = speculating, request_rounds, started
        self.drafts = self.accepted = self.generated = self.requests = self.rounds = 0
        self.per_pos = [0] * k
        self.itl = [0] * (len(ITL_BUCKETS) + 1)  # cumulative counts per bucket, +Inf last
        self.e2e = [0] * (len(ITL_BUCKETS) + 1)
        self.itl_sum = self.e2e_sum = 0.0
        self.time = 0.0

    @staticmethod
    def observe(buckets, value):
        for i, le in enumerate([*ITL_BUCKETS, math.inf]):
            buckets[i] += value <= le

    def serve(self, seconds, rounds, conditional=MEASURED, itl_s=0.028, concurrency=1.0, spread=0.0):
        """`rounds` verify rounds in `seconds`; with `spread`, requests unlike each other: each request's
        first-position rate is drawn anew, uniform within +-spread of its mean."""
        for _ in range(rounds):
            if self.rounds % self.request_rounds == 0 or not hasattr(self, "first"):
                self.first = conditional[0] + self.rng.uniform(-spread, spread) if spread else conditional[0]
            first = self.first if spread else conditional[0]
            accepted = 0
            if self.speculating:
                for rate in (first, *conditional[1:]):
                    if self.rng.random() >= rate:
                        break
                    accepted += 1
                self.drafts += 1
                self.accepted += accepted
                for i in range(accepted):
                    self.per_pos[i] += 1
            self.generated += accepted + 1
            itl = itl_s * self.rng.uniform(0.9, 1.1)
            self.observe(self.itl, itl)
            self.itl_sum += itl
            self.rounds += 1
            if self.rounds % self.request_rounds == 0:  # a request finished
                self.requests += 1
                latency = self.request_rounds * seconds / rounds * concurrency
                self.observe(self.e2e, latency)
                self.e2e_sum += latency
        self.time += seconds
        return self

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{MODEL}"'
        lines = []

        def counter(name, value, extra=""):
            lines.extend([f"# TYPE {name} counter", f"{name}_total{{{labels}{extra}}} {float(value)}"])
            lines.append(f"{name}_created{{{labels}{extra}}} {self.started}")

        counter("vllm:generation_tokens", self.generated)
        counter("vllm:request_success", self.requests, ',finished_reason="length"')
        if self.speculating:
            counter("vllm:spec_decode_num_drafts", self.drafts)
            counter("vllm:spec_decode_num_draft_tokens", len(self.per_pos) * self.drafts)
            counter("vllm:spec_decode_num_accepted_tokens", self.accepted)
            lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
            for i, value in enumerate(self.per_pos):
                lines.append(
                    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(value)}'
                )
        lines += ["# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {self.started}"]
        for name, counts, total in (
            ("vllm:inter_token_latency_seconds", self.itl, self.itl_sum),
            ("vllm:e2e_request_latency_seconds", self.e2e, self.e2e_sum),
        ):
            lines.append(f"# TYPE {name} histogram")
            for le, count in zip([*ITL_BUCKETS, math.inf], counts):
                bound = "+Inf" if math.isinf(le) else str(le)
                lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(count)}')
            lines.append(f"{name}_count{{{labels}}} {float(counts[-1])}")
            lines.append(f"{name}_sum{{{labels}}} {total}")
        lines.append("# TYPE vllm:num_requests_running gauge")
        lines.append(f"vllm:num_requests_running{{{labels}}} 1.0")
        return "\n".join(lines) + "\n"

    def snapshot(self):
        return read_snapshot(self.metrics(), self.time)


def eval_counts(conditional, drafts=900, seed=1) -> AcceptanceCounts:
    rng, counts = random.Random(seed), AcceptanceCounts()
    for _ in range(drafts):
        accepted = 0
        for rate in conditional:
            if rng.random() >= rate:
                break
            accepted += 1
        counts.observe(2, accepted)
    return counts


@pytest.fixture
def results(tmp_path):
    """An eval results.json of the head at k=2: chat and code, concurrency 1 and 4, T=0; a baseline."""
    runs = [{"head": None, "k": 0, "workload": "chat", "concurrency": 1, "acceptance": {}}]
    for workload, seed in (("chat", 1), ("code", 2)):
        for concurrency, speedup, p99 in ((1, 1.20, 31.0), (4, 0.85, 60.0)):
            runs.append(
                {
                    "head": "peagle",
                    "k": 2,
                    "schedule": None,
                    "workload": f"{workload} T=0",
                    "workload_name": workload,
                    "temperature": 0.0,
                    "concurrency": concurrency,
                    "acceptance": eval_counts(MEASURED, seed=seed).summary(),
                    "speedup": speedup,
                    "itl_ms": {"p50": 28.0, "p99": p99},
                }
            )
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": runs}))
    return path


def timeline(server, expected, phases, subwindows=20):
    """Verdicts of the windows the watch judges, scraping every 60 s / `subwindows` at 800 rounds a minute;
    phases: [(judged windows, serve kwargs)] (a window lengthens while it is `insufficient`)."""
    watcher, verdicts = Watcher(lambda k: expected, subwindows=subwindows), []
    watcher.feed(server.snapshot())
    for count, kwargs in phases:
        judged = 0
        while judged < count:
            verdict = watcher.feed(server.serve(60.0 / subwindows, 800 // subwindows, **kwargs).snapshot())
            if verdict is not None and verdict.name != "insufficient":
                verdicts.append(verdict)
                judged += 1
    return verdicts


def test_a_head_serving_as_measured_is_healthy_on_every_window(results):
    expected = expected_from_results(results, "peagle", 2)
    verdicts = timeline(Server(), expected, [(40, {})])
    assert [v.name for v in verdicts] == ["healthy"] * 40  # no false alarm in 40 windows
    numbers = verdicts[-1].numbers
    assert numbers["drafts"] == 800 and 1.3 < numbers["mean_acceptance_length"] < 1.5
    assert numbers["concurrency"] == pytest.approx(1.0)
    assert 25 < numbers["itl_p50_ms"] < 50 and numbers["break_even"] == pytest.approx(
        expected.runs[0].acceptance.mean_acceptance_length / 1.2, rel=0.05
    )


def test_requests_unlike_each_other_widen_the_bounds_not_the_alarms(results):
    """Each request draws its own acceptance (prose and code in one stream, as on the trial's real traffic):
    windows vary several times more than their drafts' binomial variance says. Judged as if the drafts were
    independent, a head serving as measured would raise false alarms; with the dispersion of the window's
    request-long batches it is healthy on every window, and a collapse is still caught at once."""
    expected = expected_from_results(results, "peagle", 2)
    varied = {"spread": 0.32}
    server = Server(seed=11, request_rounds=100)
    verdicts = timeline(server, expected, [(40, varied), (2, {"conditional": [0.05, 0.05]})])
    assert [v.name for v in verdicts[:40]] == ["healthy"] * 40
    assert 2 < statistics.median(v.numbers["dispersion"] for v in verdicts[:40]) < 30
    # Bounds from independent drafts (dispersion 1, z=3) would miss the true length on many of them.
    truth = 1 + 0.36 * (1 + 0.10)
    missed = [
        abs(v.numbers["mean_acceptance_length"] - truth)
        > 3 * math.sqrt(eval_counts(MEASURED).draft_variance / v.numbers["drafts"])
        for v in verdicts[:40]
    ]
    assert sum(missed) >= 4
    assert [v.name for v in verdicts[40:]] == ["net-negative"] * 2  # a uniform collapse: dispersion ~1
    assert all(v.numbers["dispersion"] < 3 for v in verdicts[40:])


def test_a_sudden_drop_is_degraded_at_once_and_recovers(results):
    expected = expected_from_results(results, "peagle", 2)
    # L 1.40 -> 1.22: still above break-even (~1.17), below the measured band. (A drop to 1.26 is caught
    # on 1 window in 5 here: 800 drafts a window, bounds at the t quantile of its 20 batches, 3.45 for z=3.)
    dropped = {"conditional": [0.20, 0.08]}
    verdicts = [v.name for v in timeline(Server(), expected, [(10, {}), (5, dropped), (5, {})])]
    assert verdicts[:10] == ["healthy"] * 10
    assert verdicts[10] == "degraded" and set(verdicts[10:15]) == {"degraded"}
    assert verdicts[-3:] == ["healthy"] * 3


def test_below_break_even_is_net_negative_at_the_observed_concurrency(results):
    expected = expected_from_results(results, "peagle", 2)
    collapsed = {"conditional": [0.05, 0.05]}
    assert [v.name for v in timeline(Server(), expected, [(3, collapsed)])] == ["net-negative"] * 3
    # At concurrency 4 eval measured 0.85x: even the head's measured acceptance does not pay there.
    busy = timeline(Server(), expected, [(3, {"concurrency": 4.0})])
    assert [v.name for v in busy] == ["net-negative"] * 3
    assert busy[0].numbers["break_even"] > expected.band_low(3.0)


def test_net_negative_stays_until_the_lower_bound_is_back_above_break_even(results):
    """At concurrency 4 eval measured 0.85x (break-even ~1.64). Windows whose bounds straddle break-even do
    not flip the verdict back to healthy (on the long-answer trial every other window did): only a window
    whose lower bound clears it does."""
    expected = expected_from_results(results, "peagle", 2)
    busy = {"concurrency": 4.0}
    straddling = {"concurrency": 4.0, "conditional": [0.55, 0.16]}  # L ~1.64: the bounds straddle it
    paying = {"concurrency": 4.0, "conditional": [0.75, 0.30]}  # L ~1.98
    verdicts = timeline(Server(), expected, [(2, busy), (3, straddling), (2, paying), (2, straddling)])
    assert [v.name for v in verdicts] == ["net-negative"] * 5 + ["healthy"] * 4
    break_even = verdicts[0].numbers["break_even"]
    assert all(v.numbers["acceptance_low"] < break_even < v.numbers["acceptance_high"] for v in verdicts[2:5])
    assert all(v.numbers["acceptance_low"] < break_even < v.numbers["acceptance_high"] for v in verdicts[7:])


def test_a_slow_drift_is_caught_after_it_crosses_the_band_not_before(results):
    expected = expected_from_results(results, "peagle", 2)
    band = expected.band_low(3.0)
    phases = [(1, {"conditional": [0.36 - 0.006 * i, 0.10]}) for i in range(30)]
    verdicts = timeline(Server(seed=3), expected, phases)
    true_length = [1 + (0.36 - 0.006 * i) * (1 + 0.10) for i in range(30)]
    first = next(i for i, v in enumerate(verdicts) if v.name != "healthy")
    assert verdicts[first].name == "degraded"
    assert true_length[first] < band  # no alarm while the true acceptance was inside the band
    crossed = next(i for i, length in enumerate(true_length) if length < band)
    assert first - crossed <= 12  # minutes after the true acceptance left the band


def test_a_restart_starts_a_new_baseline(results):
    """A restarted server whose counters passed the old ones by the next scrape: its start time says so;
    one whose counters went down (no start time exposed) too; and one serving another k."""
    expected = expected_from_results(results, "peagle", 2)
    server = Server()
    before = server.serve(60.0, 800).snapshot()
    restarted = Server(seed=5, started=1.8e9).serve(120.0, 1600)  # counters from zero, already higher
    assert restart_reason(before, restarted.snapshot()).startswith("the server restarted (process_start")
    down = replace(Server(seed=5).serve(30.0, 200).snapshot(), started=None, created=None)
    assert restart_reason(replace(before, started=None, created=None), down).endswith("(a counter went down)")
    watcher = Watcher(lambda k: expected)
    watcher.feed(before)
    verdict = watcher.feed(restarted.snapshot())
    assert verdict.name == "restarted" and verdict.exit_code == 3
    assert status_line(verdict).split(" | ")[0].strip() == "restarted"  # the watch prints every window
    names = [v.name for v in timeline(restarted, expected, [(2, {})])]
    assert names == ["healthy", "healthy"]


def test_no_drafts_idle_and_not_vllm(results):
    expected = expected_from_results(results, "peagle", 2)
    plain = Server(speculating=False)
    before = plain.snapshot()
    verdict = judge(window(before, plain.serve(60.0, 500).snapshot()), expected)
    assert verdict.name == "no-speculation" and verdict.exit_code == 2
    idle = Server()
    first = idle.snapshot()
    idle.time += 60.0
    assert judge(window(first, idle.snapshot()), expected).name == "idle"
    with pytest.raises(ValueError, match="not a vLLM server"):
        read_snapshot("# TYPE http_requests counter\nhttp_requests_total 3.0\n", 0.0)


def test_inter_token_latency_above_the_measured_p99_is_latency(results):
    expected = expected_from_results(results, "peagle", 2)
    verdicts = timeline(Server(), expected, [(2, {}), (2, {"itl_s": 0.080})])
    assert [v.name for v in verdicts] == ["healthy", "healthy", "latency", "latency"]
    assert verdicts[-1].exit_code == 1


def test_expected_reads_what_eval_measured_and_names_what_is_missing(results, tmp_path):
    chat = expected_from_results(results, "peagle", 2, workload="chat")
    assert {run.workload for run in chat.runs} == {"chat"} and len(chat.runs) == 2
    assert [run.concurrency for run in chat.nearest(3.0)] == [4]
    with pytest.raises(
        NotMeasured, match=r"results.json: no run of head 'peagle' at k=3.*\('peagle', 2, 0.0\)"
    ):
        expected_from_results(results, "peagle", 3, prefix_holds=True)
    # A server at k=1: a chain's (or P-EAGLE's causal) first drafts are those of k=2, its first position.
    shorter = expected_from_results(results, "peagle", 1, prefix_holds=True)
    assert "(k=2, its first 1 positions)" in shorter.source
    first = shorter.runs[0].acceptance
    assert first.accepted_per_position == chat.runs[0].acceptance.accepted_per_position[:1]
    with pytest.raises(NotMeasured):
        expected_from_results(results, "peagle", 1)  # a DFlash block of another length: no derivation
    verification = tmp_path / "verification.json"
    verification.write_text(
        json.dumps({"num_speculative_tokens": 2, "vllm": eval_counts(MEASURED).summary()})
    )
    offline = expected_from_verification(verification, 2)
    assert offline.k == 2 and offline.break_even(1.0) is None and offline.itl_p99_ms(1.0) is None
    assert expected_from_verification(verification, 1, prefix_holds=True).k == 1
    with pytest.raises(NotMeasured, match=r"verified at k=2; the server drafts k=3"):
        expected_from_verification(verification, 3, prefix_holds=True)
    # A small measurement in which every draft was accepted still leaves a band.
    perfect = AcceptanceCounts(20, 40, 40, [20, 20])
    low, high = perfect.mean_acceptance_bounds(3.0)
    assert high > 3.0 > low > 2.5
    verification.write_text(verification.read_text()[:30])
    with pytest.raises(ValueError, match=rf"{verification}: not readable export verification"):
        expected_from_verification(verification)


def test_histogram_quantile_and_counts_above_by_hand():
    hist = Histogram(((0.01, 0.0), (0.025, 10.0), (0.05, 90.0), (0.075, 100.0), (math.inf, 100.0)), 3.0)
    assert hist.count == 100
    assert hist.quantile(0.5) == pytest.approx(0.025 + 0.025 * 40 / 80)
    assert hist.quantile(0.99) == pytest.approx(0.05 + 0.025 * 9 / 10)
    assert hist.count_above(0.04) == 10  # above the 0.05 bound: never more than lie above 0.04
    later = Histogram(tuple((le, c * 3) for le, c in hist.buckets), 9.0)
    assert (later - hist).buckets == tuple((le, c * 2) for le, c in hist.buckets)


def test_the_acceptance_length_interval_covers_as_often_as_it_says():
    """mean_acceptance_bounds' variance (nested positions) against the spread of simulated windows."""
    lengths = [eval_counts([0.5, 0.6], drafts=400, seed=seed).mean_acceptance_length for seed in range(300)]
    spread = (sum((x - sum(lengths) / 300) ** 2 for x in lengths) / 299) ** 0.5
    low, high = eval_counts([0.5, 0.6], drafts=400, seed=7).mean_acceptance_bounds(1.0)
    assert (high - low) / 2 == pytest.approx(spread, rel=0.15)
    truth = 1 + 0.5 + 0.5 * 0.6
    covered = sum(
        abs(c.mean_acceptance_length - truth) <= (c.mean_acceptance_bounds(2.0)[1] - c.mean_acceptance_length)
        for c in (eval_counts([0.5, 0.6], drafts=400, seed=seed) for seed in range(300))
    )
    assert 0.92 < covered / 300 < 0.99  # ~95% at z = 2


PROMPT_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]  # vLLM's 1-2-5 up to 8,192


class LengthServer(Server):
    """A Server whose requests have a context length: vLLM's prompt-length histogram per finished request."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.prompts = [0] * (len(PROMPT_BUCKETS) + 1)
        self.prompt_sum = 0.0

    def serve(self, seconds, rounds, prompt_tokens=300, **kwargs):
        before = self.requests
        super().serve(seconds, rounds, **kwargs)
        for _ in range(self.requests - before):
            for i, le in enumerate([*PROMPT_BUCKETS, math.inf]):
                self.prompts[i] += prompt_tokens <= le
            self.prompt_sum += prompt_tokens
        return self

    def metrics(self) -> str:
        labels, name = f'engine="0",model_name="{MODEL}"', "vllm:request_prompt_tokens"
        lines = [f"# TYPE {name} histogram"]
        for le, count in zip([*PROMPT_BUCKETS, math.inf], self.prompts):
            bound = "+Inf" if math.isinf(le) else str(float(le))
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {float(count)}')
        lines += [
            f"{name}_count{{{labels}}} {float(self.prompts[-1])}",
            f"{name}_sum{{{labels}}} {self.prompt_sum}",
        ]
        return super().metrics() + "\n".join(lines) + "\n"


SHORT, LONG = [0.5, 0.3], [0.2, 0.1]  # conditional acceptance of short (300-token) and long (6,000) contexts


@pytest.fixture
def by_length(tmp_path):
    """eval's results.json with each request's length and counts: 20 short and 20 long requests, 40 drafts
    each, in one run (as eval's long workloads spread them over the context buckets)."""
    rows = [
        {"prompt_tokens": tokens, "num_drafts": 40,
         "accepted_per_position": eval_counts(rates, drafts=40, seed=seed).accepted_per_position}
        for seed in range(20) for tokens, rates in ((300, SHORT), (6000, LONG))
    ]  # fmt: skip
    whole = sum((request_counts(row) for row in rows), AcceptanceCounts())
    run = {"head": "peagle", "k": 2, "schedule": None, "workload": "long_chat", "temperature": 0.0,
           "concurrency": 1, "acceptance": whole.summary(), "speedup": None, "per_request": rows}  # fmt: skip
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"runs": [run]}))
    return expected_from_results(path, "peagle", 2)


def test_a_window_is_judged_against_the_band_of_its_own_context_lengths(by_length):
    """Acceptance falls with context length. Long-context traffic served at the long contexts' measured
    acceptance is healthy (the whole run's band would flag some windows); short-context traffic
    falling to the mix's acceptance is degraded (against the whole run's band it would pass)."""
    run = by_length.runs[0]
    assert [tokens for tokens, _ in run.requests[:2]] == [300, 6000] and len(run.requests) == 40
    long_traffic = timeline(
        LengthServer(seed=3), by_length, [(6, {"conditional": LONG, "prompt_tokens": 6000})]
    )
    assert [v.name for v in long_traffic] == ["healthy"] * 6
    assert list(long_traffic[0].numbers["length_mix"]) == [">5000"]  # vLLM's last bucket below 8,192
    whole_band = by_length.band_low(long_traffic[0].numbers["q"])
    # the mix-blind band (the whole run's, as wide as its short and long requests differ) expects more
    # than long contexts give on every window, and flags some
    assert all(v.numbers["mean_acceptance_length"] < whole_band for v in long_traffic)
    assert any(v.numbers["acceptance_high"] < whole_band for v in long_traffic)
    assert all(v.numbers["expected_low"] < whole_band - 0.1 for v in long_traffic)

    mixed = [0.36, 0.2]  # L ~1.43: the run's mean, well below short contexts' 1.65
    short_traffic = timeline(
        LengthServer(seed=4), by_length, [(6, {"conditional": mixed, "prompt_tokens": 300})]
    )
    assert [v.name for v in short_traffic] == ["degraded"] * 6
    assert all(v.numbers["acceptance_high"] > by_length.band_low(v.numbers["q"]) for v in short_traffic)
    assert list(short_traffic[0].numbers["length_mix"]) == ["<=500"]


def test_a_length_eval_never_measured_is_judged_against_the_whole_band(by_length):
    """A window of 1,500-token requests (vLLM's bucket 1,001-2,000, where eval measured none): the whole
    run's band, said by the numbers holding no length mix; a server without the prompt-length histogram
    likewise."""
    verdicts = timeline(LengthServer(seed=5), by_length, [(2, {"conditional": LONG, "prompt_tokens": 1500})])
    assert all("length_mix" not in v.numbers for v in verdicts)
    assert all(
        v.numbers["expected_low"] == pytest.approx(by_length.band_low(v.numbers["q"])) for v in verdicts
    )
    plain = timeline(Server(seed=5), by_length, [(2, {"conditional": LONG})])
    assert all("length_mix" not in v.numbers for v in plain)


VLLM_TOKEN_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 8192, math.inf)


def snapshot(time_s: float) -> Snapshot:
    return Snapshot(time_s, AcceptanceCounts(0, 0, 0, [0, 0]), True, 0.0, 0.0, Histogram(), Histogram())


def token_histogram(tokens) -> Histogram:
    return Histogram(
        tuple((le, float(sum(t <= le for t in tokens))) for le in VLLM_TOKEN_BOUNDS), float(sum(tokens))
    )


def test_the_sum_of_squares_of_requests_lengths_is_estimated_from_vllm_s_buckets():
    """20 requests of log-normal length (sigma 1) in vLLM's 1-2-5 buckets, 400 times: the estimate's median
    within 1.05-1.12x of the truth and 90% of them within 0.8-1.45x (as Histogram.square_sum says)."""
    rng, ratios = random.Random(1), []
    for mean in (50, 300, 800):
        for _ in range(400):
            tokens = [max(1, int(rng.lognormvariate(math.log(mean) - 0.5, 1.0))) for _ in range(20)]
            ratios.append(token_histogram(tokens).square_sum() / sum(t * t for t in tokens))
    ratios.sort()
    assert 1.0 <= statistics.median(ratios) <= 1.12
    assert 0.8 <= ratios[len(ratios) // 20] and ratios[-len(ratios) // 20] <= 1.45
    assert Histogram().square_sum() == 0.0


def test_a_window_s_drafts_per_request_weigh_a_request_still_in_flight():
    """m = sum n^2 / sum n: the finished requests' drafts from their generated tokens; drafts they do not
    hold belong to the requests in flight (the mean concurrency of them)."""
    counts = AcceptanceCounts(1000, 2000, 500, [400, 100])  # L = 1.5
    finished = token_histogram([150, 150])  # 100 + 100 drafts (each bucket's log-uniform estimate, rescaled)
    w = window(snapshot(0.0), replace(snapshot(10.0), acceptance=counts))
    w = replace(w, answer_tokens=finished, concurrency=1.0)
    squares = finished.square_sum() / 1.5**2
    assert w.drafts_per_request == pytest.approx((squares + 800**2) / 1000)  # one long request in flight
    assert replace(w, concurrency=4.0).drafts_per_request == pytest.approx((squares + 800**2 / 4) / 1000)
    assert math.isnan(replace(w, answer_tokens=Histogram()).drafts_per_request)  # no histogram: unknown


def test_the_window_s_dispersion_is_the_wider_of_its_batches_and_eval_s_request_spread():
    from heads.acceptance import RequestSpread
    from watch.dispersion import t_quantile, widest

    counts = AcceptanceCounts(1000, 2000, 500, [400, 100])
    w = replace(window(snapshot(0.0), snapshot(10.0)), acceptance=counts, batches=10, dispersion=4.0)
    assert widest(3.0, w, None) == (t_quantile(3.0, 9), 4.0, "10 batches")  # no eval spread
    w = replace(w, answer_tokens=token_histogram([150] * 10))
    q, phi, how = widest(3.0, w, RequestSpread(0.2, 80))
    assert phi == pytest.approx(1 + 0.2 * (w.drafts_per_request - 1)) and q == t_quantile(3.0, 79)
    assert "80 requests" in how and q * math.sqrt(phi) > t_quantile(3.0, 9) * 2.0
    assert widest(3.0, w, RequestSpread(0.0, 80))[1] == 4.0  # eval's requests alike: the batches' wider


def test_latency_spikes_in_one_stretch_are_not_read_as_independent_tokens(results):
    """3% of a window's inter-token latencies far above eval's p99: spread over every batch of the window
    it is `latency`; all in one stretch (one slow request, one stall) the share is as uncertain as its
    batches say, and the window stays healthy (a binomial over independent tokens would have said latency)."""
    expected, server = expected_from_results(results, "peagle", 2), Server()
    chain = [server.snapshot()] + [server.serve(3.0, 40).snapshot() for _ in range(20)]
    current = window(chain[0], chain[-1], chain[1:-1])
    assert current.batches >= MIN_BATCHES and len(current.itl_batches) == current.batches

    def itl(fast: int, slow: int) -> Histogram:
        return Histogram(((0.01, fast), (1.0, fast), (10.0, fast + slow), (math.inf, fast + slow)))

    n = len(current.itl_batches)
    spread = [itl(970, 30)] * n
    stretch = [itl(700, 300)] + [itl(1000, 0)] * (n - 1)
    for parts, verdict in ((spread, "latency"), (stretch, "healthy")):
        whole = itl(sum(h.count - h.count_above(1.0) for h in parts), sum(h.count_above(1.0) for h in parts))
        judged = judge(replace(current, itl=whole, itl_batches=tuple(parts)), expected)
        assert judged.name == verdict and judged.numbers["itl_above"] == 30 * n, judged.reason
    assert wilson_low(30 * n, 1000 * n, 3.0) > 0.01  # what the independent tokens' bound said of the stretch
