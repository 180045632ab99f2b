"""Online training (train.features=online): the target's hidden states computed in the training step from a
tokens-only cache (cache.hidden_states=false) train the same head as the cache does."""

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from artifacts.cache import CacheSplit
from data_prep.main import run as data_prep
from target.model import load_model, weights_bytes
from tests.helpers import (
    DFLASH,
    FAST,
    PEAGLE,
    REPO,
    assert_same_head,
    smoke_config,
    step_losses,
    train_config,
)
from train.data import online_states
from train.main import run as train

ONLINE = ("cache.hidden_states=false", "train.features=online")
# What online changes is the batching of the target's forwards (per micro-batch here, per length-sorted
# group in data_prep); with the states rounded to bf16 as the cache stores them, a rare element rounds the
# other way, so losses and weights agree to bf16 tolerance, not bitwise.
LOSS_RTOL, WEIGHT_ATOL = 1e-3, 1e-3


def shard_bytes(run_dir) -> int:
    return sum(f.stat().st_size for f in (run_dir / "cache").rglob("shard-*.safetensors"))


@pytest.fixture(scope="module")
def online_run(tmp_path_factory, smoke_target_dir):
    """A smoke run directory with a tokens-only cache of the same data as `smoke_run` (read-only)."""
    run_dir = tmp_path_factory.mktemp("online_run")
    shutil.copytree(smoke_target_dir, run_dir / "smoke_target")
    data_prep(smoke_config(run_dir, "cache.hidden_states=false"))
    return run_dir


def fresh(run_dir, tmp_path, name):
    copy = tmp_path / name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("ckpt", "draft_head", "train_*"))
    return copy


def test_a_tokens_only_cache_has_the_same_samples_and_no_states_in_far_fewer_bytes(online_run, smoke_run):
    online, cached = (
        json.loads((d / "cache" / "manifest.json").read_text()) for d in (online_run, smoke_run)
    )
    assert online["hidden_states"] is False and cached["hidden_states"] is True
    for key in ("num_samples", "num_tokens", "num_loss_tokens", "dataset_fingerprint", "aux_layer_ids"):
        assert online[key] == cached[key], key
    assert (online_run / "cache" / "vocab.safetensors").read_bytes() == (
        smoke_run / "cache" / "vocab.safetensors"
    ).read_bytes()
    for shard in (online_run / "cache").rglob("shard-*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            assert set(f.keys()) == {"input_ids", "loss_mask_bits", "sample_offsets"}
    # 4 bytes a token at most (ids, mask bits, offsets) against 2 x (n_aux + 1) x H of hidden states
    num_tokens = sum(online["num_tokens"].values())
    assert shard_bytes(online_run) <= 4 * num_tokens + 4096 * len(
        list((online_run / "cache").rglob("*.json"))
    )
    assert shard_bytes(online_run) * 50 < shard_bytes(smoke_run)
    assert online["bytes_per_token"] < 5


@pytest.mark.parametrize(
    "head",
    [(), PEAGLE, DFLASH, ("head.kind=eagle1",), (*PEAGLE, "train.pack_length=512")],
    ids=[
        "eagle3",
        "peagle",
        "dflash",
        "eagle1",
        "peagle_packed",
    ],  # packed: the target runs on each sample alone
)
def test_online_training_equals_cached_training(online_run, smoke_run, tmp_path, head):
    cached_dir, online_dir = fresh(smoke_run, tmp_path, "cached"), fresh(online_run, tmp_path, "online")
    cached_eval = train(train_config(cached_dir, *head))
    online_eval = train(train_config(online_dir, *ONLINE, *head))
    assert step_losses(online_dir) == pytest.approx(step_losses(cached_dir), rel=LOSS_RTOL)
    assert_same_head(cached_dir, online_dir, atol=WEIGHT_ATOL)
    assert online_eval == pytest.approx(cached_eval, rel=LOSS_RTOL, abs=1e-3)
    settings = json.loads((online_dir / "draft_head" / "draft_config.json").read_text())["training"]
    assert settings["settings"]["train"]["features"] == "online"


def test_two_ranks_online_equal_one_process_and_cached_training(
    online_run, smoke_run, tmp_path, subprocess_env
):
    single = fresh(online_run, tmp_path, "single")
    train(train_config(single, *ONLINE, "train.batch_size=4", "train.max_steps=4"))
    cached = fresh(smoke_run, tmp_path, "cached")
    train(train_config(cached, "train.batch_size=4", "train.max_steps=4"))
    ddp_dir = fresh(online_run, tmp_path, "ddp")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train/main.py",
           "experiment=smoke", f"run_dir={ddp_dir}", *FAST, *ONLINE, "train.batch_size=2", "train.max_steps=4"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 processes" in result.stderr
    assert_same_head(single, ddp_dir, atol=2e-5)
    assert step_losses(ddp_dir) == pytest.approx(step_losses(single), rel=1e-4)
    assert_same_head(cached, ddp_dir, atol=WEIGHT_ATOL)
    assert step_losses(ddp_dir) == pytest.approx(step_losses(cached), rel=LOSS_RTOL)


# ZeRO-3 online is slow (~32 s): ZeRO-3 runs by default in tests/test_train_loop.py, online ZeRO-2 here
@pytest.mark.parametrize("zero_stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_deepspeed_zero_online_on_two_cpu_ranks_equals_one_process(
    online_run, tmp_path, subprocess_env, zero_stage
):
    # The frozen target stays whole on each rank (loaded outside zero.Init); ZeRO-3 shards the head only.
    pytest.importorskip("deepspeed")
    single = fresh(online_run, tmp_path, "single")
    train(train_config(single, *ONLINE, "train.batch_size=4", "train.max_steps=4"))
    ds_dir = fresh(online_run, tmp_path, "ds")
    env = dict(subprocess_env, DS_ACCELERATOR="cpu", ACCELERATE_USE_DEEPSPEED="true",
               ACCELERATE_DEEPSPEED_ZERO_STAGE=str(zero_stage), ACCELERATE_DEEPSPEED_ZERO3_INIT="true")  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train/main.py",
           "experiment=smoke", f"run_dir={ds_dir}", *FAST, *ONLINE, "train.batch_size=2", "train.max_steps=4"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_head(single, ds_dir, atol=5e-5)
    assert step_losses(ds_dir) == pytest.approx(step_losses(single), rel=1e-4)


def test_online_resume_reproduces_the_losses(online_run, tmp_path):
    run_dir = fresh(online_run, tmp_path, "run")
    train(train_config(run_dir, *ONLINE))
    uninterrupted = step_losses(run_dir)
    for path in ("draft_head", "ckpt/step-000008"):
        shutil.rmtree(run_dir / path)
    train(train_config(run_dir, *ONLINE, "train.resume=true"))
    assert step_losses(run_dir) == uninterrupted  # same target forwards, same order: bitwise


def test_the_wrong_mode_for_the_cache_is_refused_naming_the_option(online_run, smoke_run, tmp_path):
    with pytest.raises(ValueError, match=r"holds no hidden states.*train\.features=online"):
        train(train_config(fresh(online_run, tmp_path, "a"), "cache.hidden_states=false"))
    with pytest.raises(ValueError, match=r"train\.features=online, but .* holds the target's hidden states"):
        train(train_config(fresh(smoke_run, tmp_path, "b"), "train.features=online"))
    with pytest.raises(
        ValueError, match=r"train\.features=disk: must be one of cache, online; change train\.features"
    ):
        train(train_config(fresh(online_run, tmp_path, "c"), "train.features=disk"))


@pytest.mark.slow  # ~40 s
def test_the_benchmark_reports_both_modes_and_the_trade_off(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "bench.online", "--steps", "3", "--warmup", "1",
           "--work-dir", str(tmp_path / "work"), "--out", str(out), "--", "experiment=smoke"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    cache, online = report["results"]["cache"], report["results"]["online"]
    assert cache["train_tokens"] == online["train_tokens"] > 0 and cache["train_steps_timed"] == 2
    assert online["shard_bytes"] * 50 < cache["shard_bytes"]
    assert report["summary"]["cache_bytes_per_token"] == pytest.approx(
        cache["shard_bytes"] / cache["cached_tokens"], rel=1e-3
    )
    assert "online / cache:" in result.stdout


def test_a_target_too_large_for_the_gpu_is_refused_with_its_size(online_run, monkeypatch):
    cfg = train_config(online_run, *ONLINE)
    model = load_model(cfg.target)
    assert weights_bytes(cfg.target) == sum(p.numel() * p.element_size() for p in model.parameters())
    free = weights_bytes(cfg.target)  # the target alone would fill the GPU: no room for the head
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 * free))
    accelerator = SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"takes [\d.]+ GB in target\.dtype=\w+, more than 60% of the"):
        online_states(cfg, accelerator, CacheSplit(online_run / "cache", "train"))
