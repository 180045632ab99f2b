"""Export refuses a head it cannot check: a forged head (a weight zeroed, its checksums deleted from
draft_config.json) passes the finite / sane-size checks, so only the missing checksums give it away; it is
exported only when asked (`export.allow_unverified_head=true`). CPU, no vLLM."""

import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from export.main import run as export
from tests.helpers import smoke_config
from train.main import run as train


@pytest.fixture(scope="module")
def trained_run(smoke_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("unverified") / "run"
    shutil.copytree(smoke_run, run_dir)
    train(smoke_config(run_dir, "train.eval_every=0", "train.num_threads=1", "train.max_steps=2"))
    return run_dir


def test_a_forged_head_is_exported_only_when_allowed(trained_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    head_dir = run_dir / "draft_head"
    weights = load_file(str(head_dir / "model.safetensors"))
    weights["lm_head.weight"] = torch.zeros_like(weights["lm_head.weight"])
    save_file(weights, str(head_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors: checksum mismatch"):  # the edit alone is caught
        export(smoke_config(run_dir))

    record = json.loads((head_dir / "draft_config.json").read_text())
    del record["files"]  # ... so the forger deletes the checksums
    (head_dir / "draft_config.json").write_text(json.dumps(record))
    message = rf"{re.escape(str(head_dir / 'draft_config.json'))} records no checksums .* export.allow_unverified_head=true"
    with pytest.raises(ValueError, match=message):
        export(smoke_config(run_dir))
    assert not (run_dir / "export").exists()

    export(smoke_config(run_dir, "export.allow_unverified_head=true", "export.dtype=float32"))
    exported = load_file(str(run_dir / "export" / "model.safetensors"))
    assert torch.equal(exported["lm_head.weight"], weights["lm_head.weight"])  # the head as it is, unchecked
