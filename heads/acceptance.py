"""Speculative-decoding acceptance counts and the metrics derived from them
(docs/design.md#acceptance-metrics-and-economics).

The counts are vLLM's, per verify step: one draft (a chain of k proposed tokens), k draft tokens, `a`
accepted tokens (the target's bonus token excluded) and +1 at every position i < a. The reference decoder
(`heads/reference_decoder.py`) and vLLM's counters (`llm.get_metrics()`, a server's `/metrics`) fill the
same structure, so the two are compared field by field.

Two acceptance numbers describe one phenomenon; their names here are unambiguous:
- mean acceptance length = 1 + accepted / drafts (tokens per verify step, bonus included);
- draft acceptance rate = accepted / draft tokens;
- per-position acceptance p_i = accepted_at[i] / drafts (unconditional); conditional = p_i / p_(i-1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

VLLM_PREFIX = "vllm:spec_decode_"


@dataclass
class AcceptanceCounts:
    num_drafts: int = 0  # verify steps that carried drafts
    num_draft_tokens: int = 0  # proposed tokens
    num_accepted_tokens: int = 0  # accepted proposed tokens (bonus excluded)
    accepted_per_position: list[int] = field(
        default_factory=list
    )  # [i]: drafts whose position i was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step: `num_draft_tokens` proposed, the first `num_accepted` of them accepted."""
        assert 0 <= num_accepted <= num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        width = max(len(self.accepted_per_position), len(other.accepted_per_position))
        mine = self.accepted_per_position + [0] * (width - len(self.accepted_per_position))
        theirs = other.accepted_per_position + [0] * (width - len(other.accepted_per_position))
        return AcceptanceCounts(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            [a + b for a, b in zip(mine, theirs)],
        )

    def __sub__(self, earlier: AcceptanceCounts) -> AcceptanceCounts:
        """The counts between two readings of cumulative counters (`self` read after `earlier`)."""
        negated = AcceptanceCounts(
            -earlier.num_drafts,
            -earlier.num_draft_tokens,
            -earlier.num_accepted_tokens,
            [-c for c in earlier.accepted_per_position],
        )
        return self + negated

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def per_position(self) -> list[float]:
        """Unconditional p_i: the share of drafts whose first i+1 tokens were all accepted."""
        return [c / self.num_drafts if self.num_drafts else float("nan") for c in self.accepted_per_position]

    @property
    def conditional_per_position(self) -> list[float]:
        """p_i / p_(i-1): acceptance at position i given positions < i were accepted."""
        counts = [self.num_drafts, *self.accepted_per_position]
        return [b / a if a else float("nan") for a, b in zip(counts, counts[1:])]

    @property
    def draft_variance(self) -> float:
        """Var(A) of one draft's accepted count A = sum_i X_i, X_i = 1[position i accepted]: vLLM accepts a
        prefix, so X_j = 1 implies X_i = 1 for i < j, E[X_i X_j] = p_j and Var(A) = sum_i p_i (1 - p_i)
        + 2 sum_{i<j} p_j (1 - p_i), from the per-position counts alone (p_i `per_position`)."""
        return prefix_variance(self.per_position)

    def mean_acceptance_bounds(self, z: float, dispersion: float = 1.0) -> tuple[float, float]:
        """(low, high): the mean acceptance length +- z standard errors over these drafts (nan without any),
        the drafts independent (`dispersion` 1) or alike within a request: their variance `dispersion`
        times the independent drafts' (watch/dispersion.py). The variance is never narrower than the drafts'
        number supports: each position's rate taken as (accepted + 1/2) / (drafts + 1), so that drafts all
        accepted (or all rejected), as a small measurement gives, still leave a band."""
        if not self.num_drafts:
            return float("nan"), float("nan")
        n = self.num_drafts
        variance = prefix_variance([(c + 0.5) / (n + 1) for c in self.accepted_per_position])
        half = z * math.sqrt(dispersion * variance / n)
        return self.mean_acceptance_length - half, self.mean_acceptance_length + half

    def summary(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance": self.per_position,
            "conditional_per_position_acceptance": self.conditional_per_position,
        }

    @classmethod
    def from_summary(cls, summary: dict) -> AcceptanceCounts:
        """The counts back from their `summary()` (eval's results.json, export's verification.json)."""
        return cls(
            int(summary["num_drafts"]),
            int(summary["num_draft_tokens"]),
            int(summary["num_accepted_tokens"]),
            [int(c) for c in summary["accepted_per_position"]],
        )

    @classmethod
    def from_request_metrics(cls, metrics: dict) -> AcceptanceCounts:
        """One request's counts from vLLM 0.32's per-request `metrics.speculative_decoding` (a server run
        with --per-request-spec-decode-metrics): its `acceptance_histogram[j]` counts the verify steps that
        accepted exactly j drafts, so position i was accepted in the steps that accepted more than i."""
        histogram = [int(n) for n in metrics["acceptance_histogram"]]
        return cls(
            int(metrics["num_spec_steps"]),
            int(metrics["num_draft_tokens"]),
            int(metrics["num_accepted_draft_tokens"]),
            [sum(histogram[i + 1 :]) for i in range(len(histogram) - 1)],
        )

    @classmethod
    def from_vllm_metrics(cls, metrics) -> AcceptanceCounts:
        """From `vllm.LLM.get_metrics()` (cumulative since the engine started).

        The offline API names the counters without Prometheus' `_total` suffix; a server's `/metrics`
        text adds it (eval parses that text and strips the suffix before calling this).
        """
        by_name = {m.name.removesuffix("_total"): m for m in metrics}
        if f"{VLLM_PREFIX}num_drafts" not in by_name:
            return cls()  # no speculative decoding configured, or no step ran yet
        return cls(
            int(by_name[f"{VLLM_PREFIX}num_drafts"].value),
            int(by_name[f"{VLLM_PREFIX}num_draft_tokens"].value),
            int(by_name[f"{VLLM_PREFIX}num_accepted_tokens"].value),
            [int(v) for v in by_name[f"{VLLM_PREFIX}num_accepted_tokens_per_pos"].values],
        )


def prefix_variance(p: list[float]) -> float:
    """Var(A) of a prefix's length A with position rates p (`AcceptanceCounts.draft_variance`)."""
    variance = sum(pi * (1 - pi) for pi in p)
    variance += 2 * sum(p[j] * (1 - p[i]) for j in range(len(p)) for i in range(j))
    return max(variance, 0.0)


@dataclass(frozen=True)
class RequestSpread:
    """How alike one request's drafts are, from requests' own counts (eval's `per_request`, vLLM 0.32's
    per-request metrics): the intraclass correlation rho of a draft's accepted count A, the share of Var(A)
    that lies between requests. Drafts of requests n_r long then vary in their mean as if there were fewer
    of them: Var(L) = Var(A) / n * phi with phi = 1 + rho (m - 1) and m = sum n_r^2 / sum n_r, the drafts of
    the request a random draft belongs to (`dispersion`). `requests` estimated rho: R - 1 degrees of
    freedom."""

    intraclass: float
    requests: int

    def dispersion(self, drafts_per_request: float) -> float:
        return 1.0 + self.intraclass * max(drafts_per_request - 1.0, 0.0)


def drafts_per_request(requests: list[AcceptanceCounts]) -> float:
    """m = sum n_r^2 / sum n_r: the length-biased drafts per request (nan without drafts)."""
    total = sum(r.num_drafts for r in requests)
    return sum(r.num_drafts**2 for r in requests) / total if total else float("nan")


def request_spread(requests: list[AcceptanceCounts]) -> RequestSpread | None:
    """rho by one-way analysis of variance over requests of unequal lengths (None with fewer than two
    requests with drafts). A draft's A is a prefix length, so its sum of squares follows from the
    per-position counts: A^2 = sum_j (2j - 1) [A >= j]."""
    requests = [r for r in requests if r.num_drafts]
    n, groups = sum(r.num_drafts for r in requests), len(requests)
    if groups < 2 or n <= groups:
        return None
    mean = sum(r.num_accepted_tokens for r in requests) / n
    between = sum(r.num_drafts * (r.num_accepted_tokens / r.num_drafts - mean) ** 2 for r in requests)
    within = sum(
        sum((2 * j + 1) * c for j, c in enumerate(r.accepted_per_position))
        - r.num_accepted_tokens**2 / r.num_drafts
        for r in requests
    )
    ms_between, ms_within = between / (groups - 1), within / (n - groups)
    size = (n - sum(r.num_drafts**2 for r in requests) / n) / (groups - 1)
    tau2 = max(0.0, (ms_between - ms_within) / size)
    return RequestSpread(tau2 / (tau2 + ms_within) if tau2 + ms_within > 0 else 0.0, groups)


# The offline estimate from a head's per-depth accuracies (train's held-out eval): 1 + acc_0 + acc_0*acc_1' + ...
def chain_counts(right_KBT: Tensor, eligible_KBT: Tensor) -> tuple[Tensor, Tensor]:
    """(hits_K, totals_K): at depth j, positions whose depths < j were all right and that are eligible at j
    (totals), and of those, the ones right at j (hits). Counts, so they sum over batches and ranks.

    `right_KBT` bool (right or not: temperature 0), or the probability that the draft there is accepted
    (temperature 1): then both are expectations, and hits / totals is depth j's acceptance given the
    depths before it were accepted."""
    right_KBT = right_KBT.float() * eligible_KBT
    all_before_KBT = torch.cat([torch.ones_like(right_KBT[:1]), right_KBT[:-1].cumprod(0)])
    reached_KBT = all_before_KBT * eligible_KBT
    return (reached_KBT * right_KBT).sum((1, 2)), reached_KBT.sum((1, 2))


def conditional_accuracies(hits_K: Tensor, totals_K: Tensor) -> list[float]:
    """acc_j' = accuracy at depth j given depths < j were right (0 where no chain reached depth j)."""
    return [float(h) / float(n) if n else 0.0 for h, n in zip(hits_K.tolist(), totals_K.tolist())]


def expected_acceptance_length(cond_accs: list[float]) -> float:
    """1 + acc_0 + acc_0*acc_1' + ...: tokens per verify step (bonus token included) for a chain of drafts."""
    return 1.0 + sum(math.prod(cond_accs[: j + 1]) for j in range(len(cond_accs)))
