"""The check machinery of the config schema: what a setting's value must satisfy, and how a bad value is
reported.

A schema field declared with `checked(default, CHECK)` carries its check beside it; the validators
(`POSITIVE`, `one_of(...)`, `within(...)`, ...) and train.loss's grammar (`loss_terms`) are here, with
`refuse`, the one error style for a setting, and the walkers a composed config goes through:
`field_errors` (every field's check) and `unknown_keys` (keys no schema declares). Both are applied by
`check_config` (artifacts/config/pipeline.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class Check:
    """What a setting's value must satisfy, and how to say so: `{key}={value}: must be {wanted}`."""

    test: Callable[[Any], bool]
    wanted: str


def checked(
    default: Any = dataclasses.MISSING, check: Check | None = None, factory: Any = dataclasses.MISSING
):
    """A schema field with its check beside it; `check_config` applies every one when a config is composed."""
    return field(default=default, default_factory=factory, metadata={"check": check})


def one_of(*choices) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))


def optional(check: Check) -> Check:
    return Check(lambda v: v is None or check.test(v), f"{check.wanted} or null")


def within(low: float, high: float, high_closed: bool = True, low_closed: bool = True) -> Check:
    def test(v):
        return (low <= v if low_closed else low < v) and (v <= high if high_closed else v < high)

    return Check(test, f"in {'[' if low_closed else '('}{low}, {high}{']' if high_closed else ')'}")


POSITIVE = Check(lambda v: v is not None and v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v is not None and v >= 0, ">= 0")
NON_EMPTY = Check(lambda v: bool(v), "non-empty")
DTYPE = one_of("bfloat16", "float16", "float32")
REPORT_TO = one_of("none", "wandb")
WANDB_MODE = one_of("offline", "online")
RECORD_FORMATS = ("auto", "sharegpt", "openai", "fields")
RECORD_FORMAT = one_of(*RECORD_FORMATS)
HEAD_KINDS = ("eagle3", "peagle", "dflash", "eagle1")  # heads/kinds.py's KINDS (tests hold them equal)
RESUME = Check(
    lambda v: str(v).lower() in ("never", "always", "auto", "true", "false"), "never, always (true) or auto"
)
POSITIVE_LIST = Check(
    lambda v: bool(v) and all(x > 0 for x in v) and len(set(v)) == len(v),
    "a non-empty list of distinct values > 0",
)
# vLLM's sampling accepts temperatures in [0, 2]; each swept value is measured (and resumed) once.
TEMPERATURES = Check(
    lambda v: bool(v) and all(0 <= t <= 2 for t in v) and len(set(v)) == len(v),
    "a non-empty list of distinct values in [0, 2] (vLLM serves temperatures up to 2)",
)


# train.loss's divergences (train/objectives.py computes them) and its grammar: one name, or a weighted sum.
DIVERGENCES = ("kl", "rkl", "tv", "nla", "lk")
_LOSS_TERM = re.compile(r"^\s*(?:((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?([a-z]+)\s*$")


def loss_terms(spec: str) -> tuple[tuple[str, float], ...]:
    """train.loss as ((divergence, weight), ...): "kl" -> (("kl", 1.0),), "0.1*kl+0.9*tv" -> two terms;
    ValueError naming the term at fault."""
    terms = []
    for part in str(spec).split("+"):
        match = _LOSS_TERM.match(part)
        if match is None or match.group(2) not in DIVERGENCES:
            raise ValueError(
                f"train.loss={spec!r}: {part.strip()!r} is not a term; want one of {', '.join(DIVERGENCES)} "
                "or a weighted sum such as 0.1*kl+0.9*tv"
            )
        terms.append((match.group(2), float(match.group(1)) if match.group(1) else 1.0))
    names = [name for name, _ in terms]
    if len(set(names)) < len(names) or not any(weight > 0 for _, weight in terms):
        raise ValueError(f"train.loss={spec!r}: each divergence at most once, and some weight > 0")
    return tuple(terms)


def _is_loss(spec) -> bool:
    """train.loss's check: loss_terms' own error, which names the term at fault, not a generic one."""
    return bool(loss_terms(spec))


def unknown_keys(node, prefix: str = "") -> list[str]:
    """Keys of `node` (recursively) that its schema dataclass does not declare; free-form dicts (vLLM
    arguments, role maps) hold any keys."""
    from omegaconf import ListConfig

    found = []
    if isinstance(node, ListConfig) and not node._is_none():
        for index, item in enumerate(node):
            found += unknown_keys(item, f"{prefix}[{index}]")
    elif (
        isinstance(node, DictConfig)
        and not node._is_none()
        and dataclasses.is_dataclass(OmegaConf.get_type(node))
    ):
        known = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
        for key in node:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in known and not (not prefix and key == "hydra"):
                found.append(path)
            elif key in known:
                found += unknown_keys(node._get_node(key), path)
    return found


def refuse(key: str, value, wanted: str) -> None:
    """The one error style for a setting: what is wrong, the value, and the setting to change."""
    raise ValueError(f"{key}={value}: must be {wanted}; change {key}")


def field_errors(node, prefix: str = "") -> None:
    """Apply every `checked` field's check under `node` (a composed config or a schema dataclass instance),
    naming the first value that fails by its key."""
    from omegaconf import ListConfig

    if isinstance(node, (ListConfig, list)) and not (isinstance(node, ListConfig) and node._is_none()):
        for index, item in enumerate(node):
            field_errors(item, f"{prefix}[{index}]")
        return
    if isinstance(node, DictConfig):
        if node._is_none():
            return
        schema = OmegaConf.get_type(node)
    elif dataclasses.is_dataclass(node):
        schema = type(node)
    else:
        return
    if not dataclasses.is_dataclass(schema):
        return
    for declared in dataclasses.fields(schema):
        key = f"{prefix}.{declared.name}" if prefix else declared.name
        value = getattr(node, declared.name)
        check = declared.metadata.get("check")
        plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        if check is not None and not check.test(plain):
            refuse(key, plain, check.wanted)
        field_errors(value, key)
