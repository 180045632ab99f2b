"""Typed config schemas for every stage, registered in Hydra's ConfigStore.

YAML under `conf/` holds values only; these dataclasses say what each field is and check its type.
A run is one experiment file plus a few overrides, e.g.
`python data_prep/main.py experiment=smoke run_dir=/tmp/smoke`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

# ShareGPT dumps name the assistant after the product that answered; all of them are the assistant.
DEFAULT_ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


@dataclass
class TargetConfig:
    path: str = MISSING  # HF hub id or local directory of the target model (weights + tokenizer)
    revision: str | None = None  # hub revision (branch, tag or commit); ignored for local directories
    dtype: str = "bfloat16"  # dtype the target runs in while caching: bfloat16 | float16 | float32
    chat_template: str | None = None  # Jinja chat template (or a path to one) for tokenizers without one
    build: str | None = (
        None  # build an embedded target at `path` if absent: smoke | smollm2 | smollm2_upgraded
    )


@dataclass
class DataSourceConfig:
    """One source of `data.mix`: a name, then the per-source fields of `data` (source ... num_samples)."""

    name: str = MISSING  # short label; this source's conversation ids become `name/id`, unique across the mix
    source: str = MISSING  # as `data.source`: HF dataset name, `save_to_disk` directory or local file(s)
    split: str = "train"  # split to read from HF datasets sources
    format: str = "auto"  # record format: auto | sharegpt | openai | fields
    messages_field: str | None = None  # field holding the turns (auto: `conversations` or `messages`)
    role_field: str = "role"  # per-turn role key for format=fields
    content_field: str = "content"  # per-turn text key for format=fields
    id_field: str | None = "id"  # record id key; records without one get a hash of their content
    num_samples: int | None = None  # use only the first N valid conversations of this source (None: all)


@dataclass
class DataConfig:
    source: str | None = None  # HF dataset name, `save_to_disk` dir or .json/.jsonl/.parquet file(s)/globs
    mix: list[DataSourceConfig] = field(
        default_factory=list
    )  # sources read in order instead of `source` (keep it null); split..id_field, num_samples: per entry
    split: str = "train"  # split to read from HF datasets sources
    format: str = "auto"  # record format: auto | sharegpt | openai | fields
    messages_field: str | None = None  # field holding the turns (auto: `conversations` or `messages`)
    role_field: str = "role"  # per-turn role key for format=fields (sharegpt uses `from`, openai `role`)
    content_field: str = (
        "content"  # per-turn text key for format=fields (sharegpt uses `value`, openai `content`)
    )
    id_field: str | None = "id"  # record id key; records without one get a hash of their content
    role_map: dict[str, str] = field(
        default_factory=lambda: dict(DEFAULT_ROLE_MAP)
    )  # source role -> system|user|assistant
    system_prompt: str | None = None  # system message added to conversations that have none
    num_samples: int | None = None  # use only the first N valid conversations (None: all)
    max_turns: int | None = None  # keep only the first N question/answer exchanges of each (None: all)
    match: str | None = None  # keep only conversations whose first user turn matches this regex (re.search)
    eval_fraction: float = 0.05  # fraction held out for evaluation, chosen by a hash of the conversation id
    strict: bool = False  # raise on a corrupt or truncated file instead of using its complete records


@dataclass
class RenderConfig:
    max_length: int = 2048  # longest tokenized conversation kept
    overlong: str = (
        "truncate"  # what to do with longer ones: truncate (keep the first max_length tokens) | drop
    )


@dataclass
class RegenConfig:
    enabled: bool = False  # replace every assistant turn with the target's own answer (vLLM, offline API)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling when temperature > 0
    max_new_tokens: int = 512  # cap on each regenerated turn
    seed: int = 0  # sampling seed (vLLM per-request seeds derive from it)
    batch_size: int = (
        256  # conversations per chunk: one vLLM call per turn, saved when done (the resume unit)
    )
    vllm_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm.LLM(...)` arguments (e.g. enforce_eager)


@dataclass
class CaptureConfig:
    """Where the cache's hidden states come from (data_prep; target/capture.py, docs/design.md#capture)."""

    engine: str = "hf"  # hf: a transformers target, after regeneration | vllm: the serving engine (with
    # regen.enabled, in the same pass that regenerates; else a prompt-only pass); targets beyond one device
    tensor_parallel_size: int = 1  # devices per vLLM engine (one engine per data_prep process)
    pipeline_parallel_size: int = 1  # refused above 1: vLLM 0.32 does not capture under pipeline parallel
    transfer: str = "file"  # hs-connectors backend the states travel through: file | fp8 | mooncake
    transfer_args: dict[str, Any] = field(default_factory=dict)  # that backend's settings (e.g. mooncake's)
    batch_size: int = 256  # samples per vLLM call in a prompt-only pass
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra `vllm.LLM(...)` arguments of a
    # prompt-only pass (when regenerating, the engine is regeneration's: regen.vllm_kwargs)


@dataclass
class CacheConfig:
    aux_layer_ids: list[int] | None = (
        None  # EAGLE-3 aux layers, vLLM ids; None: (2, L//2, L-3); [] for EAGLE-1 only
    )
    draft_vocab_size: int = 32000  # draft vocab kept by frequency; >= target vocab means no pruning
    draft_vocab_fill: str = "prompt"  # slots the answers leave: by prompt-token frequency (prompt) | by id
    hidden_states: bool = True  # false: tokens and loss masks only, no target forward (train.features=online)
    max_tokens_per_batch: int = 8192  # padded tokens per target forward
    max_shard_mb: int = 1024  # shard size cap; shards never depend on the number of processes
    num_threads: int | None = None  # torch CPU threads per process (None: torch's default)


@dataclass
class HeadConfig:
    kind: str = "eagle3"  # eagle3 | peagle (EAGLE-3 with parallel drafting) | eagle1
    # EAGLE-3 / P-EAGLE normalisation flags (speculators' names and vLLM's meaning; false = original recipe):
    norm_before_residual: bool = False  # the layer's residual is the normed hidden state, not the raw one
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc
    norm_output: bool = False  # a chain's next step reads the post-norm output (EAGLE-3 TTT; P-EAGLE: unused)
    lm_head_init: str = "random"  # random | target: lm_head = the target's rows of the draft vocab, norm its
    freeze_lm_head: bool = False  # keep lm_head fixed (with lm_head_init=target: the target's rows)
    aux_noise: float = 0.0  # training adds U(-aux_noise, aux_noise) to the aux states (speculators: 0.05)
    num_ttt_steps: int = 7  # EAGLE-3: training-time-test steps K of the rollout (draft positions trained)
    num_depths: int = 3  # P-EAGLE: parallel depths trained (mask slots + 1); serve k <= this
    gamma: float = 0.8  # the loss of draft position k (TTT step or parallel depth) weighs gamma^k
    num_layers: int = 1  # P-EAGLE decoder layers (EAGLE-3's TTT rollout drives one)
    mask_token_id: int | None = None  # P-EAGLE mask slots' token (None: the target's pad, else eos token)
    cod_ratio: float = 1.0  # P-EAGLE: depth d >= 1 trains on ~T*ratio^d anchors (COD); 1.0 keeps all
    eagle1_noise: float = 0.1  # EAGLE-1: input features get U(-noise, noise)
    eagle1_ce_weight: float = 0.1  # EAGLE-1: weight of the soft cross-entropy next to SmoothL1


@dataclass
class OptimConfig:
    lr: float = 1e-4  # peak learning rate (SpecForge's; the official recipe uses 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_ratio: float = 0.015  # fraction of the optimizer steps spent warming up linearly
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio at the last step
    max_grad_norm: float = 0.5  # gradient-norm clip


@dataclass
class TrainConfig:
    num_epochs: int = 1  # passes over the cache's train split
    max_steps: int | None = None  # stop after this many optimizer steps (the schedule is sized to it)
    num_samples: int | None = None  # train on the cache's first N train samples only (data-scaling runs)
    batch_size: int = 4  # samples per micro-batch per process
    gradient_accumulation_steps: int = 1  # micro-batches per optimizer step
    # no | bf16 | fp16 (fp32 master weights either way); default bf16, or no on a CPU without bf16 arithmetic
    mixed_precision: str = "${machine_precision:bf16}"
    features: str = "cache"  # the target's hidden states: cache (read from data_prep's cache) | online
    # (the frozen target runs on each micro-batch beside the head; the cache needs cache.hidden_states=false)
    teacher_chunk_size: int = 2048  # tokens per full-vocab teacher logits chunk (memory bound)
    log_every: int = 10  # status line (and W&B point) every N optimizer steps
    eval_every: int = 100  # held-out eval every N optimizer steps (0: only at the end)
    save_every: int = 200  # checkpoint every N optimizer steps (0: only at the end)
    keep_last: int = 2  # checkpoints kept
    resume: str = "never"  # never | always (continue from the newest checkpoint; error without one) | auto
    resume_changed: bool = False  # resume although trajectory settings differ from the checkpoint's (logged)
    init_from: str | None = None  # warm start: a final head directory or a checkpoint directory
    report_to: str = "none"  # none | wandb (W&B through accelerate; offline mode needs no account)
    wandb_project: str = "eagle-heads"  # W&B project name
    wandb_mode: str = "offline"  # offline | online
    num_threads: int | None = None  # torch CPU threads per process (None: torch's default)


@dataclass
class ExportConfig:
    head_dir: str | None = None  # the trained head to export (None: <run_dir>/draft_head)
    out_dir: str | None = None  # where the export goes (None: <run_dir>/export)
    format: str = "speculators"  # EAGLE-3: speculators | plain; an EAGLE-1 head is always a plain Llama
    dtype: str = "bfloat16"  # weight dtype written: bfloat16 | float16 | float32
    num_speculative_tokens: int = 3  # k written into the speculators config and decoded by verify
    verify: bool = False  # prove it in vLLM: load + generate, then acceptance parity with the reference
    verify_num_prompts: int = 8  # held-out prompts (the cache's eval split, first user turn) both decode
    verify_max_new_tokens: int = 64  # tokens generated per prompt
    verify_dtype: str = "float32"  # compute dtype of vLLM and the reference (parity is tight in fp32)
    verify_tolerance: float = 0.02  # max gap: relative on mean acceptance length, absolute per position
    vllm_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm.LLM(...)` arguments for the verification (e.g. gpu_memory_utilization)


@dataclass
class EvalHeadConfig:
    name: str = "head"  # label in reports (compare mode: one entry per head)
    method: str = (
        "export"  # export (a trained head: EAGLE-3 / P-EAGLE / EAGLE-1) | ngram (vLLM's prompt lookup)
    )
    path: str | None = None  # export directory to serve (None: <run_dir>/export); unused for ngram
    num_speculative_tokens: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])  # the k sweep
    prompt_lookup_max: int = 4  # ngram: longest n-gram matched in the prompt and output so far
    prompt_lookup_min: int = 1  # ngram: shortest n-gram matched


@dataclass
class WorkloadConfig:
    name: str = MISSING  # label in reports
    source: str = MISSING  # chat (the cache's held-out prompts) | code (HumanEval) | path to a JSONL
    num_prompts: int = 32  # prompts sent per measured run
    max_tokens: int = 128  # output tokens per request


@dataclass
class EvalConfig:
    heads: list[EvalHeadConfig] = field(default_factory=lambda: [EvalHeadConfig()])  # heads to serve
    workloads: list[WorkloadConfig] = field(
        default_factory=lambda: [WorkloadConfig("chat", "chat"), WorkloadConfig("code", "code")]
    )  # what to send
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])  # requests in flight
    baseline: bool = True  # also serve the target without speculation (speedups need it)
    offline: bool = False  # no vLLM: acceptance only, from the reference decoder on the exported heads
    temperature: float = 0.0  # sampling temperature of every request (0: greedy)
    ignore_eos: bool = False  # generate max_tokens even past the end of an answer
    enable_threshold: float = 1.05  # recommend a head where its best speedup reaches this
    serve_schedule: bool = True  # serve each recommended per-batch-size k schedule once and measure it
    out_dir: str | None = None  # report directory (None: <run_dir>/eval)
    server_args: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm serve` flags, name -> value (true: a bare flag), e.g. max-model-len: 4096
    startup_timeout_s: float = 900.0  # wait this long for a server's /health
    request_timeout_s: float = 600.0  # per request
    report_to: str = "none"  # none | wandb (offline mode needs no account)
    wandb_project: str = "eagle-heads"  # W&B project name
    wandb_mode: str = "offline"  # offline | online


@dataclass
class GridConfig:
    """train/grid.py: recipes trained side by side on one cache (conf/grid/*.yaml)."""

    name: str = "grid"  # results go to <run_dir>/grid/<name>/
    max_steps: int = 300  # optimizer steps of every variant (the learning-rate schedule is sized to it)
    variants: dict[str, list[str]] = field(
        default_factory=dict
    )  # variant name -> overrides of the train stage (head.*, optim.*, train.*); [] = the config as it is
    acceptance_prompts: int = 16  # held-out prompts the reference decoder drafts per variant (0: skip)
    acceptance_max_new_tokens: int = 96  # tokens generated per prompt
    num_speculative_tokens: int = 3  # k of the acceptance measured and of the estimate tabulated


@dataclass
class PipelineConfig:
    """One config for every stage, so one experiment file and the same overrides drive them all."""

    run_dir: str = MISSING  # run directory shared by all stages (cache/, ckpt/, head/, report/)
    seed: int = 0  # seed for anything random
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    render: RenderConfig = field(default_factory=RenderConfig)
    regen: RegenConfig = field(default_factory=RegenConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    grid: GridConfig = field(default_factory=GridConfig)


# (key, test, what it must be): values that would otherwise fail deep inside a stage, or not at all.
POSITIVE = (lambda v: v is not None and v > 0, "> 0")
CHECKS = [
    ("train.batch_size", *POSITIVE),
    ("train.gradient_accumulation_steps", *POSITIVE),
    ("train.num_epochs", *POSITIVE),
    ("train.max_steps", lambda v: v is None or v > 0, "> 0 or null (the epochs decide)"),
    ("train.num_samples", lambda v: v is None or v > 0, "> 0 or null (all)"),
    ("train.keep_last", *POSITIVE),
    ("train.features", lambda v: v in ("cache", "online"), "cache or online"),
    ("capture.engine", lambda v: v in ("hf", "vllm"), "hf or vllm"),
    ("capture.tensor_parallel_size", *POSITIVE),
    ("capture.batch_size", *POSITIVE),
    ("train.eval_every", lambda v: v >= 0, ">= 0 (0: only at the end)"),
    ("train.save_every", lambda v: v >= 0, ">= 0 (0: only at the end)"),
    ("optim.lr", *POSITIVE),
    ("optim.weight_decay", lambda v: v >= 0, ">= 0"),
    ("optim.warmup_ratio", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("optim.max_grad_norm", *POSITIVE),
    ("head.num_ttt_steps", *POSITIVE),
    ("head.num_depths", *POSITIVE),
    ("eval.concurrency", lambda v: bool(v) and all(c > 0 for c in v), "a non-empty list of values > 0"),
]


def unknown_keys(node, prefix: str = "") -> list[str]:
    """Keys of `node` (recursively) that its schema dataclass does not declare; free-form dicts (vLLM
    arguments, role maps) hold any keys."""
    from omegaconf import ListConfig

    found = []
    if isinstance(node, ListConfig) and not node._is_none():
        for index, item in enumerate(node):
            found += unknown_keys(item, f"{prefix}[{index}]")
    elif (
        isinstance(node, DictConfig)
        and not node._is_none()
        and dataclasses.is_dataclass(OmegaConf.get_type(node))
    ):
        known = {f.name for f in dataclasses.fields(OmegaConf.get_type(node))}
        for key in node:
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in known and not (not prefix and key == "hydra"):
                found.append(path)
            elif key in known:
                found += unknown_keys(node._get_node(key), path)
    return found


def check_config(cfg: DictConfig) -> None:
    """Refuse, naming the key, what the schema does not know (an override added with `+` is otherwise
    accepted and silently ignored) and values no stage can use - before any stage starts work."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError(
            f"unknown config keys {unknown}: not settings of any stage (a typo? every key is in "
            "artifacts/config.py)"
        )
    for key, test, wanted in CHECKS:
        value = OmegaConf.select(cfg, key)
        if not test(value):
            raise ValueError(f"{key}={value}: must be {wanted}")
    for index, workload in enumerate(cfg.eval.workloads):
        for field_name in ("num_prompts", "max_tokens"):
            if not workload[field_name] > 0:
                raise ValueError(f"eval.workloads[{index}].{field_name}={workload[field_name]}: must be > 0")
    for index, head in enumerate(cfg.eval.heads):
        ks = list(head.num_speculative_tokens)
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"eval.heads[{index}].num_speculative_tokens={ks}: give k values >= 1")


def register_configs() -> None:
    """Register the schemas so YAML under conf/ is type-checked against them."""
    cs = ConfigStore.instance()
    cs.store(name="pipeline_schema", node=PipelineConfig)


def _package_file(name: str) -> str:
    return str(Path(__file__).parent / "smoke_data" / name)


def _sharegpt_json() -> str:
    from artifacts.assets import sharegpt_json_path

    return str(sharegpt_json_path())


def half_precision_computes_here() -> bool:
    """Whether this machine has arithmetic for bfloat16 and float16: a GPU, a non-x86 CPU, or an x86 CPU
    with AVX512-BF16 or AMX. An x86 CPU without them (AVX2 only) emulates half precision, several times
    slower than float32: measured on a 2-core AVX2 EPYC, vLLM regenerates at ~20 tok/s in bf16 against ~100
    in fp32, and a P-EAGLE training step of the main job takes ~45 s under bf16 autocast against ~2.3 s in
    fp32 (docs/benchmarks.md#half-precision-on-a-cpu-without-it)."""
    import platform

    import torch

    if torch.cuda.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def machine_dtype(wanted: str) -> str:
    """`${machine_dtype:bfloat16}`: `wanted`, or float32 where half precision does not compute natively."""
    return wanted if half_precision_computes_here() else "float32"


def machine_precision(wanted: str) -> str:
    """`${machine_precision:bf16}` (train.mixed_precision): `wanted`, or no autocast where half precision
    does not compute natively."""
    return wanted if half_precision_computes_here() else "no"


# `${smoke_data:conversations.jsonl}` and `${sharegpt_json:}` in conf/data/*.yaml; `${machine_dtype:bfloat16}`
# in conf/target/*.yaml and `${machine_precision:bf16}` as train.mixed_precision's default.
OmegaConf.register_new_resolver("smoke_data", _package_file, replace=True)
OmegaConf.register_new_resolver("sharegpt_json", _sharegpt_json, replace=True)
OmegaConf.register_new_resolver("machine_dtype", machine_dtype, replace=True)
OmegaConf.register_new_resolver("machine_precision", machine_precision, replace=True)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a stage's main.py would get for these command-line overrides (for tests and scripts)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
