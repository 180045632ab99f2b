"""The watch's trial on real vLLM servers (docs/watch.md#the-trial): a head watched while it serves, then
after a base-model upgrade, then after the retrain the watch itself prescribed.

    python -m bench.watch_trial                       # runs/smollm2's head; results in runs/watch_trial
    python -m bench.watch_trial --windows 30 --interval-s 20 --k 2 --run-dir runs/smollm2 --out runs/watch_trial
    python -m bench.watch_trial --max-tokens 512 --concurrency 4 --out runs/watch_trial_long   # long answers
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
import time
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


def judged(records: list[dict]) -> list[dict]:
    """The timeline's judged windows: not a window still growing, nor a restart, an outage or an idle one."""
    return [r for r in records if "acceptance_low" in r and not r.get("window_open")]


class Trial:
    def __init__(self, args):
        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary_path = self.out / "trial.json"
        self.summary = json.loads(self.summary_path.read_text()) if self.summary_path.exists() else {}
        self.overrides = [
            f"experiment={args.experiment}",
            f"eval.heads=[{{name:{args.head_name},num_speculative_tokens:[{args.k}]}}]",
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

    def serve_and_watch(self, phase: str, run_dir: str, target: str | None, windows: int) -> dict:
        """Serve `run_dir`'s head on `target` (None: its own), send traffic, watch `windows` windows."""
        args = self.args
        watch_overrides = [
            *self.overrides,
            f"run_dir={run_dir}",
            f"watch.interval_s={args.interval_s}",
            f"watch.windows={windows}",
            f"watch.out_dir={self.out / phase}",
            f"watch.traffic={self.traffic_log.resolve()}",
            *([f"watch.target={target}"] if target else []),
        ]
        cfg = compose("config", watch_overrides)
        served = target or str(target_dir(cfg.target))
        served_cfg = compose("config", [*self.overrides, f"run_dir={run_dir}", f"target.path={served}"])
        head = next(
            c
            for c in server_configs(served_cfg, Path(run_dir), load_config(served_cfg.target))
            if c["head"] and c["k"] == args.k
        )
        timeline = self.out / phase / "timeline.jsonl"
        timeline.unlink(missing_ok=True)  # an interrupted phase is redone whole
        start = self.summary.get("traffic_position", 0)
        log.info("%s: serving %s on %s at k=%d", phase, run_dir, served, args.k)
        with VllmServer(
            served, self.out / f"{phase}_server.log", dict(cfg.eval.server_args), head["speculative_config"],
            startup_timeout_s=cfg.eval.startup_timeout_s,
        ) as server:  # fmt: skip
            url = server.url
            tokenizer = load_tokenizer(served_cfg.target)
            with Traffic(
                url, served, tokenizer, self.conversations, self.traffic_log, start=start,
                concurrency=args.concurrency, max_tokens=args.max_tokens,
            ) as traffic:  # fmt: skip
                status = watch(
                    compose("config", [*watch_overrides, f"watch.url={url}"]),
                    [*watch_overrides, f"watch.url={url}"],
                )
        records = judged([json.loads(line) for line in timeline.open()])
        verdicts = collections.Counter(r["verdict"] for r in records)
        expected = expected_from_results(
            Path(run_dir) / "eval" / "results.json", args.head_name, args.k, cfg.watch.temperature
        )
        first = next((i for i, r in enumerate(records) if r["verdict"] != "healthy"), None)
        summary = {
            "run_dir": run_dir,
            "target": served,
            "k": args.k,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "windows": len(records),
            "window_seconds": [round(r["seconds"]) for r in records],
            "verdicts": dict(verdicts),
            "exit_status": status,
            "mean_acceptance_length": [round(r["mean_acceptance_length"], 3) for r in records],
            "dispersion": [round(r["dispersion"], 1) for r in records],
            # what the watch would have said had it taken the drafts as independent (dispersion 1)
            "below_band_if_independent": sum(
                below_band_if_independent(r, expected, cfg.watch.z) for r in records
            ),
            "expected_low": records[0].get("expected_low"),
            "break_even": records[0].get("break_even"),
            "requests_sent": traffic.requests,
            "failed": traffic.failed,
            "seconds": round(records[-1]["time"] - traffic.started_s, 1),
        }
        if first is not None:
            summary["first_not_healthy"] = {
                "window": first + 1,
                "verdict": records[first]["verdict"],
                "reason": records[first]["reason"],
                "requests_since_switch": sum(r["requests"] for r in records[: first + 1]),
                "seconds_since_switch": round(records[first]["time"] - traffic.started_s, 1),
                "actions": records[first]["actions"],
            }
        self.summary["traffic_position"] = traffic.position
        self.save(phase, summary)
        log.info("%s: %s", phase, json.dumps({k: v for k, v in summary.items() if k != "first_not_healthy"}))
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
            self.serve_and_watch("before", args.run_dir, None, args.windows)
        if args.phases == "before":
            return self.summary
        if "upgrade" not in self.summary:
            self.serve_and_watch("upgrade", args.run_dir, self.upgraded_target(), args.upgrade_windows)
        switched = self.summary["upgrade"].get("first_not_healthy")
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
        records = judged([json.loads(line) for line in path.open()])
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
    parser.add_argument(
        "--run-dir", default="runs/smollm2", help="the run whose head is watched (its eval done)"
    )
    parser.add_argument("--experiment", default="smollm2", help="the run's experiment")
    parser.add_argument("--head-name", default="peagle", help="the head's name in the run's eval.heads")
    parser.add_argument("--out", default="runs/watch_trial")
    parser.add_argument("--k", type=int, default=2, help="the served k (eval's recommendation for chat)")
    parser.add_argument("--windows", type=int, default=30, help="windows watched before and after")
    parser.add_argument("--upgrade-windows", type=int, default=6, help="windows watched after the upgrade")
    parser.add_argument(
        "--interval-s",
        type=float,
        default=20.0,
        help="the watch's interval (windows grow to hold their requests)",
    )
    parser.add_argument("--max-tokens", type=int, default=128, help="the traffic's answer length")
    parser.add_argument("--concurrency", type=int, default=1, help="requests the traffic keeps in flight")
    parser.add_argument(
        "--phases", choices=("all", "before"), default="all", help="before: the false-alarm phase alone"
    )
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
