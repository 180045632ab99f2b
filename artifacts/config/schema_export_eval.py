"""Config schemas of the settings after training: `export` (formats, engines, verification), `eval`
(its heads and workloads) and `watch` (a live server held against eval's measurement).

Each field's check is declared beside it (artifacts/config/checks.py); settings wrong together are refused
by artifacts/config/combinations.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from artifacts.config.checks import (
    DTYPE,
    NON_EMPTY,
    NON_NEGATIVE,
    POSITIVE,
    POSITIVE_LIST,
    REPORT_TO,
    TEMPERATURES,
    WANDB_MODE,
    checked,
    one_of,
    within,
)


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
    # chat (held-out prompts) | code (HumanEval) | mtbench (2 turns) | agent | long_chat | long_code |
    # long_agent (spread over eval.context_buckets: eval/long_context.py) | a JSONL path
    source: str = MISSING
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
    # context-length buckets (their upper bounds, prompt tokens): each request's own acceptance (vLLM's
    # per-request metrics) and latency reported per bucket, the last bucket open above the last bound
    context_buckets: list[int] = checked(factory=lambda: [512, 2048, 4096, 8192], check=POSITIVE_LIST)
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
    """watch/main.py: a live vLLM server's acceptance held against what eval measured for its head
    (docs/watch.md; the verdicts: watch/health.py)."""

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
    # the chat-template kwargs the traffic is served with (its thinking mode): Hydra's dict,
    # 'watch.chat_template_kwargs={enable_thinking:false}', or the JSON `vllm serve
    # --default-chat-template-kwargs` takes, quoted for Hydra; None: not said, not compared with the head's
    # record
    chat_template_kwargs: Any = None
    workload: str | None = None  # judge against this workload's measurement only (None: every workload's)
    # a window per interval, lengthened while too short for its requests (watch/health.py `insufficient`)
    interval_s: float = checked(60.0, within(0, 86400, low_closed=False))
    # scrapes per interval: the window's request-long batches of them give the dispersion its bounds are
    # widened by (drafts of one request are alike; watch/dispersion.py)
    subwindows: int = checked(20, within(2, 1000))
    windows: int = checked(0, NON_NEGATIVE)  # stop after this many judged windows (0: until interrupted)
    # one judged window, then exit 0 healthy / 1 retrain / 2 turn it off / 3 could not judge
    once: bool = False
    z: float = checked(3.0, within(0, 10, low_closed=False))  # confidence bounds: z standard errors (t: docs)
    latency_margin: float = checked(0.5, NON_NEGATIVE)  # `latency` above eval's p99 x (1 + this)
    out_dir: str | None = None  # timeline.jsonl, alert rules, Grafana panel (None: <run_dir>/watch)
    # the watched server's `instance` label in your Prometheus, which the alert rules select (None: the URL's
    # host:port, Prometheus' label for a static target; '': every instance serving the model, each judged
    # with this server's dispersion and band, as the rules' annotations then say)
    instance: str | None = None
    traffic: str | None = None  # the served requests (OpenAI-style JSONL), for the retrain commands it prints
    report_to: str = checked("none", REPORT_TO)  # none | wandb (offline mode needs no account)
    wandb_project: str = "eagle-heads"
    wandb_mode: str = checked("offline", WANDB_MODE)
