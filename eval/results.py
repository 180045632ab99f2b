"""The run records of eval's results dict (eval/main.py), read the same way by the report (eval/report.py)
and its figures (eval/plots.py): which runs to show, which numbers are real, and results.json written as
valid JSON (NaN and infinities as null).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def clean(value):
    """`value` with every NaN or infinite float replaced by None, so that it is valid JSON."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data: dict) -> None:
    # Written whole then renamed: a reader (or a crash) never sees half a results.json.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(clean(data), indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)


def is_number(value) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def ordered(items) -> list:
    """Distinct items in order of first appearance (eval measures the baseline first, then k ascending)."""
    return list(dict.fromkeys(items))


def acceptance(run: dict) -> dict:
    return run.get("acceptance") or {}


def lowest_concurrency_runs(runs: list[dict]) -> list[dict]:
    """Per (head config, workload): the run with acceptance counts at the lowest concurrency (1 when
    measured), where the head's acceptance is least mixed with batching effects."""
    best: dict[tuple, dict] = {}
    with_heads = [r for r in runs if r["head"] is not None and acceptance(r)]
    for r in sorted(with_heads, key=lambda r: r["concurrency"]):
        best.setdefault((r["config"], r["workload"]), r)
    return list(best.values())


def best_at_lowest_concurrency(runs: list[dict], head: str, workload: str) -> dict | None:
    """The head's fastest k at the lowest concurrency that has a speedup (eval/economics.recommend's pick)."""
    mine = [
        r for r in runs if r["head"] == head and r["workload"] == workload and is_number(r.get("speedup"))
    ]
    if not mine:
        return None
    lowest = min(r["concurrency"] for r in mine)
    return max((r for r in mine if r["concurrency"] == lowest), key=lambda r: r["speedup"])
