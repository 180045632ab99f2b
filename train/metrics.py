"""What the training loop measures and records: each step's metric sums and loss, the records and the
status line it logs every N steps, and the held-out evaluation (loss, accuracy, conditional accuracy and
expected acceptance length per drafting depth).

    <run_dir>/train_steps.jsonl   one record per optimizer step (what resume and golden-loss tests compare)
    <run_dir>/train_eval.jsonl    one record per held-out evaluation
    W&B (train.report_to=wandb)   train/* every train.log_every steps, eval/* every train.eval_every

Used by `fit` in train/main.py; everything taking the accelerator runs on every rank (it reduces).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch
from omegaconf import OmegaConf

from artifacts.cache import CacheSplit
from heads.acceptance import conditional_accuracies, expected_acceptance_length
from train.checkpoint import checkpoint_dirs
from train.data import collate, draw_seeds

log = logging.getLogger("train")  # the loop's own logger: its lines read `train: ...`


def start_trackers(accelerator, cfg, cache_manifest: dict, run_dir: Path) -> None:
    """Open the run in accelerate's trackers (W&B when train.report_to=wandb), with the config and the
    cache's manifest as the run's config."""
    accelerator.init_trackers(
        cfg.train.wandb_project,
        config={
            **OmegaConf.to_container(cfg, resolve=True),
            "cache_manifest": {k: v for k, v in cache_manifest.items() if k != "splits"},
        },
        init_kwargs={"wandb": {"dir": str(run_dir), "mode": cfg.train.wandb_mode, "name": run_dir.name}},
    )


def add_step_metrics(sums_4K: torch.Tensor, metrics: dict) -> None:
    """Add one micro-batch's counts at each depth k to `sums_4K`: the rows are the objective summed
    over its predictions, the predictions (its mean's count), the correct drafts and the valid positions
    (the target's argmax a draft token: accuracy's count)."""
    for k in range(sums_4K.shape[1]):
        n = metrics[f"num_valid_{k}"].float()
        sums_4K[:, k] += torch.stack(
            [metrics[f"loss_sum_{k}"].float(), metrics[f"num_pred_{k}"].float(), metrics[f"acc_{k}"] * n, n]
        )


def depth_means(sums_4K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_K, acc_K): each depth's loss, the mean over its predictions, and its accuracy over its valid
    positions, from `add_step_metrics` sums."""
    return sums_4K[0] / sums_4K[1].clamp(min=1), sums_4K[2] / sums_4K[3].clamp(min=1)


def weighted_loss(sums_4K: torch.Tensor, weights: list[float]) -> float:
    """The step's loss as the objective weighs it: the mean at depth k, weighted weights[k]
    (train/losses/positions.py `loss_weights`), summed."""
    weights_K = torch.tensor(weights, device=sums_4K.device)
    return float((depth_means(sums_4K)[0] * weights_K).sum())


# fp16's loss scaler starts high and halves after each overflow: a few skipped steps are how it finds its
# scale. This many in a row (a scale 2^20 lower) is no longer that.
MAX_SKIPPED_FP16_STEPS = 20


def check_finite(
    loss: float, grad_norm, step: int, ckpt_dir: Path, skipped_in_a_row: int | None = None
) -> bool:
    """Stop before a non-finite loss or gradient reaches the weights, naming the checkpoint to go back to.

    `skipped_in_a_row`: None without a loss scaler (bf16, fp32); with fp16's, the number of steps just
    before this one that the scaler skipped. There a non-finite step is its overflow: the scaler skips the
    update and lowers its scale, so it returns True (skipped) instead of stopping, until too many in a row.
    """
    if math.isfinite(loss) and math.isfinite(float(grad_norm)):
        return False
    if skipped_in_a_row is not None and skipped_in_a_row < MAX_SKIPPED_FP16_STEPS:
        log.warning("step %d: fp16 overflow (loss %s, grad norm %s); the loss scaler skips this update",
                    step, loss, float(grad_norm))  # fmt: skip
        return True
    last = checkpoint_dirs(ckpt_dir)
    why = "" if skipped_in_a_row is None else f" after {skipped_in_a_row} fp16 overflows in a row"
    raise FloatingPointError(
        f"non-finite loss or gradient at step {step}{why} (loss {loss}, grad norm {float(grad_norm)}); "
        f"the last good checkpoint is {last[-1] if last else 'none (no checkpoint yet)'}"
    )


def append_record(path: Path, record: dict) -> None:
    """One JSON line; the main rank's job."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def train_record(sums_4K: torch.Tensor, loss: float, lr: float, grad_norm, tok_per_s: float) -> dict:
    """The `train/*` metrics of a step: loss, learning rate, gradient norm, throughput, and the loss and
    accuracy at each depth."""
    loss_K, acc_K = depth_means(sums_4K)
    record = {
        "train/loss": loss,
        "train/lr": lr,
        "train/grad_norm": float(grad_norm),
        "train/tok_per_s": tok_per_s,
    }
    record |= {f"train/loss_{k}": float(loss_K[k]) for k in range(len(loss_K))}
    record |= {f"train/acc_{k}": float(acc_K[k]) for k in range(len(acc_K))}
    return record


def log_status(step: int, record: dict) -> None:
    """The status line: `step | loss | acc@0..K | lr | grad | tok/s`."""
    num_depths = sum(key.startswith("train/acc_") for key in record)
    accs = " ".join(f"{record[f'train/acc_{k}']:.2f}" for k in range(num_depths))
    log.info(
        "step %d | loss %.4f | acc@0..%d %s | lr %.2e | grad %.2f | %.0f tok/s",
        step, record["train/loss"], num_depths - 1, accs, record["train/lr"], record["train/grad_norm"],
        record["train/tok_per_s"],
    )  # fmt: skip


def record_eval(accelerator, run_dir: Path, step: int, measured: dict) -> dict:
    """Log held-out metrics measured at `step` (trackers, train_eval.jsonl, a status line); returns the
    record."""
    result = {"step": step, **measured}
    accelerator.log(result, step=step)
    if accelerator.is_main_process:
        append_record(run_dir / "train_eval.jsonl", result)
    log.info(
        "eval step %d | acc@0 %.3f | acceptance length (k=3) %.3f",
        step, result["eval/acc_0"], result.get("eval/accept_len_k3", float("nan")),
    )  # fmt: skip
    return result


# The held-out acceptance estimates, per `Chains` prefix (train/losses/positions.py): temperature 0 (the
# draft's argmax right), and temperature 1 with drafts as vLLM makes them (its argmax, accepted with the
# target's p of it) or sampled from the draft (accepted with sum min(p, q): vLLM's
# draft_sample_method=probabilistic).
ESTIMATES = {"chain": "accept_len", "greedy_t1": "accept_len_t1", "sampled_t1": "accept_len_t1_sampled"}


@torch.no_grad()
def evaluate(
    accelerator, model, eval_split: CacheSplit, batch_size: int, num_steps: int, states=None
) -> dict | None:
    """Held-out loss, per-step accuracy, conditional accuracy and expected acceptance length for 1..K drafts
    (at temperature 0, and at 1: `ESTIMATES`); None without a held-out split (data.eval_fraction=0): not
    measured, never zeros from zero samples."""
    if not len(eval_split):
        return None
    model.eval()
    sums = torch.zeros(4, num_steps, device=accelerator.device)  # per depth: see add_step_metrics
    # per estimate and depth: chain hits, chain totals
    chain = torch.zeros(len(ESTIMATES), 2, num_steps, device=accelerator.device)
    world = accelerator.num_processes
    mine = list(range(accelerator.process_index, len(eval_split), world))
    # Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively: a rank with one
    # batch fewer would leave the others waiting forever); a rank out of samples reruns its first batch
    # and discards it.
    num_batches = math.ceil(math.ceil(len(eval_split) / world) / batch_size)
    for index in range(num_batches):
        ids = mine[index * batch_size : (index + 1) * batch_size]
        batch_ids = ids or mine[:batch_size] or [0]
        # Fixed draws per held-out sample (seeded by its index): the same anchors at every evaluation.
        batch = collate(
            [eval_split[i] for i in batch_ids], accelerator.device, states, draw_seeds(-1, 0, batch_ids)
        )
        with accelerator.autocast():
            _, metrics = model(batch)
        if not ids:
            continue
        add_step_metrics(sums, metrics)
        for e, prefix in enumerate(ESTIMATES):
            for k in range(num_steps):
                chain[e, :, k] += torch.stack(
                    [metrics[f"{prefix}_hits_{k}"].float(), metrics[f"{prefix}_total_{k}"].float()]
                )
    sums, chain = accelerator.reduce(sums, "sum"), accelerator.reduce(chain, "sum")
    model.train()
    loss_K, acc_K = depth_means(sums)
    result = {f"eval/loss_{k}": float(loss_K[k]) for k in range(num_steps)}
    result |= {f"eval/acc_{k}": float(acc_K[k]) for k in range(num_steps)}
    for (prefix, name), (hits_K, totals_K) in zip(ESTIMATES.items(), chain.cpu()):
        cond = conditional_accuracies(hits_K, totals_K)
        if prefix == "chain":
            result |= {f"eval/cond_acc_{k}": cond[k] for k in range(num_steps)}
        result |= {f"eval/{name}_k{n}": expected_acceptance_length(cond[:n]) for n in range(1, num_steps + 1)}
    return result
