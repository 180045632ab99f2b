"""The memory model (train/memory.py): the recipes fit the GPUs they name by it, train refuses a micro-batch
that cannot fit before its first step, and the model follows what autograd keeps (the GPU check, which
measures it on CUDA: tests/test_gpu_check.py)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from bench.memory import build_head, predict, recipe_config
from bench.saved import SETTINGS as SAVED_SETTINGS
from tests.helpers import REPO
from train.memory import GB, check_step_fits, peak_bytes

H100 = 80e9


@pytest.mark.parametrize("recipe", ["llama31_8b", "qwen3_8b", "llama33_70b", "qwen3_30b_a3b"])
@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_each_recipe_fits_an_80_gb_gpu_with_a_margin(recipe, kind):
    """The recipe's own micro-batch (DFlash: one sample, as docs/gpu.md runs it; P-EAGLE on the 70B too, and
    DFlash there with 256 anchors), ZeRO-2 on 8 GPUs as the recipes launch, online where the recipe is: at
    most 80% of an 80 GB GPU by the model."""
    batch = 1 if recipe == "llama33_70b" and kind != "eagle3" else None
    overrides = ["head.num_anchors=256"] if (recipe, kind) == ("llama33_70b", "dflash") else []
    breakdown = predict(recipe, kind, batch, None, world=8, zero_stage=2, online=None, overrides=overrides)
    assert peak_bytes(breakdown) <= 0.8 * H100, {k: round(v / GB, 1) for k, v in breakdown.items()}
    if recipe in ("llama31_8b", "qwen3_8b"):
        assert breakdown.get("online_target", 0) > 15 * GB  # the 8B recipes train online: the target counts


def test_a_moe_target_counts_every_expert_and_online_training_is_refused_where_it_cannot_fit(monkeypatch):
    """Qwen3-30B-A3B: 30.5B weights (all 128 experts of each of 48 layers; 3.3B active) - what the model card
    gives - and its online training refused on an 80 GB GPU, which is why its recipe caches the states."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from train.memory import active_intermediate, target_weights_bytes

    cfg, target_config = recipe_config("qwen3_30b_a3b", "eagle3", False, [])
    assert 30.4e9 < target_weights_bytes(target_config, 1) < 30.6e9
    assert active_intermediate(target_config) == 8 * 768
    tiny = Qwen3MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1])  # fmt: skip
    assert target_weights_bytes(tiny, 1) == sum(p.numel() for p in Qwen3MoeForCausalLM(tiny).parameters())
    draft, _, _ = build_head(cfg, target_config, "eagle3", "meta")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=H100))
    length = cfg.render.max_length
    assert length == 16384  # agent traffic (the recipe's comment gives the model's numbers)
    check_step_fits(cfg, fake_accelerator(), draft, target_config, length)  # cached, as the recipe trains
    cfg.train.features = "online"
    with pytest.raises(
        ValueError, match=r"online_target 61.*set (train.batch_size=1 .*, or )?train.features=cache"
    ):
        check_step_fits(cfg, fake_accelerator(), draft, target_config, length)


def fake_accelerator(device="cuda:0"):
    return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None), num_processes=8, device=device)


def test_train_refuses_a_micro_batch_that_cannot_fit_naming_the_settings(monkeypatch):
    cfg, target_config = recipe_config("llama31_8b", "eagle3", False, [])
    draft, _, _ = build_head(cfg, target_config, "eagle3", "meta")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=H100))
    check_step_fits(cfg, fake_accelerator(), draft, target_config, 2048)  # the recipe's 4 x 2048
    cfg.train.batch_size = 16
    with pytest.raises(ValueError, match=r"train.batch_size=16: one step of 16 x 2048 tokens needs about .* "
                                         r"set train.batch_size=8 train.gradient_accumulation_steps=4"):  # fmt: skip
        check_step_fits(cfg, fake_accelerator(), draft, target_config, 2048)
    check_step_fits(cfg, fake_accelerator("cpu"), draft, target_config, 2048)  # CPU: a warning at most


@pytest.mark.parametrize("setting", ["eagle3", "peagle:head.position_weights=dpace", "dflash"])
def test_the_skipped_products_leave_what_autograd_saves_unchanged(setting):
    """bench/saved.py skips the forward's matrix products (zeros of their shape): what autograd saves - each
    storage's bytes, dtype and the op that made it - is what the real forward saves, at a small shape whose
    draft vocabulary is the target's (so that every answer position trains in both)."""
    from bench.memory import build_model, random_batch
    from bench.saved import saved_by_forward

    kind, _, extra = setting.partition(":")
    overrides = ["cache.draft_vocab_size=2048", *(e for e in extra.split(",") if e)]
    cfg, target_config = recipe_config("llama31_8b", kind, True, overrides)
    seen, skipped = [], []
    for skip in (False, True):
        torch.manual_seed(0)
        model, _, aux_ids = build_model(cfg, target_config, "cpu")
        batch = random_batch(cfg, target_config, aux_ids, 2, 256, "cpu")
        sizes, about, n = saved_by_forward(model, batch, "bf16", skip=skip)
        seen.append(sorted((sizes[ptr], str(about[ptr][0]), about[ptr][1]) for ptr in sizes))
        skipped.append(n)
    assert skipped[0] == 0 and skipped[1] > 20
    assert len(seen[0]) > 20 and seen[0] == seen[1]


@pytest.mark.parametrize(
    "setting", SAVED_SETTINGS[:1] + [pytest.param(s, marks=pytest.mark.slow) for s in SAVED_SETTINGS[1:]]
)
def test_the_model_counts_what_autograd_keeps_at_the_recipe_shapes(setting, tmp_path, subprocess_env):
    """What one forward of a sample of the llama31_8b recipe (8B widths, 2,048 tokens, bf16 autocast) saves for
    backward, against the model's activations: within 5% for every kind and objective (EAGLE-3 in the default
    suite, two minutes a setting; the others slow); the bf16 copies of the head's matrices at most what the
    model holds (bench/saved.py, docs/benchmarks.md#what-autograd-keeps)."""
    out = tmp_path / "saved.json"  # a process of its own: the 8B-width head's memory goes back at its end
    command = [sys.executable, "-m", "bench.saved", "--settings", setting, "--out", str(out)]
    subprocess.run(command, check=True, cwd=REPO, env=subprocess_env)
    (r,) = json.loads(out.read_text())
    assert 0.95 <= r["ratio"] <= 1.05, r
    # autocast caches every matrix's cast to the forward's end; backward keeps those its products saved
    assert 0 < r["weight_copies_gb"] <= r["model_weight_copies_gb"], r
