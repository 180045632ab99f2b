"""The real Hydra configs compose, and the typed schema rejects bad values."""

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from eagle.config import compose
from eagle.manifest import read_manifest
from tests.conftest import REPO


def test_default_data_prep_config_is_smollm2_on_sharegpt():
    cfg = compose("config", ["run_dir=/tmp/x"])
    assert cfg.target.build == "smollm2" and cfg.target.path.endswith("SmolLM2-135M-Instruct")
    assert cfg.cache.draft_vocab_size == 32000 and cfg.cache.aux_layer_ids is None
    assert OmegaConf.to_container(cfg.data)["source"] == "${sharegpt_json:}"


def test_smoke_experiment_composes_with_explicit_layer_ids():
    cfg = compose("config", ["experiment=smoke", "run_dir=/tmp/x"])
    assert cfg.target.path == "/tmp/x/smoke_target" and cfg.target.build == "smoke"
    assert list(cfg.cache.aux_layer_ids) == [1, 3, 4]
    assert cfg.data.source.endswith("eagle/smoke_data/conversations.jsonl")
    OmegaConf.resolve(cfg)


def test_schema_rejects_a_wrongly_typed_value():
    with pytest.raises(ConfigCompositionException, match="max_shard_mb"):
        compose("config", ["experiment=smoke", "run_dir=/tmp/x", "cache.max_shard_mb=lots"])


def test_accelerate_launch_runs_the_stage(tmp_path, subprocess_env):
    # The command users type, on one CPU process here.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", "data_prep/main.py",
           "experiment=smoke", f"run_dir={tmp_path}"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "cache")["complete"] is True
    assert "caching" in result.stderr and "tok/s" in result.stderr  # the disk estimate and the progress bar
