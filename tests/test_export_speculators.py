"""Export in the speculators format, read by speculators 0.9 (vLLM's own trainer, the reference reader of the
format): `SpeculatorModel.from_pretrained` loads our EAGLE-3 and P-EAGLE exports with exactly our weights, and
the verifier the config names is the target as users load it - its hub id for a hub target. CPU, no vLLM."""

import json
import shutil

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from artifacts.vocab import load_vocab_map
from export.main import run as export
from export.to_vllm import export_head
from export.verify import export_differences
from heads.head_file import read_head
from tests.helpers import DFLASH, smoke_config
from train.main import run as train

speculators = pytest.importorskip("speculators")  # `make setup` installs it (--no-deps)

KINDS = {
    "eagle3": (),
    "peagle": ("head.kind=peagle", "head.num_layers=2", "head.mask_token_id=5"),
    "dflash": DFLASH,
}


@pytest.fixture(scope="module")
def heads(smoke_run, tmp_path_factory):
    """kind -> a run directory holding a smoke head of that kind (4 steps, a few seconds each)."""
    runs = {}
    for kind, overrides in KINDS.items():
        run_dir = tmp_path_factory.mktemp(f"spec_{kind}") / "run"
        shutil.copytree(smoke_run, run_dir)
        train(
            smoke_config(
                run_dir, "train.eval_every=0", "train.num_threads=1", "train.max_steps=4", *overrides
            )
        )
        runs[kind] = run_dir
    return runs


def assert_speculators_holds_our_head(model, run_dir, dtype=torch.bfloat16):
    """Every tensor of the trained head (rounded to the export's dtype) and the draft vocabulary map are ours,
    and what speculators took from the verifier - the target's lm_head rows of the draft vocabulary (picked
    by t2d) and final norm - is the target's."""
    loaded = model.state_dict()
    _, ours = read_head(run_dir / "draft_head")
    for name, tensor in ours.items():
        expected = tensor.to(dtype).float()
        if name == "mask_hidden":  # speculators' PEagleDraftModel holds [1, 1, A*H]
            assert loaded[name].shape == (1, 1, expected.numel())
            expected = expected.reshape(1, 1, -1)
        assert torch.equal(loaded[name].float(), expected), name
    vocab = load_vocab_map(run_dir / "draft_head" / "vocab.safetensors")
    assert torch.equal(loaded["d2t"], vocab.d2t) and torch.equal(loaded["t2d"], vocab.t2d)
    assert int(loaded["t2d"].sum()) == model.config.draft_vocab_size == 512
    target = load_file(str(run_dir / "smoke_target" / "model.safetensors"))
    for name, tensor in [
        ("verifier_lm_head", target["lm_head.weight"][vocab.t2d]),
        ("verifier_norm", target["model.norm.weight"]),
    ]:
        assert torch.equal(loaded[f"{name}.weight"], tensor.to(loaded[f"{name}.weight"].dtype)), name
    # Not checked: embed_tokens. speculators 0.9 fills it from the verifier only while it is still NaN, and
    # under transformers 5.19 from_pretrained has re-initialised it by then (a random embedding, unless the
    # user calls `model._load_verifier_weights(overwrite_embed_tokens=True)`); vLLM shares the target's.


@pytest.mark.parametrize("kind", list(KINDS))
def test_speculators_loads_the_export_with_our_weights(heads, kind, tmp_path, monkeypatch):
    run_dir = heads[kind]
    target_config = AutoConfig.from_pretrained(run_dir / "smoke_target")
    monkeypatch.chdir(run_dir)  # a relative target directory, as `target.path` may be
    out = export_head(run_dir / "draft_head", tmp_path / "export", target_config, target_path="smoke_target")
    config = json.loads((out / "config.json").read_text())
    # A local target is named by its absolute directory: loadable from any working directory.
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(
        (run_dir / "smoke_target").resolve()
    )
    weights = load_file(str(out / "model.safetensors"))
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].shape == (1024,)
    monkeypatch.chdir(tmp_path)

    model = speculators.SpeculatorModel.from_pretrained(str(out))

    config_class = {"eagle3": "Eagle3", "peagle": "PEagle", "dflash": "DFlash"}[kind] + "SpeculatorConfig"
    assert type(model.config).__name__ == config_class
    if kind == "dflash":
        assert model.config.aux_hidden_state_layer_ids == [1, 3, 4] and model.config.block_size == 5
    else:
        assert model.config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]
    assert_speculators_holds_our_head(model, run_dir)
    if kind != "eagle3":
        assert (
            model.config.mask_token_id == 5 and model.config.transformer_layer_config.num_hidden_layers == 2
        )


def hub_cache_with(model_dir, cache_dir, repo_id: str) -> None:
    """The Hugging Face cache layout a download of `repo_id` leaves (refs/main -> one snapshot)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache_dir / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_the_verifier_of_a_hub_target_is_its_hub_id(heads, tmp_path, monkeypatch):
    """target.path a hub id (here served from a local Hugging Face cache, offline): the export names the
    target by that id, not by the snapshot directory it was read from, and speculators loads the target
    through it."""
    run_dir, repo_id = heads["eagle3"], "eagle-tests/smoke-target"
    hub_cache_with(run_dir / "smoke_target", tmp_path / "hub", repo_id)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "export"
    overrides = (f"target.path={repo_id}", "target.build=null", f"export.out_dir={out}")
    export(smoke_config(run_dir, *overrides))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {
        "name_or_path": repo_id,
        "architectures": ["LlamaForCausalLM"],
    }
    model = speculators.SpeculatorModel.from_pretrained(str(out))
    assert_speculators_holds_our_head(model, run_dir)


def test_the_identity_check_reads_the_speculators_tensors(heads, tmp_path):
    """export/verify.py's identity check reads mask_hidden [1, 1, A*H] as vLLM does, and checks t2d (which
    only speculators reads) against the head's vocabulary."""
    run_dir = heads["peagle"]
    target_config = AutoConfig.from_pretrained(run_dir / "smoke_target")
    out = export_head(run_dir / "draft_head", tmp_path / "export", target_config, "float32", target_path="t")
    assert export_differences(out, run_dir / "draft_head", "float32") == []
    weights = load_file(str(out / "model.safetensors"))
    assert weights["mask_hidden"].shape == (1, 1, 3 * 256)
    weights["t2d"] = torch.roll(weights["t2d"], 1)  # the right count of tokens, the wrong ones
    save_file(weights, str(out / "model.safetensors"))
    assert export_differences(out, run_dir / "draft_head", "float32") == ["t2d: other values in the export"]
