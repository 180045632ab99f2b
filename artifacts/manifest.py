"""JSON manifests: what an artifact was made from, checked by the stage that reads it.

A manifest's identity fields say which target, tokenizer, layers and data an artifact belongs to.
Reusing a directory for other ones is refused with the name of the field that differs: a silent mix of
two targets' hidden states would train a head that never drafts well.
"""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.exists():
        raise ValueError(f"{path}: no manifest; is {directory} a directory written by this pipeline?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: corrupt manifest ({error})") from error


def check_identity(found: dict, expected: dict, where: Path, hint: str = "") -> None:
    """Refuse an artifact whose identity fields differ from what this run expects, naming them."""
    differing = [key for key in expected if key in found and found[key] != expected[key]]
    missing = [key for key in expected if key not in found]
    if differing or missing:
        lines = [f"  {key}: found {found[key]!r}, this run has {expected[key]!r}" for key in differing]
        lines += [f"  {key}: missing from the manifest" for key in missing]
        raise ValueError(
            f"{where} was made for something else; these fields differ:\n"
            + "\n".join(lines)
            + (f"\n{hint}" if hint else "")
        )


def answer_temperatures(regeneration: dict | None) -> list[float] | None:
    """The temperatures a cache's answers were generated at, from its `regeneration` identity field: [0.0]
    greedy, [T] sampled, [0.0, T] a greedy and sampled mix (`include_greedy`); None where the answers are
    the dataset's own (not the target's: no temperature of its says what a head trained on them serves)."""
    if not regeneration:
        return None
    temperature = float(regeneration["temperature"])
    return [0.0, temperature] if regeneration.get("include_greedy") else [temperature]


def regen_settings(cfg) -> dict:
    """What decides the regenerated text: recorded in the manifest and part of the cache's identity (and so
    of the head's record: artifacts/manifest.py answer_temperatures reads it)."""
    settings = {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "max_new_tokens": cfg.max_new_tokens,
        "seed": cfg.seed,
    }
    if cfg.temperature > 0:  # sampled: how many answers, and seeds per request (greedy caches keep theirs)
        settings |= {
            "samples_per_prompt": cfg.samples_per_prompt,
            "include_greedy": cfg.include_greedy,
            "seeds": "per_request",
        }
    # How answers are read and whether the target reasons (only where set: older caches keep their identity)
    for key, default in (("reasoning", "keep"), ("tool_parser", None), ("reasoning_parser", None)):
        if getattr(cfg, key, default) != default:
            settings[key] = getattr(cfg, key)
    if getattr(cfg, "tool_parser", None) or getattr(cfg, "reasoning_parser", None):
        settings["decode"] = "as_served"  # special tokens kept where the parsers keep them (they were not)
    return settings
