"""train: fit a draft head on the cache: EAGLE-3 with training-time test (TTT), P-EAGLE with parallel
drafting, or EAGLE-1.

    python train/main.py experiment=smoke run_dir=/tmp/smoke
    accelerate launch --num_processes 8 train/main.py run_dir=/runs/llama31 train.report_to=wandb
    accelerate launch --config_file conf/accelerate/zero2.yaml train/main.py run_dir=...   # DeepSpeed ZeRO-2

Reads <run_dir>/cache (data_prep), with the target's hidden states in it (train.features=cache) or
computed by the frozen target in each training step (train.features=online, for a cache made with
cache.hidden_states=false); writes checkpoints to <run_dir>/ckpt, held-out metrics to
<run_dir>/train_eval.jsonl and the final head to <run_dir>/draft_head (what export reads).
This file sets a run up (`run`) and holds the loop (`fit`); the parts live beside it: the head and its
loss in train/model.py (the losses in train/losses/), batches in train/data.py, the optimizer and
schedule in train/optim.py, metrics and held-out evaluation in train/metrics.py, checkpoints in
train/checkpoint.py and resuming in train/resume.py.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from artifacts import atomic
from artifacts.cache import CacheSplit
from artifacts.config import check_config, register_configs
from artifacts.errors import stage_errors
from artifacts.manifest import read_manifest
from artifacts.run_lock import holds_run_dir
from artifacts.vocab import load_vocab_map
from heads.head_file import write_head
from heads.layers import EXCLUDED_FROM_EXPORT
from target.launch import make_accelerator, setup_logging
from target.model import load_config, load_embedding_and_lm_head
from train import on_policy
from train.checkpoint import load_warm_start, save_checkpoint, trajectory_settings
from train.data import (
    OnlineStates,
    check_cache_matches_target,
    check_cache_settings,
    count_steps,
    micro_batch,
    online_states,
    plan_epoch,
    train_lengths,
)
from train.losses import loss_weights
from train.memory import check_step_fits
from train.metrics import (
    add_step_metrics,
    append_record,
    check_finite,
    evaluate,
    log_status,
    record_eval,
    start_trackers,
    train_record,
    weighted_loss,
)
from train.model import (
    DraftWithLoss,
    build_draft,
    check_rope_buffers,
    head_record,
    init_lm_head,
    num_loss_steps,
)
from train.optim import configure_deepspeed, make_optimizer, make_scheduler
from train.resume import StopRequest, resume_point

log = logging.getLogger("train")


@dataclass
class Setup:
    """What `run` set up for `fit`: the prepared head and optimizer, the data, where records go."""

    cfg: DictConfig  # the composed pipeline config
    accelerator: Accelerator
    model: torch.nn.Module  # DraftWithLoss, wrapped by accelerate (DDP / DeepSpeed)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # stepped by hand, once per optimizer step
    train_split: CacheSplit
    eval_split: CacheSplit  # empty with data.eval_fraction=0: no held-out metrics
    states: OnlineStates | None  # the target, run in each step (train.features=online); None: the cache's
    run_dir: Path  # train_steps.jsonl, train_eval.jsonl here, checkpoints under ckpt/
    settings: dict  # trajectory settings, recorded in every checkpoint


@dataclass
class Start:
    """Where the loop starts (0 / 0, or a resumed checkpoint's step and epoch) and ends."""

    step: int  # optimizer steps already taken
    epoch: int  # the epoch that step falls in
    num_steps: int  # optimizer steps of the whole run


@holds_run_dir("train")
def run(cfg: DictConfig) -> dict:
    """Train the head; returns the final held-out metrics."""
    check_config(cfg)
    if cfg.train.stage == "on_policy":  # then on its own drafts, from a supervised head
        return on_policy.run(cfg)
    accelerator = make_accelerator(
        cfg.process_group_timeout_s,
        # The target's lm_head is a buffer, identical on every rank: DDP need not re-send it each step.
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        mixed_precision=cfg.train.mixed_precision,
        log_with="wandb" if cfg.train.report_to == "wandb" else None,
        project_dir=cfg.run_dir,
    )
    setup_logging(accelerator)
    if cfg.train.attention == "flex" and torch.device(accelerator.device).type != "cuda":
        raise ValueError(
            f"train.attention=flex on {accelerator.device}: FlexAttention's backward runs on CUDA only; train "
            "with train.attention=chunked here"
        )
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    run_dir = Path(cfg.run_dir).resolve()
    cache_dir = run_dir / "cache"
    cache_manifest = read_manifest(cache_dir)
    target_config = load_config(cfg.target)
    check_cache_matches_target(cache_manifest, cfg, target_config)
    check_cache_settings(cache_manifest, cfg)
    train_split, eval_split = CacheSplit(cache_dir, "train"), CacheSplit(cache_dir, "eval")
    if not (cache_dir / "vocab.safetensors").exists():
        raise ValueError(
            f"{cache_dir / 'vocab.safetensors'} is missing (the draft vocabulary data_prep writes): rerun "
            "data_prep on this run_dir"
        )
    vocab = load_vocab_map(cache_dir / "vocab.safetensors")
    states = online_states(cfg, accelerator, train_split)  # None: the states come from the cache

    draft = build_draft(cfg, target_config, cache_manifest, vocab)
    embed, lm_head = load_embedding_and_lm_head(cfg.target)
    draft.load_target_embedding(embed.float())
    if cfg.head.kind != "eagle1":
        init_lm_head(cfg, draft, lm_head, vocab.draft_to_target)
    if cfg.train.init_from:
        load_warm_start(draft, Path(cfg.train.init_from), vocab)
        log.info("warm start from %s", cfg.train.init_from)
    longest = max(train_lengths(cfg, train_split), default=1)
    check_step_fits(cfg, accelerator, draft, target_config, cfg.train.pack_length or longest)
    model = DraftWithLoss(draft, lm_head, vocab.draft_to_target, cfg, cache_manifest["aux_layer_ids"])
    optimizer = make_optimizer(cfg, model)
    world, accumulation = accelerator.num_processes, cfg.train.gradient_accumulation_steps
    num_steps, steps_per_epoch = count_steps(cfg, train_split, world)
    scheduler = make_scheduler(cfg, optimizer, num_steps)
    configure_deepspeed(accelerator, cfg)
    # The scheduler is stepped by hand once per optimizer step (accelerate would step it once per process).
    model, optimizer = accelerator.prepare(model, optimizer)
    check_rope_buffers(model)
    accelerator.register_for_checkpointing(scheduler)

    settings = trajectory_settings(cfg, world, cache_manifest.get("dataset_fingerprint"))
    step, start_epoch = resume_point(cfg, accelerator, run_dir, settings, optimizer, scheduler)
    if accelerator.is_main_process:
        atomic.write_text(run_dir / "train.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    start_trackers(accelerator, cfg, cache_manifest, run_dir)
    rows = "samples" if cfg.train.pack_length is None else f"rows of up to {cfg.train.pack_length} tokens"
    log.info(
        "training %d optimizer steps (%d per epoch, %d %s per step, %d processes), %s head, K=%d depths",
        num_steps, steps_per_epoch, cfg.train.batch_size * world * accumulation, rows, world, cfg.head.kind,
        num_loss_steps(cfg),
    )  # fmt: skip
    setup = Setup(
        cfg, accelerator, model, optimizer, scheduler, train_split, eval_split, states, run_dir, settings
    )
    with StopRequest() as stop:
        history = fit(setup, Start(step, start_epoch, num_steps), stop)

    if not history:  # resumed a run that had already finished: measure the head it has
        measured = evaluate(accelerator, model, eval_split, cfg.train.batch_size, num_loss_steps(cfg), states)
        history = [{"step": step, **measured}] if measured else []
    final_eval = history[-1] if history else None  # None: no held-out split, not measured
    # On every rank: under ZeRO-3 the parameters are sharded and gathered here.
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        head = accelerator.unwrap_model(model).draft
        exported = {k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}
        exported = {k: v for k, v in exported.items() if k not in EXCLUDED_FROM_EXPORT}
        record = head_record(
            cfg, head, cache_dir, cache_manifest, num_steps, steps_per_epoch, world, final_eval
        )
        write_head(run_dir / "draft_head", record, exported, cache_dir / "vocab.safetensors")
        log.info("final head: %s", run_dir / "draft_head")
    # Every rank tears its process group down together: a rank that destroyed its gloo group and exited
    # while rank 0 still wrote the head aborted once in CI ("terminate called without an active exception").
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final_eval


def fit(setup: Setup, start: Start, stop: StopRequest) -> list[dict]:
    """The training loop: steps of accumulated micro-batches; log, eval and checkpoint every N steps.
    Returns the held-out evaluations it ran."""
    cfg, accelerator, model, train_split = setup.cfg, setup.accelerator, setup.model, setup.train_split
    step, epoch, num_steps = start.step, start.epoch, start.num_steps
    ckpt_dir = setup.run_dir / "ckpt"
    world, rank = accelerator.num_processes, accelerator.process_index
    accumulation, num_ttt = cfg.train.gradient_accumulation_steps, num_loss_steps(cfg)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    history, window_tokens, window_start = [], 0, time.perf_counter()

    def held_out_eval(at_step: int) -> None:
        measured = evaluate(accelerator, model, setup.eval_split, cfg.train.batch_size, num_ttt, setup.states)
        if measured is not None:  # None: no held-out split, nothing measured (logged once at the start)
            history.append(record_eval(accelerator, setup.run_dir, at_step, measured))

    if not len(setup.eval_split):
        log.warning("the cache has no held-out split (data.eval_fraction=0): held-out metrics not measured")
    if step == 0 and cfg.train.init_from and cfg.train.eval_every:
        held_out_eval(0)  # a warm start's starting point: the older head on this data, before any step
    model.train()
    bar = tqdm(total=num_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    overflows = 0  # fp16 steps the loss scaler has just skipped in a row
    while step < num_steps:
        plan = plan_epoch(
            train_lengths(cfg, train_split), cfg.train.batch_size, world, accumulation, cfg.seed, epoch,
            cfg.train.pack_length,
        )  # fmt: skip
        steps_per_epoch = len(plan)
        for micro_batches in plan[step - epoch * steps_per_epoch :]:
            if step >= num_steps:
                break
            step_start = time.perf_counter()
            batches = [
                micro_batch(
                    train_split, rows, accelerator.device, setup.states, (cfg.seed, epoch),
                    packed=cfg.train.pack_length is not None,
                )
                for rows in micro_batches[rank]
            ]  # fmt: skip
            # Each depth's loss is a mean over its predictions in the whole global batch: count them first
            # (the draws made now, before any forward), so that any split across processes and micro-batches
            # gives the same gradient (DDP averages, hence the factor world).
            head = accelerator.unwrap_model(model)
            draws = [head.draw(batch) for batch in batches]
            counts = accelerator.reduce(
                torch.cat(
                    [
                        sum(head.prediction_counts(b, d) for b, d in zip(batches, draws)).float(),
                        sum(b["attention_mask"].sum() for b in batches).float().view(1),
                    ]
                ),
                "sum",
            )
            denominators, step_tokens = counts[:num_ttt].clamp(min=1) / world, int(counts[num_ttt])
            window_tokens += step_tokens
            sums = torch.zeros(4, num_ttt, device=accelerator.device)  # per depth: see add_step_metrics
            for index, (batch, batch_draws) in enumerate(zip(batches, draws)):
                sync = index == len(batches) - 1
                if deepspeed:  # DeepSpeed steps (and clips) inside backward at the accumulation boundary
                    accelerator.gradient_state._set_sync_gradients(sync)
                with accelerator.autocast(), accelerator.no_sync(model) if not sync else nullcontext():
                    loss, metrics = model(batch, denominators, batch_draws)
                    # DeepSpeed divides by its accumulation steps; the loss is already a global-batch mean.
                    accelerator.backward(loss * accumulation if deepspeed else loss)
                add_step_metrics(sums, metrics)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            sums = accelerator.reduce(sums, "sum")
            total_loss = weighted_loss(sums, loss_weights(cfg.head, num_ttt))
            scaled = accelerator.scaler is not None  # fp16: an overflow is the scaler's to skip
            skipped = check_finite(total_loss, grad_norm, step + 1, ckpt_dir, overflows if scaled else None)
            overflows = overflows + 1 if skipped else 0
            step_lr = setup.scheduler.get_last_lr()[0]  # the rate this optimizer step uses
            setup.optimizer.step()
            setup.scheduler.step()
            setup.optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if accelerator.is_main_process:  # every step's loss: what resume and golden-loss tests compare
                append_record(
                    setup.run_dir / "train_steps.jsonl",
                    {"step": step, "loss": total_loss, "lr": step_lr, "grad_norm": float(grad_norm), "tokens": step_tokens,
                     "seconds": time.perf_counter() - step_start},  # data, online target included: benchmarks
                )  # fmt: skip

            if step % cfg.train.log_every == 0 or step == num_steps:
                tok_per_s = window_tokens / (time.perf_counter() - window_start)
                record = train_record(
                    sums, total_loss, setup.scheduler.get_last_lr()[0], grad_norm, tok_per_s
                )
                accelerator.log(record, step=step)
                log_status(step, record)
                window_tokens, window_start = 0, time.perf_counter()
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == num_steps:
                held_out_eval(step)
            stop_now = (
                accelerator.reduce(torch.tensor(float(stop.requested), device=accelerator.device), "sum") > 0
            )
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == num_steps or stop_now:
                next_epoch = epoch if step % steps_per_epoch else epoch + 1  # the epoch a resume starts in
                path = save_checkpoint(
                    accelerator, ckpt_dir, step, next_epoch, cfg.train.keep_last, setup.settings
                )
                log.info("checkpoint %s", path)
            if stop_now:
                bar.close()
                raise KeyboardInterrupt(
                    f"stopped by a signal at step {step}; checkpoint saved; resume with train.resume=true"
                )
        epoch += 1
    bar.close()
    return history


@hydra.main(config_path="../conf", config_name="config", version_base=None)
@stage_errors("train", rerun="rerun with train.resume=auto: it continues from the last checkpoint")
def main(cfg: DictConfig) -> None:
    run(cfg)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank has passed the final barrier, torn its process group down and its head is on disk;
        # the interpreter's own teardown of torch's and DeepSpeed's threads then aborted a rank now and then
        # ("terminate called without an active exception", exit -6: CI once, here 1 in 4 runs of the
        # ZeRO-3 online test), failing a finished run. Leave without it, logs flushed.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


register_configs()

if __name__ == "__main__":
    main()
