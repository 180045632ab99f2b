"""Export publishes only what it has proven (export/record.py): built and verified in <export>.unverified/,
swapped in with its card, proof and record together; a failed or killed verification leaves the previous
export as it was. eval checks every export it serves - files, checksums, readable weights - before any
server starts, and says when one was not verified. Verification itself is stood in for here (its vLLM
runs are tests/test_export_vllm.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import export.main as export_main
from export.record import RECORD, check_export, unproven_dir
from export.verify import VerificationError
from tests.helpers import smoke_config


def published(run_dir, tmp_path, *overrides):
    """A copy of the run with an unverified export published; (run_dir, {file: bytes} of that export)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    export_main.run(smoke_config(copy, "export.format=plain", *overrides))
    export_dir = copy / "export"
    return copy, {p.name: p.read_bytes() for p in export_dir.iterdir()}


def stand_in_verification(outcome):
    def verify(target, head_dir, export_dir, *args, **kwargs):
        assert export_dir.name == "export.unverified"  # verified where it was built, not where it is served
        if outcome == "kill":
            raise KeyboardInterrupt
        counts = {"mean_acceptance_length": 1.5, "draft_acceptance_rate": 0.2, "num_drafts": 10,
                  "per_position_acceptance": [0.4, 0.1, 0.1]}  # fmt: skip
        report = {
            "parity": {"passed": False, "mean_acceptance_length_relative_gap": 0.3, "tolerance": 0.02},
            "reference": counts, "vllm": {**counts, "mean_acceptance_length": 1.05}, "vllm_version": "x",
            "num_prompts": 2, "num_identical_outputs": 0, "num_speculative_tokens": 3, "max_new_tokens": 8,
            "dtype": "float32", "stand_in": True,
        }  # fmt: skip
        raise VerificationError("vLLM's acceptance differs from the reference decoder's", report)

    return verify


@pytest.mark.parametrize("outcome", ["fail", "kill"])
def test_a_failed_or_killed_verification_leaves_the_previous_export_as_it_was(
    smoke_head, tmp_path, monkeypatch, outcome
):
    run_dir, before = published(smoke_head, tmp_path)
    monkeypatch.setattr(export_main, "verify_export", stand_in_verification(outcome))
    error = VerificationError if outcome == "fail" else KeyboardInterrupt
    with pytest.raises(error) as raised:
        # another format, so that a mix of the two would show
        export_main.run(smoke_config(run_dir, "export.format=speculators", "export.verify=true"))
    export_dir, staging = run_dir / "export", unproven_dir(run_dir / "export")
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == before
    assert "speculators_model_type" in json.loads((staging / "config.json").read_text())
    if outcome == "fail":
        assert f"{export_dir} is unchanged" in str(raised.value) and str(staging) in str(raised.value)
        assert json.loads((staging / "verification.json").read_text())["stand_in"]
        assert not json.loads((staging / RECORD).read_text())["verified"]
    # The next successful export replaces both.
    export_main.run(smoke_config(run_dir, "export.format=speculators"))
    assert not staging.exists() and "speculators_model_type" in (export_dir / "config.json").read_text()


def test_an_export_not_verified_says_so_in_its_card_and_record_and_eval_notes_it(
    smoke_head, tmp_path, caplog
):
    from eval.grid import server_configs

    run_dir, files = published(smoke_head, tmp_path)
    record = json.loads(files[RECORD])
    assert record["verified"] is False and "export.verify=false" in record["note"]
    assert set(record["files"]) == {"config.json", "model.safetensors"}
    assert "**Not verified** (export.verify=false" in files["README.md"].decode()
    target_config = AutoConfig.from_pretrained(run_dir / "smoke_target")
    configs = server_configs(smoke_config(run_dir), run_dir, target_config)
    notes = {c["note"] for c in configs if c["head"]}
    assert len(notes) == 1 and "was not verified against the reference decoder" in notes.pop()


@pytest.mark.parametrize("damage", ["truncated", "changed", "missing"])
def test_eval_refuses_a_damaged_export_naming_the_file_before_any_server(smoke_head, tmp_path, damage):
    from eval.grid import server_configs

    run_dir, _ = published(smoke_head, tmp_path)
    weights = run_dir / "export" / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "changed":
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    else:
        weights.unlink()
    message = {"truncated": "changed since export", "changed": "sha256 differs", "missing": "missing from"}
    target_config = AutoConfig.from_pretrained(run_dir / "smoke_target")
    with pytest.raises(ValueError, match=message[damage]) as raised:
        server_configs(smoke_config(run_dir), run_dir, target_config)
    assert str(weights) in str(raised.value)


def test_an_export_without_a_record_still_has_its_weights_opened(smoke_head, tmp_path):
    run_dir, _ = published(smoke_head, tmp_path)
    export_dir = run_dir / "export"
    (export_dir / RECORD).unlink()  # written by another trainer, or before records
    assert check_export(export_dir) is None
    weights = export_dir / "model.safetensors"
    tensors = load_file(weights)
    save_file(
        {k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()},
        weights,
    )
    with pytest.raises(ValueError, match="hold NaN or inf values; rerun export"):  # export refuses them too
        check_export(export_dir)
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a readable safetensors file") as raised:
        check_export(export_dir)
    assert str(weights) in str(raised.value)


@pytest.mark.parametrize(
    "destination",
    ["{run}", "{run}/draft_head", "{run}/cache", "{run}/draft_head/export", "{run}/..", "{other}"],
)
def test_export_never_replaces_what_it_did_not_write(smoke_head, tmp_path, destination):
    """export.out_dir at the run directory, the head, the cache, inside them, above them, or at a user's
    folder: refused by name before anything is built, and every file there is as it was (issue 46: export
    used to rename the directory aside and remove it, whatever it was)."""
    run_dir = tmp_path / "run"
    shutil.copytree(smoke_head, run_dir)
    other = tmp_path / "notes"
    other.mkdir()
    (other / "head_v1.txt").write_text("mine")

    def files():  # but the stage's own run lock
        return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    out_dir = destination.format(run=run_dir, other=other)
    with pytest.raises(ValueError, match="refused, nothing was moved or removed") as raised:
        export_main.run(smoke_config(run_dir, "export.format=plain", f"export.out_dir={out_dir}"))
    assert str(Path(out_dir).resolve()) in str(raised.value)
    assert files() == before


def test_an_export_directory_is_replaced_only_by_an_export_and_an_empty_one_is_used(smoke_head, tmp_path):
    """An empty directory holds nothing to lose: export publishes into it; the next export replaces it (its
    marker says export); a checkpoint directory (the pipeline's, another kind) is refused."""
    from artifacts import atomic

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_head, run_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    export_main.run(smoke_config(run_dir, "export.format=plain", f"export.out_dir={empty}"))
    assert atomic.published_kind(empty) == "export" and (empty / "config.json").exists()
    export_main.run(smoke_config(run_dir, "export.format=speculators", f"export.out_dir={empty}"))
    assert "speculators_model_type" in (empty / "config.json").read_text()
    checkpoint = run_dir / "checkpoints" / "step-000004"
    with atomic.publish_dir(checkpoint, kind="checkpoint") as staging:  # as train publishes one
        (staging / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(ValueError, match="is the pipeline's checkpoint, not an export: refused"):
        export_main.run(smoke_config(run_dir, f"export.out_dir={checkpoint}"))


def test_a_verified_export_is_replaced_by_an_unverified_one_only_when_asked(smoke_head, tmp_path, caplog):
    """export.verify=false over a verified export: refused, naming export.replace_verified; with it, replaced,
    and the log says what was there."""
    run_dir, _ = published(smoke_head, tmp_path)
    record_file = run_dir / "export" / RECORD
    record = json.loads(record_file.read_text())
    record_file.write_text(json.dumps({**record, "verified": True}))  # as a verified export records itself
    before = {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()}
    with pytest.raises(ValueError, match="holds a verified export.*export.replace_verified=true"):
        export_main.run(smoke_config(run_dir, "export.format=plain"))
    assert {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()} == before
    with caplog.at_level("INFO", logger="export"):
        export_main.run(smoke_config(run_dir, "export.format=plain", "export.replace_verified=true"))
    assert "replacing the export that was there (verified)" in caplog.text
    assert json.loads(record_file.read_text())["verified"] is False


def test_a_truncated_export_record_is_named_with_what_to_do(smoke_head, tmp_path):
    run_dir, _ = published(smoke_head, tmp_path)
    record_file = run_dir / "export" / RECORD
    record_file.write_text(record_file.read_text()[:20])
    with pytest.raises(ValueError, match=f"{record_file}: not a readable export record .*rerun export"):
        check_export(run_dir / "export")


def test_a_full_disk_while_the_export_is_built_frees_its_staging_and_says_so(
    smoke_head, tmp_path, monkeypatch
):
    """ENOSPC at the record (after the weights were written): the unfinished export.unverified/ is removed,
    the published export is untouched, and the stage's one line names both the file and what was freed."""
    import errno

    from artifacts.errors import explain

    run_dir, before = published(smoke_head, tmp_path)

    def full(export_dir, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(export_dir / RECORD))

    monkeypatch.setattr(export_main, "record_export", full)
    with pytest.raises(OSError) as raised:
        export_main.run(smoke_config(run_dir, "export.format=plain"))
    staging = unproven_dir(run_dir / "export")
    assert not staging.exists()
    assert {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()} == before
    line = explain("export", raised.value)
    assert line.startswith(f"export: no space left on the disk of {staging / RECORD}; export removed its ")
    assert f"unfinished {staging}: free space, then rerun" in line


def test_a_full_disk_after_the_weights_names_the_file_and_what_was_freed(smoke_head, tmp_path, monkeypatch):
    """ENOSPC as a flush raises it (no file name) at config.json, right after model.safetensors, inside the
    engine files' own staging: the line names config.json and the staging removed (as a 19.7-MB tmpfs
    with one page to spare did before the fix: "the directories it writes", nothing said freed)."""
    import errno
    import pathlib

    from artifacts.errors import explain

    run_dir, before = published(smoke_head, tmp_path)
    write_text = pathlib.Path.write_text

    def full(self, *args, **kwargs):
        if "config.json" in self.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "write_text", full)
    with pytest.raises(OSError) as raised:
        export_main.run(smoke_config(run_dir, "export.format=plain"))
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (run_dir / "export").iterdir()} == before
    assert sorted(p.name for p in run_dir.iterdir() if "export" in p.name) == ["export"]  # nothing left
    line = explain("export", raised.value)
    assert line.startswith("export: no space left on the disk of ") and "config.json; the unfinished " in line
    assert "was removed: free space, then rerun" in line


def test_the_card_labels_each_estimate_by_temperature_and_claims_no_check_export_did_not_run():
    """Nine estimates (T=0, T=1 with greedy and with sampled drafts, k=1..3) each with its temperature; the
    SGLang line says the loader check is the test suite's, and an unverified export is not 'verified above'."""
    from export.card import held_out_section, sglang_section

    held_out = {"step": 4, "eval/acc_0": 0.5, "eval/loss_0": 1.0}
    for prefix in ("accept_len", "accept_len_t1", "accept_len_t1_sampled"):
        held_out |= {f"eval/{prefix}_k{k}": 1 + k / 10 for k in (1, 2, 3)}
    line = held_out_section(held_out)[-1]
    for label in ("T=0 k=1: 1.100", "T=1 k=3: 1.300", "T=1 sampled drafts k=2: 1.200"):
        assert label in line
    config = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_config": {}}
    text = "\n".join(sglang_section(config, "target", "/runs/x/export", 3))
    assert "in this project's test suite, not by this export run" in text and "verified above" not in text
