"""Read a vLLM server's `/metrics` text (Prometheus exposition format) into acceptance counts.

The spec-decode counters are cumulative since the server started; eval reads them before and after each
measured run, on an otherwise idle server, and takes the difference (`AcceptanceCounts.__sub__`).

    counts = acceptance_counts(requests.get(f"{url}/metrics").text)
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from heads.acceptance import VLLM_PREFIX, AcceptanceCounts


def parse_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample as (name, labels, value), read by prometheus_client's parser of the text format."""
    try:
        return [
            (sample.name, sample.labels, float(sample.value))
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except ValueError as error:
        raise ValueError(f"not a Prometheus sample line ({error}) in {text[:120]!r}") from error


def counter_total(samples, name: str) -> float:
    """A counter summed over its label sets (engines, models); 0 when absent."""
    values = [v for n, _, v in samples if n in (name, f"{name}_total") and not math.isnan(v)]
    return sum(values)


def acceptance_counts(text: str) -> AcceptanceCounts:
    """vLLM's cumulative spec-decode counters from one `/metrics` scrape (zeros without speculation)."""
    samples = parse_samples(text)
    per_position: dict[int, float] = {}
    for name, labels, value in samples:
        if (
            name.removesuffix("_total") == f"{VLLM_PREFIX}num_accepted_tokens_per_pos"
            and "position" in labels
        ):
            position = int(labels["position"])
            per_position[position] = per_position.get(position, 0.0) + value
    width = max(per_position) + 1 if per_position else 0
    return AcceptanceCounts(
        int(counter_total(samples, f"{VLLM_PREFIX}num_drafts")),
        int(counter_total(samples, f"{VLLM_PREFIX}num_draft_tokens")),
        int(counter_total(samples, f"{VLLM_PREFIX}num_accepted_tokens")),
        [int(per_position.get(i, 0)) for i in range(width)],
    )
