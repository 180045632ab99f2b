"""watch: a live vLLM server's acceptance held against what eval measured for its head, one verdict per
window (eval/health.py), with what to do about it (docs/watch.md).

    python eval/watch.py experiment=smollm2 run_dir=runs/smollm2 watch.url=http://localhost:8000
    python eval/watch.py experiment=smollm2 run_dir=runs/smollm2 watch.url=http://localhost:8000 watch.once=true
    python eval/watch.py run_dir=/runs/llama31 watch.url=http://gpu7:8000 watch.head=/heads/llama31 \
        watch.results=/runs/llama31/eval/results.json watch.temperature=1 watch.traffic=/logs/requests.jsonl

Every `watch.interval_s` it scrapes the server's `/metrics` and judges the window since the last scrape:
`healthy`, `degraded` (retrain: the commands are printed), `net-negative` (turn it off, or the deploy config
eval recommends), `latency`, `no-speculation`, `restarted`, `idle`. Each window is a status line, a record
in <out_dir>/timeline.jsonl and (watch.report_to=wandb) a W&B step; at start it writes a Prometheus alerting
rule file and a Grafana panel from the head's record into out_dir. `watch.once=true` judges one window and
exits 0 (healthy), 1 (retrain), 2 (turn it off) or 3 (nothing to judge).

Before the first window it refuses, naming what is wrong: a URL that does not answer or is not a vLLM
server, a server serving another model than the head's target (by name and path, /v1/models), a head
directory without an export, a server whose k differs from the one judged.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
import signal
import sys
import time
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig

from artifacts.config import check_config, register_configs
from eval.health import (
    EXIT_CODES,
    Expected,
    Snapshot,
    Verdict,
    expected_from_results,
    expected_from_verification,
    judge,
    read_snapshot,
    window,
)
from eval.server import http_get

log = logging.getLogger("watch")


class WatchError(ValueError):
    """Bad input: the message names the URL, file or setting at fault."""


def scrape(url: str) -> Snapshot:
    try:
        text = http_get(f"{url.rstrip('/')}/metrics", timeout=10.0)
    except OSError as error:
        raise WatchError(f"watch.url={url}: no answer from {url}/metrics ({error})") from error
    try:
        return read_snapshot(text, time.time())
    except ValueError as error:
        raise WatchError(f"watch.url={url}: {error}") from error


def served_model(url: str) -> tuple[str, str | None]:
    """(served name, model path) from the server's /v1/models (vLLM's `root` is the path it loaded)."""
    try:
        models = json.loads(http_get(f"{url.rstrip('/')}/v1/models", timeout=10.0))["data"]
    except (OSError, ValueError, KeyError) as error:
        raise WatchError(f"watch.url={url}: /v1/models did not list a model ({error})") from error
    return models[0]["id"], models[0].get("root")


def head_target(head_dir: Path) -> str | None:
    """The target the head was exported for (speculators' verifier), None when its format does not say."""
    config = json.loads((head_dir / "config.json").read_text())
    return (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")


def same_model(a: str, b: str) -> bool:
    """By path where both are local directories, else by name (the last path component)."""
    if Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    return Path(a.rstrip("/")).name == Path(b.rstrip("/")).name


def check_server(url: str, target: str | None) -> None:
    name, root = served_model(url)
    if target is None:
        return
    served = [value for value in (root, name) if value]
    if not any(same_model(value, target) for value in served):
        raise WatchError(
            f"watch.url={url} serves {root or name!r}; the head was trained for {target!r} "
            "(a different model: set watch.target to the model the server should serve)"
        )


def eval_head_name(results: Path, head_dir: Path) -> str:
    """The name eval gave the head served from `head_dir` (a head without a path is its run's export)."""
    config = json.loads(results.read_text()).get("config", {})
    heads = config.get("heads") or config.get("eval", {}).get("heads") or []
    run_export = results.parent.parent / "export"
    names = [
        h["name"]
        for h in heads
        if h.get("method", "export") == "export"
        and Path(h.get("path") or run_export).resolve() == head_dir.resolve()
    ]
    if len(names) != 1:
        every = [h.get("name") for h in heads]
        raise WatchError(
            f"{results}: {len(names)} heads served from {head_dir} (heads: {every}); name one with "
            "watch.eval_head"
        )
    return names[0]


def results_path(cfg: DictConfig) -> Path:
    """eval's results.json for the watched head: watch.results, or the run's own eval."""
    return Path(cfg.watch.results or Path(cfg.run_dir) / "eval" / "results.json")


def load_expected(cfg: DictConfig, head_dir: Path, k: int) -> Expected:
    watch = cfg.watch
    results = results_path(cfg)
    if results.exists():
        name = watch.eval_head or eval_head_name(results, head_dir)
        try:
            return expected_from_results(results, name, k, watch.temperature, watch.workload)
        except ValueError as error:
            raise WatchError(str(error)) from error
    verification = head_dir / "verification.json"
    if not verification.exists():
        raise WatchError(
            f"{results} does not exist and {verification} neither: nothing says what this head should "
            "accept (run eval/main.py, or export with export.verify=true)"
        )
    log.warning(
        "%s does not exist: judging against export verification's acceptance (%s; offline, T=0, no "
        "break-even or latency)",
        results,
        verification,
    )
    return expected_from_verification(verification)


def actions(verdict: Verdict, cfg: DictConfig, head_dir: Path, overrides: list[str]) -> list[str]:
    """What to do, as commands. `degraded`, `latency`: retrain on the served traffic, warm-started from this
    head, for the model the server serves. `net-negative`: the config to deploy now, then the same retrain
    where the window is also below what the head was measured to do (a head that stopped paying)."""
    todo = []
    if verdict.name in ("net-negative", "no-speculation"):
        todo.append(deploy_now(cfg))
    n = verdict.numbers
    below_band = "acceptance_high" in n and n["acceptance_high"] < n["expected_low"]
    if verdict.name in ("degraded", "latency") or (verdict.name == "net-negative" and below_band):
        todo += retrain_commands(cfg, overrides)
    return todo


def retrain_commands(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """data_prep on the served traffic (watch.traffic), train warm-started from this run's head, export
    with verification, eval: the run's own overrides, and the served model where it is not the head's
    target (watch.target, after a base-model upgrade)."""
    same = [o for o in overrides if not o.startswith(("watch.", "run_dir="))]
    if cfg.watch.target and not any(o.startswith(("target=", "target.path=")) for o in same):
        same.append(f"target.path={cfg.watch.target}")
    same = " ".join(shlex.quote(o) for o in same)  # eval.heads=[{...,...}] would be brace-expanded
    new_run = f"{cfg.run_dir.rstrip('/')}_retrained"
    traffic = cfg.watch.traffic or "<your request log, OpenAI-style JSONL>"
    warm = Path(cfg.run_dir) / "draft_head"
    return [
        f"python data_prep/main.py {same} run_dir={new_run} data.source={traffic} data.format=openai",
        f"python train/main.py {same} run_dir={new_run} train.init_from={warm}",
        f"python export/main.py {same} run_dir={new_run} export.verify=true",
        f"python eval/main.py {same} run_dir={new_run}",
    ]


def deploy_now(cfg: DictConfig) -> str:
    """eval's recommendation for this traffic (a smaller k, a per-batch-size schedule, another drafter),
    or serving without speculation."""
    results = results_path(cfg)
    if results.exists():
        recommendations = json.loads(results.read_text()).get("recommendations") or []
        wanted = [r for r in recommendations if r.get("enable") and r.get("deploy")]
        if cfg.watch.workload:
            wanted = [r for r in wanted if r.get("workload", "").split(" T=")[0] == cfg.watch.workload]
        if wanted:
            best = max(wanted, key=lambda r: r.get("best_speedup") or 0)
            return f"vllm serve ... --speculative-config '{json.dumps(best['deploy'])}'  ({best['text']})"
    return "vllm serve ... without --speculative-config (eval recommends no drafter for this traffic)"


def status_line(verdict: Verdict) -> str:
    n = verdict.numbers
    parts = [f"{verdict.name:>14}"]
    if "acceptance_low" in n:  # judged on its acceptance (not a restart, an idle or a draftless window)
        parts.append(
            f"L {n['mean_acceptance_length']:.3f} ({n['acceptance_low']:.3f}..{n['acceptance_high']:.3f})"
            f" expected >= {n['expected_low']:.3f}"
            + (f", break-even {n['break_even']:.3f}" if n.get("break_even") else "")
        )
        parts.append("positions " + "/".join(f"{p:.2f}" for p in n["per_position"]))
        parts.append(f"dispersion {n['dispersion']:.1f}")
    parts.append(
        f"{n['requests']:.0f} req, {n['generated_tokens']:.0f} tok, concurrency {n['concurrency']:.1f}"
    )
    if not math.isnan(n["itl_p50_ms"]):
        parts.append(f"ITL p50 {n['itl_p50_ms']:.0f} p99 {n['itl_p99_ms']:.0f} ms")
    return " | ".join(parts) + f" | {verdict.reason}"


def acceptance_length_promql(model: str, over: str) -> str:
    """PromQL for the mean acceptance length of `model`'s server over the last `over` (e.g. 10m)."""
    return (
        f'1 + sum(rate(vllm:spec_decode_num_accepted_tokens_total{{model_name="{model}"}}[{over}])) / '
        f'sum(rate(vllm:spec_decode_num_drafts_total{{model_name="{model}"}}[{over}]))'
    )


def alert_rules(expected: Expected, model: str, z: float) -> dict:
    """A Prometheus alerting-rule group from the head's record: the mean acceptance length over 10 minutes
    below the measured band (retrain) and below break-even at the lowest measured concurrency (turn off)."""
    length = acceptance_length_promql(model, "10m")
    rules = [
        {
            "alert": "SpeculativeHeadDegraded",
            "expr": f"{length} < {expected.band_low(z):.4f}",
            "for": "15m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "draft head accepts less than it was measured to: retrain it on current traffic",
                "source": expected.source,
            },
        }
    ]
    break_even = expected.break_even(1.0)
    if break_even is not None:
        rules.append(
            {
                "alert": "SpeculativeHeadNetNegative",
                "expr": f"{length} < {break_even:.4f}",
                "for": "10m",
                "labels": {"severity": "critical"},
                "annotations": {
                    "summary": "speculation makes serving slower than without it: turn it off",
                    "source": expected.source,
                },
            }
        )
    return {"groups": [{"name": "speculative-decoding", "rules": rules}]}


def grafana_panel(expected: Expected, model: str, z: float) -> dict:
    """A Grafana time-series panel: the mean acceptance length with the band and break-even as thresholds."""
    steps = [{"color": "red", "value": None}]
    break_even = expected.break_even(1.0)
    if break_even is not None:
        steps.append({"color": "orange", "value": round(break_even, 4)})
    steps.append({"color": "green", "value": round(expected.band_low(z), 4)})
    return {
        "type": "timeseries",
        "title": "Mean acceptance length (speculative decoding)",
        "targets": [
            {
                "expr": acceptance_length_promql(model, "5m"),
                "legendFormat": "acceptance length",
            }
        ],
        "fieldConfig": {
            "defaults": {
                "thresholds": {"mode": "absolute", "steps": steps},
                "custom": {"thresholdsStyle": {"mode": "line"}},
            }
        },
    }


def watch(cfg: DictConfig, overrides: list[str] = ()) -> int:
    """Run the watch; returns the exit status (the last verdict's with watch.once)."""
    check_config(cfg)
    settings = cfg.watch
    if not settings.url:
        raise WatchError(
            "watch.url is not set: the vLLM server to watch, e.g. watch.url=http://localhost:8000"
        )
    head_dir = Path(settings.head or Path(cfg.run_dir) / "export")
    if not (head_dir / "config.json").exists():
        raise WatchError(f"watch.head={head_dir}: not an export (no config.json; run export/main.py)")
    check_server(settings.url, settings.target or head_target(head_dir))
    first = scrape(settings.url)
    k = len(first.acceptance.accepted_per_position)
    if not first.speculating:
        raise WatchError(
            f"watch.url={settings.url}: the server exposes no spec-decode counters: it does not draft"
        )
    expected = load_expected(cfg, head_dir, k)
    model = next(iter(first.model_names), "")
    out_dir = Path(settings.out_dir or Path(cfg.run_dir) / "watch")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "alerts.yml").write_text(
        yaml.safe_dump(alert_rules(expected, model, settings.z), sort_keys=False)
    )
    (out_dir / "grafana_panel.json").write_text(
        json.dumps(grafana_panel(expected, model, settings.z), indent=2)
    )
    log.info(
        "watching %s (k=%d, T=%g) against %s; timeline: %s",
        settings.url,
        k,
        settings.temperature,
        expected.source,
        out_dir / "timeline.jsonl",
    )
    wandb_run = None
    if settings.report_to == "wandb":
        import wandb

        wandb_run = wandb.init(
            project=settings.wandb_project, mode=settings.wandb_mode, dir=str(out_dir), job_type="watch"
        )
    previous, before, status, windows = "healthy", first, 0, 0
    try:
        while True:
            scrapes = []  # within the window: its sub-windows give the acceptance's dispersion
            for _ in range(settings.subwindows):
                time.sleep(settings.interval_s / settings.subwindows)
                scrapes.append(scrape(settings.url))
            after = scrapes[-1]
            current = window(before, after, scrapes[:-1])
            verdict = judge(current, expected, previous, settings.z, settings.latency_margin)
            todo = actions(verdict, cfg, head_dir, list(overrides)) if verdict.name != previous else []
            record = {
                "time": after.time_s,
                "verdict": verdict.name,
                "reason": verdict.reason,
                **verdict.numbers,
                "actions": todo,
            }
            with (out_dir / "timeline.jsonl").open("a") as timeline:
                timeline.write(json.dumps(record) + "\n")
            print(status_line(verdict), flush=True)
            for command in todo:
                print(f"    {command}", flush=True)
            if wandb_run is not None:
                wandb_run.log(
                    {k: v for k, v in record.items() if isinstance(v, (int, float))}
                    | {"verdict_code": verdict.exit_code}
                )
            if verdict.name not in ("idle", "restarted"):  # nothing judged: the state stays
                previous = verdict.name
            before, status, windows = after, verdict.exit_code, windows + 1
            if settings.once or (settings.windows and windows >= settings.windows):
                return status
    finally:
        if wandb_run is not None:
            wandb_run.finish()


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_CODES["idle"]))
    try:
        status = watch(cfg, list(HydraConfig.get().overrides.task))
    except WatchError as error:
        log.error("%s", error)
        sys.exit(64)
    sys.exit(status)


register_configs()

if __name__ == "__main__":
    main()
