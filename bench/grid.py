"""grid: train several recipes on one cache at the same budget and compare them side by side.

    python -m bench.grid experiment=smollm2_eagle3 run_dir=runs/smollm2 grid=recipe

Every variant of `grid.variants` (a name and overrides of the train stage's config: head.*, optim.*,
train.*) trains `grid.max_steps` optimizer steps on <run_dir>/cache (the same cache, the same data order,
the learning-rate schedule sized to the same budget; `grid.max_steps=null`: train.num_epochs each) in <run_dir>/grid/<grid.name>/<variant>/, as a train
stage subprocess with the command's own overrides plus the variant's. Then the reference decoder (the HF
target plus the trained head, `heads/reference_decoder.py`) drafts `grid.acceptance_prompts` held-out
prompts with k = `grid.num_speculative_tokens`, the acceptance vLLM serves (export verification proves the
two equal). Results: <grid dir>/results.md (the table), results.json, and the held-out curves
(acceptance_k<k>.png, acc_0.png; train/curves.py).

A variant whose head is already there is not trained again, so an interrupted grid continues where it
stopped (an interrupted variant resumes from its last checkpoint); a variant whose overrides changed since
is refused: rename it or delete its directory.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from artifacts import atomic
from artifacts.config import check_config, register_configs
from artifacts.run_lock import holds_run_dir
from heads.head_file import read_record
from train.curves import plot, read_curve

log = logging.getLogger("grid")
TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "train" / "main.py"
GRID_KEYS = ("run_dir", "grid")  # the grid's own overrides, not passed on to train


def variant_overrides(cfg, own_overrides: list[str], name: str, variant_dir: Path) -> list[str]:
    """The train stage's command line for one variant: the grid's overrides, the variant's, the budget."""
    allowed = ("head.", "optim.", "train.")
    bad = [o for o in cfg.grid.variants[name] if not o.lstrip("+~").startswith(allowed)]
    if bad:
        raise ValueError(
            f"grid.variants.{name}: {bad} - a variant changes head.*, optim.* or train.* only (all variants "
            "train on the same cache)"
        )
    from target.model import target_dir

    passed = [o for o in own_overrides if o.lstrip("+~").split("=")[0].split(".")[0] not in GRID_KEYS]
    return [
        *passed,
        f"target.path={target_dir(cfg.target)}",  # resolved here: a path relative to run_dir stays valid
        *([] if cfg.grid.max_steps is None else [f"train.max_steps={cfg.grid.max_steps}"]),
        "train.resume=auto",
        *cfg.grid.variants[name],
        f"run_dir={variant_dir}",
    ]


def prepare_variant(run_dir: Path, variant_dir: Path, overrides: list[str]) -> bool:
    """Make the variant's directory (its cache: a link to the run's); True when its head is already done."""
    variant_dir.mkdir(parents=True, exist_ok=True)
    cache = variant_dir / "cache"
    if not cache.exists():
        cache.symlink_to(run_dir / "cache", target_is_directory=True)
    stamp = variant_dir / "grid_overrides.json"
    if stamp.exists() and json.loads(stamp.read_text()) != overrides:
        raise ValueError(
            f"{variant_dir} was trained with other overrides ({json.loads(stamp.read_text())}, now "
            f"{overrides}): rename the variant or delete that directory"
        )
    atomic.write_json(stamp, overrides)
    return (variant_dir / "draft_head" / "draft_config.json").exists()


def train_variant(variant_dir: Path, overrides: list[str]) -> None:
    """Run the train stage for one variant (log: <variant>/train.log); its wall time, summed over the runs
    of an interrupted variant, goes to grid_result.json."""
    result_file = variant_dir / "grid_result.json"
    start = time.perf_counter()
    try:
        with open(variant_dir / "train.log", "a") as out:
            done = subprocess.run([sys.executable, str(TRAIN_SCRIPT), *overrides], stdout=out, stderr=out)
    finally:
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        result["train_seconds"] = result.get("train_seconds", 0.0) + time.perf_counter() - start
        atomic.write_json(result_file, result)
    if done.returncode:
        raise RuntimeError(
            f"training variant {variant_dir.name} failed (exit {done.returncode}); its log: "
            f"{variant_dir / 'train.log'}"
        )


def held_out_acceptance(cfg, head_dir: Path) -> dict:
    """The reference decoder's acceptance on the cache's held-out prompts (what vLLM serves the head at)."""
    from artifacts.prompts import held_out_prompts, stop_token_ids
    from heads.reference_decoder import reference_acceptance
    from target.model import load_tokenizer, target_dir

    tokenizer = load_tokenizer(cfg.target)
    prompts = held_out_prompts(Path(cfg.run_dir) / "cache", tokenizer, cfg.grid.acceptance_prompts)
    _, counts = reference_acceptance(
        target_dir(cfg.target),
        head_dir,
        prompts,
        cfg.grid.num_speculative_tokens,
        cfg.grid.acceptance_max_new_tokens,
        stop_token_ids(tokenizer, target_dir(cfg.target)),
    )
    return {"num_prompts": len(prompts), **counts.summary()}


def result_row(name: str, overrides: list[str], variant_dir: Path, k: int, result: dict) -> dict:
    """One variant's numbers: its final held-out eval, plus `result` (reference acceptance, training time)."""
    record = read_record(variant_dir / "draft_head")
    held_out = record.held_out
    depths = sorted(int(key.rsplit("_", 1)[1]) for key in held_out if key.startswith("eval/acc_"))
    return {
        "variant": name,
        "overrides": overrides,
        "steps": record.training["num_steps"],
        # the optimizer steps' own time (data, forward, backward, optimizer), without startup and evals; a
        # step replayed after a resume counts once
        "step_seconds": sum(
            {
                r["step"]: r["seconds"] for r in map(json.loads, (variant_dir / "train_steps.jsonl").open())
            }.values()
        ),
        "loss": [held_out[f"eval/loss_{d}"] for d in depths],
        "acc": [held_out[f"eval/acc_{d}"] for d in depths],
        "cond_acc": [held_out[f"eval/cond_acc_{d}"] for d in depths],
        "estimate": held_out.get(f"eval/accept_len_k{min(k, len(depths))}"),
        **result,
    }


def results_table(rows: list[dict], k: int) -> str:
    """The Markdown table of a grid, best reference acceptance first."""

    def numbers(values):
        return " / ".join(f"{v:.3f}" for v in values)

    lines = [
        f"| variant | overrides | held-out loss per depth | acc per depth | conditional acc | estimate k={k} "
        f"| reference k={k} | per position | steps | steps' s | train min |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    key = lambda r: -(r.get("acceptance", {}).get("mean_acceptance_length") or 0)  # noqa: E731
    for r in sorted(rows, key=key):
        acceptance = r.get("acceptance") or {}
        lines.append(
            f"| {r['variant']} | {' '.join(r['overrides']) or '(defaults)'} | {numbers(r['loss'])} | "
            f"{numbers(r['acc'])} | {numbers(r['cond_acc'])} | {r['estimate']:.3f} | "
            + (f"{acceptance['mean_acceptance_length']:.3f} | " if acceptance else " | ")
            + (f"{numbers(acceptance['per_position_acceptance'])} | " if acceptance else " | ")
            + f"{r['steps']} | {r['step_seconds']:.0f} | "
            + (f"{r['train_seconds'] / 60:.1f} |" if r.get("train_seconds") else " |")
        )
    return "\n".join(lines)


@holds_run_dir("grid")
def run(cfg: DictConfig, overrides: list[str] | None = None) -> list[dict]:
    """Train, measure and tabulate every variant; returns the rows. `overrides`: the command line `cfg` was
    composed from (default: Hydra's, when run as a command), passed on to every variant's train stage."""
    check_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not cfg.grid.variants:
        raise ValueError("grid.variants is empty: pick a grid (grid=recipe) or give variants")
    run_dir = Path(cfg.run_dir).resolve()
    if not (run_dir / "cache" / "manifest.json").exists():
        raise ValueError(f"{run_dir}/cache holds no finished cache: run data_prep/main.py first")
    grid_dir = run_dir / "grid" / cfg.grid.name
    if overrides is None:
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    rows = []
    for name in tqdm(list(cfg.grid.variants), desc=f"grid {cfg.grid.name}", unit="variant"):
        variant_dir = grid_dir / name
        command = variant_overrides(cfg, overrides, name, variant_dir)
        result_file = variant_dir / "grid_result.json"
        if not prepare_variant(run_dir, variant_dir, command):
            log.info("variant %s: training (log %s)", name, variant_dir / "train.log")
            train_variant(variant_dir, command)
        result = json.loads(result_file.read_text()) if result_file.exists() else {}
        if cfg.grid.acceptance_prompts and "acceptance" not in result:
            log.info("variant %s: reference acceptance on held-out prompts", name)
            result["acceptance"] = held_out_acceptance(cfg, variant_dir / "draft_head")
            atomic.write_json(result_file, result)
        rows.append(
            result_row(
                name, list(cfg.grid.variants[name]), variant_dir, cfg.grid.num_speculative_tokens, result
            )
        )
        log.info(
            "variant %s: held-out acc@0 %.3f, estimate %.3f, reference %s",
            name,
            rows[-1]["acc"][0],
            rows[-1]["estimate"],
            result.get("acceptance", {}).get("mean_acceptance_length"),
        )

    k = cfg.grid.num_speculative_tokens
    table = results_table(rows, k)
    header = (
        f"Grid `{cfg.grid.name}` on {run_dir / 'cache'}: "
        + (f"{cfg.grid.max_steps} optimizer steps each" if cfg.grid.max_steps else "train.num_epochs each")
        + "; held-out "
        f"metrics from train's final eval; reference = the reference decoder's mean acceptance length at "
        f"k={k} on {cfg.grid.acceptance_prompts} held-out prompts x {cfg.grid.acceptance_max_new_tokens} tokens.\n\n"
    )
    atomic.write_text(grid_dir / "results.md", header + table + "\n")
    atomic.write_json(grid_dir / "results.json", {"grid": OmegaConf.to_container(cfg.grid), "rows": rows})
    curves = {name: read_curve(grid_dir / name) for name in cfg.grid.variants}
    plot(curves, f"eval/accept_len_k{k}", grid_dir / f"acceptance_k{k}.png")
    plot(curves, "eval/acc_0", grid_dir / "acc_0.png")
    print(header + table)
    print(f"\nresults: {grid_dir / 'results.md'}; curves: {grid_dir}/acceptance_k{k}.png, acc_0.png")
    return rows


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
