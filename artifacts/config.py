"""Typed config schemas for every stage, registered in Hydra's ConfigStore.

YAML under `conf/` holds values only; these dataclasses say what each field is and check its type.
A run is one experiment file plus a few overrides, e.g.
`python data_prep/main.py experiment=smoke run_dir=/tmp/smoke`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass(frozen=True)
class Check:
    """What a setting's value must satisfy, and how to say so: `{key}={value}: must be {wanted}`."""

    test: Callable[[Any], bool]
    wanted: str


def checked(
    default: Any = dataclasses.MISSING, check: Check | None = None, factory: Any = dataclasses.MISSING
):
    """A schema field with its check beside it; `check_config` applies every one when a config is composed."""
    return field(default=default, default_factory=factory, metadata={"check": check})


def one_of(*choices) -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(map(str, choices)))


def optional(check: Check) -> Check:
    return Check(lambda v: v is None or check.test(v), f"{check.wanted} or null")


def within(low: float, high: float, high_closed: bool = True, low_closed: bool = True) -> Check:
    def test(v):
        return (low <= v if low_closed else low < v) and (v <= high if high_closed else v < high)

    return Check(test, f"in {'[' if low_closed else '('}{low}, {high}{']' if high_closed else ')'}")


POSITIVE = Check(lambda v: v is not None and v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v is not None and v >= 0, ">= 0")
NON_EMPTY = Check(lambda v: bool(v), "non-empty")
DTYPE = one_of("bfloat16", "float16", "float32")
REPORT_TO = one_of("none", "wandb")
WANDB_MODE = one_of("offline", "online")
RECORD_FORMATS = ("auto", "sharegpt", "openai", "fields")
RECORD_FORMAT = one_of(*RECORD_FORMATS)
HEAD_KINDS = ("eagle3", "peagle", "dflash", "eagle1")  # heads/kinds.py's KINDS (tests hold them equal)
RESUME = Check(
    lambda v: str(v).lower() in ("never", "always", "auto", "true", "false"), "never, always (true) or auto"
)
POSITIVE_LIST = Check(
    lambda v: bool(v) and all(x > 0 for x in v) and len(set(v)) == len(v),
    "a non-empty list of distinct values > 0",
)
# vLLM's sampling accepts temperatures in [0, 2]; each swept value is measured (and resumed) once.
TEMPERATURES = Check(
    lambda v: bool(v) and all(0 <= t <= 2 for t in v) and len(set(v)) == len(v),
    "a non-empty list of distinct values in [0, 2] (vLLM serves temperatures up to 2)",
)


# train.loss's divergences (train/objectives.py computes them) and its grammar: one name, or a weighted sum.
DIVERGENCES = ("kl", "rkl", "tv", "nla", "lk")
_LOSS_TERM = re.compile(r"^\s*(?:((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?([a-z]+)\s*$")


def loss_terms(spec: str) -> tuple[tuple[str, float], ...]:
    """train.loss as ((divergence, weight), ...): "kl" -> (("kl", 1.0),), "0.1*kl+0.9*tv" -> two terms;
    ValueError naming the term at fault."""
    terms = []
    for part in str(spec).split("+"):
        match = _LOSS_TERM.match(part)
        if match is None or match.group(2) not in DIVERGENCES:
            raise ValueError(
                f"train.loss={spec!r}: {part.strip()!r} is not a term; want one of {', '.join(DIVERGENCES)} "
                "or a weighted sum such as 0.1*kl+0.9*tv"
            )
        terms.append((match.group(2), float(match.group(1)) if match.group(1) else 1.0))
    names = [name for name, _ in terms]
    if len(set(names)) < len(names) or not any(weight > 0 for _, weight in terms):
        raise ValueError(f"train.loss={spec!r}: each divergence at most once, and some weight > 0")
    return tuple(terms)


def _is_loss(spec) -> bool:
    """train.loss's check: loss_terms' own error, which names the term at fault, not a generic one."""
    return bool(loss_terms(spec))


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
    # dtype the target runs in while caching: bfloat16 | float16 | float32
    dtype: str = checked("bfloat16", DTYPE)
    chat_template: str | None = None  # Jinja chat template (or a path to one) for tokenizers without one
    # build an embedded target at `path` if absent: smoke | smollm2 | smollm2_upgraded
    build: str | None = checked(None, optional(one_of("smoke", "smollm2", "smollm2_upgraded")))


@dataclass
class DataSourceConfig:
    """One source of `data.mix`: a name, then the per-source fields of `data` (source ... num_samples)."""

    name: str = MISSING  # short label; this source's conversation ids become `name/id`, unique across the mix
    source: str = MISSING  # as `data.source`: HF dataset name, `save_to_disk` directory or local file(s)
    split: str = "train"  # split to read from HF datasets sources
    format: str = checked("auto", RECORD_FORMAT)  # record format: auto | sharegpt | openai | fields
    messages_field: str | None = None  # field holding the turns (auto: `conversations` or `messages`)
    role_field: str = "role"  # per-turn role key for format=fields
    content_field: str = "content"  # per-turn text key for format=fields
    id_field: str | None = "id"  # record id key; records without one get a hash of their content
    # use only the first N valid conversations of this source (None: all)
    num_samples: int | None = checked(None, optional(POSITIVE))


@dataclass
class DataConfig:
    source: str | None = None  # HF dataset name, `save_to_disk` dir or .json/.jsonl/.parquet file(s)/globs
    mix: list[DataSourceConfig] = field(
        default_factory=list
    )  # sources read in order instead of `source` (keep it null); split..id_field, num_samples: per entry
    split: str = "train"  # split to read from HF datasets sources
    format: str = checked("auto", RECORD_FORMAT)  # record format: auto | sharegpt | openai | fields
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
    # use only the first N valid conversations (None: all)
    num_samples: int | None = checked(None, optional(POSITIVE))
    # keep only the first N question/answer exchanges of each (None: all)
    max_turns: int | None = checked(None, optional(POSITIVE))
    match: str | None = None  # keep only conversations whose first user turn matches this regex (re.search)
    # fraction held out for evaluation, chosen by a hash of the conversation id
    eval_fraction: float = checked(0.05, within(0, 1, high_closed=False))
    strict: bool = False  # raise on a corrupt or truncated file instead of using its complete records


@dataclass
class RenderConfig:
    max_length: int = checked(2048, POSITIVE)  # longest tokenized conversation kept
    # what to do with longer ones: truncate (keep the first max_length tokens) | drop
    overlong: str = checked("truncate", one_of("truncate", "drop"))


@dataclass
class RegenConfig:
    enabled: bool = False  # replace every assistant turn with the target's own answer (vLLM, offline API)
    temperature: float = checked(0.0, within(0, 2))  # 0 = greedy (vLLM samples up to 2)
    top_p: float = checked(1.0, within(0, 1, low_closed=False))  # nucleus sampling when temperature > 0
    max_new_tokens: int = checked(512, POSITIVE)  # cap on each regenerated turn
    seed: int = 0  # sampling seed (vLLM per-request seeds derive from it)
    # conversations per chunk: one vLLM call per turn, saved when done (the resume unit)
    batch_size: int = checked(256, POSITIVE)
    vllm_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm.LLM(...)` arguments (e.g. enforce_eager)


@dataclass
class CaptureConfig:
    """Where the cache's hidden states come from (data_prep; target/capture.py, docs/design.md#capture)."""

    # hf: a transformers target, after regeneration | vllm: the serving engine (with regen.enabled, in the
    # same pass that regenerates; else a prompt-only pass); targets beyond one device
    engine: str = checked("hf", one_of("hf", "vllm"))
    # devices per vLLM engine (one engine per data_prep process)
    tensor_parallel_size: int = checked(1, POSITIVE)
    # refused above 1: vLLM 0.32's capture reads one rank's cache, and no peer captures under pipeline
    # parallelism; capture.tensor_parallel_size takes a target larger than one device
    pipeline_parallel_size: int = checked(1, Check(lambda v: v == 1, "1 (use capture.tensor_parallel_size)"))
    # hs-connectors backend the states travel through: file | fp8. Not mooncake: hs-connectors 0.9's
    # Mooncake connector hands back a store key, not the `hidden_states_path` each request is read by, so
    # every request would fail and its store objects never be freed; nothing here has run one
    transfer: str = checked(
        "file",
        Check(
            lambda v: v in ("file", "fp8"), "one of file, fp8 (mooncake is not supported: see docs/gpu.md)"
        ),
    )
    transfer_args: dict[str, Any] = field(default_factory=dict)  # that backend's settings
    batch_size: int = checked(256, POSITIVE)  # samples per vLLM call in a prompt-only pass
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)  # extra `vllm.LLM(...)` arguments of a
    # prompt-only pass (when regenerating, the engine is regeneration's: regen.vllm_kwargs)


@dataclass
class CacheConfig:
    # the target layers the head reads, vLLM aux ids; None: head.kind's default (target/model.py
    # default_aux_layer_ids: EAGLE-3 (2, L//2, L-3), DFlash 5 evenly spaced); [] for EAGLE-1 only
    aux_layer_ids: list[int] | None = None
    # draft vocab kept by frequency; >= target vocab means no pruning
    draft_vocab_size: int = checked(32000, POSITIVE)
    # slots the answers leave: by prompt-token frequency (prompt) | by id
    draft_vocab_fill: str = checked("prompt", one_of("prompt", "id"))
    hidden_states: bool = True  # false: tokens and loss masks only, no target forward (train.features=online)
    max_tokens_per_batch: int = checked(8192, POSITIVE)  # padded tokens per target forward
    # shard size cap; shards never depend on the number of processes
    max_shard_mb: int = checked(1024, POSITIVE)
    # torch CPU threads per process (None: torch's default)
    num_threads: int | None = checked(None, optional(POSITIVE))


@dataclass
class HeadConfig:
    # eagle3 | peagle (EAGLE-3 with parallel drafting) | dflash (block drafting) | eagle1
    kind: str = checked("eagle3", one_of(*HEAD_KINDS))
    # EAGLE-3 / P-EAGLE normalisation flags (speculators' names and vLLM's meaning; false = original recipe):
    norm_before_residual: bool = False  # the layer's residual is the normed hidden state, not the raw one
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc
    norm_output: bool = False  # a chain's next step reads the post-norm output (EAGLE-3 TTT; P-EAGLE: unused)
    # random | target: lm_head = the target's rows of the draft vocab, norm its
    lm_head_init: str = checked("random", one_of("random", "target"))
    freeze_lm_head: bool = False  # keep lm_head fixed (with lm_head_init=target: the target's rows)
    # training adds U(-aux_noise, aux_noise) to the aux states (speculators: 0.05)
    aux_noise: float = checked(0.0, NON_NEGATIVE)
    # EAGLE-3: training-time-test steps K of the rollout (draft positions trained)
    num_ttt_steps: int = checked(7, POSITIVE)
    # P-EAGLE: parallel depths trained (mask slots + 1); serve k <= this
    num_depths: int = checked(3, POSITIVE)
    # the loss of draft position k (TTT step or parallel depth) weighs gamma^k
    gamma: float = checked(0.8, within(0, 1, low_closed=False))
    num_layers: int = checked(1, POSITIVE)  # P-EAGLE / DFlash decoder layers (EAGLE-3's TTT drives one)
    # the cache's aux layers this head reads (vLLM ids, a subset of cache.aux_layer_ids; None: all of them):
    # one cache holding the union serves heads of several kinds (e.g. EAGLE-3's 3 layers and DFlash's 5)
    aux_layer_ids: list[int] | None = None
    # P-EAGLE / DFlash mask slots' token (None: the target's pad, else eos token)
    mask_token_id: int | None = None
    # P-EAGLE: depth d >= 1 trains on ~T*ratio^d anchors (COD); 1.0 keeps all
    cod_ratio: float = checked(1.0, within(0, 1, low_closed=False))
    # DFlash: tokens per block, the anchor and block_size - 1 mask slots (the longest block trained); by
    # default the block served at export.num_speculative_tokens (docs/dflash.md#served-k: measured best)
    block_size: int = checked(
        "${plus_one:${export.num_speculative_tokens}}", Check(lambda v: v is not None and v >= 2, ">= 2")
    )
    # DFlash: each block trained is uniformly min_block_size..block_size long, so that a bidirectional head
    # serves every k = length - 1 as trained (None: full blocks only, served at k = block_size - 1 alone)
    min_block_size: int | None = checked(None, optional(Check(lambda v: v >= 2, ">= 2")))
    num_anchors: int = checked(512, POSITIVE)  # DFlash: random anchors (blocks) per sequence and step
    # DFlash: mask slot k's loss weighs exp(-(k-1)/loss_decay) (the paper: 7 for block 16, 4 for block 8)
    loss_decay: float = checked(4.0, POSITIVE)
    # decay (DFlash slot k weighs exp(-(k-1)/loss_decay), TTT step / P-EAGLE depth k gamma^k) | dpace (each
    # prediction of a draft chain - block, TTT steps, depths - weighs the draft's chance to reach it and those
    # after it: D-PACE, train/objectives.py dpace_weights)
    position_weights: str = checked("decay", one_of("decay", "dpace"))
    dpace_a: float = checked(0.5, within(0, 1))  # D-PACE's floor a in c~ = (1 - a) c + a
    causal: bool = False  # DFlash: causal attention inside a block (default: bidirectional, as served)
    eagle1_noise: float = checked(0.1, NON_NEGATIVE)  # EAGLE-1: input features get U(-noise, noise)
    # EAGLE-1: weight of the soft cross-entropy next to SmoothL1
    eagle1_ce_weight: float = checked(0.1, NON_NEGATIVE)


@dataclass
class OptimConfig:
    lr: float = checked(1e-4, POSITIVE)  # peak learning rate (SpecForge's; the official recipe uses 5e-5)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    weight_decay: float = checked(0.0, NON_NEGATIVE)  # AdamW weight decay
    # fraction of the optimizer steps spent warming up linearly
    warmup_ratio: float = checked(0.015, within(0, 1, high_closed=False))
    # cosine decays towards lr * min_lr_ratio (reached after the last step)
    min_lr_ratio: float = checked(0.0, within(0, 1))
    max_grad_norm: float = checked(0.5, POSITIVE)  # gradient-norm clip


@dataclass
class TrainConfig:
    num_epochs: int = checked(1, POSITIVE)  # passes over the cache's train split
    # stop after this many optimizer steps (the schedule is sized to it)
    max_steps: int | None = checked(None, optional(POSITIVE))
    # train on the cache's first N train samples only (data-scaling runs)
    num_samples: int | None = checked(None, optional(POSITIVE))
    batch_size: int = checked(4, POSITIVE)  # samples per micro-batch per process
    gradient_accumulation_steps: int = checked(1, POSITIVE)  # micro-batches per optimizer step
    # no | bf16 | fp16 (fp32 master weights either way); default bf16, or no on a CPU without bf16 arithmetic
    mixed_precision: str = checked("${machine_precision:bf16}", one_of("no", "bf16", "fp16"))
    # the target's hidden states: cache (read from data_prep's cache) | online (the frozen target runs on
    # each micro-batch beside the head; the cache needs cache.hidden_states=false)
    features: str = checked("cache", one_of("cache", "online"))
    # what each prediction minimises (train/objectives.py): kl | rkl | tv | nla | lk, or a weighted sum such
    # as "0.1*kl+0.9*tv"
    loss: str = checked(
        "kl", Check(_is_loss, f"one of {', '.join(DIVERGENCES)} or a weighted sum (0.1*kl+0.9*tv)")
    )
    lk_eta: float = checked(3.0, NON_NEGATIVE)  # LK: lambda = exp(-lk_eta * alpha) per token
    # tokens per full-vocab teacher logits chunk (memory bound)
    teacher_chunk_size: int = checked(2048, POSITIVE)
    log_every: int = checked(10, POSITIVE)  # status line (and W&B point) every N optimizer steps
    eval_every: int = checked(100, NON_NEGATIVE)  # held-out eval every N optimizer steps (0: only at the end)
    save_every: int = checked(200, NON_NEGATIVE)  # checkpoint every N optimizer steps (0: only at the end)
    keep_last: int = checked(2, POSITIVE)  # checkpoints kept
    # never | always (continue from the newest checkpoint; error without one) | auto
    resume: str = checked("never", RESUME)
    resume_changed: bool = False  # resume although trajectory settings differ from the checkpoint's (logged)
    init_from: str | None = None  # warm start: a final head directory or a checkpoint directory
    # none | wandb (W&B through accelerate; offline mode needs no account)
    report_to: str = checked("none", REPORT_TO)
    wandb_project: str = "eagle-heads"  # W&B project name
    wandb_mode: str = checked("offline", WANDB_MODE)  # offline | online
    # torch CPU threads per process (None: torch's default)
    num_threads: int | None = checked(None, optional(POSITIVE))


@dataclass
class ExportConfig:
    head_dir: str | None = None  # the trained head to export (None: <run_dir>/draft_head)
    out_dir: str | None = None  # where the export goes (None: <run_dir>/export)
    allow_unverified_head: bool = False  # export a head whose draft_config.json records no checksums
    # EAGLE-3: speculators | plain | auto (the format the engines read: speculators for export.engine=vllm,
    # plain for sglang|both); an EAGLE-1 head is always a plain Llama
    format: str = checked("auto", one_of("auto", "speculators", "plain"))
    # the engines that load the export as it is: vllm | sglang | both (sglang, both: an EAGLE-3 plain export
    # with SGLang's eagle_config, one directory for both engines; EAGLE-1: SGLang's directory inside vLLM's:
    # export/to_sglang.py, docs/sglang.md)
    engine: str = checked("vllm", one_of("vllm", "sglang", "both"))
    # sglang, both: estimate SGLang's EAGLE-2 tree settings on the verification prompts for the card
    # (export/sglang_trees.py: a target and head decode per prompt; false: the card gives the chain of k)
    sglang_trees: bool = True
    dtype: str = checked("bfloat16", DTYPE)  # weight dtype written: bfloat16 | float16 | float32
    # k written into the speculators config and decoded by verify
    num_speculative_tokens: int = checked(3, POSITIVE)
    verify: bool = False  # prove it in vLLM: load + generate, then acceptance parity with the reference
    # replace a verified export with one that is not (export.verify=false): refused without it
    replace_verified: bool = False
    # held-out prompts (the cache's eval split, first user turn) both decode
    verify_num_prompts: int = checked(8, POSITIVE)
    verify_max_new_tokens: int = checked(64, POSITIVE)  # tokens generated per prompt
    # compute dtype of vLLM and the reference (parity is tight in fp32)
    verify_dtype: str = checked("float32", DTYPE)
    # max gap: relative on mean acceptance length, absolute per position
    verify_tolerance: float = checked(0.02, NON_NEGATIVE)
    vllm_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm.LLM(...)` arguments for the verification (e.g. gpu_memory_utilization)


@dataclass
class EvalHeadConfig:
    name: str = checked("head", NON_EMPTY)  # label in reports (compare mode: one entry per head)
    # export (a trained head: EAGLE-3 / P-EAGLE / EAGLE-1) | ngram (vLLM's prompt lookup)
    method: str = checked("export", one_of("export", "ngram"))
    # greedy (vLLM's default: the draft's argmax, accepted with the target's p of it) | probabilistic
    # (drafts sampled from the head, accepted with min(1, p/q): docs/design.md#objectives); export heads
    draft_sample_method: str = checked("greedy", one_of("greedy", "probabilistic"))
    path: str | None = None  # export directory to serve (None: <run_dir>/export); unused for ngram
    # the k sweep
    num_speculative_tokens: list[int] = checked(factory=lambda: [1, 2, 3, 4, 5], check=POSITIVE_LIST)
    # ngram: longest n-gram matched in the prompt and output so far
    prompt_lookup_max: int = checked(4, POSITIVE)
    prompt_lookup_min: int = checked(1, POSITIVE)  # ngram: shortest n-gram matched


@dataclass
class WorkloadConfig:
    name: str = checked(MISSING, NON_EMPTY)  # label in reports
    source: str = MISSING  # chat (held-out prompts) | code (HumanEval) | mtbench (2 turns) | a JSONL path
    num_prompts: int = checked(32, POSITIVE)  # prompts sent per measured run
    max_tokens: int = checked(128, POSITIVE)  # output tokens per request


@dataclass
class EvalConfig:
    heads: list[EvalHeadConfig] = field(default_factory=lambda: [EvalHeadConfig()])  # heads to serve
    workloads: list[WorkloadConfig] = field(
        default_factory=lambda: [WorkloadConfig("chat", "chat"), WorkloadConfig("code", "code")]
    )  # what to send
    concurrency: list[int] = checked(factory=lambda: [1, 4, 16], check=POSITIVE_LIST)  # requests in flight
    baseline: bool = True  # also serve the target without speculation (speedups need it)
    offline: bool = False  # no vLLM: acceptance only, from the reference decoder on the exported heads
    # the sampling temperatures swept, each request at one (0: greedy); with several, each workload is
    # reported and recommended per temperature ("chat T=1")
    temperature: list[float] = checked(factory=lambda: [0.0], check=TEMPERATURES)
    ignore_eos: bool = False  # generate max_tokens even past the end of an answer
    enable_threshold: float = checked(1.05, POSITIVE)  # recommend a head where its best speedup reaches this
    serve_schedule: bool = True  # serve each recommended per-batch-size k schedule once and measure it
    out_dir: str | None = None  # report directory (None: <run_dir>/eval)
    server_args: dict[str, Any] = field(
        default_factory=dict
    )  # extra `vllm serve` flags, name -> value (true: a bare flag), e.g. max-model-len: 4096
    startup_timeout_s: float = checked(900.0, POSITIVE)  # wait this long for a server's /health
    request_timeout_s: float = checked(600.0, POSITIVE)  # per request
    report_to: str = checked("none", REPORT_TO)  # none | wandb (offline mode needs no account)
    wandb_project: str = "eagle-heads"  # W&B project name
    wandb_mode: str = checked("offline", WANDB_MODE)  # offline | online


@dataclass
class WatchConfig:
    """eval/watch.py: a live vLLM server's acceptance held against what eval measured for its head
    (docs/watch.md; the verdicts: eval/health.py)."""

    url: str | None = None  # the server, e.g. http://localhost:8000 (its /metrics and /v1/models)
    head: str | None = None  # the served head's export directory (None: <run_dir>/export)
    # the model the server should serve (None: the head's target, from its export); set it after a
    # base-model upgrade to judge the old head on the new target
    target: str | None = None
    # eval's results.json for that head (None: <run_dir>/eval/results.json; without one, the export's
    # verification.json, which gives no break-even or latency)
    results: str | None = None
    eval_head: str | None = None  # the head's name in those results (None: the one served from `head`)
    temperature: float = checked(0.0, within(0, 2))  # the traffic's sampling temperature, as eval measured
    workload: str | None = None  # judge against this workload's measurement only (None: every workload's)
    # a window per interval, lengthened while too short for its requests (eval/health.py `insufficient`)
    interval_s: float = checked(60.0, within(0, 86400, low_closed=False))
    # scrapes per interval: the window's request-long batches of them give the dispersion its bounds are
    # widened by (drafts of one request are alike; eval/dispersion.py)
    subwindows: int = checked(20, within(2, 1000))
    windows: int = checked(0, NON_NEGATIVE)  # stop after this many judged windows (0: until interrupted)
    # one judged window, then exit 0 healthy / 1 retrain / 2 turn it off / 3 could not judge
    once: bool = False
    z: float = checked(3.0, within(0, 10, low_closed=False))  # confidence bounds: z standard errors (t: docs)
    latency_margin: float = checked(0.5, NON_NEGATIVE)  # `latency` above eval's p99 x (1 + this)
    out_dir: str | None = None  # timeline.jsonl, alert rules, Grafana panel (None: <run_dir>/watch)
    traffic: str | None = None  # the served requests (OpenAI-style JSONL), for the retrain commands it prints
    report_to: str = checked("none", REPORT_TO)  # none | wandb (offline mode needs no account)
    wandb_project: str = "eagle-heads"
    wandb_mode: str = checked("offline", WANDB_MODE)


@dataclass
class GridConfig:
    """train/grid.py: recipes trained side by side on one cache (conf/grid/*.yaml)."""

    name: str = "grid"  # results go to <run_dir>/grid/<name>/
    # optimizer steps of every variant (the learning-rate schedule is sized to it)
    max_steps: int = checked(300, POSITIVE)
    variants: dict[str, list[str]] = field(
        default_factory=dict
    )  # variant name -> overrides of the train stage (head.*, optim.*, train.*); [] = the config as it is
    # held-out prompts the reference decoder drafts per variant (0: skip)
    acceptance_prompts: int = checked(16, NON_NEGATIVE)
    acceptance_max_new_tokens: int = checked(96, POSITIVE)  # tokens generated per prompt
    # k of the acceptance measured and of the estimate tabulated
    num_speculative_tokens: int = checked(3, POSITIVE)


@dataclass
class PipelineConfig:
    """One config for every stage, so one experiment file and the same overrides drive them all."""

    run_dir: str = MISSING  # run directory shared by all stages (cache/, ckpt/, head/, report/)
    seed: int = 0  # seed for anything random
    # how long a rank waits for the others at a collective: ranks finish hours of regeneration or caching
    # minutes to hours apart, and NCCL's default (10 minutes) would kill the job at the barrier
    process_group_timeout_s: float = checked(6 * 3600.0, POSITIVE)
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
    watch: WatchConfig = field(default_factory=WatchConfig)


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


def refuse(key: str, value, wanted: str) -> None:
    """The one error style for a setting: what is wrong, the value, and the setting to change."""
    raise ValueError(f"{key}={value}: must be {wanted}; change {key}")


def field_errors(node, prefix: str = "") -> None:
    """Apply every `checked` field's check under `node` (a composed config or a schema dataclass instance),
    naming the first value that fails by its key."""
    from omegaconf import ListConfig

    if isinstance(node, (ListConfig, list)) and not (isinstance(node, ListConfig) and node._is_none()):
        for index, item in enumerate(node):
            field_errors(item, f"{prefix}[{index}]")
        return
    if isinstance(node, DictConfig):
        if node._is_none():
            return
        schema = OmegaConf.get_type(node)
    elif dataclasses.is_dataclass(node):
        schema = type(node)
    else:
        return
    if not dataclasses.is_dataclass(schema):
        return
    for declared in dataclasses.fields(schema):
        key = f"{prefix}.{declared.name}" if prefix else declared.name
        value = getattr(node, declared.name)
        check = declared.metadata.get("check")
        plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        if check is not None and not check.test(plain):
            refuse(key, plain, check.wanted)
        field_errors(value, key)


ROLES = ("system", "user", "assistant")  # what data.role_map maps a source's roles onto


def check_data(data) -> None:
    """`data.*` (composed, or a DataConfig given to data_prep's reader): the sources wrong together."""
    import re

    if data.mix:
        if data.source is not None:
            refuse(
                "data.source", repr(data.source), "null when data.mix lists the sources (or drop data.mix)"
            )
        if data.num_samples is not None:
            refuse(
                "data.num_samples",
                data.num_samples,
                "null with data.mix: give each source its own data.mix[i].num_samples",
            )
        names = [entry.name for entry in data.mix]
        for index, name in enumerate(names):
            if not name or name == MISSING or names.index(name) != index:
                refuse(
                    f"data.mix[{index}].name",
                    repr(name),
                    f"non-empty and unique across the mix (it prefixes that source's conversation ids); names: {names}",
                )
    entries = (
        [(f"data.mix[{i}]", entry) for i, entry in enumerate(data.mix)] if data.mix else [("data", data)]
    )
    for where, entry in entries:
        if not entry.source or entry.source == MISSING:
            refuse(
                f"{where}.source",
                None,
                "a hub dataset name, a `save_to_disk` directory or local .json/.jsonl/.parquet files"
                + (" (or list several sources in data.mix)" if where == "data" else ""),
            )
        if entry.format == "fields" and not entry.messages_field:
            refuse(
                f"{where}.messages_field",
                None,
                f"the record key holding the turns with {where}.format=fields",
            )
    bad_roles = {source: role for source, role in data.role_map.items() if role not in ROLES}
    if bad_roles:
        refuse("data.role_map", bad_roles, f"a map onto {', '.join(ROLES)}")
    if data.match:
        try:
            re.compile(data.match)
        except re.error as error:
            refuse("data.match", repr(data.match), f"a valid regular expression ({error})")


# EAGLE-3's normalisation flags; a DFlash head has none of these norms.
EAGLE3_NORMS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# Head settings an EAGLE-1 head has no use for (it reads no aux states and shares the target's lm_head).
EAGLE3_ONLY = (*EAGLE3_NORMS, "freeze_lm_head", "aux_noise", "aux_layer_ids")


def trained_depths(head) -> int | None:
    """The most drafts per round a head of this config trained (P-EAGLE's depths, a DFlash block's mask
    slots), None for a chain head (any k runs)."""
    return {"peagle": head.num_depths, "dflash": head.block_size - 1}.get(head.kind)


def trained_block_lengths(head) -> tuple[int, int]:
    """(shortest, longest) DFlash block a head of this config trains: head.min_block_size (None: full
    blocks) to head.block_size."""
    return (head.min_block_size or head.block_size, head.block_size)


def dflash_trained_ks(block_size: int, min_block_size: int | None, causal: bool) -> list[int]:
    """The k a DFlash head drafts as it was trained. vLLM serves k mask slots as a block of 1 + k tokens;
    inside a bidirectional block every slot sees every other, so a block shorter than any trained changes
    every slot's output: only k = length - 1 of a trained length. A causal slot sees only the slots before
    it, the same in any longer block: every k up to block_size - 1."""
    shortest = 2 if causal else (min_block_size or block_size)
    return list(range(shortest - 1, block_size))


def trained_ks(head) -> list[int] | None:
    """The k (drafts per round) a head of this config is trained for; None: any (a chain head)."""
    if head.kind == "dflash":
        return dflash_trained_ks(head.block_size, head.min_block_size, head.causal)
    if head.kind == "peagle":
        return list(range(1, head.num_depths + 1))
    return None


def export_format_setting(export) -> str:
    """export.format with `auto` resolved for export.engine: speculators for vLLM alone, plain where SGLang
    reads it too (it reads no speculators config)."""
    if export.format != "auto":
        return export.format
    return "speculators" if export.engine == "vllm" else "plain"


def sglang_refusal(kind: str, fmt: str, norm_before_residual: bool) -> tuple[str, object, str] | None:
    """(setting, value, what SGLang needs) for the first setting SGLang cannot serve, else None (the facts:
    export/to_sglang.py; checked when the config is composed and by export_head)."""
    if kind == "peagle":
        return (
            "head.kind",
            kind,
            "eagle3 or eagle1 for export.engine=sglang|both (SGLang 0.5.23 has no parallel drafting)",
        )
    if kind == "dflash":
        return (
            "head.kind",
            kind,
            "eagle3 or eagle1 for export.engine=sglang|both (SGLang's DFlash drafts with the target's lm_head over the "
            "whole vocabulary and reads no d2t; this pipeline's DFlash heads train their own lm_head)",
        )
    if kind == "eagle1":  # one format (plain); SGLang's goes to a directory of its own
        return None
    if fmt != "plain":
        return (
            "export.format",
            fmt,
            "plain for export.engine=sglang|both (SGLang reads no speculators config; the plain format with "
            "its eagle_config serves vLLM and SGLang from one directory)",
        )
    if norm_before_residual:
        return (
            "head.norm_before_residual",
            True,
            "false for export.engine=sglang|both (SGLang 0.5.23 always carries the fc output as the residual)",
        )
    return None


def check_combinations(cfg: DictConfig) -> None:
    """Settings that are each valid but wrong together, refused before any stage starts work."""
    ks = trained_ks(cfg.head)
    limit = (
        f"one of {ks}, the k a {cfg.head.kind} head of head.block_size={cfg.head.block_size}, "
        f"head.min_block_size={cfg.head.min_block_size}, head.causal={cfg.head.causal} drafts as trained; "
        "train blocks of k + 1 (head.block_size, by default export.num_speculative_tokens + 1) or of several "
        "lengths (head.min_block_size) (docs/dflash.md#served-k)"
        if cfg.head.kind == "dflash"
        else f"<= head.num_depths={cfg.head.num_depths} (a P-EAGLE head drafts only the depths it trained)"
    )
    if cfg.head.kind == "peagle" and cfg.head.num_depths == 1:
        refuse(
            "head.num_depths",
            1,
            ">= 2 for head.kind=peagle (one depth trains no mask slot: its mask state would get no gradient, "
            "which stops DDP at step 2); for k=1, train head.kind=eagle3 with head.num_ttt_steps=1",
        )
    if (
        cfg.head.kind == "dflash"
        and cfg.head.min_block_size
        and cfg.head.min_block_size > cfg.head.block_size
    ):
        refuse("head.min_block_size", cfg.head.min_block_size, f"<= head.block_size={cfg.head.block_size}")
    if ks is not None and cfg.export.num_speculative_tokens not in ks:
        refuse("export.num_speculative_tokens", cfg.export.num_speculative_tokens, limit)
    if cfg.export.engine != "vllm":
        refusal = sglang_refusal(
            cfg.head.kind, export_format_setting(cfg.export), cfg.head.norm_before_residual
        )
        if refusal is not None:
            refuse(*refusal)
    if cfg.head.kind == "eagle1":
        eagle3_only = [f"head.{flag}" for flag in EAGLE3_ONLY if cfg.head[flag]]
        eagle3_only += ["head.lm_head_init"] if cfg.head.lm_head_init != "random" else []
        if eagle3_only:
            refuse(
                "head.kind",
                "eagle1",
                f"eagle3 or peagle for {', '.join(eagle3_only)} (an EAGLE-1 head has no aux states, fc norms "
                "or lm_head of its own); or reset those settings",
            )
    norms = [f"head.{flag}" for flag in EAGLE3_NORMS if cfg.head[flag]]
    if cfg.head.kind == "dflash" and norms:
        refuse(
            "head.kind",
            "dflash",
            f"eagle3 or peagle for {', '.join(norms)} (EAGLE-3's norms; DFlash has none)",
        )
    if cfg.head.position_weights == "dpace" and cfg.head.kind == "eagle1":
        refuse("head.position_weights", "dpace", "decay for an eagle1 head (EAGLE-1 trains one position)")
    if cfg.head.num_layers != 1 and cfg.head.kind not in ("peagle", "dflash"):
        refuse(
            "head.num_layers",
            cfg.head.num_layers,
            f"1 for a {cfg.head.kind} head (only P-EAGLE and DFlash stack layers)",
        )
    check_data(cfg.data)
    for key, entries in (("eval.heads", cfg.eval.heads), ("eval.workloads", cfg.eval.workloads)):
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            refuse(f"{key}[].name", names, "unique (each names a report row, a server log, a source's ids)")
    if cfg.eval.offline and list(cfg.eval.temperature) != [0.0]:
        refuse(
            "eval.temperature",
            list(cfg.eval.temperature),
            "[0] with eval.offline (the reference decoder is greedy)",
        )
    for index, head in enumerate(cfg.eval.heads):
        if head.method == "ngram" and head.draft_sample_method != "greedy":
            refuse(
                f"eval.heads[{index}].draft_sample_method",
                head.draft_sample_method,
                "greedy for ngram (no draft distribution)",
            )
        if head.method == "ngram" and head.prompt_lookup_min > head.prompt_lookup_max:
            refuse(f"eval.heads[{index}].prompt_lookup_min", head.prompt_lookup_min, "<= prompt_lookup_max")


def check_config(cfg: DictConfig) -> None:
    """Refuse, naming the key, what the schema does not know (an override added with `+` is otherwise
    accepted and silently ignored), values no stage can use (each field's check, declared beside it) and
    settings wrong together - before any stage starts work."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ValueError(
            f"unknown config keys {unknown}: not settings of any stage (a typo? every key is in "
            "artifacts/config.py)"
        )
    field_errors(cfg)
    check_combinations(cfg)


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


def plus_one(value) -> int:
    """`${plus_one:${export.num_speculative_tokens}}` (head.block_size's default): the block of k + 1 (at
    least 2, so that a k below 1 is refused as export.num_speculative_tokens, not as the block it implies)."""
    return max(int(value) + 1, 2)


# `${smoke_data:conversations.jsonl}` and `${sharegpt_json:}` in conf/data/*.yaml; `${machine_dtype:bfloat16}`
# in conf/target/*.yaml, `${machine_precision:bf16}` as train.mixed_precision's default and `${plus_one:..}`
# as head.block_size's.
OmegaConf.register_new_resolver("smoke_data", _package_file, replace=True)
OmegaConf.register_new_resolver("sharegpt_json", _sharegpt_json, replace=True)
OmegaConf.register_new_resolver("machine_dtype", machine_dtype, replace=True)
OmegaConf.register_new_resolver("machine_precision", machine_precision, replace=True)
OmegaConf.register_new_resolver("plus_one", plus_one, replace=True)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(config_name: str, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config a stage's main.py would get for these command-line overrides (for tests and scripts)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))
