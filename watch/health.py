"""Is a served head still doing what it was measured to do? The acceptance watch's judgement (watch/main.py
polls; this module decides), pure functions over scrapes of a vLLM server's `/metrics`.

A `Snapshot` holds one scrape's cumulative counters and the server process' identity; a `Window` what one
server process did between two; `Expected` what eval measured for the head (watch/expectation.py); `judge`
gives each window a `Verdict`, with statistics rather than fixed thresholds:

- the window's mean acceptance length L has a standard error from its own counts (a draft's accepted
  tokens are a prefix: `AcceptanceCounts.mean_acceptance_bounds`), so does eval's measurement of it; both
  widened by the window's dispersion (drafts of one request are alike), estimated from request-long
  batches of the window, with the t quantile of their degrees of freedom (watch/dispersion.py);
- `insufficient` while the window holds fewer than MIN_BATCHES request-long batches or MIN_DRAFTS drafts:
  the watch lengthens the window until it does (a window shorter than its requests cannot say how much they
  differ, and judged anyway it raises false alarms);
- `degraded` when the window's upper bound L + q se falls below the expected band (the lowest lower bound
  eval measured on the workloads judged against, at the window's own mix of context lengths where eval
  recorded its requests' lengths: watch/expectation.py); back to `healthy` when its lower bound rises into
  it;
- `net-negative` when the upper bound falls below break-even: the L at which the head's measured round cost
  (at the eval concurrency nearest the window's) makes serving as fast as no speculation, L_be = L_eval /
  speedup_eval (speedup proportional to L at a fixed round cost);
- `latency` when more than 1% of the window's inter-token latencies exceed eval's p99 x (1 + margin) with
  confidence (a binomial lower bound above 1%: under the measured distribution at most 1% lie above p99);
- `no-speculation` (tokens generated, no drafts: the server does not draft), `idle` (no tokens generated).

The watch itself gives `restarted` (another server process, or another k: `restart_reason`, on the first
scrape after it), `down` (no answer) and `unmeasured` (the record has nothing at the server's k).
A change inside a window is caught in that window when it moves the whole window past the bounds, else in
the next one at the latest: inside a window it also inflates the dispersion, which widens the bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from eval.prometheus import acceptance_counts, counter_total, parse_samples
from heads.acceptance import VLLM_PREFIX, AcceptanceCounts
from watch.dispersion import MIN_BATCHES, REQUESTS_PER_BATCH, batches, dispersion, t_quantile
from watch.expectation import Expected

ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"  # its sum over a window / the window's length = mean concurrency
PROMPT_TOKENS = "vllm:request_prompt_tokens"  # the finished requests' context lengths: a window's length mix
GENERATED = "vllm:generation_tokens"
REQUESTS = "vllm:request_success"

MIN_DRAFTS = 50  # fewer drafts in a window: `insufficient`
MAX_GROWTH = 100  # a window `insufficient` after this many intervals is dropped, and the next one begins

# One-shot exit status (cron, CI canaries, Kubernetes probes): 0 healthy, 1 retrain (degraded, latency),
# 2 turn it off (net-negative, no-speculation), 3 could not judge (idle, insufficient, restarted, down,
# unmeasured). Never a verdict's code: 64 bad input (a setting, file or server the watch cannot use),
# 70 the watch's own failure (a bug: its traceback), 130 interrupted.
EXIT_CODES = {
    "healthy": 0,
    "degraded": 1,
    "latency": 1,
    "net-negative": 2,
    "no-speculation": 2,
    "idle": 3,
    "insufficient": 3,
    "restarted": 3,
    "down": 3,
    "unmeasured": 3,
}
BAD_INPUT, CRASHED, INTERRUPTED = 64, 70, 130


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
    prompt_tokens: Histogram = Histogram()
    model_names: frozenset[str] = frozenset()
    # the server process' identity: process_start_time_seconds and the earliest `_created` of its counters
    # (None where it exposes neither, e.g. prometheus_client's multiprocess mode)
    started: float | None = None
    created: float | None = None

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


@dataclass(frozen=True)
class Window:
    """What a server did between two snapshots of one server process."""

    start_s: float
    end_s: float
    acceptance: AcceptanceCounts
    speculating: bool
    generated_tokens: float
    requests: float
    itl: Histogram
    concurrency: float  # requests in flight on average (Little's law over the finished requests' latency)
    request_s: float = float("nan")  # the finished requests' mean latency (nan: none finished)
    batches: int = 0  # request-long batches with drafts (watch/dispersion.py)
    dispersion: float = 1.0  # the acceptance's variance over the independent drafts'
    prompt_tokens: Histogram = Histogram()  # the finished requests' context lengths

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


def window(earlier: Snapshot, later: Snapshot, between: Sequence[Snapshot] = ()) -> Window:
    """The difference of two snapshots of one server process (`restart_reason` None between each), with
    the scrapes `between` them merged into request-long batches for the acceptance's dispersion."""
    chain = [earlier, *between, later]
    seconds = later.time_s - earlier.time_s
    e2e = later.e2e - earlier.e2e
    acceptance = later.acceptance - earlier.acceptance
    request_s = e2e.total / e2e.count if e2e.count > 0 else float("nan")
    spans = batches([snapshot.time_s for snapshot in chain], REQUESTS_PER_BATCH * request_s)
    merged = [chain[j].acceptance - chain[i].acceptance for i, j in spans]
    merged = [part for part in merged if part.num_drafts]
    return Window(
        earlier.time_s,
        later.time_s,
        acceptance,
        later.speculating,
        later.generated_tokens - earlier.generated_tokens,
        later.requests - earlier.requests,
        later.itl - earlier.itl,
        e2e.total / seconds if seconds > 0 else float("nan"),
        request_s,
        len(merged),
        dispersion(merged, acceptance),
        later.prompt_tokens - earlier.prompt_tokens,
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


def insufficient_reason(current: Window) -> str:
    """Why a window cannot be judged yet, and how long it must grow."""
    if current.acceptance.num_drafts < MIN_DRAFTS:
        return f"{current.acceptance.num_drafts} drafts in {current.seconds:.0f} s, fewer than {MIN_DRAFTS}: too little to judge"
    if math.isnan(current.request_s):
        return (
            f"no request finished in {current.seconds:.0f} s: requests outlive the window, too few to judge"
        )
    batch_s = REQUESTS_PER_BATCH * current.request_s
    return (
        f"requests last {current.request_s:.1f} s on average: {current.seconds:.0f} s hold {current.batches} "
        f"batches of {batch_s:.0f} s, fewer than {MIN_BATCHES} (about {MIN_BATCHES * batch_s:.0f} s needed)"
    )


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
    if current.generated_tokens <= 0:
        return Verdict("idle", "no tokens generated in this window: nothing to judge", numbers)
    if not current.speculating or counts.num_drafts == 0:
        return Verdict(
            "no-speculation",
            f"{current.generated_tokens:.0f} tokens generated and no drafts: the server is not drafting",
            numbers,
        )
    numbers.update(request_s=current.request_s, batches=current.batches)
    if current.batches < MIN_BATCHES or counts.num_drafts < MIN_DRAFTS:
        return Verdict("insufficient", insufficient_reason(current), numbers)
    q = t_quantile(z, current.batches - 1)  # the dispersion is estimated from `batches` numbers
    low, high = counts.mean_acceptance_bounds(q, current.dispersion)
    mix = current.prompt_tokens.per_bucket() if current.prompt_tokens.count > 0 else ()
    band = expected.band_low(q, current.dispersion, mix)
    if expected.judges_mix(mix):
        bounds = [0.0] + [le for le, _ in mix]
        numbers["length_mix"] = {  # requests per prompt-length bucket, as vLLM's histogram cuts them
            (f">{below:g}" if math.isinf(le) else f"<={le:g}"): n for below, (le, n) in zip(bounds, mix) if n
        }
    break_even = expected.break_even(current.concurrency)
    numbers.update(acceptance_low=low, acceptance_high=high, expected_low=band, break_even=break_even, q=q)
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


class Watcher:
    """The watch's judgement over a stream of scrapes (watch/main.py feeds it; tests feed it synthetic
    ones): a window every `subwindows` scrapes, lengthened while it is `insufficient` (its verdict then
    says `window_open`; after MAX_GROWTH intervals it is dropped), and a new baseline on the first scrape of
    another server process or k, whose expectation `expect(k)` gives (NotMeasured: `unmeasured`)."""

    def __init__(self, expect, z: float = 3.0, latency_margin: float = 0.5, subwindows: int = 20):
        self.expect, self.z, self.latency_margin = expect, z, latency_margin
        self.subwindows, self.max_subwindows = subwindows, MAX_GROWTH * subwindows
        self.previous, self.before, self.scrapes = "healthy", None, []
        self.expected: Expected | None = None
        self.unmeasured = ""

    def baseline(self, snapshot: Snapshot) -> None:
        from watch.expectation import NotMeasured

        self.before, self.scrapes = snapshot, []
        try:
            self.expected, self.unmeasured = self.expect(snapshot.k), ""
        except NotMeasured as error:
            self.expected, self.unmeasured = None, str(error)

    def feed(self, snapshot: Snapshot) -> Verdict | None:
        """The verdict this scrape completes (None: inside a window)."""
        if self.before is None:
            self.baseline(snapshot)
            return None
        last = self.scrapes[-1] if self.scrapes else self.before
        reason = restart_reason(last, snapshot)
        if reason is not None:
            self.baseline(snapshot)
            return Verdict("restarted", f"{reason}: a new baseline from this scrape", {"k": snapshot.k})
        self.scrapes.append(snapshot)
        if len(self.scrapes) % self.subwindows:
            return None
        current = window(self.before, self.scrapes[-1], self.scrapes[:-1])
        if self.expected is None:
            verdict = Verdict("unmeasured", self.unmeasured, {"k": snapshot.k, "seconds": current.seconds})
        else:
            verdict = judge(current, self.expected, self.previous, self.z, self.latency_margin)
        if verdict.name == "insufficient" and len(self.scrapes) < self.max_subwindows:
            return Verdict(verdict.name, verdict.reason, {**verdict.numbers, "window_open": True})  # it grows
        self.before, self.scrapes = self.scrapes[-1], []
        if verdict.name not in ("idle", "insufficient", "unmeasured"):  # nothing judged: the state stays
            self.previous = verdict.name
        return verdict
