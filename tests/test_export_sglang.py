"""Exports SGLang loads as they are (export.engine=sglang|both), proven with SGLang 0.5.23's own loader
(export/sglang_check.py, one subprocess for every export: `make setup` installs SGLang into .venv/sglang):
every tensor lands where ours is, packed q/k/v and gate/up included, the hot-token map is our draft-to-target
map, SGLang's target captures the layers the head was trained on, nothing we ship is dropped; and what
SGLang cannot serve is refused by name. CPU, no SGLang server."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from artifacts.config import check_config, compose
from artifacts.vocab import load_vocab_map
from export.main import run as export
from export.sglang_check import check_with_sglang
from export.to_sglang import SGLANG_DIR
from export.to_vllm import export_head
from heads.head_file import read_record
from tests.helpers import smoke_config
from train.main import run as train


@pytest.fixture(scope="module")
def eagle3_run(smoke_head, tmp_path_factory):
    """A copy of the EAGLE-3 smoke head's run, which the exports below are written into."""
    run_dir = tmp_path_factory.mktemp("sglang") / "run"
    shutil.copytree(smoke_head, run_dir)
    return run_dir


SMALL = ("export.verify_num_prompts=2", "export.verify_max_new_tokens=16")  # the tree grid's prompts
NORMS = ("head.norm_before_fc=true", "head.fc_norm=true", "head.norm_output=true")


@pytest.fixture(scope="module")
def eagle1_export(smoke_run, tmp_path_factory):
    """The export stage's engine=both export of an EAGLE-1 smoke head (4 steps): vLLM's directory, SGLang's
    inside it."""
    run_dir = tmp_path_factory.mktemp("sglang_eagle1") / "run"
    shutil.copytree(smoke_run, run_dir)
    overrides = ["train.eval_every=0", "train.num_threads=1", "train.max_steps=4", "head.kind=eagle1"]
    train(smoke_config(run_dir, *overrides))
    return Path(export(smoke_config(run_dir, *overrides, "export.engine=both", *SMALL))["export_dir"])


@pytest.fixture(scope="module")
def reports(eagle3_run, eagle1_export, smoke_run, tmp_path_factory):
    """SGLang's loader on the export stage's engine=both exports (EAGLE-3; EAGLE-1's SGLang directory and,
    to show why it has one, its vLLM directory), on a vLLM-only plain export of the EAGLE-3 head, and on a
    one-layer head with every norm flag SGLang reads on (norm_before_fc, fc_norm, norm_output)."""
    out = f"export.out_dir={eagle3_run / 'export_both'}"
    both = Path(
        export(smoke_config(eagle3_run, "export.engine=both", "export.format=plain", out, *SMALL))[
            "export_dir"
        ]
    )
    target_config = AutoConfig.from_pretrained(eagle3_run / "smoke_target")
    vllm_only = export_head(eagle3_run / "draft_head", eagle3_run / "export_vllm", target_config, fmt="plain")
    normed = tmp_path_factory.mktemp("sglang_norms") / "run"
    shutil.copytree(smoke_run, normed)
    train(smoke_config(normed, "train.eval_every=0", "train.num_threads=1", "train.max_steps=4", *NORMS))
    normed_export = export_head(
        normed / "draft_head", normed / "export", target_config, fmt="plain", engine="sglang"
    )
    exports = [both, vllm_only, normed_export, eagle1_export / SGLANG_DIR, eagle1_export]
    names = ["both", "vllm", "norms", "eagle1", "eagle1_vllm"]
    return {**dict(zip(names, check_with_sglang(exports), strict=True)), "dir": both}


def test_sglang_loads_every_tensor_where_ours_is(reports, eagle3_run):
    report = reports["both"]
    assert report["architecture"] == "LlamaForCausalLMEagle3"
    assert report["mismatched"] == {} and report["not_loaded"] == [] and report["dropped"] == []
    for packed in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        assert f"model.layers.0.{packed}.weight" in report["landed"]
    assert {"model.fc.weight", "model.norm.weight", "lm_head.weight"} <= set(report["landed"])
    weights = load_file(str(reports["dir"] / "model.safetensors"))
    assert report["hot_token_map_equal"]  # target id = draft id + d2t[id], our draft-to-target map
    vocab = load_vocab_map(eagle3_run / "draft_head" / "vocab.safetensors")
    assert vocab.d2t is not None and torch.equal(weights["d2t"], vocab.d2t.long())


def test_sglang_loads_the_norms_it_reads(reports):
    report = reports["norms"]
    assert report["mismatched"] == {} and report["not_loaded"] == [] and report["dropped"] == []
    assert {"model.input_norm.weight", "model.fc_norm.0.weight", "model.fc_norm.2.weight"} <= set(
        report["landed"]
    )


def test_sglang_loads_an_eagle1_head_from_its_own_directory(reports, eagle1_export):
    report = reports["eagle1"]
    assert report["architecture"] == "LlamaForCausalLMEagle"
    assert report["mismatched"] == {} and report["not_loaded"] == [] and report["dropped"] == []
    assert {"model.fc.weight", "model.fc.bias", "model.layers.0.self_attn.qkv_proj.weight"} <= set(
        report["landed"]
    )
    assert report["capture_layers"] is None  # EAGLE-1 reads the target's final states
    sglang = load_file(str(eagle1_export / SGLANG_DIR / "model.safetensors"))
    vllm = load_file(str(eagle1_export / "model.safetensors"))
    assert not sglang.pop("fc.bias").any() and "fc.bias" not in vllm  # SGLang's fc has a bias, vLLM's none
    assert sglang.keys() == vllm.keys() and all(torch.equal(sglang[k], vllm[k]) for k in vllm)
    assert json.loads((eagle1_export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # vLLM's directory is no EAGLE-1 head to SGLang: it builds a plain Llama, and the layer weights miss.
    plain = reports["eagle1_vllm"]
    assert plain["architecture"] == "LlamaForCausalLM" and plain["mismatched"] and plain["not_loaded"]
    card = (eagle1_export / "README.md").read_text()
    assert "--speculative-algorithm EAGLE " in card
    assert f"--speculative-draft-model-path {eagle1_export / SGLANG_DIR}" in card


def test_sglang_captures_the_layers_the_head_was_trained_on(reports, eagle3_run):
    aux = read_record(eagle3_run / "draft_head").config.to_dict()["aux_layer_ids"]
    assert reports["both"]["capture_layers"] == aux
    config = json.loads((reports["dir"] / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in aux]
    assert config["eagle_aux_hidden_state_layer_ids"] == aux  # vLLM reads these first
    # Without eagle_config, SGLang's target falls back to its own default layers: it reads no other field.
    assert reports["vllm"]["capture_layers"] is None and reports["vllm"]["mismatched"] == {}


def test_the_card_gives_sglangs_serve_command_with_the_estimated_tree(reports):
    trees = json.loads((reports["dir"] / "sglang_trees.json").read_text())
    best, rows = trees["recommended"], trees["rows"]
    within = [r["mean_acceptance_length"] for r in rows if r["num_draft_tokens"] <= 8]
    assert best["num_draft_tokens"] <= 8 and best["mean_acceptance_length"] == max(within)
    assert (trees["chain"]["num_steps"], trees["chain"]["topk"], trees["chain"]["num_draft_tokens"]) == (
        3,
        1,
        4,
    )
    assert (trees["sglang_default"]["num_steps"], trees["sglang_default"]["topk"]) == (5, 4)
    assert all(r["rounds_below_chain"] == 0 for r in rows if r["topk"] == 1)  # a chain against itself
    card = (reports["dir"] / "README.md").read_text()
    assert "python -m sglang.launch_server" in card and "--speculative-algorithm EAGLE3" in card
    assert f"--speculative-draft-model-path {reports['dir']}" in card
    assert (
        f"--speculative-num-steps {best['num_steps']} --speculative-eagle-topk {best['topk']} "
        f"--speculative-num-draft-tokens {best['num_draft_tokens']}"
    ) in card


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["head.kind=peagle"],
            r"head.kind=peagle: must be eagle3 .*no parallel drafting",
        ),
        (["export.format=speculators"], r"export.format=speculators: must be plain .*reads no speculators"),
        (
            ["export.format=plain", "head.norm_before_residual=true"],
            r"head.norm_before_residual=True: must be false",
        ),
    ],
)
def test_what_sglang_cannot_serve_is_refused_when_the_config_is_composed(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_config(compose("config", ["experiment=smoke", "export.engine=sglang", *overrides]))


def test_the_engine_picks_the_format_it_reads_unless_the_user_set_one():
    """export.format=auto (the default, and the recipes'): speculators for vLLM, plain where SGLang reads it;
    on the Llama-3.1-8B recipe, export.engine=sglang is then refused only for what SGLang cannot serve."""
    from artifacts.config import export_format_setting

    for engine, fmt in [("vllm", "speculators"), ("sglang", "plain"), ("both", "plain")]:
        cfg = compose(
            "config", ["experiment=smoke", f"export.engine={engine}", "head.norm_before_residual=false"]
        )
        check_config(cfg)
        assert export_format_setting(cfg.export) == fmt
    with pytest.raises(ValueError, match=r"head.norm_before_residual=True: must be false"):
        check_config(compose("config", ["experiment=llama31_8b", "run_dir=/x", "export.engine=sglang"]))
    check_config(compose("config", ["experiment=llama31_8b", "run_dir=/x", "export.engine=sglang",
                                    "head.norm_before_residual=false"]))  # fmt: skip


def test_layers_sglang_cannot_capture_are_refused_at_export(eagle3_run, tmp_path):
    target_config = AutoConfig.from_pretrained(eagle3_run / "smoke_target")
    aux = read_record(eagle3_run / "draft_head").config.to_dict()["aux_layer_ids"]
    target_config.num_hidden_layers = max(aux)  # the last id is then the last layer's output
    with pytest.raises(ValueError, match=r"cache.aux_layer_ids=.*SGLang cannot capture"):
        export_head(eagle3_run / "draft_head", tmp_path / "x", target_config, fmt="plain", engine="both")
