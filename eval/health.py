"""Is a served head still doing what it was measured to do? The acceptance watch's judgement (eval/watch.py
polls; this module decides), pure functions over scrapes of a vLLM server's `/metrics`.

A `Snapshot` holds one scrape's cumulative counters; a `Window` what happened between two; `Expected` what
eval measured for the head (`expected_from_results`: its results.json, per k, temperature, workload and
concurrency); `judge` gives each window a `Verdict`, with statistics rather than fixed thresholds:

- the window's mean acceptance length L has a standard error from its own counts (a draft's accepted
  tokens are a prefix: `AcceptanceCounts.mean_acceptance_bounds`), so does eval's measurement of it; both
  widened by the window's dispersion (drafts of one request are alike: `dispersion`, from the scrapes
  taken within the window);
- `degraded` when the window's upper bound L + z se falls below the expected band (the lowest lower bound
  eval measured on the workloads judged against); back to `healthy` when its lower bound rises into it;
- `net-negative` when the upper bound falls below break-even: the L at which the head's measured round cost
  (at the eval concurrency nearest the window's) makes serving as fast as no speculation, L_be = L_eval /
  speedup_eval (speedup proportional to L at a fixed round cost);
- `latency` when more than 1% of the window's inter-token latencies exceed eval's p99 x (1 + margin) with
  confidence (a binomial lower bound above 1%: under the measured distribution at most 1% lie above p99);
- `no-speculation` (tokens generated, no drafts: the server does not draft), `restarted` (a counter went
  down: the window starts again from this scrape), `idle` (no tokens generated: nothing to judge).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eval.prometheus import acceptance_counts, counter_total, parse_samples
from heads.acceptance import VLLM_PREFIX, AcceptanceCounts

ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"  # its sum over a window / the window's length = mean concurrency
GENERATED = "vllm:generation_tokens"
REQUESTS = "vllm:request_success"

# One-shot exit status (cron, CI canaries, Kubernetes probes): 0 healthy, 1 retrain (degraded, latency),
# 2 turn it off (net-negative, no-speculation), 3 nothing to judge (idle, restarted).
EXIT_CODES = {
    "healthy": 0,
    "degraded": 1,
    "latency": 1,
    "net-negative": 2,
    "no-speculation": 2,
    "idle": 3,
    "restarted": 3,
}


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram summed over its label sets: (upper bound, cumulative count) per bucket,
    +Inf last."""

    buckets: tuple[tuple[float, float], ...] = ()
    total: float = 0.0  # _sum

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def __sub__(self, earlier: Histogram) -> Histogram:
        if not earlier.buckets:
            return self
        before = dict(earlier.buckets)
        return Histogram(
            tuple((le, c - before.get(le, 0.0)) for le, c in self.buckets), self.total - earlier.total
        )

    def count_above(self, threshold: float) -> float:
        """Observations above the smallest bucket bound >= threshold (so never more than lie above it)."""
        for le, cumulative in self.buckets:
            if le >= threshold:
                return self.count - cumulative
        return 0.0

    def quantile(self, q: float) -> float:
        """Prometheus' histogram_quantile: linear within the bucket that holds rank q * count (nan if
        empty; the last finite bound if the rank falls in +Inf)."""
        if self.count <= 0:
            return float("nan")
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if math.isinf(le):
                    return lower
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = le, cumulative
        return lower


def histogram(samples, name: str) -> Histogram:
    """`name`'s buckets and sum from parsed samples (`eval.prometheus.parse_samples`), summed over engines."""
    buckets: dict[float, float] = {}
    for sample, labels, value in samples:
        if sample == f"{name}_bucket" and "le" in labels:
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + value
    return Histogram(tuple(sorted(buckets.items())), counter_total(samples, f"{name}_sum"))


@dataclass(frozen=True)
class Snapshot:
    """One scrape of a server's `/metrics`: cumulative since it started."""

    time_s: float
    acceptance: AcceptanceCounts
    speculating: bool  # vLLM exposes the spec-decode counters only with a speculative config
    generated_tokens: float
    requests: float  # finished requests
    itl: Histogram
    e2e: Histogram
    model_names: frozenset[str] = frozenset()


def read_snapshot(text: str, time_s: float) -> Snapshot:
    """A Snapshot from one `/metrics` text; ValueError when it is not a vLLM server's."""
    samples = parse_samples(text)
    if not any(name.startswith("vllm:") for name, _, _ in samples):
        raise ValueError(
            "no vllm: metrics in this /metrics text: not a vLLM server, or it runs with --disable-log-stats"
        )
    return Snapshot(
        time_s,
        acceptance_counts(text),
        any(name.startswith(VLLM_PREFIX) for name, _, _ in samples),
        counter_total(samples, GENERATED),
        counter_total(samples, REQUESTS),
        histogram(samples, ITL),
        histogram(samples, E2E),
        frozenset(labels["model_name"] for _, labels, _ in samples if "model_name" in labels),
    )


@dataclass(frozen=True)
class Window:
    """What a server did between two snapshots."""

    start_s: float
    end_s: float
    acceptance: AcceptanceCounts
    speculating: bool
    generated_tokens: float
    requests: float
    itl: Histogram
    concurrency: float  # requests in flight on average (Little's law over the finished requests' latency)
    restarted: bool = False
    dispersion: float = 1.0  # the acceptance's variance over the independent drafts' (`dispersion`)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def went_down(earlier: Snapshot, later: Snapshot) -> bool:
    return (
        later.acceptance.num_drafts < earlier.acceptance.num_drafts
        or later.generated_tokens < earlier.generated_tokens
        or later.requests < earlier.requests
    )


def window(earlier: Snapshot, later: Snapshot, between: Sequence[Snapshot] = ()) -> Window:
    """The difference of two snapshots; `restarted` (and the later snapshot's own totals) when a counter
    went down, as it does when the server restarts. With the scrapes `between` them, the acceptance's
    dispersion over those sub-windows (`dispersion`; 1 without them)."""
    chain = [earlier, *between, later]
    restarted = any(went_down(a, b) for a, b in zip(chain, chain[1:]))
    base = Snapshot(earlier.time_s, AcceptanceCounts(), later.speculating, 0.0, 0.0, Histogram(), Histogram())
    start = base if restarted else earlier
    seconds = later.time_s - earlier.time_s
    e2e = later.e2e - start.e2e
    acceptance = later.acceptance - start.acceptance
    parts = [] if restarted else [b.acceptance - a.acceptance for a, b in zip(chain, chain[1:])]
    return Window(
        earlier.time_s,
        later.time_s,
        acceptance,
        later.speculating,
        later.generated_tokens - start.generated_tokens,
        later.requests - start.requests,
        later.itl - start.itl,
        e2e.total / seconds if seconds > 0 else float("nan"),
        restarted,
        dispersion(parts, acceptance),
    )


def dispersion(parts: Sequence[AcceptanceCounts], whole: AcceptanceCounts) -> float:
    """How much more a window's mean acceptance length varies than if its drafts were independent.

    They are not: the drafts of one request share its prompt and answer, and a request of prose accepts
    less than one of code, so a window of a few requests varies between windows several times more than
    its drafts' binomial variance says (the watch's trial on real traffic: docs/watch.md). Estimated by
    batch means, from the window alone: its sub-windows' lengths L_j (n_j drafts each, between the scrapes
    the watch takes `watch.subwindows` times per window) spread around the window's L as
    sum_j n_j (L_j - L)^2 / Var(A) ~ phi chi2(J - 1), Pearson's estimate of phi over the J sub-windows with
    drafts; at least 1, and 1 with fewer than two such sub-windows."""
    parts = [part for part in parts if part.num_drafts]
    variance = whole.draft_variance
    if len(parts) < 2 or not whole.num_drafts or variance <= 0:
        return 1.0
    length = whole.mean_acceptance_length
    pearson = sum(part.num_drafts * (part.mean_acceptance_length - length) ** 2 for part in parts)
    return max(1.0, pearson / variance / (len(parts) - 1))


@dataclass(frozen=True)
class Measured:
    """One eval run of the head (or its export verification): where the expectation comes from."""

    workload: str
    concurrency: int
    acceptance: AcceptanceCounts
    speedup: float | None  # against the baseline on the same prompts; None: verification (no server)
    itl_p99_ms: float | None


@dataclass(frozen=True)
class Expected:
    """What the head was measured to do at one k and temperature, per workload and concurrency."""

    k: int
    temperature: float
    runs: tuple[Measured, ...]
    source: str  # the file it was read from, said in every report

    def band_low(self, z: float, dispersion: float = 1.0) -> float:
        """The bottom of the expected band: the lowest lower bound of L over the workloads measured, its
        drafts as dispersed as the window's (eval's requests are requests like the window's)."""
        return min(run.acceptance.mean_acceptance_bounds(z, dispersion)[0] for run in self.runs)

    def nearest(self, concurrency: float) -> list[Measured]:
        """The runs at the measured concurrency nearest (in ratio) the observed one."""
        measured = sorted({run.concurrency for run in self.runs})
        observed = max(concurrency, 1.0) if not math.isnan(concurrency) else measured[0]
        best = min(measured, key=lambda c: abs(math.log(c / observed)))
        return [run for run in self.runs if run.concurrency == best]

    def break_even(self, concurrency: float) -> float | None:
        """L at which speculation stops paying at this concurrency (median over workloads of L / speedup);
        None without a measured speedup."""
        values = [
            run.acceptance.mean_acceptance_length / run.speedup
            for run in self.nearest(concurrency)
            if run.speedup
        ]
        return statistics.median(values) if values else None

    def itl_p99_ms(self, concurrency: float) -> float | None:
        values = [run.itl_p99_ms for run in self.nearest(concurrency) if run.itl_p99_ms]
        return statistics.median(values) if values else None


def expected_from_results(
    results_path: Path, head: str, k: int, temperature: float = 0.0, workload: str | None = None
) -> Expected:
    """The head's runs in an eval results.json at k and temperature (one workload, or all); ValueError
    naming the file and what it lacks."""
    results = json.loads(Path(results_path).read_text())
    runs = [
        run
        for run in results.get("runs", [])
        if run.get("head") == head
        and run.get("k") == k
        and run.get("schedule") is None
        and float(run.get("temperature", 0.0)) == float(temperature)
        and run.get("acceptance", {}).get("num_drafts")
        and (workload is None or run.get("workload_name", run.get("workload")) == workload)
    ]
    if not runs:
        heads = sorted(
            {
                (r.get("head"), r.get("k"), r.get("temperature", 0.0))
                for r in results.get("runs", [])
                if r.get("head")
            }
        )
        raise ValueError(
            f"{results_path}: no run of head {head!r} at k={k}, temperature {temperature}"
            + (f", workload {workload!r}" if workload else "")
            + f"; it has (head, k, temperature) {heads}"
        )
    return Expected(
        k,
        temperature,
        tuple(
            Measured(
                run.get("workload_name", run["workload"]),
                int(run["concurrency"]),
                AcceptanceCounts.from_summary(run["acceptance"]),
                run.get("speedup"),
                run.get("itl_ms", {}).get("p99"),
            )
            for run in runs
        ),
        str(results_path),
    )


def expected_from_verification(verification_path: Path) -> Expected:
    """Export verification's vLLM acceptance (offline, T=0, its k): no break-even, no latency."""
    record = json.loads(Path(verification_path).read_text())
    counts = AcceptanceCounts.from_summary(record["vllm"])
    return Expected(
        int(record["num_speculative_tokens"]),
        0.0,
        (Measured("verification", 1, counts, None, None),),
        str(verification_path),
    )


@dataclass(frozen=True)
class Verdict:
    name: str  # a key of EXIT_CODES
    reason: str
    numbers: dict = field(default_factory=dict)  # what was measured in the window, for the timeline

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.name]


def wilson_low(successes: float, trials: float, z: float) -> float:
    """The Wilson score interval's lower bound of a binomial proportion (0 without trials)."""
    if trials <= 0:
        return 0.0
    p = successes / trials
    centre = p + z * z / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, (centre - spread) / (1 + z * z / trials))


def judge(
    current: Window,
    expected: Expected,
    previous: str = "healthy",
    z: float = 3.0,
    latency_margin: float = 0.5,
) -> Verdict:
    """The verdict on one window (`previous`: the last verdict, for the way back to healthy)."""
    counts = current.acceptance
    numbers = {
        "seconds": round(current.seconds, 3),
        "requests": current.requests,
        "generated_tokens": current.generated_tokens,
        "concurrency": current.concurrency,
        "drafts": counts.num_drafts,
        "mean_acceptance_length": counts.mean_acceptance_length,
        "per_position": counts.per_position,
        "dispersion": current.dispersion,
        "itl_p50_ms": current.itl.quantile(0.5) * 1e3,
        "itl_p99_ms": current.itl.quantile(0.99) * 1e3,
    }
    if current.restarted:
        return Verdict(
            "restarted", "a counter went down: the server restarted; counting again from here", numbers
        )
    if current.generated_tokens <= 0:
        return Verdict("idle", "no tokens generated in this window: nothing to judge", numbers)
    if not current.speculating or counts.num_drafts == 0:
        return Verdict(
            "no-speculation",
            f"{current.generated_tokens:.0f} tokens generated and no drafts: the server is not drafting",
            numbers,
        )
    low, high = counts.mean_acceptance_bounds(z, current.dispersion)
    band = expected.band_low(z, current.dispersion)
    break_even = expected.break_even(current.concurrency)
    numbers.update(acceptance_low=low, acceptance_high=high, expected_low=band, break_even=break_even)
    if break_even is not None and high < break_even:
        return Verdict(
            "net-negative",
            f"acceptance {counts.mean_acceptance_length:.3f} (<= {high:.3f}) below break-even {break_even:.3f} "
            f"at concurrency {current.concurrency:.1f}: serving is slower than without the head",
            numbers,
        )
    if high < band or (previous in ("degraded", "net-negative") and low < band):
        return Verdict(
            "degraded",
            f"acceptance {counts.mean_acceptance_length:.3f} ({low:.3f}..{high:.3f}) below what the head was "
            f"measured to do (>= {band:.3f}, {expected.source})",
            numbers,
        )
    p99 = expected.itl_p99_ms(current.concurrency)
    if p99 is not None and current.itl.count > 0:
        threshold = p99 * (1 + latency_margin)
        above = current.itl.count_above(threshold / 1e3)
        numbers.update(itl_threshold_ms=threshold, itl_above=above)
        if wilson_low(above, current.itl.count, z) > 0.01:
            return Verdict(
                "latency",
                f"{above:.0f} of {current.itl.count:.0f} inter-token latencies above {threshold:.1f} ms "
                f"(eval's p99 {p99:.1f} ms + {latency_margin:.0%}): more than 1% with confidence",
                numbers,
            )
    return Verdict(
        "healthy",
        f"acceptance {counts.mean_acceptance_length:.3f} ({low:.3f}..{high:.3f}) within what the head was "
        f"measured to do (>= {band:.3f})",
        numbers,
    )
