"""Prove an export in vLLM: it loads, it generates, and vLLM accepts its drafts at the rate our head does.

1. Load: vLLM (the installed build: CPU here, GPU for users) starts on the target with the exported head
   and decodes greedily; a refusal is raised again with vLLM's message and the export named.
2. Acceptance parity: the reference decoder (`heads/reference_decoder.py`: the HF target and our trained
   head) and vLLM decode the same prompts with the same k at temperature 0. Their acceptance counts must
   agree within `tolerance` (relative, on the mean acceptance length; absolute, on each per-position rate).
   In fp32 on the smoke target they agree exactly; a gap means a flag or convention differs between
   training and serving (layer ids, norm placement, RoPE, vocabulary mapping) - the failure that loads
   without error and silently lowers acceptance (docs/design.md#what-vllm-loads).

3. Export identity: the export read back (config fields and tensors) must equal the trained head rounded to
   the export's dtype. Acceptance alone cannot see a field the head barely depends on: measured on the smoke
   P-EAGLE head, another mask token id or a zeroed mask_hidden moved vLLM's mean acceptance length by less
   than 1%, inside the tolerance.

The reference uses the trained head with its weights rounded to the export's dtype, so a bf16 export is
compared against exactly the values vLLM loads. Use `verify_export(...)`; export/main.py calls it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from artifacts.prompts import held_out_prompts
from heads.acceptance import AcceptanceCounts
from heads.head_file import HeadRecord
from heads.reference_decoder import reference_acceptance

log = logging.getLogger("export")


def cache_dir(record: HeadRecord, run_dir: Path) -> Path:
    """The cache the head was trained on (its held-out split gives the verification prompts)."""
    return Path(record.cache.get("path") or run_dir / "cache").resolve()


def verification_prompts(cfg, tokenizer, record: HeadRecord, run_dir: Path) -> list[list[int]]:
    """The first user turns of the cache's held-out conversations, chat-templated for the target with their
    tools and the template kwargs the head was trained with (its thinking mode)."""
    return held_out_prompts(
        cache_dir(record, run_dir),
        tokenizer,
        cfg.export.verify_num_prompts,
        record.trained_chat_template_kwargs,
    )


class VerificationError(RuntimeError):
    """vLLM refused the export, or its acceptance differs from the reference decoder's (`report`)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


def vllm_acceptance(
    target_dir: Path,
    export_dir: Path,
    kind: str,
    prompts: list[list[int]],
    num_draft_tokens: int,
    max_new_tokens: int,
    stop_ids: list[int],
    dtype: str = "float32",
    vllm_kwargs: dict | None = None,
) -> tuple[list[list[int]], AcceptanceCounts]:
    """Outputs and counters of vLLM's offline engine serving the target with the export."""
    import vllm

    from export.to_vllm import speculative_config as make_speculative_config
    from target.vllm import EngineSettings, running_llm

    speculative_config = make_speculative_config(kind, str(export_dir), num_draft_tokens)
    # log_stats (the default): the acceptance counters, which vLLM's offline engine turns off unless told.
    settings = EngineSettings(
        str(target_dir), speculative_config, dict(vllm_kwargs or {}), "export.vllm_kwargs", dtype=dtype
    )

    def refused(error: Exception) -> VerificationError:
        return VerificationError(
            f"vLLM {vllm.__version__} refused the export {export_dir} (speculative_config="
            f"{speculative_config}): {type(error).__name__}: {error}. vLLM's own log has the cause."
        )

    with running_llm(settings, start_error=refused) as llm:
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, stop_token_ids=stop_ids
        )
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        outputs = [list(r.outputs[0].token_ids) for r in results]
        counts = AcceptanceCounts.from_vllm_metrics(llm.get_metrics())
    return outputs, counts


def export_differences(export_dir: Path, head_dir: Path, export_dtype: str) -> list[str]:
    """Where the export, read as vLLM reads it, differs from the trained head (empty when it does not);
    its draft vocabulary map too, `t2d` included (speculators reads it, vLLM does not)."""
    from export.read_vllm import read_export_config, read_export_weights
    from heads.head_file import read_head
    from target.model import DTYPES

    kind, fields = read_export_config(export_dir)
    record, weights = read_head(head_dir)
    trained = record.config.to_dict()
    # The export raises max_position_embeddings to the target's on purpose.
    differences = [
        f"{k}: export {fields[k]!r}, trained {trained[k]!r}"
        for k in fields
        if k in trained and k != "max_position_embeddings" and fields[k] != trained[k]
    ]
    exported = read_export_weights(export_dir)
    for name, tensor in weights.items():
        if name not in exported:
            differences.append(f"{name}: missing from the export")
        elif not torch.equal(exported[name].float(), tensor.to(DTYPES[export_dtype]).float()):
            differences.append(f"{name}: other values in the export")
    return differences + (vocab_differences(export_dir, head_dir) if kind != "eagle1" else [])


def vocab_differences(export_dir: Path, head_dir: Path) -> list[str]:
    """Where the export's draft vocabulary map differs from the head's vocab.safetensors: `d2t` (only when
    the vocabulary is pruned) and, in the speculators format, `t2d` beside it."""
    import json

    from safetensors.torch import load_file

    from artifacts.vocab import load_vocab_map

    exported = load_file(str(export_dir / "model.safetensors"))
    vocab = load_vocab_map(head_dir / "vocab.safetensors")
    speculators = "speculators_model_type" in json.loads((export_dir / "config.json").read_text())
    wanted = {"d2t": vocab.d2t, "t2d": vocab.t2d if speculators and vocab.d2t is not None else None}
    differences = []
    for name, tensor in wanted.items():
        if tensor is None and name in exported:
            differences.append(f"{name}: in the export, where the head has none")
        elif tensor is not None and name not in exported:
            differences.append(f"{name}: missing from the export")
        elif tensor is not None and not torch.equal(exported[name], tensor.to(exported[name].dtype)):
            differences.append(f"{name}: other values in the export")
    return differences


def compare(reference: AcceptanceCounts, served: AcceptanceCounts, tolerance: float) -> dict:
    """The gaps between the two decoders and whether they are within `tolerance`."""
    length_gap = abs(served.mean_acceptance_length / reference.mean_acceptance_length - 1)
    position_gaps = [abs(a - b) for a, b in zip(reference.per_position, served.per_position)]
    return {
        "mean_acceptance_length_relative_gap": length_gap,
        "per_position_absolute_gaps": position_gaps,
        "tolerance": tolerance,
        "passed": length_gap <= tolerance and all(g <= tolerance for g in position_gaps),
    }


COLLAPSE_SHARE = 0.25  # served gain below this share of train's promised gain: the head does not draft


def train_estimate(head_dir: Path, k: int) -> float | None:
    """Train's held-out expected acceptance length at k drafts (its largest depth if fewer); None when
    the head was trained without a held-out split."""
    from heads.head_file import read_record

    held_out = read_record(head_dir).held_out
    if not held_out:
        return None
    depths = sorted(int(key.rsplit("k", 1)[1]) for key in held_out if key.startswith("eval/accept_len_k"))
    usable = [d for d in depths if d <= k] or depths
    return held_out[f"eval/accept_len_k{usable[-1]}"] if usable else None


def collapsed(served_length: float, estimate: float | None) -> bool:
    """Whether the served head gains less than COLLAPSE_SHARE of what train's estimate promised (checked
    only where train promised at least 0.1 token per round): corrupt weights, a wrong layer, a mask."""
    if estimate is None or estimate - 1 < 0.1:
        return False
    return served_length - 1 < COLLAPSE_SHARE * (estimate - 1)


def format_report(report: dict) -> str:
    ref, served = report["reference"], report["vllm"]

    def rates(values):
        return ", ".join(f"{v:.3f}" for v in values)

    return "\n".join(
        [
            f"acceptance at k={report['num_speculative_tokens']}, temperature 0, {report['num_prompts']} "
            f"held-out prompts ({report['dtype']}):",
            f"  reference decoder: mean acceptance length {ref['mean_acceptance_length']:.4f} "
            f"({ref['num_accepted_tokens']} accepted / {ref['num_drafts']} drafts), per-position acceptance "
            f"[{rates(ref['per_position_acceptance'])}]",
            f"  vLLM {report['vllm_version']}:       mean acceptance length "
            f"{served['mean_acceptance_length']:.4f} ({served['num_accepted_tokens']} accepted / "
            f"{served['num_drafts']} drafts), per-position acceptance "
            f"[{rates(served['per_position_acceptance'])}]",
            f"  gap {report['parity']['mean_acceptance_length_relative_gap']:.2%} (tolerance "
            f"{report['parity']['tolerance']:.0%}); identical outputs for {report['num_identical_outputs']}"
            f"/{report['num_prompts']} prompts",
        ]
    )


def verify_export(
    target_dir: Path,
    head_dir: Path | None,
    export_dir: Path,
    kind: str,
    prompts: list[list[int]],
    stop_ids: list[int],
    num_draft_tokens: int = 3,
    max_new_tokens: int = 64,
    tolerance: float = 0.02,
    dtype: str = "float32",
    export_dtype: str = "bfloat16",
    vllm_kwargs: dict | None = None,
    log_path: Path | None = None,
    estimate: float | None = None,
) -> dict:
    """Run both decoders; returns the report, or raises VerificationError with it in the message.
    `log_path`: vLLM's log (default <export_dir>/../logs/<export name>_verify.log).

    `head_dir=None`: a head trained elsewhere (speculators': bench/peer_heads.py). The reference decoder
    then drafts with the export read back as vLLM reads it (`read_export`), so a gap is a convention our
    reader and vLLM's disagree on; there is no trained head to compare the export with, and `estimate`
    (its held-out estimate at this k) stands in for train's."""
    import vllm

    if not prompts:
        raise ValueError("verification needs at least one prompt")
    from target.vllm import vllm_log_file

    start = time.perf_counter()
    log_path = log_path or export_dir.parent / "logs" / f"{export_dir.name}_verify.log"
    with vllm_log_file(log_path) as log_path:
        served_outputs, served = vllm_acceptance(
            target_dir,
            export_dir,
            kind,
            prompts,
            num_draft_tokens,
            max_new_tokens,
            stop_ids,
            dtype,
            vllm_kwargs,
        )
    log.info("vLLM's log: %s", log_path)
    if served.num_drafts == 0:
        raise VerificationError(f"vLLM loaded {export_dir} but never drafted with it (no spec-decode steps)")
    draft = None
    if head_dir is None:
        from types import SimpleNamespace

        from export.read_vllm import read_export
        from target.model import load_embedding_and_lm_head

        target = SimpleNamespace(path=str(target_dir), dtype="float32", revision=None)
        draft = read_export(export_dir, load_embedding_and_lm_head(target)[0])
    reference_outputs, reference = reference_acceptance(
        target_dir, head_dir, prompts, num_draft_tokens, max_new_tokens, stop_ids, dtype, export_dtype, draft
    )
    report = {
        "export_dir": str(export_dir),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "dtype": dtype,
        "num_speculative_tokens": num_draft_tokens,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "num_identical_outputs": sum(a == b for a, b in zip(served_outputs, reference_outputs)),
        "reference": reference.summary(),
        "vllm": served.summary(),
        "parity": compare(reference, served, tolerance),
        "export_differences": export_differences(export_dir, head_dir, export_dtype) if head_dir else [],
        "train_estimate": train_estimate(head_dir, num_draft_tokens) if head_dir else estimate,
        "seconds": time.perf_counter() - start,
    }
    report["collapsed"] = collapsed(served.mean_acceptance_length, report["train_estimate"])
    log.info("%s", format_report(report))
    problems = []
    if not report["parity"]["passed"]:
        problems.append(
            f"vLLM's acceptance differs from the reference decoder's for {export_dir}: a flag or convention "
            "differs between training and serving (aux layer ids, norm_before_residual, RoPE, d2t; for "
            "P-EAGLE the mask token id and mask_hidden)."
        )
    if report["collapsed"]:
        problems.append(
            f"the head collapsed: vLLM's mean acceptance length {served.mean_acceptance_length:.3f} is far below "
            f"train's held-out estimate {report['train_estimate']:.3f} at k={num_draft_tokens} (parity cannot "
            "see a head that does not draft). Are its weights corrupt, was it trained on another target, or "
            "on answers the target does not give (regenerate them: regen.enabled=true)?"
        )
    if report["export_differences"]:
        problems.append(
            f"{export_dir} is not the trained head {head_dir}: "
            + "; ".join(report["export_differences"])
            + (" (vLLM's acceptance matched regardless)." if report["parity"]["passed"] else ".")
        )
    if problems:
        raise VerificationError("\n".join(problems) + "\n" + format_report(report), report)
    return report
