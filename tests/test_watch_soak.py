"""The acceptance watch over long synthetic runs (watch/health.py `Watcher`, fed scrapes as the watch takes
them): a head serving exactly as measured, requests of 50 to 2,000 verify rounds with log-normal lengths and
a per-request acceptance as unlike as the real trial's, 1,000 judged windows per length - false alarms at
most 1%; collapses at random times inside windows caught within 2 windows; a restart and a k change seen on
the next scrape. Pure functions over synthetic scrapes: seconds, no server."""

import math

import numpy as np
import pytest

from heads.acceptance import AcceptanceCounts
from watch.dispersion import MIN_BATCHES
from watch.expectation import Expected, Measured, NotMeasured
from watch.health import Histogram, Snapshot, Watcher

RATES = (0.36, 0.10)  # the head's conditional acceptance at positions 0 and 1 (k=2), as measured
SPREAD = 0.32  # each request's first-position rate uniform within +-SPREAD (dispersion ~5-30 per window)
ROUND_S = 0.075  # 800 verify rounds a minute at concurrency 1
SCRAPE_ROUNDS = 40  # a scrape every 3 s: watch.interval_s=60, watch.subwindows=20 (the defaults)
# mean request lengths in verify rounds; 2,000 (windows of ~20 min here, ~10 s of simulation each) is slow
LENGTHS = [50, 300, 800, pytest.param(2000, marks=pytest.mark.slow)]


def measured(seed: int = 1, drafts: int = 900) -> AcceptanceCounts:
    rng = np.random.default_rng(seed)
    first = rng.random(drafts) < RATES[0]
    second = first & (rng.random(drafts) < RATES[1])
    return AcceptanceCounts(
        drafts, 2 * drafts, int(first.sum() + second.sum()), [int(first.sum()), int(second.sum())]
    )


def expected(k: int = 2) -> Expected:
    if k != 2:
        raise NotMeasured(f"no run at k={k}")
    runs = tuple(
        Measured(workload, c, measured(seed), speedup, None)
        for workload, seed in (("chat", 1), ("code", 2))
        for c, speedup in ((1, 1.20), (4, 0.85))
    )
    return Expected(2, 0.0, runs, "results.json")


def scrapes(rng, num_rounds, mean_rounds, collapse_at=None, k=2, started=1.0):
    """Snapshots every SCRAPE_ROUNDS rounds of one stream of requests at concurrency 1: request lengths
    log-normal (sigma 1) with mean `mean_rounds`, each request's first-position rate drawn anew. From round
    `collapse_at` on, the head accepts (0.05, 0.05), alike on every request (+-0.04)."""
    lengths = np.maximum(
        1, rng.lognormal(math.log(mean_rounds) - 0.5, 1.0, num_rounds // mean_rounds * 3 + 10)
    )
    lengths = lengths.astype(int)[: int(np.searchsorted(np.cumsum(lengths.astype(int)), num_rounds)) + 1]
    request = np.repeat(np.arange(len(lengths)), lengths)[:num_rounds]
    assert len(request) == num_rounds
    collapsed = np.arange(num_rounds) >= (num_rounds if collapse_at is None else collapse_at)
    spread = np.where(collapsed, 0.04, SPREAD)
    first = np.where(collapsed, 0.05, RATES[0]) + rng.uniform(-1, 1, len(lengths))[request] * spread
    first, second = np.clip(first, 0, 1), np.where(collapsed, 0.05, RATES[1])
    accept_1 = rng.random(num_rounds) < first
    accept_2 = accept_1 & (rng.random(num_rounds) < second)
    ends = np.cumsum(lengths)  # a request finishes at its last round
    at = np.arange(SCRAPE_ROUNDS, num_rounds + 1, SCRAPE_ROUNDS)
    c1, c2 = np.cumsum(accept_1)[at - 1].tolist(), np.cumsum(accept_2)[at - 1].tolist()
    finished = np.searchsorted(ends, at, side="right")
    latency = (np.concatenate([[0], ends])[finished] * ROUND_S).tolist()  # one request at a time
    out = []
    for n, a1, a2, done, seconds in zip(at.tolist(), c1, c2, finished.tolist(), latency):
        counts = AcceptanceCounts(n, k * n, a1 + a2, [a1, a2])
        e2e = Histogram(((math.inf, float(done)),), seconds)
        out.append(Snapshot(n * ROUND_S, counts, True, float(n + a1 + a2), float(done), Histogram(), e2e,
                            started=started, created=started))  # fmt: skip
    return out


def verdicts(stream):
    watcher = Watcher(expected)
    return [v for v in map(watcher.feed, stream) if v is not None and v.name != "insufficient"]


def false_alarms(mean_rounds: int, windows: int = 1000) -> tuple[int, float]:
    """(windows not healthy among `windows` judged of a head serving as measured, their median seconds)."""
    rng, judged = np.random.default_rng(mean_rounds), []
    while len(judged) < windows:
        judged += verdicts(scrapes(rng, 200_000, mean_rounds))
    judged = judged[:windows]
    return sum(v.name != "healthy" for v in judged), float(np.median([v.numbers["seconds"] for v in judged]))


def collapses_caught(mean_rounds: int, trials: int = 100) -> int:
    """Trials in which a collapse at a random round, after 3 judged windows' worth of traffic, is caught by
    the window holding it or the next one."""
    rng, caught = np.random.default_rng(7 + mean_rounds), 0
    window_rounds = max(800, 2 * MIN_BATCHES * mean_rounds)  # at least a judged window's length
    for _ in range(trials):
        collapse_at = int(rng.integers(3 * window_rounds, 4 * window_rounds))
        watcher, judged = Watcher(expected), []
        for snapshot in scrapes(rng, collapse_at + 4 * window_rounds, mean_rounds, collapse_at):
            verdict = watcher.feed(snapshot)
            if verdict is not None and verdict.name != "insufficient":
                judged.append((snapshot.time_s, verdict.name))
        after = [name for time_s, name in judged if time_s >= collapse_at * ROUND_S]
        caught += any(name != "healthy" for name in after[:2])
    return caught


@pytest.mark.parametrize("mean_rounds", LENGTHS)
def test_a_head_serving_as_measured_is_healthy_on_99_percent_of_windows(mean_rounds):
    assert false_alarms(mean_rounds)[0] <= 10


@pytest.mark.parametrize("mean_rounds", LENGTHS)
def test_a_collapse_inside_a_window_is_caught_within_two_windows(mean_rounds):
    assert collapses_caught(mean_rounds) >= 99


def test_a_restart_with_higher_counters_and_a_k_change_are_seen_on_the_next_scrape():
    rng = np.random.default_rng(3)
    watcher = Watcher(expected)
    first = scrapes(rng, 8000, 100)
    names = [v.name for v in map(watcher.feed, first) if v is not None]
    assert names and set(names) <= {"healthy", "insufficient"}
    # Restarted and already past the old counters by its first scrape: the process' start time says so.
    again = scrapes(rng, 16000, 100, started=2.0)
    verdict = watcher.feed(again[-1])
    assert verdict.name == "restarted" and "process_start_time_seconds" in verdict.reason
    assert watcher.before is again[-1]
    # Back with k=3, which the record does not measure: restarted, then every window unmeasured.
    wider = [
        Snapshot(s.time_s + 2000, AcceptanceCounts(s.acceptance.num_drafts, 3 * s.acceptance.num_drafts,
                 s.acceptance.num_accepted_tokens, [*s.acceptance.accepted_per_position, 0]),
                 True, s.generated_tokens, s.requests, Histogram(), s.e2e, started=3.0, created=3.0)
        for s in scrapes(rng, 8000, 100)
    ]  # fmt: skip
    verdicts = [v for v in map(watcher.feed, wider) if v is not None]
    assert verdicts[0].name == "restarted" and verdicts[0].numbers["k"] == 3
    assert {v.name for v in verdicts[1:]} == {"unmeasured"} and "k=3" in verdicts[1].reason


if __name__ == "__main__":  # the numbers docs/watch.md gives: python -m tests.test_watch_soak
    for length in (50, 300, 800, 2000):
        alarms, seconds = false_alarms(length)
        print(f"requests of {length} rounds: {alarms} of 1000 windows not healthy (median window {seconds:.0f} s), "
              f"collapses caught within two windows in {collapses_caught(length)} of 100")  # fmt: skip
