"""Config schemas of data_prep's settings: `target`, `data` (and its `data.mix` sources), `render`,
`regen`, `capture` and `cache`.

Each field's check is declared beside it (artifacts/config/checks.py); YAML under `conf/` holds the values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from artifacts.config.checks import DTYPE, POSITIVE, RECORD_FORMAT, Check, checked, one_of, optional, within

# ShareGPT dumps name the assistant after the product that answered; all of them are the assistant.
DEFAULT_ROLE_MAP = {
    "system": "system",
    "developer": "developer",  # OpenAI's: vLLM renders it as system where the template has no such role
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "tool": "tool",  # a tool's result (OpenAI), answering the assistant's call `tool_call_id`
    "function": "tool",  # OpenAI's legacy name for it
    "ipython": "tool",  # Llama 3.1's
}


@dataclass
class TargetConfig:
    path: str = MISSING  # HF hub id or local directory of the target model (weights + tokenizer)
    revision: str | None = None  # hub revision (branch, tag or commit); ignored for local directories
    # dtype the target runs in while caching: bfloat16 | float16 | float32
    dtype: str = checked("bfloat16", DTYPE)
    chat_template: str | None = None  # Jinja chat template (or a path to one) for tokenizers without one
    # build an embedded target at `path` if absent: smoke | smoke_agent | smoke_moe | smollm2 | smollm2_upgraded
    build: str | None = checked(
        None, optional(one_of("smoke", "smoke_agent", "smoke_moe", "smollm2", "smollm2_upgraded"))
    )


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
    # a last user turn (or tool results) no answer follows - a request logged without its response, a prompt
    # alone: skip | answer (kept for regeneration to answer: the target's answer is the one trained;
    # regen.enabled only)
    unanswered: str = checked("skip", one_of("skip", "answer"))


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
    )  # source role -> system|developer|user|assistant|tool
    system_prompt: str | None = None  # system message added to conversations that have none
    # use only the first N valid conversations (None: all; of a per-request log, N records, merged after)
    num_samples: int | None = checked(None, optional(POSITIVE))
    # keep only the first N question/answer exchanges of each (None: all)
    max_turns: int | None = checked(None, optional(POSITIVE))
    match: str | None = None  # keep only conversations whose first user turn matches this regex (re.search)
    # a last user turn (or tool results) no answer follows - a request logged without its response, a prompt
    # alone: skip | answer (kept for regeneration to answer: the target's answer is the one trained;
    # regen.enabled only)
    unanswered: str = checked("skip", one_of("skip", "answer"))
    # fraction held out for evaluation, chosen by a hash of the conversation id
    eval_fraction: float = checked(0.05, within(0, 1, high_closed=False))
    strict: bool = False  # raise on a corrupt or truncated file instead of using its complete records
    # per-request logs (one record per request, each re-sending the earlier turns): merge the records that
    # are prefixes of a longer one into it, so each turn trains once, with the reasoning its response
    # logged (data_prep/request_log.py); a log of whole conversations has none to merge
    merge_requests: bool = True


@dataclass
class RenderConfig:
    max_length: int = checked(2048, POSITIVE)  # longest tokenized conversation kept
    # what to do with longer ones: truncate (keep the first max_length tokens) | drop
    overlong: str = checked("truncate", one_of("truncate", "drop"))
    # the chat template's kwargs the target is served with (a request's `chat_template_kwargs`, e.g.
    # {enable_thinking: false} or {reasoning_effort: low}): every rendering and regenerated request passes
    # them, the head's record keeps them (its thinking mode) and eval serves with them
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RegenConfig:
    enabled: bool = False  # replace every assistant turn with the target's own answer (vLLM, offline API)
    temperature: float = checked(0.0, within(0, 2))  # 0 = greedy (vLLM samples up to 2)
    top_p: float = checked(1.0, within(0, 1, low_closed=False))  # nucleus sampling when temperature > 0
    max_new_tokens: int = checked(512, POSITIVE)  # cap on each regenerated turn
    seed: int = 0  # sampling seed: each request's own seed derives from it, the conversation id and turn
    # answers per conversation (temperature > 0): each sample its own conversation `<id>#<j>` and seeds; the
    # held-out split is by prompt, so a prompt's samples all land on one side (docs/recipe.md#temperature)
    samples_per_prompt: int = checked(1, POSITIVE)
    include_greedy: bool = False  # sample 0 of each prompt is the greedy answer: a greedy and sampled mix
    # the target's reasoning in the regenerated answers: keep (it reasons as render.chat_template_kwargs
    # let it, and the reasoning is trained on) | off (asked not to: regen.reasoning_off_kwargs are added
    # to the template kwargs of every rendering and request, and so to the head's record)
    reasoning: str = checked("keep", one_of("keep", "off"))
    reasoning_off_kwargs: dict[str, Any] = field(default_factory=lambda: {"enable_thinking": False})
    # vLLM's parsers the target is served with (`vllm serve --tool-call-parser`, `--reasoning-parser`):
    # they read each regenerated answer's tool calls (to compare them with the logged ones; needed when
    # the data has tools) and its reasoning (kept as `reasoning_content`, as a client sends it back)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
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
