"""Export of an EAGLE-3 head in vLLM's plain format, and vLLM (CPU build) loading it and drafting with it."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from export.to_vllm import export_eagle3
from tests.conftest import smoke_config
from train.main import run as train


@pytest.fixture(scope="module")
def trained_run(smoke_run, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("export") / "run"
    shutil.copytree(smoke_run, run_dir)
    train(smoke_config(run_dir, "train.max_steps=8", "train.eval_every=0", "train.num_threads=1"))
    return run_dir


def test_plain_eagle3_export_has_exactly_what_vllm_reads(trained_run):
    target_config = AutoConfig.from_pretrained(trained_run / "smoke_target")
    out = export_eagle3(trained_run / "draft_head", trained_run / "head_plain", target_config, fmt="plain")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and config["num_aux_hidden_states"] == 3
    assert config["norm_before_residual"] is False and config["draft_vocab_size"] == 512
    assert config["max_position_embeddings"] >= target_config.max_position_embeddings
    weights = load_file(str(out / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["d2t"].shape == (512,)  # pruned vocabulary
    assert weights["fc.weight"].shape == (256, 3 * 256) and weights["fc.weight"].dtype == torch.bfloat16
    assert weights["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 256
    assert "fc.bias" not in weights and "embed_tokens.weight" not in weights and "t2d" not in weights


def test_export_refuses_a_head_for_another_target(trained_run):
    other = AutoConfig.from_pretrained(trained_run / "smoke_target")
    other.hidden_size = 512
    with pytest.raises(ValueError, match=r"trained for hidden_size=256.*target has 512"):
        export_eagle3(trained_run / "draft_head", trained_run / "head_other", other)


def test_speculators_export_states_every_norm_flag(trained_run):
    target_config = AutoConfig.from_pretrained(trained_run / "smoke_target")
    out = export_eagle3(trained_run / "draft_head", trained_run / "head_spec", target_config, target_path="t")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    # In this format a missing norm_before_residual means TRUE: it must be written.
    flags = {k: config[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")}
    assert flags == {
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
    }
    assert config["transformer_layer_config"]["num_aux_hidden_states"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == "t"


@pytest.mark.parametrize("fmt", ["plain", "speculators"])
def test_vllm_loads_the_export_and_drafts_with_it(trained_run, fmt):
    vllm = pytest.importorskip("vllm")
    target_dir = trained_run / "smoke_target"
    target_config = AutoConfig.from_pretrained(target_dir)
    out = export_eagle3(
        trained_run / "draft_head",
        trained_run / f"head_{fmt}_fp32",
        target_config,
        "float32",
        fmt,
        str(target_dir),
    )
    llm = vllm.LLM(
        model=str(target_dir), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
        max_model_len=1024, disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": 3},
    )  # fmt: skip
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    outputs = llm.generate([prompt] * 2, vllm.SamplingParams(temperature=0, max_tokens=24))
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    metrics = {m.name: m for m in llm.get_metrics()}
    assert metrics["vllm:spec_decode_num_drafts"].value > 0
    assert (
        metrics["vllm:spec_decode_num_draft_tokens"].value == 3 * metrics["vllm:spec_decode_num_drafts"].value
    )
