"""Hidden states from the vLLM engine (capture.engine=vllm, target/capture.py): the layer convention, the
checks on every captured file, the engine settings (CPU connector, parallelism, the 70B recipe), and on the
smoke target: the same states and heads as the transformers path, and a capture killed mid-run that
resumes to the same cache and leaves nothing behind."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from artifacts.cache import CacheSplit
from artifacts.config import check_config, compose
from artifacts.manifest import read_manifest
from target.capture import CaptureLayers, capture_settings, check_and_split
from target.model import capture_aux_states, load_final_norm, load_model, target_hidden_states
from target.reaper import alive, descendants
from target.vllm import llm_kwargs
from tests.helpers import AUX_IDS, REPO, shard_hashes, smoke_config


@pytest.fixture(scope="module")
def smoke_layers(smoke_target_dir):
    cfg = smoke_config(smoke_target_dir.parent)
    return CaptureLayers(AUX_IDS, 6, load_final_norm(cfg.target), 1e-5), cfg


def captured_file(layers, token_ids, states=None):
    """What vLLM's connector writes for one request: its token ids and [T, n_captured, H] states."""
    if states is None:
        states = torch.randn(len(token_ids), len(layers.captured_ids), 256)
    return {"token_ids": torch.tensor(token_ids), "hidden_states": states}


def test_vllm_layer_ids_and_the_final_norm_give_the_transformers_states(smoke_layers):
    # The convention, decided in CaptureLayers: vLLM's id k = the residual entering decoder layer k (HF's
    # hidden_states[k]); id L = the last layer's output before the final norm, which split() applies.
    layers, cfg = smoke_layers
    model = load_model(cfg.target)
    assert float(model.config.rms_norm_eps) == layers.final_norm_eps
    input_ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(0))
    aux_BTNH, final_BTH = target_hidden_states(model, input_ids, torch.ones_like(input_ids), AUX_IDS)
    assert layers.captured_ids == [1, 3, 4, 6]
    with torch.inference_mode(), capture_aux_states(model, layers.captured_ids) as captured:
        model.model(input_ids=input_ids, use_cache=False)
    aux, final = layers.split(torch.stack([captured[i][0] for i in layers.captured_ids], dim=1))
    torch.testing.assert_close(aux, aux_BTNH[0], rtol=0, atol=0)
    torch.testing.assert_close(final, final_BTH[0], rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        hf = model(input_ids, output_hidden_states=True).hidden_states
    for k, layer_id in enumerate(AUX_IDS):
        torch.testing.assert_close(aux[:, k], hf[layer_id][0], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("model_type", "norm_class"),
    [("llama", "llama.modeling_llama.LlamaRMSNorm"), ("gemma2", "gemma2.modeling_gemma2.Gemma2RMSNorm")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_final_state_is_the_targets_own_norm_of_the_last_layer(model_type, norm_class, dtype):
    """Gemma-family targets scale by (1 + w): the capture path computes each family's norm as it does."""
    import importlib

    from transformers import AutoConfig

    from target.capture import final_norm_style

    module, name = norm_class.rsplit(".", 1)
    config = AutoConfig.for_model(model_type, hidden_size=32, rms_norm_eps=1e-6)
    norm = getattr(importlib.import_module(f"transformers.models.{module}"), name)(32, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(32))
    norm.to(dtype)  # as the target holds it; load_final_norm reads the stored weight as fp32
    layers = CaptureLayers([1], 2, norm.weight.detach().float(), 1e-6, final_norm_style(config))
    states = (3 * torch.randn(5, 2, 32)).to(dtype)
    _, final = layers.split(states)
    with torch.no_grad():
        torch.testing.assert_close(final, norm(states[:, 1]), rtol=0, atol=0)


def test_a_target_whose_final_norm_capture_cannot_reproduce_is_refused_by_name():
    from transformers import AutoConfig

    from target.capture import final_norm_style

    with pytest.raises(ValueError, match=r"model_type='phi'.*use capture.engine=hf"):
        final_norm_style(AutoConfig.for_model("phi"))


def test_a_file_of_other_tokens_is_refused_naming_the_conversation(smoke_layers):
    layers, _ = smoke_layers
    data = captured_file(layers, [5, 6, 7, 8])
    with pytest.raises(ValueError, match=r"conversation 'c17'.*position 2"):
        check_and_split(data, [5, 6, 9, 8], layers, "conversation 'c17'")
    with pytest.raises(ValueError, match=r"conversation 'c17'.*position 4 \(4 captured, 5 rendered\)"):
        check_and_split(data, [5, 6, 7, 8, 1], layers, "conversation 'c17'")


def test_all_zero_or_non_finite_states_are_refused_naming_the_sample(smoke_layers):
    layers, _ = smoke_layers
    data = captured_file(layers, [1, 2, 3])
    aux, final = check_and_split(data, [1, 2, 3], layers, "sample 'a'")
    assert aux.shape == (3, 3, 256) and final.shape == (3, 256)
    zeros = captured_file(layers, [1, 2, 3])
    zeros["hidden_states"][1, 2] = 0
    with pytest.raises(ValueError, match="sample 'b'.*all zero"):
        check_and_split(zeros, [1, 2, 3], layers, "sample 'b'")
    nan = captured_file(layers, [1, 2, 3])
    nan["hidden_states"][0, 0, 7] = float("nan")
    with pytest.raises(ValueError, match="sample 'c'.*NaN"):
        check_and_split(nan, [1, 2, 3], layers, "sample 'c'")
    wrong = captured_file(layers, [1, 2, 3], torch.randn(3, 2, 256))
    with pytest.raises(ValueError, match="sample 'd'.*shape"):
        check_and_split(wrong, [1, 2, 3], layers, "sample 'd'")


def test_capture_engine_settings(smoke_layers, tmp_path):
    layers, _ = smoke_layers
    cpu = llm_kwargs(capture_settings("t", layers, tmp_path, {"enforce_eager": True}, "capture.vllm_kwargs"))
    assert cpu["speculative_config"]["method"] == "extract_hidden_states"
    assert cpu["speculative_config"]["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        1, 3, 4, 6
    ]  # fmt: skip
    assert cpu["enable_prefix_caching"] is False  # a cached prefix is never computed, so never captured
    transfer = cpu["kv_transfer_config"]
    assert transfer["kv_connector"] == "SyncHiddenStatesConnector"
    assert transfer["kv_connector_module_path"] == "target.capture_connector"
    assert transfer["kv_connector_extra_config"]["shared_storage_path"] == str(tmp_path)
    assert "tensor_parallel_size" not in cpu and cpu["enforce_eager"] is True
    with pytest.raises(ValueError, match="capture.vllm_kwargs.enable_prefix_caching"):
        capture_settings("t", layers, tmp_path, {"enable_prefix_caching": True}, "capture.vllm_kwargs")
    with pytest.raises(ValueError, match="capture.transfer='nfs'.*file"):
        capture_settings("t", layers, tmp_path, {}, "x", transfer="nfs")
    with pytest.raises(ValueError, match="capture.transfer='fp8'.*CPU build"):
        capture_settings("t", layers, tmp_path, {}, "x", transfer="fp8", on_cpu=True)


def test_the_70b_recipe_composes_tp4_times_two_engines_with_vllms_own_connector(tmp_path, monkeypatch):
    from data_prep.capture import capture_engine

    cfg = compose("config", ["experiment=llama33_70b", f"run_dir={tmp_path}"])
    check_config(cfg)
    assert cfg.target.path == "meta-llama/Llama-3.3-70B-Instruct"
    assert (cfg.capture.engine, cfg.capture.tensor_parallel_size) == ("vllm", 4)
    assert cfg.regen.enabled and cfg.cache.hidden_states and cfg.train.features == "cache"
    assert cfg.cache.aux_layer_ids == [2, 40, 77]
    assert sum(entry.num_samples for entry in cfg.data.mix) == 20000
    layers = CaptureLayers(list(cfg.cache.aux_layer_ids), 80, torch.ones(8192), 1e-5)
    # The stage's engines on an 8-GPU node (as if CUDA were there): two data_prep processes, rank r's
    # engine tensor-parallel over GPUs 4r .. 4r+3, writing through vLLM's own connector (pinned copies on
    # a CUDA stream; ours is for its CPU build).
    vllm = pytest.importorskip("vllm")
    seen = []

    def engine_start(**kwargs):  # what the engine's processes would see; then stop before any real start
        seen.append(os.environ.get("CUDA_VISIBLE_DEVICES"))
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm, "LLM", engine_start)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for rank, devices in [(0, "0,1,2,3"), (1, "4,5,6,7")]:
        engine = capture_engine(cfg, cfg.target.path, layers, tmp_path / f"rank{rank}", rank, True)
        with pytest.raises(RuntimeError, match="no GPU here"), engine:
            pass
        assert seen[-1] == devices and "CUDA_VISIBLE_DEVICES" not in os.environ  # the user's (unset) back
        kwargs = llm_kwargs(engine.settings)
        assert kwargs["tensor_parallel_size"] == 4 and kwargs["gpu_memory_utilization"] == 0.9
        assert kwargs["max_model_len"] == cfg.render.max_length
        assert kwargs["kv_transfer_config"]["kv_connector"] == "ExampleHiddenStatesConnector"
        assert "kv_connector_module_path" not in kwargs["kv_transfer_config"]
        assert kwargs["speculative_config"]["draft_model_config"]["hf_config"][
            "eagle_aux_hidden_state_layer_ids"
        ] == [2, 40, 77, 80]
    assert cfg.export.vllm_kwargs.tensor_parallel_size == 4
    assert cfg.eval.server_args["tensor-parallel-size"] == 4


def test_online_training_refuses_vllm_states_and_says_what_to_do(smoke_run, tmp_path):
    from train.main import run as train

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    from data_prep.main import run as data_prep

    # A tokens-only cache under capture.engine=vllm: nothing captured, and the manifest says so (it crashed
    # at its last line before, after all the work).
    data_prep(smoke_config(run_dir, "cache.hidden_states=false", "capture.engine=vllm"))
    assert read_manifest(run_dir / "cache")["capture"] == {"engine": None, "hidden_states": False}
    with pytest.raises(
        ValueError, match="capture.engine=vllm.*cache.hidden_states=true.*train.features=cache"
    ):
        train(smoke_config(run_dir, "train.features=online", "capture.engine=vllm"))


# On the smoke target through vLLM's CPU build.


@pytest.fixture(scope="module")
def vllm_run(smoke_run, tmp_path_factory):
    """smoke_run's cache made again with a prompt-only vLLM pass: the same samples, vLLM's states."""
    pytest.importorskip("vllm")
    from data_prep.main import run

    run_dir = tmp_path_factory.mktemp("vllm_run")
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    run(smoke_config(run_dir, "capture.engine=vllm"))
    return run_dir


def relative_error(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found.float() - expected.float()).norm() / expected.float().norm())


def test_vllm_states_equal_transformers_states_per_layer(vllm_run, smoke_run):
    manifest = read_manifest(vllm_run / "cache")
    assert manifest["capture"]["engine"] == "vllm" and manifest["capture"]["captured_layer_ids"] == [
        1,
        3,
        4,
        6,
    ]
    assert not list((vllm_run / "cache").glob(".capture-rank*")), "the engine's files outlived it"
    for split in ("train", "eval"):
        found, expected = CacheSplit(vllm_run / "cache", split), CacheSplit(smoke_run / "cache", split)
        assert found.ids == expected.ids and len(found) > 0
        for index in range(len(found)):
            a, b = found[index], expected[index]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
            # Within bf16 rounding (2^-8 relative): the cache stores bf16 either way.
            for k in range(len(AUX_IDS)):
                assert relative_error(a["aux_hidden"][:-1, k], b["aux_hidden"][:-1, k]) < 2**-8, (
                    split,
                    index,
                    k,
                )
            assert relative_error(a["final_hidden"], b["final_hidden"]) < 2**-8, (split, index)


# Slow (26 s): the states themselves are compared per layer by the default test above.
@pytest.mark.slow
def test_heads_trained_on_vllm_and_transformers_states_agree(vllm_run, smoke_run, tmp_path):
    from train.main import run as train

    estimates = []
    for name, source in [("hf", smoke_run), ("vllm", vllm_run)]:
        run_dir = tmp_path / name
        shutil.copytree(source, run_dir)
        overrides = ["train.eval_every=0", "train.save_every=0", "train.num_threads=1", "train.num_epochs=4"]
        result = train(smoke_config(run_dir, *overrides))
        estimates.append([result[f"eval/accept_len_k{k}"] for k in (1, 3)])
    hf, vllm = estimates
    assert hf[1] > 1.05, "the heads learned nothing: the comparison would say nothing"
    assert vllm == pytest.approx(hf, abs=0.02)


@pytest.fixture(scope="module")
def one_pass_run(smoke_target_dir, tmp_path_factory):
    """The smoke target regenerating its answers and capturing their states in the same pass, 4 chunks."""
    pytest.importorskip("vllm")
    from data_prep.main import run

    run_dir = tmp_path_factory.mktemp("one_pass")
    shutil.copytree(smoke_target_dir, run_dir / "smoke_target")
    run(smoke_config(run_dir, *ONE_PASS, experiment="smoke_regen"))
    return run_dir


# 1 MB shards: a chunk of 16 conversations of the smoke target (~2 KB of states a token) takes several.
# Sampled at T=1, two answers to each of 32 prompts: 64 conversations in 4 chunks, each its own seeds, their
# prompts prefilled in steps of 128 tokens (target/vllm_cpu_fixes.py: vLLM's CPU build died on that).
ONE_PASS = [
    "capture.engine=vllm",
    "regen.batch_size=16",
    "regen.max_new_tokens=32",
    "cache.max_shard_mb=1",
    "data.num_samples=32",
    "regen.temperature=1",
    "regen.samples_per_prompt=2",
    "+regen.vllm_kwargs.max_num_batched_tokens=128",  # prompts prefilled in chunks: seeded samples discarded
]


def test_one_pass_samples_are_the_regenerated_conversations(one_pass_run):
    from transformers import AutoTokenizer

    cache = one_pass_run / "cache"
    manifest = read_manifest(cache)
    assert manifest["capture"]["regenerated_in_same_pass"] is True
    assert len(manifest["regeneration_record"]["files"]) == 4
    assert manifest["regeneration"] == {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 32, "seed": 0,
                                        "samples_per_prompt": 2, "include_greedy": False, "seeds": "per_request"}  # fmt: skip
    # Two samples of each prompt, on one side of the split (it hashes the prompt), answered differently.
    conversations = {}
    for split in ("train", "eval"):
        for sample_id in CacheSplit(cache, split).ids:
            conversations.setdefault(sample_id.rsplit("#", 1)[0], []).append((split, sample_id))
    assert len(conversations) > 24 and all(len({s for s, _ in v}) == 1 for v in conversations.values())
    assert sum(len(v) == 2 for v in conversations.values()) > 24  # both samples kept (unless one was empty)
    train = CacheSplit(cache, "train")
    pairs = [
        [train.ids.index(i) for _, i in v]
        for v in conversations.values()
        if len(v) == 2 and v[0][0] == "train"
    ]
    differ = [not torch.equal(train[a]["input_ids"], train[b]["input_ids"]) for a, b in pairs]
    assert sum(differ) >= 0.8 * len(differ)  # the same prompt, other sampled answers
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > 4  # more than one shard per chunk, each about max_shard_mb
    assert max(s["num_bytes"] for s in shards) < 1.2 * 2**20
    tokenizer = AutoTokenizer.from_pretrained(one_pass_run / "smoke_target")
    train = CacheSplit(cache, "train")
    for index in (0, len(train) - 1):
        sample = train[index]
        ids, mask = sample["input_ids"].tolist(), sample["loss_mask"].tolist()
        # The last turn's request: every earlier turn as its prompt (its answers in the loss), then the
        # engine's own answer tokens, all in the loss.
        last_answer = len(mask) - mask[::-1].index(0)
        assert tokenizer.decode(ids[:last_answer]).endswith("assistant\n") and last_answer < len(ids)
        assert not any(mask[: mask.index(1)]) and tokenizer.decode(ids[: mask.index(1)]).endswith(
            "assistant\n"
        )
        assert sample["final_hidden"].float().abs().sum(-1).min() > 0


# Slow (~70 s, a vLLM engine killed and a second run): the default suite kills data_prep's transformers capture
# (test_data_prep_cache.py), eval and export verification with their engines (test_eval_vllm.py).
@pytest.mark.slow
def test_a_capture_killed_mid_run_resumes_to_the_same_cache_and_leaves_nothing(
    one_pass_run, tmp_path, subprocess_env
):
    run_dir = tmp_path / "killed"
    shutil.copytree(one_pass_run / "smoke_target", run_dir / "smoke_target")
    overrides = ["experiment=smoke_regen", f"run_dir={run_dir}", "cache.num_threads=1", *ONE_PASS]
    proc = subprocess.Popen(
        [sys.executable, "data_prep/main.py", *overrides], cwd=REPO, env=subprocess_env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    regenerated = run_dir / "cache" / "regenerated"
    deadline = time.time() + 240
    while not (regenerated / "chunk-00001-of-00004.json").exists() and time.time() < deadline:
        assert proc.poll() is None, "data_prep ended before the kill"
        time.sleep(0.05)
    tree = descendants(proc.pid)
    assert tree, "no engine process to leave behind"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (regenerated / "chunk-00003-of-00004.json").exists(), "the run finished before the kill"
    deadline = time.time() + 30
    while any(alive(*p) for p in tree) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if alive(*p)], "processes outlived the killed stage"
    assert not list((run_dir / "cache").glob(".capture-rank*")), "capture files outlived the killed stage"
    kept = {p.name: p.read_bytes() for p in regenerated.glob("chunk-*.json")}

    from data_prep.main import run

    manifest = run(smoke_config(run_dir, *ONE_PASS, experiment="smoke_regen"))
    assert all((regenerated / name).read_bytes() == data for name, data in kept.items())  # not redone
    assert shard_hashes(run_dir / "cache") == shard_hashes(one_pass_run / "cache")
    assert (
        manifest["regeneration_record"]["files"]
        == read_manifest(one_pass_run / "cache")["regeneration_record"]["files"]
    )
    assert not list((run_dir / "cache").glob(".capture-rank*"))


def test_a_prompt_only_engine_too_short_for_the_samples_is_refused_before_it_starts(smoke_layers, tmp_path):
    from data_prep.capture import capture_engine

    layers, _ = smoke_layers
    cfg = smoke_config(tmp_path, "capture.engine=vllm", "regen.vllm_kwargs.max_model_len=512")  # = max_length
    with pytest.raises(ValueError, match=r"capture.vllm_kwargs.max_model_len=512.*render.max_length=512"):
        capture_engine(cfg, "target", layers, tmp_path / "states", None, regenerating=False)
    assert capture_engine(cfg, "target", layers, tmp_path / "states", None, regenerating=True).settings


def test_cpu_thread_binding_gives_each_tensor_parallel_rank_its_own_cores():
    from target.capture import cpu_thread_binding

    assert cpu_thread_binding(2, [0, 1]) == "0|1"
    assert cpu_thread_binding(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    with pytest.raises(ValueError, match="tensor_parallel_size=4.*may use 2"):
        cpu_thread_binding(4, [0, 1])


def test_tensor_parallel_capture_on_cpu_gives_the_tp1_states(vllm_run, tmp_path, monkeypatch):
    # vllm-cpu runs TP=2 on one NUMA node once each rank is bound to its own core (cpu_thread_binding).
    from vllm import SamplingParams

    from data_prep.capture import capture_engine, capture_layers
    from target.model import load_config

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    cfg = smoke_config(vllm_run, "capture.engine=vllm", "capture.tensor_parallel_size=2")
    layers = capture_layers(cfg, load_config(cfg.target), AUX_IDS)
    cache = CacheSplit(vllm_run / "cache", "train")  # captured at TP=1
    samples = [cache[i] for i in range(4)]
    engine = capture_engine(cfg, str(vllm_run / "smoke_target"), layers, tmp_path / "states", None, False)
    assert len(os.environ["VLLM_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert llm_kwargs(engine.settings)["tensor_parallel_size"] == 2
    with engine:
        outputs = engine.generate([s["input_ids"].tolist() for s in samples], SamplingParams(max_tokens=1))
        for sample, output in zip(samples, outputs):
            aux, final = engine.states(output, sample["input_ids"].tolist(), "tp2")
            for k in range(len(AUX_IDS)):
                assert relative_error(aux[:-1, k], sample["aux_hidden"][:-1, k]) < 2**-8
            assert relative_error(final, sample["final_hidden"]) < 2**-8
    assert not (tmp_path / "states").exists()


def test_capture_computes_in_the_targets_dtype_and_its_settings_are_the_caches_identity(tmp_path):
    from data_prep.capture import capture_identity

    layers = CaptureLayers([1, 3], 6, torch.ones(8), 1e-5)
    settings = capture_settings("/t", layers, tmp_path, {"dtype": "float32", "max_model_len": 64}, "regen.vllm_kwargs",
                                on_cpu=True, dtype="float32")  # fmt: skip
    assert llm_kwargs(settings)["dtype"] == "float32" and settings.extra == {"max_model_len": 64}
    assert (
        llm_kwargs(capture_settings("/t", layers, tmp_path, {}, "x", on_cpu=True, dtype="bfloat16"))["dtype"]
        == "bfloat16"
    )
    with pytest.raises(ValueError, match=r"regen.vllm_kwargs.dtype='bfloat16': .* target.dtype='float32'"):
        capture_settings(
            "/t", layers, tmp_path, {"dtype": "bfloat16"}, "regen.vllm_kwargs", on_cpu=True, dtype="float32"
        )

    def identity(*overrides):
        return capture_identity(smoke_config(tmp_path, "capture.engine=vllm", *overrides))

    base = identity()
    assert base["dtype"] == "float32" and base["vllm_version"]
    for override in ("capture.transfer=fp8", "capture.tensor_parallel_size=2", "target.dtype=bfloat16"):
        assert identity(override) != base, override


def test_an_engine_that_fails_to_start_leaves_no_scratch_directory(tmp_path, monkeypatch):
    vllm = pytest.importorskip("vllm")
    from target.capture import CaptureEngine

    def no_memory(**kwargs):
        raise RuntimeError("not enough memory for the KV cache")

    monkeypatch.setattr(vllm, "LLM", no_memory)
    layers = CaptureLayers([1, 3], 6, torch.ones(8), 1e-5)
    storage = tmp_path / ".capture-rank0"
    settings = capture_settings("/t", layers, storage, {}, "capture.vllm_kwargs", on_cpu=True)
    with pytest.raises(RuntimeError, match="not enough memory"):
        with CaptureEngine(settings, layers, storage):
            pass
    assert not storage.exists()
