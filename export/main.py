"""export: write the trained head in a format vLLM loads as it is, and with verify=true prove it in vLLM.

    python export/main.py run_dir=runs/default                                   # speculators, bf16
    python export/main.py run_dir=runs/default export.format=plain export.verify=true
    python export/main.py experiment=smoke run_dir=/tmp/smoke export.verify=true

Reads <run_dir>/draft_head (train) and the target; writes <run_dir>/export/ with config.json and
model.safetensors (what vLLM reads), README.md (the model card), export_record.json (checksums, verified or
not: export/record.py) and, when verified, verification.json - built and verified in
<run_dir>/export.unverified/ and swapped in together only when verification passed (or was not asked for).
The format is decided in export/to_vllm.py, the proof in export/verify.py (reference decoder:
heads/reference_decoder.py). Serve the result with
    vllm serve TARGET --speculative-config '{"method": "eagle3", "model": "<run_dir>/export", ...}'
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from artifacts import atomic
from artifacts.config import check_config, export_format_setting, refuse, register_configs
from artifacts.errors import stage_errors
from artifacts.prompts import stop_token_ids
from artifacts.run_lock import holds_run_dir
from export.card import write_model_card
from export.record import RECORD, read_record, record_export, unproven_dir
from export.sglang_trees import run_trees
from export.to_sglang import for_sglang
from export.to_vllm import export_format, export_head
from export.verify import VerificationError, cache_dir, verification_prompts, verify_export
from heads.head_file import read_head
from target.model import load_config, load_tokenizer, target_dir, weights_hash
from target.reaper import leash

log = logging.getLogger("export")


def check_destination(cfg, out_dir: Path, protected: dict[str, Path]) -> dict | None:
    """Refuse, before anything is built, an export.out_dir whose publication would remove what export did
    not write: the run directory or a directory above it, the head, the cache or the target, or anything
    inside those three, and an existing directory that is not an export of this pipeline
    (atomic.check_replaceable); a verified export is replaced by an unverified one only with
    export.replace_verified=true. `protected`: {what: directory}, the run directory first (an export inside
    it is the default). The export there now (its record), or None."""
    for what, path in protected.items():
        path = Path(path).resolve()
        if out_dir == path:
            where = "at"
        elif path.is_relative_to(out_dir):
            where = "above"
        elif out_dir.is_relative_to(path) and what != "the run directory":
            where = "inside"
        else:
            continue
        raise atomic.NotOurs(
            f"export.out_dir={out_dir} is {where} {what} ({path}): publishing there would replace what "
            "export did not write; refused, nothing was moved or removed. Name a new directory"
        )
    for directory in (out_dir, unproven_dir(out_dir)):
        atomic.check_replaceable(directory, "export", (RECORD,))
    previous = read_record(out_dir)
    if previous and previous.get("verified") and not cfg.export.verify and not cfg.export.replace_verified:
        refuse(
            "export.verify",
            False,
            f"true: {out_dir} holds a verified export, which an unverified one would replace (or set "
            "export.replace_verified=true to replace it anyway)",
        )
    return previous


@holds_run_dir("export")
def run(cfg: DictConfig) -> dict:
    """Export (and verify) the head; returns {"export_dir", "verification"}."""
    check_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    run_dir = Path(cfg.run_dir).resolve()
    head_dir = Path(cfg.export.head_dir or run_dir / "draft_head").resolve()
    out_dir = Path(cfg.export.out_dir or run_dir / "export").resolve()
    # Checksums, finite and sane weights: a corrupt head is not exported (export_head reuses what is read);
    # a head without checksums only with export.allow_unverified_head.
    atomic.recover_dir(head_dir)  # a train killed while publishing the head left the old one aside
    head = record, _ = read_head(head_dir, allow_unverified=cfg.export.allow_unverified_head)
    if record.trained_ks is not None and cfg.export.num_speculative_tokens not in record.trained_ks:
        refuse(
            "export.num_speculative_tokens",
            cfg.export.num_speculative_tokens,
            f"one of {record.trained_ks}, the k {head_dir} was trained to draft (docs/dflash.md#served-k)",
        )
    target_path = target_dir(cfg.target)
    protected = {"the run directory": run_dir, "the head": head_dir, "the cache": run_dir / "cache",
                 "the head's cache": cache_dir(record, run_dir), "the target": Path(target_path)}  # fmt: skip
    previous = check_destination(cfg, out_dir, protected)
    recorded = record.target.get("hash")
    if recorded and recorded != weights_hash(target_path):
        log.warning(
            "%s was trained on other target weights (sha256 %s...) than %s: exporting anyway (same shapes)",
            head_dir,
            recorded[:12],
            target_path,
        )
    # Built and verified beside the export, swapped in whole only when proven (export/record.py): a failed
    # or killed verification leaves the previous export, card and proof as they were.
    atomic.recover_dir(out_dir)
    staging = unproven_dir(out_dir)
    with freed_on_full_disk(staging):
        verification = build_and_prove(cfg, head_dir, head, record, staging, out_dir, run_dir, target_path)
    atomic.finish_publish(staging, out_dir, kind="export", legacy=(RECORD,))
    state = "verified" if cfg.export.verify else "not verified"
    if previous is not None:
        was = "verified" if previous.get("verified") else "not verified"
        log.info("published %s (%s), replacing the export that was there (%s)", out_dir, state, was)
    else:
        log.info("published %s (%s)", out_dir, state)
    return {"export_dir": str(out_dir), "verification": verification}


@contextmanager
def freed_on_full_disk(staging: Path):
    """A full disk while the unproven export is built: it is this run's partial work (a rerun builds it
    again), so it is removed to give its space back, and the stage's one line says so."""
    try:
        yield
    except OSError as error:
        if error.errno == errno.ENOSPC and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
            error.add_note(f"export removed its unfinished {staging}")
        raise


def build_and_prove(cfg, head_dir, head, record, staging, out_dir, run_dir, target_path) -> dict | None:
    """Export the head into `staging`, verify it (export.verify), estimate SGLang's trees, record it and
    write its card; VerificationError, with `staging` left for inspection, when verification fails."""
    setting = export_format_setting(cfg.export)
    export_head(
        head_dir,
        staging,
        load_config(cfg.target),
        cfg.export.dtype,
        setting,
        str(cfg.target.path),
        cfg.export.num_speculative_tokens,
        head,
        engine=cfg.export.engine,
    )
    fmt = export_format(record.kind, setting)
    log.info("exported %s (%s, %s format, %s)", staging, record.kind, fmt, cfg.export.dtype)

    verification, failure = None, None
    trees = for_sglang(cfg.export.engine) and cfg.export.sglang_trees
    if cfg.export.verify or trees:
        tokenizer = load_tokenizer(cfg.target)
        prompts = verification_prompts(cfg, tokenizer, record, run_dir)
    if cfg.export.verify:
        try:
            with leash(run_dir, "export"):  # vLLM's engine never outlives this process, however it dies
                verification = verify_export(
                    target_path,
                    head_dir,
                    staging,
                    record.kind,
                    prompts,
                    stop_token_ids(tokenizer, target_path),
                    cfg.export.num_speculative_tokens,
                    cfg.export.verify_max_new_tokens,
                    cfg.export.verify_tolerance,
                    cfg.export.verify_dtype,
                    cfg.export.dtype,
                    OmegaConf.to_container(cfg.export.vllm_kwargs, resolve=True),
                    log_path=run_dir / "logs" / f"{out_dir.name}_verify.log",
                )
        except VerificationError as error:
            verification, failure = error.report, error
        if verification is not None:  # where it will be read: published only when it passed
            verification["export_dir"] = str(out_dir if failure is None else staging)
            atomic.write_json(staging / "verification.json", verification)

    if trees:  # SGLang's tree settings, estimated by the reference decoder
        run_trees(cfg, head_dir, staging / "sglang_trees.json", tokenizer, prompts)

    eval_file = run_dir / "eval" / "results.json"
    eval_results = json.loads(eval_file.read_text()) if eval_file.exists() else None
    if not cfg.export.verify:
        note = "export.verify=false: vLLM's acceptance was not compared with the reference decoder's"
    else:
        note = "" if failure is None else f"verification failed: {str(failure).splitlines()[0]}"
    record_export(staging, cfg.export.verify and failure is None, note, str(cfg.target.path))
    write_model_card(
        staging,
        head_dir,
        cfg.export.num_speculative_tokens,
        eval_results,
        OmegaConf.to_container(cfg.eval.server_args, resolve=True),
        served_dir=out_dir,
    )
    if failure is not None:
        kept = f"{out_dir} is unchanged" if out_dir.exists() else f"nothing was published at {out_dir}"
        raise VerificationError(
            f"{failure}\n{kept}; the unproven export, with its card and verification.json, is at {staging}",
            failure.report,
        )
    return verification


@hydra.main(config_path="../conf", config_name="config", version_base=None)
@stage_errors("export")
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
