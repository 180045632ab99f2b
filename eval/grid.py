"""The sweep eval serves: the baseline, every (head, k) - a trained export or vLLM's ngram drafter - and,
once the fixed-k runs are measured, each head's recommended per-batch-size k schedule. Each entry is one
`vllm serve` configuration (eval/measure.py starts one server per entry); every head is checked against
the target here, before any server starts.
"""

from __future__ import annotations

import logging
from pathlib import Path

from artifacts import atomic
from artifacts.prompts import served_template_kwargs
from export.read_vllm import (
    export_trained_ks,
    export_trained_temperatures,
    export_trained_template_kwargs,
    read_export_config,
    temperature_note,
    thinking_note,
)
from export.record import check_export
from export.to_vllm import check_head_fits_target, speculative_config
from heads.kinds import head_kind

log = logging.getLogger("eval")


def server_configs(cfg, run_dir: Path, target_config) -> list[dict]:
    """The baseline and every (head, k), each head checked against the target before any server starts."""
    configs = (
        [{"config": "baseline", "head": None, "k": 0, "speculative_config": None}]
        if cfg.eval.baseline
        else []
    )
    served_t = [float(t) for t in cfg.eval.temperature]
    served_kwargs = served_template_kwargs(cfg)
    for head in cfg.eval.heads:
        if head.method == "ngram":
            drafting = "ngram"
            lookup = {
                "prompt_lookup_max": head.prompt_lookup_max,
                "prompt_lookup_min": head.prompt_lookup_min,
            }
            note, ks = None, head.num_speculative_tokens
        elif head.method == "export":
            path = Path(head.path or run_dir / "export")
            atomic.recover_dir(path)  # an export killed while publishing left the old one aside
            note = export_note(head.name, path, check_export(path))  # files, checksums, weights readable
            kind, fields = read_export_config(path)
            check_head_fits_target(path, fields, target_config)
            drafting = head_kind(kind).drafting
            ks, dropped = served_ks(head, path, kind, fields)
            other_t = temperature_note(head.name, export_trained_temperatures(path), served_t)
            other_mode = thinking_note(head.name, export_trained_template_kwargs(path), served_kwargs)
            for warning in (other_t, other_mode):
                if warning:
                    log.warning("%s", warning)
            note = "; ".join(n for n in (note, dropped, other_t, other_mode) if n) or None
        else:
            raise ValueError(f"eval.heads[{head.name}].method={head.method!r}: choose export or ngram")
        for k in ks:
            if drafting == "ngram":
                spec = {"method": "ngram", "num_speculative_tokens": int(k), **lookup}
            else:
                spec = speculative_config(kind, str(path), int(k))
                if head.draft_sample_method != "greedy":  # vLLM's default stays unwritten
                    spec["draft_sample_method"] = head.draft_sample_method
            configs.append(
                {
                    "config": f"{head.name} k={k}",
                    "head": head.name,
                    "k": int(k),
                    "drafting": drafting,
                    "speculative_config": spec,
                    "note": note,
                }
            )
    return configs


def export_note(name: str, path: Path, record: dict | None) -> str | None:
    """What eval's log and report say about an export it serves that is not proven (export/record.py)."""
    if record is None:
        note = (
            f"head {name}: {path} has no export record (written elsewhere or by an older export): its files "
            "have no checksums to be checked against"
        )
    elif not record["verified"]:
        note = f"head {name}: {path} was not verified against the reference decoder ({record['note']})"
    else:
        return None
    log.warning("%s", note)
    return note


def served_ks(head, path: Path, kind: str, fields: dict) -> tuple[list[int], str | None]:
    """The k eval serves an export at: eval.heads[].num_speculative_tokens among the k its head was trained
    to draft (its config.json says which), the others dropped with a note; none of them left, the longest it
    drafts. A head trained for fixed blocks is measured at what it serves, whatever the sweep lists. Where
    the export does not say, a bidirectional DFlash head asked for k != block_size - 1 is warned about (every
    slot would see a block of another length than it trained on)."""
    ks, asked = export_trained_ks(path), [int(k) for k in head.num_speculative_tokens]
    if ks is None:
        if kind == "dflash" and not fields["causal"]:
            others = [k for k in asked if k != fields["block_size"] - 1]
            if others:
                log.warning(
                    "%s does not say which k its bidirectional DFlash head was trained for: k=%s serve blocks "
                    "other than its block_size %d, which it was probably not trained on (docs/dflash.md#served-k)",
                    path, others, fields["block_size"],
                )  # fmt: skip
        return asked, None
    served = [k for k in asked if k in ks] or [max(ks)]
    if served == asked:
        return asked, None
    note = (
        f"head {head.name}: k={[k for k in asked if k not in ks]} of eval.heads[].num_speculative_tokens "
        f"not served: {path} was trained to draft k in {ks}; measured at k={served} (docs/dflash.md#served-k)"
    )
    log.warning("%s", note)
    return served, note


def schedule_configs(recommendations: list[dict], first: str, configs: list[dict] = ()) -> list[dict]:
    """One config per head whose recommended k changes with the batch size: its deployable schedule (from
    the recommendation for the workload labelled `first`: eval/measure.py workload_label), served once
    beside the fixed-k runs (`configs`: those runs')."""
    drafting = {c["head"]: c.get("drafting") for c in configs}
    schedules = []
    for rec in recommendations:
        deploy = rec.get("deploy") or {}
        if rec["workload"] == first and "num_speculative_tokens_per_batch_size" in deploy:
            schedules.append(
                {
                    "config": f"{rec['head']} schedule",
                    "head": rec["head"],
                    "k": deploy["num_speculative_tokens"],
                    "drafting": drafting.get(rec["head"]),
                    "schedule": deploy["num_speculative_tokens_per_batch_size"],
                    "speculative_config": deploy,
                }
            )
    return schedules
