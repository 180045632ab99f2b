"""Is a served head still doing what it was measured to do? The acceptance watch's judgement (watch/main.py
polls; this module decides), pure functions over scrapes of a vLLM server's `/metrics`.

A `Snapshot` (watch/scrape.py) holds one scrape's cumulative counters and the server process' identity; a
`Window` what one server process did between two; `Expected` what eval measured for the head
(watch/expectation.py); `judge` gives each window a `Verdict`, with statistics rather than fixed thresholds:

- the window's mean acceptance length L has a standard error from its own counts (a draft's accepted
  tokens are a prefix: `AcceptanceCounts.mean_acceptance_bounds`), so does eval's measurement of it; both
  widened by their dispersion (drafts of one request are alike): eval's from its requests' own counts, the
  window's the wider of eval's request spread at the window's request lengths and the window's batch
  means, with the t quantile of its degrees of freedom (watch/dispersion.py);
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
  confidence (a binomial lower bound above 1%: under the measured distribution at most 1% lie above p99),
  the binomial widened by the share's dispersion over the request-long batches (a slow stretch delays every
  token in it) with their t quantile;
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

from heads.acceptance import AcceptanceCounts
from watch.dispersion import (
    MIN_BATCHES,
    REQUESTS_PER_BATCH,
    batches,
    dispersion,
    proportion_dispersion,
    t_quantile,
    widest,
)
from watch.expectation import Expected
from watch.scrape import Histogram, Snapshot, restart_reason

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
    answer_tokens: Histogram = Histogram()  # the finished requests' generated tokens
    itl_batches: tuple[Histogram, ...] = ()  # the inter-token latencies of each request-long batch

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def drafts_per_request(self) -> float:
        """m = sum n_r^2 / sum n_r over the window's drafts: the finished requests' from their generated
        tokens (a request of g tokens holds g / L drafts), and the drafts they do not hold split among the
        requests still in flight (the mean concurrency, at least one: a long request outliving the window
        weighs as it does). nan where the server has no histogram of generated tokens."""
        drafts, length = self.acceptance.num_drafts, self.acceptance.mean_acceptance_length
        if not drafts or not self.answer_tokens.buckets:
            return float("nan")
        finished = self.answer_tokens.total / length
        squares = self.answer_tokens.square_sum() / length**2
        rest = max(0.0, drafts - finished)
        in_flight = max(1.0, self.concurrency) if math.isfinite(self.concurrency) else 1.0
        return (squares + rest * rest / in_flight) / (finished + rest)


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
        later.answer_tokens - earlier.answer_tokens,
        tuple(chain[j].itl - chain[i].itl for i, j in spans),
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
    q, phi, how = widest(z, current, expected.spread)
    numbers.update(dispersion=phi, dispersion_from=how)
    low, high = counts.mean_acceptance_bounds(q, phi)
    mix = current.prompt_tokens.per_bucket() if current.prompt_tokens.count > 0 else ()
    band = expected.band_low(q, phi, mix)
    if expected.judges_mix(mix):
        bounds = [0.0] + [le for le, _ in mix]
        numbers["length_mix"] = {  # requests per prompt-length bucket, as vLLM's histogram cuts them
            (f">{below:g}" if math.isinf(le) else f"<={le:g}"): n for below, (le, n) in zip(bounds, mix) if n
        }
    break_even = expected.break_even(current.concurrency)
    numbers.update(acceptance_low=low, acceptance_high=high, expected_low=band, break_even=break_even, q=q)
    # once net-negative, it stays so until the lower bound is back above break-even (as `degraded` below):
    # a head that does not pay, judged on windows too noisy to show it every time, is not said to pay
    if break_even is not None and (high < break_even or (previous == "net-negative" and low < break_even)):
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
        parts = [(h.count, h.count_above(threshold / 1e3)) for h in current.itl_batches if h.count > 0]
        phi_itl = proportion_dispersion(parts)  # a slow stretch delays every token in it: not independent
        q_itl = t_quantile(z, len(parts) - 1) if len(parts) > 1 else z
        numbers.update(
            itl_threshold_ms=threshold,
            itl_bound_s=current.itl.bound_at(threshold / 1e3),  # the bucket the share is counted above
            itl_above=above,
            itl_dispersion=phi_itl,
            itl_q=q_itl,
        )
        if wilson_low(above / phi_itl, current.itl.count / phi_itl, q_itl) > 0.01:
            return Verdict(
                "latency",
                f"{above:.0f} of {current.itl.count:.0f} inter-token latencies above {threshold:.1f} ms "
                f"(eval's p99 {p99:.1f} ms + {latency_margin:.0%}): more than 1% with confidence "
                f"(dispersion {phi_itl:.1f} over {len(parts)} batches)",
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
