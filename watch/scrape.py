"""One scrape of a vLLM server's `/metrics`, as the acceptance watch reads it (watch/health.py judges the
windows between scrapes): the spec-decode counters, the histograms of latency and request lengths, and the
server process' identity, by which `restart_reason` tells a restart (or another k) on the first scrape."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eval.prometheus import acceptance_counts, counter_total, parse_samples
from heads.acceptance import VLLM_PREFIX, AcceptanceCounts

ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"  # its sum over a window / the window's length = mean concurrency
PROMPT_TOKENS = "vllm:request_prompt_tokens"  # the finished requests' context lengths: a window's length mix
GENERATED = "vllm:generation_tokens"
ANSWER_TOKENS = "vllm:request_generation_tokens"  # each finished request's: how many drafts a request holds
REQUESTS = "vllm:request_success"


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

    def per_bucket(self) -> tuple[tuple[float, float], ...]:
        """(upper bound, observations in that bucket alone) per bucket, +Inf last."""
        below, rows = 0.0, []
        for le, cumulative in self.buckets:
            rows.append((le, cumulative - below))
            below = cumulative
        return tuple(rows)

    def square_sum(self) -> float:
        """The sum of the observations' squares, estimated: log-uniform within each bucket (+Inf's at its
        lower bound), scaled by (total / estimated sum)^2 so that the exact sum (`total`) places them within
        their buckets. For 20 log-normal requests in vLLM's 1-2-5 buckets: median 1.08x the truth, 90%
        within 0.87-1.37x (tests/test_watch_health.py)."""
        lower, first, second = 0.0, 0.0, 0.0
        for le, count in self.per_bucket():
            log = math.log(le / lower) if lower > 0 and not math.isinf(le) else 0.0
            at = lower if math.isinf(le) else le
            first += count * ((le - lower) / log if log else at)
            second += count * ((le * le - lower * lower) / (2 * log) if log else at * at)
            lower = le
        return second * (self.total / first) ** 2 if first > 0 else 0.0

    def bound_at(self, threshold: float) -> float | None:
        """The smallest bucket bound >= threshold (None: none is)."""
        return next((le for le, _ in self.buckets if le >= threshold), None)

    def count_above(self, threshold: float) -> float:
        """Observations above the smallest bucket bound >= threshold (so never more than lie above it)."""
        le = self.bound_at(threshold)
        return 0.0 if le is None else self.count - dict(self.buckets)[le]

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
    prompt_tokens: Histogram = Histogram()
    model_names: frozenset[str] = frozenset()
    # the server process' identity: process_start_time_seconds and the earliest `_created` of its counters
    # (None where it exposes neither, e.g. prometheus_client's multiprocess mode)
    started: float | None = None
    created: float | None = None
    answer_tokens: Histogram = Histogram()  # the finished requests' generated tokens

    @property
    def k(self) -> int:
        """The server's k: the width of its per-position counter (0 before its first draft)."""
        return len(self.acceptance.accepted_per_position)


def read_snapshot(text: str, time_s: float) -> Snapshot:
    """A Snapshot from one `/metrics` text; ValueError when it is not a vLLM server's."""
    samples = parse_samples(text)
    if not any(name.startswith("vllm:") for name, _, _ in samples):
        raise ValueError(
            "no vllm: metrics in this /metrics text: not a vLLM server, or it runs with --disable-log-stats"
        )
    created = [v for name, _, v in samples if name.startswith("vllm:") and name.endswith("_created")]
    started = [v for name, _, v in samples if name == "process_start_time_seconds"]
    return Snapshot(
        time_s,
        acceptance_counts(text),
        any(name.startswith(VLLM_PREFIX) for name, _, _ in samples),
        counter_total(samples, GENERATED),
        counter_total(samples, REQUESTS),
        histogram(samples, ITL),
        histogram(samples, E2E),
        histogram(samples, PROMPT_TOKENS),
        frozenset(labels["model_name"] for _, labels, _ in samples if "model_name" in labels),
        min(started) if started else None,
        min(created) if created else None,
        histogram(samples, ANSWER_TOKENS),
    )


def restart_reason(earlier: Snapshot, later: Snapshot) -> str | None:
    """Why `later` is not the same server process as `earlier` (a restart: its counters start again), or
    serves another k; None when it is the same. Seen on the first scrape after it, whatever the counters
    reached by then: by the process' start time and its counters' creation times, then by a counter that
    went down."""
    if None not in (earlier.started, later.started) and later.started != earlier.started:
        return (
            f"the server restarted (process_start_time_seconds {earlier.started:.0f} -> {later.started:.0f})"
        )
    if None not in (earlier.created, later.created) and later.created != earlier.created:
        return "the server restarted (its counters were created again)"
    if (
        later.acceptance.num_drafts < earlier.acceptance.num_drafts
        or later.generated_tokens < earlier.generated_tokens
        or later.requests < earlier.requests
    ):
        return "the server restarted (a counter went down)"
    if earlier.k and later.k and later.k != earlier.k:
        return f"the server drafts k={later.k} (it drafted k={earlier.k})"
    return None
