"""watch: a live vLLM server's acceptance held against what eval measured for its head, one verdict per
window (watch/health.py), with what to do about it (docs/watch.md).

    python watch/main.py experiment=smollm2 run_dir=runs/smollm2 watch.url=http://localhost:8000
    python watch/main.py experiment=smollm2 run_dir=runs/smollm2 watch.url=http://localhost:8000 watch.once=true
    python watch/main.py run_dir=/runs/llama31 watch.url=http://gpu7:8000 watch.head=/heads/llama31 \
        watch.results=/runs/llama31/eval/results.json watch.temperature=1 watch.traffic=/logs/requests.jsonl

It scrapes the server's `/metrics` `watch.subwindows` times per `watch.interval_s` and judges a window per
interval, lengthened while it is too short for its requests (`insufficient`): `healthy`, `degraded`
(retrain: the commands are printed), `net-negative` (turn it off, or the deploy config eval recommends),
`latency`, `no-speculation`, `idle`; `restarted` (another server process or k: a new baseline, the served
model checked again, the expectation re-read for the new k), `down` (no answer: it waits, and starts again
from the first answer), `unmeasured` (the record has nothing at the server's k). Each is a status line, a
record in <out_dir>/timeline.jsonl and (watch.report_to=wandb) a W&B step; after every judged window it
rewrites a Prometheus alerting rule file and a Grafana panel from that window (watch/alert_rules.py).
`watch.once=true` judges one window and exits with its code (watch/health.py EXIT_CODES: 0 healthy, 1
retrain, 2 turn it off, 3 could not judge); bad input exits 64, a crash 70, an interrupt 130.

Before the first window it refuses, in one line naming what is wrong: a URL that does not answer or is not
a vLLM server, a server serving another model than the head's target (by name and path, /v1/models; the
export's record names it in every format), a head directory without an export, a record it cannot read.
"""

from __future__ import annotations

import json
import logging
import math
import signal
import sys
import time
import traceback
from pathlib import Path
from urllib.parse import urlparse

import hydra
from omegaconf import DictConfig

from artifacts import atomic
from artifacts.config import check_config, register_configs
from eval.server import http_get
from export.read_vllm import (
    export_trained_temperatures,
    export_trained_template_kwargs,
    read_export_config,
    temperature_note,
    thinking_note,
)
from export.record import read_record
from watch.actions import actions, results_path, served_kwargs_of
from watch.alert_rules import write_rules
from watch.expectation import (
    Expected,
    expected_from_results,
    expected_from_verification,
    read_json,
)
from watch.health import BAD_INPUT, CRASHED, INTERRUPTED, Verdict, Watcher
from watch.scrape import Snapshot, read_snapshot

log = logging.getLogger("watch")


class WatchError(ValueError):
    """Bad input: the message names the URL, file or setting at fault."""


class Unanswered(OSError):
    """The server did not answer a scrape (down, restarting, unreachable)."""


def scrape(url: str) -> Snapshot:
    try:
        text = http_get(f"{url.rstrip('/')}/metrics", timeout=10.0)
    except OSError as error:
        raise Unanswered(f"watch.url={url}: no answer from {url}/metrics ({error})") from error
    try:
        return read_snapshot(text, time.time())
    except ValueError as error:
        raise WatchError(f"watch.url={url}: {error}") from error


def served_model(url: str) -> tuple[str, str | None]:
    """(served name, model path) from the server's /v1/models (vLLM's `root` is the path it loaded); warns
    when it lists LoRA adapters, whose traffic the counters and the request log also hold."""
    try:
        models = json.loads(http_get(f"{url.rstrip('/')}/v1/models", timeout=10.0))["data"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise WatchError(f"watch.url={url}: /v1/models did not list a model ({error})") from error
    if not models:
        raise WatchError(f"watch.url={url}: /v1/models lists no model")
    adapters = [m.get("id") for m in models if m.get("parent")]
    if adapters:
        log.warning(
            "%s also serves LoRA adapters %s: their requests are in the same counters and request log, and "
            "the head was not measured on them",
            url,
            adapters,
        )
    base = next((m for m in models if not m.get("parent")), models[0])
    return base["id"], base.get("root")


def head_target(head_dir: Path) -> str | None:
    """The target the head was exported for: the export's record (every format), else speculators'
    verifier; None when neither says."""
    if target := (read_record(head_dir) or {}).get("target"):
        return target
    config = read_json(head_dir / "config.json", "export config")
    return (config.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")


def same_model(a: str, b: str) -> bool | None:
    """Whether two model names are the same model: the same directory where both are on this host, the same
    path or hub id otherwise; None where only their last components agree (a path elsewhere against another,
    or a hub id against a path): the weights behind them cannot be compared from here."""
    if Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    if a.rstrip("/") == b.rstrip("/"):
        return True
    return None if Path(a.rstrip("/")).name == Path(b.rstrip("/")).name else False


def check_server(url: str, target: str | None) -> None:
    name, root = served_model(url)
    if target is None:
        log.warning("the export does not name its target: the model %s serves is not checked", url)
        return
    served = [value for value in (root, name) if value]
    found = [same_model(value, target) for value in served]
    if True in found:
        return
    if None in found:  # said, not passed in silence: a server elsewhere may hold the same weights elsewhere
        log.warning(
            "%s serves %r and the head was trained for %r: only their names agree. The watch cannot tell "
            "from here whether they are the same weights (neither path is on this host, and vLLM does not "
            "report a hash of its weights); judging as if they were. Set watch.target to the served model "
            "if it is another one",
            url,
            root or name,
            target,
        )
        return
    raise WatchError(
        f"watch.url={url} serves {root or name!r}; the head was trained for {target!r} "
        "(a different model: set watch.target to the model the server should serve)"
    )


def eval_head_name(results: Path, head_dir: Path) -> str:
    """The name eval gave the head served from `head_dir` (a head without a path is its run's export)."""
    config = read_json(results, "eval results").get("config", {})
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


def load_expected(cfg: DictConfig, head_dir: Path, k: int, prefix_holds: bool) -> Expected:
    """What the head was measured to do at the server's k (NotMeasured where the record has nothing)."""
    watch = cfg.watch
    results = results_path(cfg)
    if results.exists():
        if watch.eval_head is not None:
            names = sorted(
                {r.get("head") for r in read_json(results, "eval results").get("runs", [])} - {None}
            )
            if watch.eval_head not in names:  # a typo is bad input, not a head eval could not judge
                raise WatchError(
                    f"watch.eval_head={watch.eval_head}: {results} measured no such head ({names})"
                )
        name = watch.eval_head or eval_head_name(results, head_dir)
        return expected_from_results(results, name, k, watch.temperature, watch.workload, prefix_holds)
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
    return expected_from_verification(verification, k, prefix_holds)


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
        parts.append(f"dispersion {n['dispersion']:.1f} ({n['dispersion_from']})")
    if "requests" in n:
        parts.append(
            f"{n['seconds']:.0f} s, {n['requests']:.0f} req, {n['generated_tokens']:.0f} tok, "
            f"concurrency {n['concurrency']:.1f}"
        )
    if not math.isnan(n.get("itl_p50_ms", math.nan)):
        parts.append(f"ITL p50 {n['itl_p50_ms']:.0f} p99 {n['itl_p99_ms']:.0f} ms")
    return " | ".join(parts) + f" | {verdict.reason}"


def checked_settings(cfg: DictConfig) -> tuple[Path, bool, str | None]:
    """(head directory, whether the record's larger k holds the server's, the target) before anything runs."""
    check_config(cfg)
    settings = cfg.watch
    if not settings.url:
        raise WatchError(
            "watch.url is not set: the vLLM server to watch, e.g. watch.url=http://localhost:8000"
        )
    head_dir = Path(settings.head or Path(cfg.run_dir) / "export")
    atomic.recover_dir(head_dir)  # an export killed while publishing left the old one aside
    if not (head_dir / "config.json").exists():
        raise WatchError(f"watch.head={head_dir}: not an export (no config.json; run export/main.py)")
    try:
        kind, fields = read_export_config(head_dir)
    except (ValueError, KeyError) as error:
        raise WatchError(
            f"{head_dir / 'config.json'}: not a readable export config ({error}); rerun export"
        ) from error
    # a chain's or P-EAGLE's first drafts do not depend on k; a bidirectional DFlash block does
    prefix_holds = kind != "dflash" or bool(fields.get("causal"))
    return head_dir, prefix_holds, settings.target or head_target(head_dir)


def watch(cfg: DictConfig, overrides: list[str] = ()) -> int:
    """Run the watch; returns the exit status (the last judged window's with watch.once)."""
    head_dir, prefix_holds, target = checked_settings(cfg)
    settings = cfg.watch
    try:
        first = scrape(settings.url)
    except Unanswered as error:
        raise WatchError(str(error)) from error
    check_server(settings.url, target)
    other_t = temperature_note(
        "watched", export_trained_temperatures(head_dir), [float(settings.temperature)]
    )
    if other_t:  # judged all the same: the record's eval may have measured it at this temperature
        log.warning("%s", other_t)
    if settings.chat_template_kwargs is not None:
        other_mode = thinking_note(
            "watched", export_trained_template_kwargs(head_dir), served_kwargs_of(settings)
        )
        if other_mode:
            log.warning("%s", other_mode)
    if not first.speculating:
        raise WatchError(
            f"watch.url={settings.url}: the server exposes no spec-decode counters: it does not draft"
        )
    out_dir = Path(settings.out_dir or Path(cfg.run_dir) / "watch")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as error:
        raise WatchError(f"watch.out_dir={out_dir}: cannot be a directory ({error})") from error

    def expect(k: int) -> Expected:
        return load_expected(cfg, head_dir, k, prefix_holds)

    watcher = Watcher(expect, settings.z, settings.latency_margin, settings.subwindows)
    watcher.feed(first)
    model = next(iter(first.model_names), "")
    instance = urlparse(settings.url).netloc if settings.instance is None else settings.instance
    log.info(
        "watching %s (k=%d, T=%g) against %s; timeline: %s",
        settings.url, first.k, settings.temperature,
        watcher.expected.source if watcher.expected else watcher.unmeasured, out_dir / "timeline.jsonl",
    )  # fmt: skip
    wandb_run = None
    if settings.report_to == "wandb":
        import wandb

        wandb_run = wandb.init(
            project=settings.wandb_project, mode=settings.wandb_mode, dir=str(out_dir), job_type="watch"
        )
    status, windows, down_since, said = 0, 0, None, []
    try:
        while True:
            time.sleep(settings.interval_s / settings.subwindows)
            try:
                snapshot = scrape(settings.url)
            except Unanswered as error:
                if down_since is None:
                    down_since = time.time()
                    emit(
                        Verdict("down", f"{error}: waiting for it; a new baseline from its first answer"),
                        out_dir,
                        wandb_run,
                    )
                continue
            previous = watcher.previous  # the last judged verdict, before this scrape
            if down_since is not None:
                last = watcher.scrapes[-1] if watcher.scrapes else watcher.before
                drafts = f", drafting k={snapshot.k} (it drafted k={last.k})" if last.k != snapshot.k else ""
                verdict = Verdict("restarted", f"the server answers again after {time.time() - down_since:.0f} s down{drafts}: a new baseline from this scrape", {"k": snapshot.k})  # fmt: skip
                down_since = None
                watcher.baseline(snapshot)
            else:
                verdict = watcher.feed(snapshot)
            if verdict is None:
                continue
            if verdict.name == "restarted":
                check_server(settings.url, target)  # after a restart, the same model (else: bad input)
                model = next(iter(snapshot.model_names), model)
            judged = not verdict.numbers.get("window_open")
            todo = actions(verdict, cfg, head_dir, list(overrides)) if judged else []
            if verdict.name == previous and set(todo) <= set(said):
                todo = []  # said already
            elif verdict.name not in ("idle", "insufficient", "unmeasured"):
                said = todo  # said again when the verdict changes or something is added to do: a head
                # judged net-negative (as eval measured it at a concurrency) that also falls below its band
            emit(verdict, out_dir, wandb_run, todo)
            if judged and "acceptance_low" in verdict.numbers:
                write_rules(out_dir, watcher.expected, verdict, model, instance)
            if not judged or verdict.name in ("restarted", "down"):
                continue
            status, windows = verdict.exit_code, windows + 1
            if settings.once or (settings.windows and windows >= settings.windows):
                return status
    finally:
        if wandb_run is not None:
            wandb_run.finish()


def emit(verdict: Verdict, out_dir: Path, wandb_run=None, todo: list[str] = ()) -> None:
    """A verdict's status line (and its commands), its timeline record, its W&B step."""
    record = {"time": time.time(), "verdict": verdict.name, "reason": verdict.reason, **verdict.numbers,
              "actions": list(todo)}  # fmt: skip
    with (out_dir / "timeline.jsonl").open("a") as timeline:
        timeline.write(json.dumps(record) + "\n")
    print(status_line(verdict), flush=True)
    for command in todo:
        print(f"    {command}", flush=True)
    if wandb_run is not None:
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        wandb_run.log(numbers | {"verdict_code": verdict.exit_code})


def interrupted(*_):
    raise KeyboardInterrupt


STARTED = False  # set once Hydra has composed the config: an exit before it is Hydra refusing the command


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    global STARTED
    STARTED = True
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    signal.signal(signal.SIGTERM, interrupted)  # a quiet stop, as Ctrl-C
    try:
        status = watch(cfg, list(HydraConfig.get().overrides.task))
    except KeyboardInterrupt:
        print("watch: stopped", file=sys.stderr, flush=True)
        sys.exit(INTERRUPTED)
    except ValueError as error:  # WatchError; a setting refused, a record unreadable or without the k
        print(f"watch: {error}", file=sys.stderr, flush=True)
        sys.exit(BAD_INPUT)
    except Exception:  # the watch's own failure: never a verdict's exit code
        traceback.print_exc()
        print("watch: crashed (a bug in the watch: the traceback above)", file=sys.stderr, flush=True)
        sys.exit(CRASHED)
    sys.exit(status)


register_configs()

if __name__ == "__main__":
    try:
        main()
    except SystemExit as stop:
        # Hydra reports an override it cannot parse or a config it cannot compose with exit status 1, the
        # one-shot protocol's "retrain": that is bad input (its message is printed above).
        if not STARTED and stop.code not in (0, None):
            sys.exit(BAD_INPUT)
        raise
