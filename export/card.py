"""The model card (`README.md`) written beside an export: what the head is for, how it was made, what it
measured, and the command that serves it.

Every number comes from a file the pipeline wrote: the head's `draft_config.json` (target, data, training
settings, train's held-out eval), export's `verification.json` (vLLM vs the reference decoder) and, when
present, eval's `results.json` (its `headline` rows).
"""

from __future__ import annotations

import json
from pathlib import Path

from artifacts import atomic
from artifacts.config import dflash_trained_ks
from artifacts.manifest import answer_temperatures
from export.record import RECORD
from export.to_sglang import sglang_export, sglang_serve_command
from export.to_vllm import speculative_config
from heads.head_file import read_record
from heads.kinds import head_kind
from target.vllm import printable_serve_command, served_settings


def table(header: list[str], rows: list[list]) -> list[str]:
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def held_out_section(held_out: dict) -> list[str]:
    steps = sorted(int(k.rsplit("_", 1)[1]) for k in held_out if k.startswith("eval/acc_"))
    rows = [
        [k, held_out[f"eval/loss_{k}"], held_out[f"eval/acc_{k}"], held_out.get(f"eval/cond_acc_{k}", "")]
        for k in steps
    ]
    # train/metrics.py ESTIMATES: eval/accept_len_k<k> (T=0), _t1_k<k> (T=1, vLLM's greedy drafts) and
    # _t1_sampled_k<k> (T=1, drafts sampled: draft_sample_method=probabilistic)
    labels = {"accept_len": "T=0", "accept_len_t1": "T=1", "accept_len_t1_sampled": "T=1 sampled drafts"}
    lengths = [
        f"{labels.get(k.split('/')[1].rsplit('_k', 1)[0], k)} k={k.rsplit('k', 1)[1]}: {v:.3f}"
        for k, v in sorted(held_out.items())
        if k.startswith("eval/accept_len")
    ]
    lines = [
        f"## Held-out metrics (train's eval at step {held_out.get('step')})",
        "",
        *table(["TTT step", "loss", "accuracy", "chain accuracy (earlier steps right)"], rows),
    ]
    if lengths:
        lines += [
            "",
            "Offline estimate of the mean acceptance length: " + ", ".join(lengths) + ". Teacher-forced, it "
            "weighs every position once; when serving, each chain starts where the previous one was "
            "rejected, at the harder positions, so the measured acceptance (below) is usually lower.",
        ]
    return lines


def stages_section(stages: list[dict]) -> list[str]:
    """The stages that made the head (train.stage=on_policy records them): the supervised head it started
    from, then each on-policy iteration's rollouts and the held-out acceptance they led to."""
    lines = ["## Stages", ""]
    for stage in stages:
        if stage["stage"] == "supervised":
            lines.append(
                f"- supervised: {stage.get('num_steps', '?')} optimizer steps, from `{stage.get('from')}`"
            )
            continue
        iterations = stage.get("iterations", [])
        rows = [
            [
                r["iteration"],
                r["step"],
                f"{r['rollouts']['num']} ({r['rollouts']['tokens']} tokens, {r['rollouts']['seconds']:.0f} s)"
                if "rollouts" in r else "-",
                f"{r['rollouts']['mean_acceptance_length']:.3f}" if "rollouts" in r else "-",
                f"{r['held_out']['mean_acceptance_length']:.3f}" if "held_out" in r else "-",
            ]
            for r in iterations
        ]  # fmt: skip
        lines += [
            f"- on-policy: {sum(r['iteration'] > 0 for r in iterations)} iterations of rollouts (the head "
            f"drafting k={stage.get('k', '?')}, the target verifying at temperature "
            f"{stage.get('temperature', 0.0):g}) and replay from their rounds (iteration 0: before any)",
            "",
            *table(
                ["iteration", "step", "rollouts", "rollout acceptance length", "held-out acceptance length"],
                rows,
            ),
        ]
    return lines


def verification_section(report: dict) -> list[str]:
    parity = report["parity"]
    rows = [
        [
            name,
            r["mean_acceptance_length"],
            r["draft_acceptance_rate"],
            ", ".join(f"{p:.3f}" for p in r["per_position_acceptance"]),
            r["num_drafts"],
        ]
        for name, r in (("reference decoder (PyTorch)", report["reference"]), ("vLLM", report["vllm"]))
    ]
    verdict = "passed" if parity["passed"] else "FAILED"
    return [
        "## vLLM verification",
        "",
        f"vLLM {report['vllm_version']} loaded this export and decoded {report['num_prompts']} held-out prompts "
        f"(k={report['num_speculative_tokens']}, temperature 0, {report['max_new_tokens']} new tokens, "
        f"{report['dtype']}); the reference decoder ran our head on the same prompts.",
        "",
        *table(
            [
                "decoder",
                "mean acceptance length",
                "draft acceptance rate",
                "per-position acceptance",
                "drafts",
            ],
            rows,
        ),
        "",
        f"Parity {verdict}: gap {parity['mean_acceptance_length_relative_gap']:.2%} in mean acceptance length "
        f"(tolerance {parity['tolerance']:.0%}); identical outputs for {report['num_identical_outputs']}/"
        f"{report['num_prompts']} prompts.",
    ]


def eval_section(results: dict) -> list[str]:
    rows = results.get("headline") or []
    if not rows:
        return []
    header = list(rows[0])
    advice = [f"- {rec['text']}" for rec in results.get("recommendations") or [] if rec.get("text")]
    return [
        "## Serving measurements (eval)",
        "",
        *table(header, [[r.get(k, "") for k in header] for r in rows]),
        *(
            ["", "Deploy, per workload and temperature (eval's recommendations):", "", *advice]
            if advice
            else []
        ),
    ]


def write_model_card(
    export_dir: Path,
    head_dir: Path,
    num_speculative_tokens: int,
    eval_results=None,
    serve_args=None,
    served_dir: Path | None = None,
) -> Path:
    """README.md of an export from the files beside it (export runs this, and eval again with its results);
    `serve_args`: the `vllm serve` flags eval serves with (`eval.server_args`), given in the serve command;
    `served_dir`: where the export is served from, when it is written elsewhere first (export's staging)."""
    export_config = json.loads((export_dir / "config.json").read_text())
    verification_file = export_dir / "verification.json"
    verification = json.loads(verification_file.read_text()) if verification_file.exists() else None
    record_file = export_dir / RECORD
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    card = model_card(
        str(Path(served_dir or export_dir).resolve()),
        dict(serve_args or {}),
        read_record(head_dir).to_json(),
        export_config,
        "speculators" if "speculators_model_type" in export_config else "plain",
        export_config.get("torch_dtype", "?"),
        num_speculative_tokens,
        verification,
        eval_results,
        files_dir=export_dir,
        unverified_note=None if record.get("verified", True) else record.get("note") or "not verified",
    )
    return atomic.write_text(export_dir / "README.md", card)


def model_card(
    export_dir: str,
    serve_args: dict,
    head_config: dict,
    export_config: dict,
    fmt: str,
    dtype: str,
    num_speculative_tokens: int,
    verification: dict | None = None,
    eval_results: dict | None = None,
    files_dir: Path | None = None,
    unverified_note: str | None = None,
) -> str:
    """The card's text; `export_dir` as served, `files_dir` where its files are read now (default: the same)."""
    kind, c = head_config["kind"], head_config["config"]
    target, cache = head_config["target"], head_config.get("cache", {})
    training = head_config.get("training", {})
    settings = training.get("settings", {})
    speculative = speculative_config(kind, export_dir, num_speculative_tokens)
    serve_args = {**served_chat(cache), **serve_args}  # eval's own flags win
    target_path = Path(target["path"]).expanduser()
    target_path = str(target_path.resolve()) if target_path.exists() else target["path"]  # else a hub name
    name, mode = head_kind(kind).title, head_kind(kind).drafting
    block = mode == "block"
    num_layers = c.get("num_hidden_layers", 1)
    drafting = {
        "parallel": "parallel drafting: all k drafts of a round in one forward pass",
        "block": "block drafting: the bonus token and k mask slots in one forward pass; trained on blocks of "
        f"{block_lengths(c)} tokens, so serve k in {ks_text(c)} (docs/dflash.md#served-k)"
        if block
        else "",
    }.get(mode, "chain drafting")
    lines = [
        f"# {name} draft head for {Path(target['path']).name}",
        "",
        f"A {num_layers}-layer {name} draft head for speculative decoding in vLLM ({drafting}), trained with "
        f"the eagle pipeline on the target's own hidden states. Serve it with (the command that runs with the vLLM "
        "installed where this card was written, with eval's server settings; elsewhere `vllm serve` with the "
        "same arguments):",
        "",
        "```bash",
        printable_serve_command(served_settings(target_path, speculative, serve_args)),
        "```",
        *sglang_section(export_config, target_path, export_dir, num_speculative_tokens, files_dir),
        "",
        "## Head",
        "",
        *table(
            ["field", "value"],
            [
                ["target", target["path"]],
                ["target weights sha256", target.get("hash", "")],
                ["format", f"{fmt} ({export_config.get('architectures', ['?'])[0]})"],
                ["dtype", dtype],
                ["hidden size", c["hidden_size"]],
                ["draft vocabulary", f"{c.get('draft_vocab_size', c['vocab_size'])} of {c['vocab_size']}"],
                ["aux layer ids (vLLM convention)", c.get("aux_layer_ids", "final hidden state")],
                ["norm_before_residual", c.get("norm_before_residual", "n/a")],
                ["decoder layers", num_layers],
                ["attention", window_text(c.get("sliding_window"))],
                [
                    "mask token id (parallel / block drafting)",
                    "n/a" if c.get("mask_token_id") is None else c["mask_token_id"],
                ],
                *(
                    [
                        [
                            "block size, attention in the block",
                            f"{c['block_size']} (trained {block_lengths(c)}), "
                            f"{'causal' if c['causal'] else 'bidirectional'}",
                        ]
                    ]
                    if block
                    else []
                ),
            ],
        ),
        "",
        "## Data",
        "",
        *table(
            ["field", "value"],
            [
                ["source", cache.get("data_source", "?")],
                ["conversations (train / held out)", _pair(cache.get("num_samples"))],
                ["tokens (train / held out)", _pair(cache.get("num_tokens"))],
                ["answers regenerated by the target", json.dumps(cache.get("regeneration")) or "no"],
                ["answers' temperature (serve at)", temperature_text(cache.get("regeneration"))],
                ["thinking mode (serve with)", thinking_text(cache.get("chat_template_kwargs"))],
                ["training samples per request mode", modes_text(cache.get("num_samples_by_mode"))],
                ["dataset fingerprint", cache.get("dataset_fingerprint", "?")],
            ],
        ),
        "",
        "## Training",
        "",
        *table(
            ["field", "value"],
            [
                ["optimizer steps", training.get("num_steps", "?")],
                ["processes", training.get("num_processes", "?")],
                [
                    {"parallel": "parallel depths", "block": "block size"}.get(mode, "TTT steps"),
                    settings.get("head", {}).get(
                        {"parallel": "num_depths", "block": "block_size"}.get(mode, "num_ttt_steps"), "?"
                    ),
                ],
                ["learning rate", settings.get("optim", {}).get("lr", "?")],
                ["micro-batch per process", settings.get("train", {}).get("batch_size", "?")],
                ["gradient accumulation", settings.get("train", {}).get("gradient_accumulation_steps", "?")],
                ["epochs", epochs_text(training, settings.get("train", {}).get("num_epochs", "?"))],
                ["mixed precision", settings.get("train", {}).get("mixed_precision", "?")],
                ["warm start", settings.get("train", {}).get("init_from") or "none"],
            ],
        ),
    ]
    if training.get("stages"):
        lines += ["", *stages_section(training["stages"])]
    if training.get("held_out"):
        lines += ["", *held_out_section(training["held_out"])]
    elif training:
        lines += [
            "",
            "## Held-out metrics",
            "",
            "Not measured: on_policy.num_eval_prompts=0."
            if training.get("stages")
            else "Not measured: the cache has no held-out split (data.eval_fraction=0).",
        ]
    if unverified_note:
        lines += [
            "",
            "## vLLM verification",
            "",
            f"**Not verified** ({unverified_note}): rerun export with "
            "`export.verify=true` for the proof that vLLM drafts this head as trained.",
        ]
    if verification:
        lines += ["", *verification_section(verification)]
    if eval_results:
        lines += ["", *eval_section(eval_results)]
    return "\n".join(lines) + "\n"


def sglang_section(
    export_config: dict, target: str, export_dir: str, k: int, files_dir: Path | None = None
) -> list[str]:
    """SGLang's serve command, for an export SGLang loads (export.engine=sglang|both), with the EAGLE-2 tree
    settings the reference decoder estimated best (sglang_trees.json), else the chain of k drafts."""
    files_dir = Path(files_dir or export_dir)
    served = sglang_export(files_dir, export_config)
    if served is None:
        return []
    sglang_dir, algorithm = Path(export_dir) / served[0].relative_to(files_dir), served[1]
    trees_file = files_dir / "sglang_trees.json"
    settings, served_as = (k, 1, k + 1), "here as the chain of k drafts"
    if trees_file.exists():
        trees = json.loads(trees_file.read_text())
        best, chain, default = trees["recommended"], trees["chain"], trees["sglang_default"]

        def setting(r):
            return (
                f"({r['num_steps']}, {r['topk']}, {r['num_draft_tokens']}): {r['mean_acceptance_length']:.3f}"
            )

        settings = (best["num_steps"], best["topk"], best["num_draft_tokens"])
        served_as = (
            f"with the EAGLE-2 tree the reference decoder estimated best within {trees['budget']} verified "
            f"tokens on {trees['prompts']} held-out prompts (tokens per round, (steps, topk, draft tokens)): "
            f"{setting(best)}; SGLang's default {setting(default)}; the chain of k={k} {setting(chain)} "
            "(estimates: a GPU run confirms them, docs/sglang.md#trees)"
        )
    where = (
        "the same directory"
        if sglang_dir == Path(export_dir)
        else f"its own directory, `{sglang_dir}` (SGLang's EAGLE-1 class is a name vLLM does not know)"
    )
    return [
        "",
        f"SGLang serves {where} (`export.engine=sglang|both`; exports of this kind are loaded by SGLang "
        f"0.5.23's own loader in this project's test suite, not by this export run: docs/sglang.md), "
        f"{served_as}:",
        "",
        "```bash",
        sglang_serve_command(target, str(sglang_dir), algorithm, *settings),
        "```",
    ]


def epochs_text(training: dict, configured) -> str:
    """The epochs the head was trained for (its steps over the steps of an epoch), and the configured
    number where `train.max_steps` cut it short; a record from before steps_per_epoch says it is the
    configured one."""
    per_epoch, steps = training.get("steps_per_epoch"), training.get("num_steps")
    if not per_epoch or steps is None:
        return f"{configured} configured (the record does not say how many were trained)"
    trained = steps / per_epoch
    text = f"{trained:.3g} ({steps} optimizer steps, {per_epoch} an epoch)"
    if configured != "?" and abs(trained - configured) > 1e-9:
        text += f"; {configured} configured, cut short by train.max_steps"
    return text


def temperature_text(regeneration: dict | None) -> str:
    """The temperatures the training answers were generated at, and so the traffic the head is for."""
    temperatures = answer_temperatures(regeneration)
    if temperatures is None:
        return "the dataset's own answers (not the target's): measure it at your temperature with eval"
    if temperatures == [0.0]:
        return "0, greedy: for greedy traffic; at T > 0 retrain with regen.temperature (docs/recipe.md#temperature)"
    samples = regeneration.get("samples_per_prompt", 1)
    sampled = f"{temperatures[-1]:g}, sampled (top_p {regeneration['top_p']:g}, {samples} answers per prompt"
    if len(temperatures) > 1:
        return f"0 and {sampled}, one of them greedy): for both"
    return f"{sampled}): for traffic sampled at {temperatures[-1]:g}"


def served_chat(cache: dict) -> dict:
    """`vllm serve` flags that serve requests as the head was trained: the chat template its data was
    rendered with (a file given as target.chat_template) and the thinking mode (chat-template kwargs)."""
    flags = {"chat-template": cache.get("chat_template")} if cache.get("chat_template") else {}
    if cache.get("chat_template_kwargs"):
        flags["default-chat-template-kwargs"] = cache["chat_template_kwargs"]
    return flags


def thinking_text(kwargs: dict | None) -> str:
    """The chat-template kwargs the training answers were rendered with: the requests' to serve it with."""
    if kwargs is None:
        return "not recorded (a cache from before the thinking mode was): serve as the data was rendered"
    if not kwargs:
        return "the chat template's defaults (no `chat_template_kwargs`)"
    return f"`chat_template_kwargs` {json.dumps(kwargs)} in every request (or the server's defaults)"


def window_text(window: int | None) -> str:
    """The draft layers' attention: full causal, or a sliding window (vLLM's `layer_types`)."""
    if window is None:
        return "full causal"
    return f"sliding window of {window} positions (config.json `layer_types` / `sliding_window`)"


def modes_text(counts: dict | None) -> str:
    """How many training samples were rendered in each request's own chat-template kwargs (a log may mix
    thinking on and off; data_prep counts them)."""
    if not counts:
        return "not recorded"
    return "; ".join(f"{n} with `{kwargs}`" for kwargs, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def _pair(values: dict | None) -> str:
    return f"{values.get('train', '?')} / {values.get('eval', '?')}" if values else "?"


def block_lengths(c: dict) -> str:
    """The DFlash block lengths a head config trained, as the card writes them: "8" or "2-8"."""
    shortest = c.get("min_block_size") or c["block_size"]
    return str(c["block_size"]) if shortest == c["block_size"] else f"{shortest}-{c['block_size']}"


def ks_text(c: dict) -> str:
    """The k a DFlash head config drafts as trained, as the card writes them: "7" or "1-7"."""
    ks = dflash_trained_ks(c["block_size"], c.get("min_block_size"), c["causal"])
    return str(ks[0]) if len(ks) == 1 else f"{ks[0]}-{ks[-1]}"
