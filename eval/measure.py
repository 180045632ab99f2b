"""Measure every (server config, workload, concurrency) on real `vllm serve` servers, one server per config
(eval/server.py): acceptance from the difference of the server's `/metrics` counters around each run
(eval/prometheus.py), latency and throughput from the streaming client (eval/client.py). Each finished run
is appended to <out_dir>/runs.jsonl under a key of everything that decides it, so an interrupted eval
continues where it stopped; servers are always shut down (Ctrl-C, SIGTERM and SIGHUP included: the leash
of target/reaper.py turns the last two into KeyboardInterrupt).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from eval.client import run_load, summarize
from eval.prometheus import acceptance_counts
from eval.server import VllmServer


def settings_key(cfg, config: dict, workload, concurrency: int, temperature: float) -> str:
    """Identity of one measured run: a finished run with the same key is reused on a rerun."""
    values = {
        "config": config,
        "workload": OmegaConf.to_container(workload),
        "concurrency": concurrency,
        "temperature": temperature,
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


def workload_label(name: str, temperature: float, temperatures) -> str:
    """A run's workload as reports, comparisons and recommendations group it: the workload's name, with
    its temperature when eval sweeps several ("chat T=1")."""
    return name if len(temperatures) == 1 else f"{name} T={temperature:g}"


def measure(
    server: VllmServer, model: str, prompts, concurrency: int, workload, temperature: float, cfg
) -> dict:
    """One measured run on an idle server: counters before and after, latency from the client."""
    before = acceptance_counts(server.metrics())
    results, duration = asyncio.run(
        run_load(
            server.url,
            model,
            prompts,
            concurrency,
            workload.max_tokens,
            temperature,
            cfg.eval.ignore_eos,
            cfg.seed,
            cfg.eval.request_timeout_s,
        )
    )
    counts = acceptance_counts(server.metrics()) - before
    summary = summarize(results, duration, list(cfg.eval.context_buckets))
    return {**summary, "acceptance": counts.summary() if counts.num_drafts else None}


def served_runs(cfg, configs: list[dict], prompts: dict, target_path: Path, out_dir: Path) -> list[dict]:
    """Every (config, workload, concurrency, temperature) measured on real servers, one server per config;
    finished runs come from <out_dir>/runs.jsonl instead."""
    finished_file = out_dir / "runs.jsonl"
    finished = read_finished(finished_file)
    temperatures = [float(t) for t in cfg.eval.temperature]
    plan = [
        (config, (workload, int(c), t), settings_key(cfg, config, workload, int(c), t))
        for config in configs
        for workload in cfg.eval.workloads
        for t in temperatures
        for c in cfg.eval.concurrency
    ]
    runs = [finished[key]["run"] for *_, key in plan if key in finished]
    bar = tqdm(total=len(plan), initial=len(runs), desc="eval runs", unit="run")
    try:  # SIGTERM and SIGHUP raise KeyboardInterrupt here (target/reaper.py's leash): servers shut down
        for config in configs:
            todo = [(*case, key) for cf, case, key in plan if cf is config and key not in finished]
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
                for workload, concurrency, temperature, key in todo:
                    label = workload_label(workload.name, temperature, temperatures)
                    bar.set_postfix_str(f"{config['config']} {label} c={concurrency}")
                    result = measure(
                        server, model, prompts[workload.name], concurrency, workload, temperature, cfg
                    )
                    record = {
                        "config": config["config"],
                        "head": config["head"],
                        "k": config["k"],
                        "drafting": config.get("drafting"),
                        "schedule": config.get("schedule"),
                        "workload": label,
                        "workload_name": workload.name,
                        "temperature": temperature,
                        "concurrency": concurrency,
                        **result,
                    }
                    runs.append(record)
                    with open(finished_file, "a") as f:  # nothing measured is lost on a crash
                        f.write(json.dumps({"key": key, "run": record}) + "\n")
                    bar.update()
    finally:
        bar.close()

    return runs
