"""What a served head was measured to do, as the acceptance watch judges against it (watch/health.py):
eval's results.json (per k, temperature, workload and concurrency, with speedup and latency) or, without
one, export verification's vLLM acceptance (offline, T=0, one k).

A record measured at a larger k than the server drafts still holds the server's k for a head whose first
drafts do not depend on how many follow (a chain, or P-EAGLE's causal parallel slots): vLLM accepts a
prefix, so the counts of positions 1..k are the counts at k (`AcceptanceCounts` truncated). A bidirectional
DFlash block changes every slot with its length: no such derivation.

Acceptance falls with context length, so a window is judged against the band of its own length mix where
eval recorded each request's context length and counts (results.json `per_request`): eval's requests are
grouped by the bounds of the server's prompt-length histogram (`vllm:request_prompt_tokens`), and each
group weighs in by the window's share of requests in it (`Expected.band_low`, `mix`).
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from heads.acceptance import AcceptanceCounts, RequestSpread, drafts_per_request, request_spread

OWN_SPREAD_REQUESTS = 10  # a length bucket's requests estimate their own spread from this many on


@dataclass(frozen=True)
class Measured:
    """One eval run of the head (or its export verification): where the expectation comes from."""

    workload: str
    concurrency: int
    acceptance: AcceptanceCounts
    speedup: float | None  # against the baseline on the same prompts; None: verification (no server)
    itl_p99_ms: float | None
    # each request's context length (prompt tokens) and own counts, where eval recorded them
    requests: tuple[tuple[int, AcceptanceCounts], ...] = ()

    @functools.cached_property
    def spread(self) -> RequestSpread | None:
        """How alike one request's drafts are in this run (None where requests were not recorded)."""
        return request_spread([counts for _, counts in self.requests])

    def dispersion(self, members: Sequence[AcceptanceCounts], window: float) -> float:
        """phi of `members` (requests of this run) at their own lengths: by their own spread where they are
        OWN_SPREAD_REQUESTS or more (a context-length bucket's requests differ less than the whole run's),
        else by this run's; the window's where nothing was recorded per request."""
        own = request_spread(list(members)) if len(members) >= OWN_SPREAD_REQUESTS else None
        spread = own or self.spread
        return window if spread is None else spread.dispersion(drafts_per_request(list(members)))

    def whole_low(self, q: float, dispersion: float) -> float:
        phi = self.dispersion([counts for _, counts in self.requests], dispersion)
        return self.acceptance.mean_acceptance_bounds(q, phi)[0]

    def mix_low(self, q: float, dispersion: float, mix: Sequence[tuple[float, float]]) -> float | None:
        """The lower bound of L over this run's requests weighed by a window's length mix: `mix` holds
        (upper bound, requests) per prompt-length bucket, +Inf last, as the server's histogram has them.
        Each bucket's requests weigh in by the window's share of requests there times their drafts per
        request; the standard errors combine as independent. None where a bucket the window has requests
        in holds none of this run's (not measured at that length) or nothing was recorded per request."""
        if not self.requests:
            return None
        parts, lower = [], -math.inf
        for upper, share in mix:
            members = [counts for tokens, counts in self.requests if lower < tokens <= upper]
            lower = upper
            if share <= 0:
                continue
            counts = sum(members, AcceptanceCounts())
            if not counts.num_drafts:
                return None
            parts.append((share * counts.num_drafts / len(members), counts, members))
        total = sum(weight for weight, _, _ in parts)
        if not total:
            return None
        mean = sum(weight * counts.mean_acceptance_length for weight, counts, _ in parts) / total
        variance = 0.0
        for weight, counts, members in parts:
            low, high = counts.mean_acceptance_bounds(q, self.dispersion(members, dispersion))
            variance += (weight / total * (high - low) / 2) ** 2
        half = math.sqrt(variance)
        return mean - half


@dataclass(frozen=True)
class Expected:
    """What the head was measured to do at one k and temperature, per workload and concurrency."""

    k: int
    temperature: float
    runs: tuple[Measured, ...]
    source: str  # the file it was read from (and the k it was derived from), said in every report

    def band_low(self, q: float, dispersion: float = 1.0, mix: Sequence[tuple[float, float]] = ()) -> float:
        """The bottom of the expected band: the lowest lower bound of L over the workloads measured (q
        standard errors), its drafts as dispersed as its own requests say where eval recorded them, else
        as the window's (eval's requests are requests like the window's). With a window's length `mix`
        (`Measured.mix_low`), over the runs that measured every length the window holds; where none did,
        over whole runs."""
        mixed = [run.mix_low(q, dispersion, mix) for run in self.runs] if mix else []
        mixed = [low for low in mixed if low is not None]
        if mixed:
            return min(mixed)
        return min(run.whole_low(q, dispersion) for run in self.runs)

    @property
    def spread(self) -> RequestSpread | None:
        """The most dispersed run's request spread (None where no run recorded its requests)."""
        spreads = [run.spread for run in self.runs if run.spread is not None]
        return max(spreads, key=lambda spread: spread.intraclass, default=None)

    def judges_mix(self, mix: Sequence[tuple[float, float]]) -> bool:
        """Whether `band_low` weighs this length mix (some run measured every length it holds)."""
        return any(run.mix_low(1.0, 1.0, mix) is not None for run in self.runs) if mix else False

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


class NotMeasured(ValueError):
    """The record holds no measurement at the server's k (or temperature, workload): nothing to judge by."""


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not readable {what} ({error}); rerun the stage that wrote it") from error


def truncated(counts: AcceptanceCounts, k: int) -> AcceptanceCounts:
    """Counts of drafts of k tokens from drafts of more (vLLM accepts a prefix: positions 1..k alone)."""
    kept = list(counts.accepted_per_position[:k])
    return AcceptanceCounts(counts.num_drafts, counts.num_drafts * k, sum(kept), kept)


def request_counts(row: dict) -> AcceptanceCounts:
    """One request's counts from eval's `per_request` row (eval/client.py `per_request`)."""
    kept = [int(c) for c in row["accepted_per_position"]]
    drafts = int(row["num_drafts"])
    return AcceptanceCounts(drafts, drafts * len(kept), sum(kept), kept)


def expected_from_results(
    results_path: Path,
    head: str,
    k: int,
    temperature: float = 0.0,
    workload: str | None = None,
    prefix_holds: bool = False,
) -> Expected:
    """The head's runs in an eval results.json at k and temperature (one workload, or all); with
    `prefix_holds` and none at k, those at the nearest larger k, truncated to k. NotMeasured naming the
    file and what it has where there is none."""
    results = read_json(results_path, "eval results")

    def runs_at(at: int) -> list[dict]:
        return [
            run
            for run in results.get("runs", [])
            if run.get("head") == head
            and run.get("k") == at
            and run.get("schedule") is None
            and float(run.get("temperature", 0.0)) == float(temperature)
            and run.get("acceptance", {}).get("num_drafts")
            and (workload is None or run.get("workload_name", run.get("workload")) == workload)
        ]

    runs, source = runs_at(k), str(results_path)
    if not runs and prefix_holds:
        larger = sorted(
            {r.get("k") for r in results.get("runs", []) if r.get("head") == head and r.get("k", 0) > k}
        )
        for at in larger:
            if runs := runs_at(at):
                source = f"{results_path} (k={at}, its first {k} positions)"
                break
    if not runs:
        heads = sorted(
            {
                (r.get("head"), r.get("k"), r.get("temperature", 0.0))
                for r in results.get("runs", [])
                if r.get("head")
            }
        )
        raise NotMeasured(
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
                truncated(AcceptanceCounts.from_summary(run["acceptance"]), k),
                run.get("speedup"),
                run.get("itl_ms", {}).get("p99"),
                tuple(
                    (int(row["prompt_tokens"]), truncated(request_counts(row), k))
                    for row in run.get("per_request") or []
                ),
            )
            for run in runs
        ),
        source,
    )


def expected_from_verification(
    verification_path: Path, k: int | None = None, prefix_holds: bool = False
) -> Expected:
    """Export verification's vLLM acceptance (offline, T=0, its k): no break-even, no latency. `k`: the
    server's, which the verification's must equal, or be larger than where `prefix_holds`."""
    record = read_json(verification_path, "export verification")
    measured = int(record["num_speculative_tokens"])
    k = measured if k is None else k
    if k != measured and not (prefix_holds and k < measured):
        raise NotMeasured(
            f"{verification_path}: verified at k={measured}; the server drafts k={k}, which it does not "
            + (
                "measure (a larger k than verified)"
                if k > measured
                else "measure (a DFlash block of another length)"
            )
        )
    source = str(verification_path) + (f" (k={measured}, its first {k} positions)" if k != measured else "")
    counts = truncated(AcceptanceCounts.from_summary(record["vllm"]), k)
    return Expected(k, 0.0, (Measured("verification", 1, counts, None, None),), source)
