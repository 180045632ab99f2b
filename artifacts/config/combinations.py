"""Checks across settings: values each valid alone but wrong together (`check_combinations`, `check_data`),
and the facts about a head or export config they rest on, which the stages read too (`trained_ks`,
`dflash_trained_ks`, `trained_depths`, `trained_block_lengths`, `export_format_setting`, `sglang_refusal`).
"""

from __future__ import annotations

from omegaconf import MISSING, DictConfig

from artifacts.config.checks import loss_terms, refuse

ALPHA_TERMS = {"tv", "nla", "lk"}  # the divergences whose alpha train.alpha_on says the p of

# what data.role_map maps a source's roles onto (`developer`: OpenAI's, rendered as vLLM renders it)
ROLES = ("system", "developer", "user", "assistant", "tool")


def source_entries(data) -> list:
    """(name in messages, settings) per source: `data` itself, or each `data.mix[i]` in order."""
    if not data.mix:
        return [("data", data)]
    return [(f"data.mix[{index}]", entry) for index, entry in enumerate(data.mix)]


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
    for where, entry in source_entries(data):
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
    # Settings that act only with another: a value other than the default without it would change nothing.
    if cfg.head.position_weights != "dpace":
        for key, default in (("dpace_norm", "position"), ("dpace_a", 0.5)):
            if cfg.head[key] != default:
                refuse(
                    f"head.{key}",
                    cfg.head[key],
                    f"{default} without D-PACE (or set head.position_weights=dpace)",
                )
    if cfg.train.alpha_on != "target" and not {name for name, _ in loss_terms(cfg.train.loss)} & ALPHA_TERMS:
        refuse("train.alpha_on", cfg.train.alpha_on,
               f"target for train.loss={cfg.train.loss} (alpha is in tv, nla and lk only)")  # fmt: skip
    if cfg.head.sliding_window is not None:
        if cfg.head.kind not in ("eagle3", "peagle"):
            refuse("head.sliding_window", cfg.head.sliding_window,
                   f"null for a {cfg.head.kind} head (vLLM 0.32 serves sliding windows in EAGLE-3 drafts)")  # fmt: skip
        if cfg.head.sliding_window <= max(
            cfg.head.num_ttt_steps, cfg.head.num_depths, cfg.export.num_speculative_tokens
        ):
            refuse("head.sliding_window", cfg.head.sliding_window,
                   "more than the drafted tokens (head.num_ttt_steps, head.num_depths, export.num_speculative_tokens): "
                   "a draft step's window holds the steps before it")  # fmt: skip
    if cfg.head.num_layers != 1 and cfg.head.kind not in ("peagle", "dflash"):
        refuse(
            "head.num_layers",
            cfg.head.num_layers,
            f"1 for a {cfg.head.kind} head (only P-EAGLE and DFlash stack layers)",
        )
    if cfg.train.pack_length is not None and cfg.train.pack_length < cfg.render.max_length:
        refuse(
            "train.pack_length",
            cfg.train.pack_length,
            f">= render.max_length={cfg.render.max_length} (a row must hold the longest sample), or null",
        )
    if cfg.train.stage == "on_policy":
        check_on_policy(cfg, ks, limit)
    check_data(cfg.data)
    check_regen(cfg.regen)
    for where, entry in source_entries(cfg.data):
        if entry.unanswered == "answer" and not cfg.regen.enabled:
            refuse(
                f"{where}.unanswered",
                "answer",
                "skip without regeneration: only the target can answer a question the data leaves unanswered "
                "(regen.enabled=true)",
            )
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


def check_on_policy(cfg: DictConfig, ks: list[int] | None, limit: str) -> None:
    """train.stage=on_policy: a head whose rounds replay, at a k it was trained for, replicated on every
    process (the rollouts draft with the whole head)."""
    if cfg.head.kind == "eagle1":
        refuse("head.kind", "eagle1", "eagle3, peagle or dflash with train.stage=on_policy (the replayed "
               "drafting schemes: chain with aux states, parallel, block)")  # fmt: skip
    k = cfg.on_policy.num_speculative_tokens
    if k < 1 or (ks is not None and k not in ks):
        refuse("on_policy.num_speculative_tokens", k, limit if ks is not None else "> 0")
    if cfg.train.pack_length is not None:
        refuse(
            "train.pack_length", cfg.train.pack_length, "null with train.stage=on_policy (a rollout a row)"
        )


def check_regen(regen) -> None:
    """Several answers per prompt only where they differ: sampled (temperature > 0), after regeneration."""
    if regen.samples_per_prompt > 1 and not regen.enabled:
        refuse("regen.samples_per_prompt", regen.samples_per_prompt, "1 without regeneration (regen.enabled)")
    if regen.samples_per_prompt > 1 and regen.temperature == 0:
        refuse(
            "regen.samples_per_prompt",
            regen.samples_per_prompt,
            "1 at regen.temperature=0 (greedy answers are all the same); sample with regen.temperature > 0",
        )
    if regen.include_greedy and (regen.samples_per_prompt < 2 or regen.temperature == 0):
        refuse(
            "regen.include_greedy",
            True,
            "false unless regen.samples_per_prompt >= 2 and regen.temperature > 0 (sample 0 greedy, the rest "
            "sampled)",
        )
