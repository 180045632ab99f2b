"""How much a window's mean acceptance length varies (the acceptance watch, watch/health.py): phi, its
variance over its drafts' binomial variance, and the Student t quantile for the degrees of freedom behind it.

Drafts of one request are alike (they share its prompt and answer; a request of prose accepts less than one
of code): with rho the share of a draft's variance between requests and m the drafts of the request a random
draft belongs to, phi = 1 + rho (m - 1) (`heads.acceptance.RequestSpread`). `widest` takes the wider of:
- eval's request spread (rho from its requests' own counts, R - 1 degrees of freedom) at the window's m
  (`Window.drafts_per_request`);
- batch means: consecutive sub-windows merged into batches each lasting at least REQUESTS_PER_BATCH times
  the window's mean request (`batches`); their means L_j (n_j drafts) spread around the window's L as
  sum_j n_j (L_j - L)^2 / Var(A) ~ phi chi2(J - 1) (`dispersion`, Pearson's estimate of phi), J - 1
  degrees of freedom. Requests straddling batches make it read low (0.45x in tests/test_watch_soak.py's
  traffic, issue 62): it stands alone only where eval recorded no requests, and shorter batches read lower
  still (issue 47: 37% of healthy windows judged not healthy with 800-round requests in 80-round batches).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from heads.acceptance import AcceptanceCounts

MIN_BATCHES = 8  # fewer batches leave too few degrees of freedom to judge: `insufficient`
# a batch lasts at least this many mean requests: a round picked at random belongs to a longer request than
# the mean one (length-biased: e^(sigma^2) = 2.7 times the mean for log-normal lengths of sigma 1). Measured on
# tests/test_watch_soak.py's healthy streams (1,000 windows each, requests of 50/300/800/2,000 rounds):
# 9/2/3/6 windows not healthy at 1 mean request, 6/1/1/2 at 1.5, 0/0/0/1 at 2.
REQUESTS_PER_BATCH = 2.0


def batches(times: Sequence[float], min_seconds: float) -> list[tuple[int, int]]:
    """The scrapes at `times` (a window's, first to last) cut into consecutive batches of at least
    `min_seconds` each, as (first, last) index pairs; a shorter tail joins the last batch. No batch where
    `min_seconds` is not a finite number (no request finished: every request outlived the window so far).
    A batch's counts are its last scrape's less its first's (the counters are cumulative)."""
    if not math.isfinite(min_seconds):
        return []
    spans, first = [], 0
    for last in range(1, len(times)):
        if times[last] - times[first] >= min_seconds:
            spans.append((first, last))
            first = last
    if spans and first < len(times) - 1:
        spans[-1] = (spans[-1][0], len(times) - 1)
    return spans


def dispersion(parts: Sequence[AcceptanceCounts], whole: AcceptanceCounts) -> float:
    """phi: the window's acceptance variance over its independent drafts' (at least 1; 1 with fewer than
    two batches with drafts)."""
    parts = [part for part in parts if part.num_drafts]
    variance = whole.draft_variance
    if len(parts) < 2 or not whole.num_drafts or variance <= 0:
        return 1.0
    length = whole.mean_acceptance_length
    pearson = sum(part.num_drafts * (part.mean_acceptance_length - length) ** 2 for part in parts)
    return max(1.0, pearson / variance / (len(parts) - 1))


def proportion_dispersion(parts: Sequence[tuple[float, float]]) -> float:
    """phi of a share over batches of (trials, successes) - the inter-token latencies above a threshold:
    Pearson's sum_j (s_j - n_j p)^2 / (n_j p (1 - p)) / (J - 1), at least 1 (1 with fewer than two
    batches, or a share of 0 or 1)."""
    trials, successes = sum(n for n, _ in parts), sum(s for _, s in parts)
    if len(parts) < 2 or not 0 < successes < trials:
        return 1.0
    p = successes / trials
    pearson = sum((s - n * p) ** 2 / (n * p * (1 - p)) for n, s in parts)
    return max(1.0, pearson / (len(parts) - 1))


def widest(z: float, window, spread) -> tuple[float, float, str]:
    """(q, phi, how): the window's t quantile and dispersion, the wider of two estimates (q sqrt(phi)):
    - the batch means' (`dispersion`, J - 1 degrees of freedom), low where requests outlive batches;
    - eval's request spread (`RequestSpread`: rho from its requests' own counts, R - 1 degrees of freedom)
      at the window's own drafts per request (`Window.drafts_per_request`, from vLLM's histogram of
      generated tokens per request), where eval recorded its requests and a request finished."""
    options = [(t_quantile(z, window.batches - 1), window.dispersion, f"{window.batches} batches")]
    m = window.drafts_per_request
    if spread is not None and math.isfinite(m):
        options.append(
            (
                t_quantile(z, spread.requests - 1),
                spread.dispersion(m),
                f"eval's spread over {spread.requests} requests at {m:.0f} drafts per request",
            )
        )
    return max(options, key=lambda option: option[0] * math.sqrt(option[1]))


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < 1e-14:
            break
    return result


def incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * beta_fraction(a, b, x) / a
    return 1.0 - front * beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(z: float, df: float) -> float:
    """The t quantile (df degrees of freedom) at the normal's probability of z: the z of the watch's
    settings, widened for a dispersion estimated from df + 1 batches (z itself where df is infinite)."""
    if math.isinf(df):
        return z
    p, low, high = normal_cdf(z), 0.0, max(2.0 * z, 1.0)
    while t_cdf(high, df) < p:
        high *= 2.0
    for _ in range(100):
        middle = (low + high) / 2.0
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2.0
