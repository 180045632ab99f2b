"""The watch's trial on real vLLM servers (docs/watch.md#the-trial): a head watched while it serves, then
after a base-model upgrade, then after the retrain the watch itself prescribed.

    python -m bench.watch_trial                       # runs/smollm2's head; results in runs/watch_trial
    python -m bench.watch_trial --windows 30 --interval-s 20 --k 2 --run-dir runs/smollm2 --out runs/watch_trial
    python -m bench.watch_trial --max-tokens 512 --concurrency 4 --windows 10 --upgrade-windows 10 \
        --restart-k 3 --phases upgrade --out runs/watch_trial_long   # long answers, a restart, no retrain
    python -m bench.watch_trial --experiment smoke_regen --run-dir runs/smoke_long --head-name head --k 3 \
        --max-tokens 512 --phases before --traffic heldout --out runs/watch_smoke_long   # the smoke run

1. before: the run's head served on its own target (compiled, as eval serves), eval's client sending
   ShareGPT questions the head never saw (the ones after the run's `data.num_samples`), one at a time; the
   watch judges `--windows` windows against the run's eval results: every verdict is counted (a verdict
   other than `healthy` is a false alarm).
2. upgrade: the same head served on the base-upgrade workflow's new checkpoint (`target=smollm2_upgraded`,
   docs/workflows.md), the traffic going on with the next questions; the first window that is not
   `healthy`, and the requests and seconds since the switch.
3. retrain: the commands the watch printed at that window - data_prep on the request log the traffic
   wrote (the questions with the answers served), train warm-started from the head, export, eval - run as
   printed, each with its log in the trial directory.
4. after: the retrained head on the new checkpoint, judged against its own eval, `--windows` windows.

With `--restart-k K` the before phase restarts its server with K drafts after its `--windows` windows (the
traffic paused, the same port) and watches `--restart-windows` more: the watch must say `restarted` with
k=K on its first scrape of the new server and judge on against the record at K. Besides the verdicts, each
phase counts its windows below the head's band (acceptance alone, whatever the speed verdict: where eval
measured the head slower than the baseline, as at concurrency 4 on a 2-core CPU, every window is rightly
`net-negative`, and the upgrade shows as the first window below the band: the retrain printed).

Every phase's summary goes to <out>/trial.json as it finishes; a rerun skips the finished phases and
retrain commands (each stage resumes its own work), so an interrupted trial continues where it stopped.
The settings the watch is given (and so its printed commands) narrow eval to the chat and MT-Bench
workloads at the served k and concurrency 1, what fits this CPU (NARROW_EVAL).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import shlex
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from artifacts.config import compose
from artifacts.prompts import read_conversations
from bench.traffic import Traffic
from data_prep.main import build_embedded_target
from data_prep.sources import load_conversations
from eval.grid import server_configs
from eval.server import VllmServer
from heads.acceptance import AcceptanceCounts
from target.model import load_config, load_tokenizer, target_dir
from watch.actions import below_band
from watch.expectation import expected_from_results
from watch.main import watch

log = logging.getLogger("watch_trial")

# eval in the retrain commands: the main job's chat and MT-Bench workloads (the watch's band is the lowest
# measured over the workloads: traffic like either is healthy), at the served k and one request at a time
# (the traffic's concurrency), what fits this CPU
NARROW_EVAL = (
    "eval.workloads=[{name:chat,source:chat,num_prompts:12,max_tokens:128},"
    "{name:mtbench,source:mtbench,num_prompts:8,max_tokens:96}]",
    "eval.concurrency=[1]",
)


def below_band_if_independent(record: dict, expected, z: float) -> bool:
    """Whether a window's binomial upper bound (its drafts independent) lies below the binomial band."""
    n, rates = record["drafts"], record["per_position"]
    counts = AcceptanceCounts(
        int(n),
        int(n) * len(rates),
        round((record["mean_acceptance_length"] - 1) * n),
        [round(r * n) for r in rates],
    )
    return counts.mean_acceptance_bounds(z)[1] < expected.band_low(z)


def read_timeline(path: Path) -> list[dict]:
    """The watch's timeline records so far ([] before its first)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def judged(records: list[dict]) -> list[dict]:
    """The timeline's judged windows: not a window still growing, nor a restart, an outage or an idle one."""
    return [r for r in records if "acceptance_low" in r and not r.get("window_open")]


def first_alarm(records: list[dict], alarmed, started_s: float) -> dict | None:
    """The first judged window for which `alarmed(record)` holds: its number, verdict, reason and the
    requests and seconds from `started_s` (the traffic's start) to it; None when none."""
    windows = judged(records)
    first = next((i for i, r in enumerate(windows) if alarmed(r)), None)
    if first is None:
        return None
    return {
        "window": first + 1,
        "verdict": windows[first]["verdict"],
        "reason": windows[first]["reason"],
        "requests_since_switch": sum(r["requests"] for r in windows[: first + 1]),
        "seconds_since_switch": round(windows[first]["time"] - started_s, 1),
        "actions": windows[first]["actions"],
    }


def restart_seen(records: list[dict], stopped_s: float, answered_s: float, k: int) -> dict:
    """How the watch saw a restart: the server stopped at `stopped_s` and answered again at `answered_s`
    with `k` drafts; its first `restarted` record after the stop (seconds after the answer, the k it read)
    and the verdicts of the judged windows after it."""
    seen = next((r for r in records if r["verdict"] == "restarted" and r["time"] >= stopped_s), None)
    after = judged([r for r in records if seen is not None and r["time"] > seen["time"]])
    return {
        "k": k,
        "down_s": round(answered_s - stopped_s, 1),
        "down_records": sum(r["verdict"] == "down" and r["time"] >= stopped_s for r in records),
        "seen": seen is not None,
        "seen_k": seen.get("k") if seen else None,
        "seen_after_answer_s": round(seen["time"] - answered_s, 1) if seen else None,
        "reason": seen["reason"] if seen else None,
        "windows_after": len(after),
        "verdicts_after": dict(collections.Counter(r["verdict"] for r in after)),
        "below_band_after": sum(below_band(r) for r in after),
    }


class Trial:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary_path = self.out / "trial.json"
        self.summary = json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
        served_k = ",".join(str(k) for k in sorted({args.k, args.restart_k or args.k}))
        self.overrides = [
            f"experiment={args.experiment}",
            f"eval.heads=[{{name:{args.head_name},num_speculative_tokens:[{served_k}]}}]",
            *NARROW_EVAL,
        ]
        base = compose("config", [*self.overrides, f"run_dir={args.run_dir}"])
        self.traffic_log = self.out / "requests.jsonl"
        self.conversations = (
            self.unseen_questions(base) if args.traffic == "unseen" else self.held_out(args.run_dir)
        )
        self.upgraded = None  # built when the upgrade phase first needs it

    def upgraded_target(self) -> str:
        """SmolLM2's upgraded checkpoint (docs/workflows.md), built once beside SmolLM2 as data_prep does."""
        if self.upgraded is None:
            upgraded = compose("config", [*self.overrides, "target=smollm2_upgraded"]).target
            build_embedded_target(upgraded)
            self.upgraded = str(target_dir(upgraded))
        return self.upgraded

    @staticmethod
    def held_out(run_dir: str) -> list[dict]:
        """The run's held-out conversations (its cache), sent over and over: a run whose data has no
        questions left after its own (the smoke run's 64)."""
        loaded = read_conversations(Path(run_dir) / "cache" / "eval_conversations.jsonl")
        log.info("traffic: the run's %d held-out conversations, repeated", len(loaded))
        return loaded

    def unseen_questions(self, cfg) -> list[dict]:
        """ShareGPT's conversations after the first `data.num_samples` the run trained and was evaluated
        on, as `{"id", "messages"}`."""
        data = cfg.data.copy()
        if data.num_samples is None:  # the run trained on all of its data: nothing unseen is left
            raise SystemExit(f"--traffic unseen: {self.args.experiment} sets no data.num_samples, so the run "
                             "trained on all of its data; use --traffic heldout")  # fmt: skip
        skip = int(data.num_samples)
        data.num_samples = skip + self.args.num_questions
        loaded = load_conversations(data).conversations[skip:]
        log.info("traffic: %d ShareGPT questions after the run's first %d", len(loaded), skip)
        return [{"id": c.id, "messages": c.messages} for c in loaded]

    def save(self, phase: str, summary: dict) -> None:
        self.summary[phase] = summary
        self.summary_path.write_text(json.dumps(self.summary, indent=2))

    def serve_and_watch(
        self, phase: str, run_dir: str, target: str | None, windows: int, restart_k: int | None = None
    ) -> dict:
        """Serve `run_dir`'s head on `target` (None: its own), send traffic, watch `windows` windows (with
        `restart_k`: then restart the server at that k and watch `--restart-windows` more)."""
        args = self.args
        total = windows + (args.restart_windows if restart_k else 0)
        watch_overrides = [
            *self.overrides,
            f"run_dir={run_dir}",
            f"watch.interval_s={args.interval_s}",
            f"watch.windows={total}",
            f"watch.out_dir={self.out / phase}",
            f"watch.traffic={self.traffic_log.resolve()}",
            *([f"watch.target={target}"] if target else []),
        ]
        cfg = compose("config", watch_overrides)
        served = target or str(target_dir(cfg.target))
        served_cfg = compose("config", [*self.overrides, f"run_dir={run_dir}", f"target.path={served}"])
        configs = server_configs(served_cfg, Path(run_dir), load_config(served_cfg.target))

        def server(k: int, log_name: str, port: int | None = None) -> VllmServer:
            head = next((c for c in configs if c["head"] and c["k"] == k), None)
            if head is None:
                raise SystemExit(f"k={k}: {run_dir}'s eval.heads do not serve {args.head_name} at k={k}")
            return VllmServer(
                served, self.out / log_name, dict(cfg.eval.server_args), head["speculative_config"],
                port=port, startup_timeout_s=cfg.eval.startup_timeout_s,
            )  # fmt: skip

        timeline = self.out / phase / "timeline.jsonl"
        timeline.unlink(missing_ok=True)  # an interrupted phase is redone whole
        start = self.summary.get("traffic_position", 0)
        tokenizer = load_tokenizer(served_cfg.target)
        log.info("%s: serving %s on %s at k=%d", phase, run_dir, served, args.k)
        restart = None
        with ExitStack() as stack:
            first = stack.enter_context(server(args.k, f"{phase}_server.log"))
            url = first.url

            def traffic_from(position: int) -> Traffic:
                return stack.enter_context(
                    Traffic(
                        url, served, tokenizer, self.conversations, self.traffic_log, start=position,
                        concurrency=args.concurrency, max_tokens=args.max_tokens,
                    )
                )  # fmt: skip

            traffic = traffic_from(start)
            started_s, sent, failed = traffic.started_s, 0, 0
            done: dict = {}

            def run_watch() -> None:
                try:
                    done["status"] = watch(
                        compose("config", [*watch_overrides, f"watch.url={url}"]),
                        [*watch_overrides, f"watch.url={url}"],
                    )
                except BaseException as error:  # raised again in this thread
                    done["error"] = error

            watcher = threading.Thread(target=run_watch, name="watch", daemon=True)
            watcher.start()
            if restart_k:
                while watcher.is_alive() and len(judged(read_timeline(timeline))) < windows:
                    time.sleep(1.0)
                if watcher.is_alive():
                    log.info("%s: restarting the server at k=%d after %d windows", phase, restart_k, windows)
                    traffic.stop()  # after its batch in flight: nothing sent to a stopped server
                    sent, failed = traffic.requests, traffic.failed
                    stopped_s = time.time()
                    first.stop()
                    stack.enter_context(server(restart_k, f"{phase}_server_k{restart_k}.log", first.port))
                    answered_s = time.time()
                    traffic = traffic_from(traffic.position)
                    restart = (stopped_s, answered_s)
            watcher.join()
            if "error" in done:
                raise done["error"]
            status = done["status"]
        sent, failed = sent + traffic.requests, failed + traffic.failed
        records = read_timeline(timeline)
        windows_judged = judged(records)
        verdicts = collections.Counter(r["verdict"] for r in windows_judged)
        expected = expected_from_results(
            Path(run_dir) / "eval" / "results.json", args.head_name, args.k, cfg.watch.temperature
        )
        summary = {
            "run_dir": run_dir,
            "target": served,
            "k": args.k,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "windows": len(windows_judged),
            "window_seconds": [round(r["seconds"]) for r in windows_judged],
            "verdicts": dict(verdicts),
            "exit_status": status,
            "mean_acceptance_length": [round(r["mean_acceptance_length"], 3) for r in windows_judged],
            "dispersion": [round(r["dispersion"], 1) for r in windows_judged],
            "below_band": sum(below_band(r) for r in windows_judged),
            # what the watch would have said had it taken the drafts as independent (dispersion 1)
            "below_band_if_independent": sum(
                below_band_if_independent(r, expected, cfg.watch.z)
                for r in windows_judged
                if not restart or r["time"] < restart[0]  # the windows at --k
            ),
            "expected_low": windows_judged[0].get("expected_low"),
            "break_even": windows_judged[0].get("break_even"),
            "requests_sent": sent,
            "failed": failed,
            "seconds": round(windows_judged[-1]["time"] - started_s, 1),
        }
        for key, alarmed in (
            ("first_not_healthy", lambda r: r["verdict"] != "healthy"),
            ("first_below_band", below_band),
        ):
            if found := first_alarm(records, alarmed, started_s):
                summary[key] = found
        if restart:
            summary["restart"] = restart_seen(records, *restart, restart_k)
        self.summary["traffic_position"] = traffic.position
        self.save(phase, summary)
        log.info("%s: %s", phase, json.dumps({k: v for k, v in summary.items() if not k.startswith("first")}))
        return summary

    def retrain(self, commands: list[str]) -> dict:
        """The printed retrain commands, run as printed (`python` is this interpreter)."""
        timings = self.summary.get("retrain", {}).get("seconds", {})
        for i, command in enumerate(c for c in commands if c.startswith("python ")):
            stage = Path(shlex.split(command)[1]).parent.name
            if stage in timings:
                continue
            log_path = self.out / f"retrain_{i}_{stage}.log"
            log.info("retrain: %s (log: %s)", command, log_path)
            start = time.time()
            with open(log_path, "w") as out:
                code = subprocess.call(
                    [sys.executable, *shlex.split(command)[1:]], stdout=out, stderr=subprocess.STDOUT
                )
            if code != 0:
                raise RuntimeError(
                    f"retrain command failed with exit code {code}: {command} (log: {log_path})"
                )
            timings[stage] = round(time.time() - start, 1)
            self.save("retrain", {"commands": commands, "seconds": timings})
        return self.summary["retrain"]

    def run(self) -> dict:
        args = self.args
        if "before" not in self.summary:
            self.serve_and_watch("before", args.run_dir, None, args.windows, args.restart_k)
        if args.phases == "before":
            return self.summary
        if "upgrade" not in self.summary:
            self.serve_and_watch("upgrade", args.run_dir, self.upgraded_target(), args.upgrade_windows)
        if args.phases == "upgrade":
            return self.summary
        # the retrain is printed at the first window below the band (a head judged net-negative before the
        # upgrade, as eval measured it, prints it there), else at the first alarm
        upgrade = self.summary["upgrade"]
        switched = upgrade.get("first_below_band") or upgrade.get("first_not_healthy")
        if switched is None:
            log.warning("the old head stayed healthy on the new checkpoint: nothing to retrain")
            return self.summary
        if "retrain" not in self.summary or len(self.summary["retrain"]["seconds"]) < 4:
            self.retrain(switched["actions"])
        if "after" not in self.summary:
            self.serve_and_watch(
                "after", f"{args.run_dir.rstrip('/')}_retrained", self.upgraded_target(), args.windows
            )
        return self.summary


COLORS = {
    "healthy": "tab:green",
    "degraded": "tab:orange",
    "net-negative": "tab:red",
    "latency": "tab:purple",
}
TITLES = {"before": "head on its target", "upgrade": "upgraded", "after": "retrained head, upgraded target"}


def plot(out: Path) -> Path | None:
    """Each watched window's mean acceptance length with its bounds, coloured by verdict, and the band and
    break-even it was held against, phase after phase (<out>/timeline.png)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(p, out / p / "timeline.jsonl") for p in TITLES if (out / p / "timeline.jsonl").exists()]
    if not phases:
        return None
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.set(xlabel="judged window", ylabel="mean acceptance length", ylim=(0.9, 1.95))
    x0 = 0
    for phase, path in phases:
        records = judged(read_timeline(path))
        for x, r in enumerate(records, x0):
            color = COLORS.get(r["verdict"], "tab:gray")
            low, high, length = r["acceptance_low"], r["acceptance_high"], r["mean_acceptance_length"]
            ax.errorbar(x, length, yerr=[[length - low], [high - length]], fmt="o", color=color, ms=4)
            ax.plot(x, r["expected_low"], "_", color="tab:green", ms=8)  # the band, this window's dispersion
        if records and records[0].get("break_even"):
            ax.plot((x0 - 0.5, x0 + len(records) - 0.5), [records[0]["break_even"]] * 2, ":", color="tab:red")
        ax.text(x0, 1.9, TITLES[phase], fontsize=8, va="top")
        x0 += len(records) + 2
        ax.axvline(x0 - 1.5, color="gray", lw=0.5)
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=v) for v, c in COLORS.items()]
    handles += [
        plt.Line2D([], [], marker="_", ls="", color="tab:green", label="bottom of the band"),
        plt.Line2D([], [], ls=":", color="tab:red", label="break-even"),
    ]
    ax.legend(
        handles=handles, fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=6, frameon=False
    )
    fig.tight_layout()
    path = out / "timeline.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", default="runs/smollm2", help="the run whose head is watched (eval done)")
    parser.add_argument("--experiment", default="smollm2", help="the run's experiment")
    parser.add_argument("--head-name", default="peagle", help="the head's name in the run's eval.heads")
    parser.add_argument("--out", default="runs/watch_trial")
    parser.add_argument("--k", type=int, default=2, help="the served k (eval's recommendation for chat)")
    parser.add_argument("--windows", type=int, default=30, help="windows watched before and after")
    parser.add_argument("--upgrade-windows", type=int, default=6, help="windows watched after the upgrade")
    parser.add_argument("--interval-s", type=float, default=20.0, help="the watch's interval (windows grow)")
    parser.add_argument("--max-tokens", type=int, default=128, help="the traffic's answer length")
    parser.add_argument("--concurrency", type=int, default=1, help="requests the traffic keeps in flight")
    parser.add_argument(
        "--phases", choices=("all", "before", "upgrade"), default="all",
        help="before: the false-alarm phase alone; upgrade: before and upgrade, no retrain",
    )  # fmt: skip
    parser.add_argument("--restart-k", type=int, help="restart the before phase's server at this k after it")
    parser.add_argument("--restart-windows", type=int, default=2, help="windows watched after the restart")
    parser.add_argument(
        "--traffic", choices=("unseen", "heldout"), default="unseen",
        help="unseen: the data source's questions after the run's; heldout: the run's held-out ones, repeated",
    )  # fmt: skip
    parser.add_argument("--num-questions", type=int, default=2000, help="ShareGPT questions to send from")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    summary = Trial(args).run()
    print(json.dumps(summary, indent=2))
    log.info("plot: %s", plot(Path(args.out)))


if __name__ == "__main__":
    main()
