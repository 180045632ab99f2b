"""What the watch tells operators to do (watch/main.py `actions`): the config to deploy now (eval's
recommendation, or serving without speculation) and the commands that retrain the head on the served
traffic - warm-started, at the served temperature and thinking mode, for the served model.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from artifacts.prompts import served_template_kwargs
from watch.expectation import read_json
from watch.health import Verdict


def results_path(cfg: DictConfig) -> Path:
    """eval's results.json for the watched head: watch.results, or the run's own eval."""
    return Path(cfg.watch.results or Path(cfg.run_dir) / "eval" / "results.json")


def actions(verdict: Verdict, cfg: DictConfig, head_dir: Path, overrides: list[str]) -> list[str]:
    """What to do, as commands. `degraded`, `latency`: retrain on the served traffic, warm-started from this
    head, for the model the server serves. `net-negative`: the config to deploy now, then the same retrain
    where the window is also below what the head was measured to do (a head that stopped paying)."""
    todo = []
    if verdict.name in ("net-negative", "no-speculation"):
        todo.append(deploy_now(cfg))
    if verdict.name in ("degraded", "latency") or (
        verdict.name == "net-negative" and below_band(verdict.numbers)
    ):
        todo += retrain_commands(cfg, overrides)
    return todo


def below_band(numbers: dict) -> bool:
    """Whether a judged window's acceptance lies below the head's band (its upper bound under the band's
    low edge): the retrain's signal, whatever the speed verdict."""
    return "acceptance_high" in numbers and numbers["acceptance_high"] < numbers["expected_low"]


def retrain_commands(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """data_prep on the served traffic (watch.traffic), train warm-started from this run's head, export
    with verification, eval: the run's own overrides, and the served model where it is not the head's
    target (watch.target, after a base-model upgrade). Answers regenerated at the served temperature
    (watch.temperature) where the run regenerated at another, and rendered with the served thinking mode
    (watch.chat_template_kwargs) where the run's differs: the head is trained for what it serves."""
    same = [o for o in overrides if not o.startswith(("watch.", "run_dir="))]
    regen = []
    served_t = float(cfg.watch.temperature)
    if cfg.regen.enabled and abs(float(cfg.regen.temperature) - served_t) > 1e-6:
        same = [o for o in same if not o.startswith(("regen.temperature=", "regen.samples_per_prompt=",
                                                     "regen.include_greedy="))]  # fmt: skip
        regen = [f"regen.temperature={served_t:g}"]
        if served_t == 0:  # one greedy answer per prompt
            regen += ["regen.samples_per_prompt=1", "regen.include_greedy=false"]
    served_kwargs = served_kwargs_of(cfg.watch)
    if served_kwargs is not None and served_kwargs != served_template_kwargs(cfg):
        same = [
            o
            for o in same
            if not o.lstrip("+").startswith(("render.chat_template_kwargs", "regen.reasoning="))
        ]
        # `++`: the schema's dict takes keys it does not have only when forced
        regen.append(f"++render.chat_template_kwargs={hydra_dict(served_kwargs)}")
        if cfg.regen.reasoning != "keep":
            regen.append("regen.reasoning=keep")  # the served kwargs say the mode themselves
    if cfg.watch.target and not any(o.startswith(("target=", "target.path=")) for o in same):
        same.append(f"target.path={cfg.watch.target}")
    same = " ".join(shlex.quote(o) for o in same + regen)  # eval.heads=[{...,...}] would be brace-expanded
    new_run = f"{cfg.run_dir.rstrip('/')}_retrained"
    traffic = cfg.watch.traffic or "<your request log, OpenAI-style JSONL>"
    warm = Path(cfg.run_dir) / "draft_head"
    return [
        f"python data_prep/main.py {same} run_dir={new_run} data.source={traffic} data.format=openai",
        f"python train/main.py {same} run_dir={new_run} train.init_from={warm}",
        f"python export/main.py {same} run_dir={new_run} export.verify=true",
        f"python eval/main.py {same} run_dir={new_run}",
    ]


def served_kwargs_of(settings) -> dict | None:
    """watch.chat_template_kwargs read: Hydra's dict or a JSON object, or None where it is not set (a
    ValueError, which the watch reports as bad input, for anything else)."""
    if settings.chat_template_kwargs is None:
        return None
    if isinstance(settings.chat_template_kwargs, DictConfig):  # Hydra's form: {enable_thinking:false}
        return OmegaConf.to_container(settings.chat_template_kwargs)
    if not isinstance(settings.chat_template_kwargs, str):
        raise ValueError(f"watch.chat_template_kwargs={settings.chat_template_kwargs!r}: not an object")
    try:
        value = json.loads(settings.chat_template_kwargs)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"watch.chat_template_kwargs={settings.chat_template_kwargs!r}: not JSON ({error})"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"watch.chat_template_kwargs={settings.chat_template_kwargs!r}: not a JSON object")
    return value


def hydra_dict(values: dict) -> str:
    """A flat dict as a Hydra override value: `{enable_thinking:false,reasoning_effort:'low'}`."""
    return (
        "{"
        + ",".join(f"{k}:{json.dumps(v) if not isinstance(v, str) else repr(v)}" for k, v in values.items())
        + "}"
    )


def deploy_now(cfg: DictConfig) -> str:
    """eval's recommendation for this traffic (a smaller k, a per-batch-size schedule, another drafter),
    or serving without speculation."""
    results = results_path(cfg)
    if results.exists():
        recommendations = read_json(results, "eval results").get("recommendations") or []
        wanted = [r for r in recommendations if r.get("enable") and r.get("deploy")]
        if cfg.watch.workload:
            wanted = [r for r in wanted if r.get("workload", "").split(" T=")[0] == cfg.watch.workload]
        if wanted:
            best = max(wanted, key=lambda r: r.get("best_speedup") or 0)
            return f"vllm serve ... --speculative-config '{json.dumps(best['deploy'])}'  ({best['text']})"
    return "vllm serve ... without --speculative-config (eval recommends no drafter for this traffic)"
