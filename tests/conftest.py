"""Shared fixtures: the smoke cache is built once per test session (CPU, a few seconds). Helpers that tests
import live in tests/helpers.py."""

import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import QUALITY_THREADS, REPO, smoke_config


@pytest.fixture(scope="session")
def smoke_target_dir(tmp_path_factory) -> Path:
    from artifacts.smoke import build_smoke_target

    return build_smoke_target(tmp_path_factory.mktemp("target") / "smoke_target")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, smoke_target_dir) -> Path:
    """A run directory with a finished smoke cache (treat as read-only; copy it to change it)."""
    from data_prep.main import run

    run_dir = tmp_path_factory.mktemp("smoke_run")
    shutil.copytree(smoke_target_dir, run_dir / "smoke_target")
    run(smoke_config(run_dir))
    return run_dir


@pytest.fixture(scope="session")
def smoke_head(smoke_run, tmp_path_factory) -> Path:
    """smoke_run plus an EAGLE-3 head trained 4 steps, for export tests that need a head, not a good one
    (read-only; copy it to change it)."""
    from train.main import run

    run_dir = tmp_path_factory.mktemp("smoke_head") / "run"
    shutil.copytree(smoke_run, run_dir)
    run(smoke_config(run_dir, "train.eval_every=0", "train.num_threads=1", "train.max_steps=4"))
    return run_dir


@pytest.fixture(scope="session")
def regen_run(tmp_path_factory, smoke_target_dir) -> Path:
    """A smoke cache whose answers the smoke target regenerated through vLLM (experiment=smoke_regen):
    data a head learns to draft well. Read-only, like smoke_run."""
    pytest.importorskip("vllm")
    from data_prep.main import run

    run_dir = tmp_path_factory.mktemp("regen_run")
    shutil.copytree(smoke_target_dir, run_dir / "smoke_target")
    run(smoke_config(run_dir, experiment="smoke_regen"))
    return run_dir


@pytest.fixture(scope="session")
def regen_head(regen_run, tmp_path_factory) -> Path:
    """regen_run plus a head trained on it (195 steps, ~1 min on two threads): vLLM mean acceptance length ~1.7."""
    from train.main import run

    run_dir = tmp_path_factory.mktemp("regen_head") / "run"
    shutil.copytree(regen_run, run_dir)
    overrides = ["train.eval_every=0", "train.save_every=0", QUALITY_THREADS]
    run(smoke_config(run_dir, *overrides, experiment="smoke_regen"))
    return run_dir


@pytest.fixture(scope="session")
def regen_peagle_head(regen_run, tmp_path_factory) -> Path:
    """regen_run plus a two-layer P-EAGLE head trained on it (parallel drafting; ~55 s)."""
    from train.main import run

    run_dir = tmp_path_factory.mktemp("regen_peagle_head") / "run"
    shutil.copytree(regen_run, run_dir)
    # 5 epochs: vLLM mean acceptance 1.53 at k=3 in the speculators format (measured; 8 cost ~30 s more)
    overrides = ["train.eval_every=0", "train.save_every=0", QUALITY_THREADS, "train.num_epochs=5"]
    overrides += ["head.kind=peagle", "head.num_layers=2"]
    run(smoke_config(run_dir, *overrides, experiment="smoke_regen"))
    return run_dir


@pytest.fixture
def subprocess_env():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def pytest_collection_modifyitems(config, items):
    """GPU tests stay in the suite and are skipped where there is no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
