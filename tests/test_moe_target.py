"""A MoE target through every path: the MoE smoke target (Qwen3-MoE's architecture, artifacts/smoke.py)
captured through transformers and through vLLM's CPU build - the same states - and trained online (the
memory model's count of its experts: tests/test_train_memory.py)."""

import shutil

import pytest
import torch

from artifacts.cache import CacheSplit
from artifacts.manifest import read_manifest
from tests.helpers import AUX_IDS, smoke_config, step_losses, train_config

MOE = ["target=smoke_moe", "data.num_samples=12"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A smoke cache of 12 conversations on the MoE smoke target, its states through transformers."""
    from data_prep.main import run

    run_dir = tmp_path_factory.mktemp("moe_run")
    run(smoke_config(run_dir, *MOE))
    return run_dir


def test_a_moe_target_is_captured_through_transformers(moe_run):
    from transformers import AutoModelForCausalLM

    manifest = read_manifest(moe_run / "cache")
    assert manifest["architecture"] == "Qwen3MoeForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(moe_run / "smoke_moe_target", dtype=torch.float32).eval()
    sample = CacheSplit(moe_run / "cache", "train")[0]
    with torch.no_grad():
        out = model(sample["input_ids"][None], output_hidden_states=True)
    for k, layer_id in enumerate(AUX_IDS):
        expected = out.hidden_states[layer_id][0, :-1].to(torch.bfloat16)
        torch.testing.assert_close(sample["aux_hidden"][:-1, k], expected, atol=2e-2, rtol=2e-2)


# Slow (~10 s): online training runs the dense target's code path, tested by default (tests/test_train_online.py).
@pytest.mark.slow
def test_online_training_on_a_moe_target_trains_the_head_its_cached_states_train(moe_run, tmp_path):
    """Online, the target's forward in each step (its tokens-only cache from another data_prep run)."""
    from data_prep.main import run as data_prep
    from train.main import run as train

    cached_dir, online_dir = tmp_path / "cached", tmp_path / "online"
    shutil.copytree(moe_run, cached_dir)
    shutil.copytree(moe_run / "smoke_moe_target", online_dir / "smoke_moe_target")
    data_prep(smoke_config(online_dir, *MOE, "cache.hidden_states=false"))
    train(train_config(cached_dir, *MOE))
    train(train_config(online_dir, *MOE, "cache.hidden_states=false", "train.features=online"))
    assert step_losses(online_dir) == pytest.approx(step_losses(cached_dir), rel=1e-3)


# Slow (~90 s: a vLLM engine on a MoE): the capture code is the dense target's, tested by default in
# tests/test_target_capture.py; this proves vLLM's CPU build runs the MoE and gives its states.
@pytest.mark.slow
def test_vllm_captures_a_moe_target_with_the_transformers_states(moe_run, tmp_path):
    pytest.importorskip("vllm")
    from data_prep.main import run

    run_dir = tmp_path / "vllm"
    shutil.copytree(moe_run / "smoke_moe_target", run_dir / "smoke_moe_target")
    run(smoke_config(run_dir, *MOE, "capture.engine=vllm"))
    for split in ("train", "eval"):
        found, expected = CacheSplit(run_dir / "cache", split), CacheSplit(moe_run / "cache", split)
        assert found.ids == expected.ids and len(found) > 0
        for index in range(len(found)):
            a, b = found[index], expected[index]
            assert torch.equal(a["input_ids"], b["input_ids"])
            for k in range(len(AUX_IDS)):
                error = (a["aux_hidden"][:-1, k].float() - b["aux_hidden"][:-1, k].float()).norm()
                assert error / b["aux_hidden"][:-1, k].float().norm() < 2**-7, (split, index, k)
