"""The real Hydra configs compose, and the typed schema rejects bad values."""

import re
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from artifacts.config import check_config, compose, export_format_setting, machine_dtype, machine_precision
from artifacts.manifest import read_manifest
from target.model import default_aux_layer_ids
from tests.helpers import REPO


def test_default_data_prep_config_is_smollm2_on_sharegpt():
    cfg = compose("config", ["run_dir=/tmp/x"])
    assert cfg.target.build == "smollm2" and cfg.target.path.endswith("SmolLM2-135M-Instruct")
    assert cfg.cache.draft_vocab_size == 32000 and cfg.cache.aux_layer_ids is None
    assert OmegaConf.to_container(cfg.data)["source"] == "${sharegpt_json:}"


@pytest.mark.parametrize(
    "machine, avx512_bf16, amx, native",
    [
        ("x86_64", False, False, False),  # AVX2 only: half precision emulated, several times slower
        ("x86_64", True, False, True),
        ("x86_64", False, True, True),
        ("aarch64", False, False, True),
    ],
)
def test_half_precision_only_where_the_machine_computes_it(monkeypatch, machine, avx512_bf16, amx, native):
    import platform

    import torch

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert machine_dtype("bfloat16") == ("bfloat16" if native else "float32")
    assert machine_dtype("float16") == ("float16" if native else "float32")
    assert machine_dtype("float32") == "float32"
    assert machine_precision("bf16") == ("bf16" if native else "no")
    cfg = compose("config", ["experiment=smollm2", "run_dir=/tmp/x"])
    assert cfg.target.dtype == ("bfloat16" if native else "float32")
    assert cfg.train.mixed_precision == ("bf16" if native else "no")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert machine_dtype("bfloat16") == "bfloat16" and machine_precision("bf16") == "bf16"


def test_the_main_job_runs_every_engine_in_the_targets_dtype():
    cfg = compose("config", ["experiment=smollm2", "run_dir=/tmp/x"])
    engines = (cfg.regen.vllm_kwargs, cfg.capture.vllm_kwargs, cfg.eval.server_args)
    assert [engine.dtype for engine in engines] == [cfg.target.dtype] * 3


def test_the_main_job_and_its_comparisons_train_what_measured_best():
    """docs/recipe.md#objectives: D-PACE over the depths, TTT steps and blocks; NLA per token for the main
    job's P-EAGLE head, forward KL for the comparisons (what was measured for them)."""
    for experiment, loss in (("smollm2", "nla"), ("smollm2_eagle3", "kl"), ("smollm2_dflash", "kl")):
        cfg = compose("config", [f"experiment={experiment}", "run_dir=/tmp/x"])
        assert (cfg.head.position_weights, cfg.train.loss) == ("dpace", loss), experiment


def test_smoke_experiment_composes_with_explicit_layer_ids():
    cfg = compose("config", ["experiment=smoke", "run_dir=/tmp/x"])
    assert cfg.target.path == "/tmp/x/smoke_target" and cfg.target.build == "smoke"
    assert list(cfg.cache.aux_layer_ids) == [1, 3, 4]
    assert cfg.data.source.endswith("artifacts/smoke_data/conversations.jsonl")
    OmegaConf.resolve(cfg)


def test_schema_rejects_a_wrongly_typed_value():
    with pytest.raises(ConfigCompositionException, match="max_shard_mb"):
        compose("config", ["experiment=smoke", "run_dir=/tmp/x", "cache.max_shard_mb=lots"])


def installed_env(subprocess_env) -> dict:
    """The environment of a user's shell: the stages import from the installed package, not PYTHONPATH."""
    return {k: v for k, v in subprocess_env.items() if k != "PYTHONPATH"}


# export and eval run from the package the same way (slow, ~9 s each: the default suite's budget)
@pytest.mark.parametrize(
    "stage",
    ["data_prep", "train", *(pytest.param(s, marks=pytest.mark.slow) for s in ("export", "eval", "watch"))],
)
def test_entry_script_runs_from_the_installed_package(stage, tmp_path, subprocess_env):
    # From another directory, no PYTHONPATH: every import of the stage resolves through `pip install -e .`
    # (no entry script edits sys.path). --cfg job composes the config and prints it without running.
    cmd = [
        sys.executable,
        str(REPO / stage / "main.py"),
        "--cfg",
        "job",
        "experiment=smoke",
        f"run_dir={tmp_path}",
    ]
    result = subprocess.run(
        cmd, cwd=tmp_path, env=installed_env(subprocess_env), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"run_dir: {tmp_path}" in result.stdout
    assert "sys.path" not in (REPO / stage / "main.py").read_text()


def test_accelerate_launch_runs_the_stage(tmp_path, subprocess_env):
    # The command users type, on one CPU process here, from outside the repository and without PYTHONPATH.
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
           str(REPO / "data_prep/main.py"), "experiment=smoke", f"run_dir={tmp_path}"]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=tmp_path, env=installed_env(subprocess_env), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert read_manifest(tmp_path / "cache")["complete"] is True
    assert "caching" in result.stderr and "tok/s" in result.stderr  # the disk estimate and the progress bar


EXPERIMENTS = sorted(path.stem for path in (REPO / "conf" / "experiment").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((REPO / "conf" / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_resolves(experiment):
    # Every file in conf/experiment/, so a new one is covered the day it is added.
    cfg = compose("config", [f"experiment={experiment}", "run_dir=/tmp/x"])
    check_config(cfg)  # no unknown key, no unusable value
    OmegaConf.resolve(cfg)
    typed = OmegaConf.to_object(cfg)  # every value checked against the schema; nothing left MISSING
    assert typed.target.path and (typed.data.source or typed.data.mix)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_a_dflash_head_trains_the_block_it_is_served_with_by_default(k):
    overrides = [
        f"export.num_speculative_tokens={k}",
        f"eval.heads=[{{name: h, num_speculative_tokens: [{k}]}}]",
    ]
    cfg = compose("config", ["head.kind=dflash", *overrides, "run_dir=/tmp/x"])
    check_config(cfg)
    assert cfg.head.block_size == k + 1 and cfg.head.min_block_size is None


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda path: path.stem)
def test_every_accelerate_config_loads_for_one_8_gpu_node(path):
    config = load_config_from_file(str(path))
    assert config.distributed_type in ("MULTI_GPU", "DEEPSPEED")
    assert config.num_machines == 1 and config.num_processes == 8 and config.mixed_precision == "bf16"


# Rows of the hub splits the GPU recipes read, from the dataset cards; the training schedule is sized on them.
HUB_ROWS = {
    ("Aeala/ShareGPT_Vicuna_unfiltered", "train"): 121_000,  # about: the viewer says 121k
    ("HuggingFaceH4/ultrachat_200k", "train_sft"): 207_865,
    ("HuggingFaceH4/ultrachat_200k", "train_gen"): 256_032,
}


@pytest.mark.parametrize("experiment, num_layers", [("llama31_8b", 32), ("qwen3_8b", 36)])
def test_gpu_recipe(experiment, num_layers):
    cfg = compose("config", [f"experiment={experiment}", "run_dir=/tmp/x"])
    assert cfg.target.build is None and cfg.target.dtype == "bfloat16" and "/" in cfg.target.path  # hub id
    assert list(cfg.cache.aux_layer_ids) == default_aux_layer_ids(num_layers)  # (2, L//2, L-3), explicit
    assert cfg.cache.draft_vocab_size == 32000 and cfg.head.kind == "eagle3" and cfg.head.num_ttt_steps == 7
    assert cfg.regen.enabled and cfg.regen.vllm_kwargs.max_model_len == cfg.render.max_length >= 2048

    assert [entry.source for entry in cfg.data.mix] == [
        "Aeala/ShareGPT_Vicuna_unfiltered",
        "HuggingFaceH4/ultrachat_200k",
        "HuggingFaceH4/ultrachat_200k",
    ]
    num_conversations = sum(
        min(HUB_ROWS[(entry.source, entry.split)], entry.num_samples or float("inf"))
        for entry in cfg.data.mix
    )
    assert 450_000 <= num_conversations <= 650_000  # the EAGLE-3 paper's scale (~530k)

    # The schedule: ~500k conversations x epochs / global batch, on the 8 GPUs of the accelerate configs.
    num_gpus = load_config_from_file(str(REPO / "conf" / "accelerate" / "zero2.yaml")).num_processes
    global_batch = cfg.train.batch_size * cfg.train.gradient_accumulation_steps * num_gpus
    num_steps = num_conversations * (1 - cfg.data.eval_fraction) * cfg.train.num_epochs / global_batch
    assert 10_000 <= num_steps <= 100_000 and cfg.train.max_steps is None
    assert 100 <= cfg.optim.warmup_ratio * num_steps <= 0.02 * num_steps
    assert cfg.optim.lr == 1e-4 and cfg.optim.max_grad_norm == 0.5 and cfg.train.mixed_precision == "bf16"
    assert cfg.train.save_every <= num_steps / 10 and cfg.train.report_to == "wandb"
    assert cfg.train.loss == "lk"  # the published gain at scale (docs/recipe.md#objectives)
    assert cfg.head.position_weights == "decay"  # D-PACE: within noise for EAGLE-3 here, published for DFlash

    assert (
        cfg.export.verify
        and export_format_setting(cfg.export) == "speculators"
        and cfg.export.vllm_kwargs.max_model_len
    )
    assert [list(head.num_speculative_tokens) for head in cfg.eval.heads] == [[1, 2, 3, 4, 5]]
    assert list(cfg.eval.concurrency) == [1, 2, 4, 8, 16, 32, 64] and list(cfg.eval.temperature) == [0, 1]
    assert [w.source for w in cfg.eval.workloads] == ["chat", "code"]
    assert all(w.num_prompts >= 64 for w in cfg.eval.workloads)  # at least one full batch at concurrency 64
    assert cfg.eval.server_args["max-model-len"] >= cfg.render.max_length


def test_a_mix_entry_can_be_overridden_from_the_command_line():
    # What the README suggests for a smaller first run.
    cfg = compose("config", ["experiment=llama31_8b", "run_dir=/tmp/x", "data.mix.1.num_samples=1000"])
    assert [entry.num_samples for entry in cfg.data.mix] == [None, 1000, None]


@pytest.mark.parametrize(
    "override, message",
    [
        ("+train.nonsense=1", "unknown config keys ['train.nonsense']"),
        ("+nonsense=1", "unknown config keys ['nonsense']"),
        ("train.batch_size=0", "train.batch_size=0: must be > 0"),
        ("train.gradient_accumulation_steps=0", "train.gradient_accumulation_steps=0: must be > 0"),
        ("optim.lr=-1", "optim.lr=-1.0: must be > 0"),
        ("eval.concurrency=[0]", "eval.concurrency=[0]: must be a non-empty list"),
        (
            "eval.workloads=[{name: w, source: chat, num_prompts: 0}]",
            "eval.workloads[0].num_prompts=0: must be > 0",
        ),
        ("eval.heads=[{name: h, num_speculative_tokens: []}]", "eval.heads[0].num_speculative_tokens=[]"),
        # Each value accepted silently or refused late before (issue 25, docs/hardening.md):
        ("export.num_speculative_tokens=-2", "export.num_speculative_tokens=-2: must be > 0; change"),
        ("export.num_speculative_tokens=0", "export.num_speculative_tokens=0: must be > 0"),
        ("regen.max_new_tokens=0", "regen.max_new_tokens=0: must be > 0; change regen.max_new_tokens"),
        ("train.resume=maybe", "train.resume=maybe: must be never, always (true) or auto"),
        ("head.kind=medusa", "head.kind=medusa: must be one of eagle3, peagle, dflash, eagle1"),
        ("head.block_size=1", "head.block_size=1: must be >= 2"),
        ("capture.pipeline_parallel_size=2", "capture.pipeline_parallel_size=2: must be 1"),
        ("capture.transfer=mooncake", "capture.transfer=mooncake: must be one of file, fp8 (mooncake is not"),
        ("process_group_timeout_s=0", "process_group_timeout_s=0.0: must be > 0"),
        (
            "target.build=llama",
            "target.build=llama: must be one of smoke, smoke_agent, smoke_moe, smollm2, smollm2_upgraded or null",
        ),
        ("eval.heads=[{name: a}, {name: a, method: ngram}]", "eval.heads[].name=['a', 'a']: must be unique"),
        (
            "eval.workloads=[{name: w, source: chat}, {name: w, source: code}]",
            "eval.workloads[].name=['w', 'w']",
        ),
        ("train.loss=kll", "train.loss='kll': 'kll' is not a term; want one of kl, rkl, tv, nla, lk"),
        ("train.loss='0.5*kl+0.5*jsd'", "train.loss='0.5*kl+0.5*jsd': '0.5*jsd' is not a term"),
        ("train.loss=0*kl", "train.loss='0*kl': each divergence at most once, and some weight > 0"),
        ("train.loss=kl+kl", "train.loss='kl+kl': each divergence at most once"),
        ("train.lk_eta=-1", "train.lk_eta=-1.0: must be >= 0"),
        ("head.position_weights=pace", "head.position_weights=pace: must be one of decay, dpace"),
        ("head.dpace_norm=token", "head.dpace_norm=token: must be one of position, all"),
        ("train.alpha_on=full", "train.alpha_on=full: must be one of target, draft_vocab"),
        # settings that act only with another (issue 62: accepted and ignored)
        ("head.dpace_norm=all", "head.dpace_norm=all: must be position without D-PACE"),
        ("head.dpace_a=0.2", "head.dpace_a=0.2: must be 0.5 without D-PACE"),
        ("train.alpha_on=draft_vocab", "train.alpha_on=draft_vocab: must be target for train.loss=kl"),
        (
            "eval.temperature=[-1]",
            "eval.temperature=[-1.0]: must be a non-empty list of distinct values in [0, 2]",
        ),
        (
            "eval.temperature=[3]",
            "eval.temperature=[3.0]: must be a non-empty list of distinct values in [0, 2]",
        ),
        (
            "eval.temperature=[0,0]",
            "eval.temperature=[0.0, 0.0]: must be a non-empty list of distinct values",
        ),
        (
            "eval.concurrency=[1,1]",
            "eval.concurrency=[1, 1]: must be a non-empty list of distinct values > 0",
        ),
    ],
)
def test_bad_settings_are_refused_before_any_stage_works_naming_the_key(tmp_path, override, message):
    from train.main import run

    cfg = compose("config", ["experiment=smoke", f"run_dir={tmp_path}", override])
    with pytest.raises(ValueError, match=re.escape(message)):
        run(cfg)  # before reading anything: the run directory is empty
    # Free-form dicts (vLLM arguments) hold any keys.
    check_config(
        compose("config", ["experiment=smoke", "run_dir=/x", "+eval.server_args.tensor-parallel-size=2"])
    )


def test_no_aux_layers_is_refused_where_the_cache_is_built_unless_for_eagle1():
    from target.model import resolve_aux_layer_ids

    for kind in ("eagle3", "peagle"):
        with pytest.raises(
            ValueError, match=rf"cache.aux_layer_ids=\[\]: a head.kind={kind} head needs at least one"
        ):
            resolve_aux_layer_ids([], 30, kind)
    assert resolve_aux_layer_ids([], 30, "eagle1") == []  # EAGLE-1 reads only the final state


@pytest.mark.parametrize(
    "overrides, message",
    [
        # A P-EAGLE head trained with two parallel depths, exported and served with k=3.
        (
            ["head.kind=peagle", "head.num_depths=2"],
            "export.num_speculative_tokens=3: must be <= head.num_depths=2",
        ),
        # A packed row must hold the longest sample.
        (["train.pack_length=300"], "train.pack_length=300: must be >= render.max_length=512"),
        # One depth trains no mask slot: the mask state's unused parameter stops DDP at step 2.
        (
            ["head.kind=peagle", "head.num_depths=1", "export.num_speculative_tokens=1"],
            "head.num_depths=1: must be >= 2 for head.kind=peagle",
        ),
        # A DFlash head trained with blocks of 4 (3 mask slots), exported or served with more drafts; a
        # bidirectional one trained on full blocks only, exported or served with fewer.
        (
            ["head.kind=dflash", "head.block_size=4", "export.num_speculative_tokens=5"],
            "export.num_speculative_tokens=5: must be one of [3], the k a dflash head of head.block_size=4, "
            "head.min_block_size=None, head.causal=False drafts as trained",
        ),
        (
            ["head.kind=dflash", "head.block_size=8", "export.num_speculative_tokens=3"],
            "export.num_speculative_tokens=3: must be one of [7]",
        ),
        (
            [
                "head.kind=dflash",
                "head.block_size=8",
                "head.min_block_size=5",
                "export.num_speculative_tokens=3",
            ],
            "export.num_speculative_tokens=3: must be one of [4, 5, 6, 7]",
        ),
        (
            ["head.kind=dflash", "head.block_size=4", "head.min_block_size=6"],
            "head.min_block_size=6: must be <= head.block_size=4",
        ),
        (
            ["head.kind=dflash", "head.block_size=4", "head.norm_output=true"],
            "head.kind=dflash: must be eagle3 or peagle for head.norm_output",
        ),
        (
            ["head.kind=eagle1", "head.aux_layer_ids=[2]"],
            "head.kind=eagle1: must be eagle3 or peagle for head.aux_layer_ids",
        ),
        (
            ["head.kind=eagle1", "head.fc_norm=true"],
            "head.kind=eagle1: must be eagle3 or peagle for head.fc_norm",
        ),
        (
            ["eval.heads=[{name: n, method: ngram, prompt_lookup_min: 5}]"],
            "eval.heads[0].prompt_lookup_min=5",
        ),
        (
            ["head.kind=eagle1", "head.position_weights=dpace"],
            "head.position_weights=dpace: must be decay for an eagle1 head (EAGLE-1 trains one position)",
        ),
        (
            ["eval.heads=[{name: n, method: ngram, draft_sample_method: probabilistic}]"],
            "eval.heads[0].draft_sample_method=probabilistic: must be greedy for ngram",
        ),
        (
            ["eval.offline=true", "eval.temperature=[0,1]"],
            "eval.temperature=[0.0, 1.0]: must be [0] with eval.offline",
        ),
        (
            ["head.kind=dflash", "head.block_size=4", "head.sliding_window=64"],
            "head.sliding_window=64: must be null for a dflash head",
        ),
        (["head.sliding_window=3"], "head.sliding_window=3: must be more than the drafted tokens"),
    ],
)
def test_settings_wrong_together_are_refused_when_composed(overrides, message):
    cfg = compose("config", ["experiment=smoke", "run_dir=/x", *overrides])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_config(cfg)


@pytest.mark.parametrize(
    "head",
    [["head.kind=peagle", "export.num_speculative_tokens=2"], ["head.kind=dflash", "head.block_size=4"]],
)
def test_evals_k_sweep_is_not_a_training_setting(head):
    """A head trained for fixed depths or blocks composes with any eval k sweep (eval serves it at the k it
    drafts, eval/grid.py served_ks): train, export and data_prep are not refused for an eval setting."""
    check_config(compose("config", ["experiment=smoke", "run_dir=/x", *head, "eval.heads=[{name: h}]"]))


def test_the_schemas_head_kinds_are_the_heads_package_kinds():
    from artifacts.config import HEAD_KINDS
    from heads.kinds import KINDS

    assert set(HEAD_KINDS) == set(KINDS)
