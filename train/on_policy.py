"""train.stage=on_policy: a supervised head trained further on its own drafts (Draft-OPD's on-policy
distillation), for EAGLE-3, P-EAGLE and DFlash heads (docs/design.md#on-policy-training; measured:
docs/recipe.md#on-policy-training-measured).

    python train/main.py experiment=smollm2 run_dir=runs/smollm2 train.stage=on_policy
    accelerate launch --num_processes 2 train/main.py ... train.stage=on_policy on_policy.num_iterations=8

Starts from the supervised head in <run_dir>/draft_head (or on_policy.init_from) and repeats
on_policy.num_iterations times: roll out (train/rollouts.py: the target decodes on_policy.num_prompts
training prompts of the cache with the current head drafting k = on_policy.num_speculative_tokens a round,
greedy or sampled at on_policy.temperature, each process its share, on_policy.rollout_batch_size prompts
at a time), then replay (train/losses/replay.py: on_policy.num_steps optimizer steps on those rollouts, the
head drafting again from each round's anchor). Held-out prompts are rolled out before
the first step and every on_policy.eval_every iterations: the acceptance the head serves at, measured.

Writes <out_dir> (on_policy.out_dir, default <run_dir>/on_policy), a run directory of its own:
rollouts/iter-*-rank-*.safetensors (each iteration's, reused on resume), ckpt/ (train.resume continues from
it), train_steps.jsonl, on_policy.jsonl (per iteration: rollout and held-out acceptance, seconds and tokens
of the rollouts and of the replay) and draft_head/, whose record names both stages. Export it with
`export.head_dir=<out_dir>/draft_head export.out_dir=<out_dir>/export`.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import heads.attention
from artifacts import atomic
from artifacts.cache import CacheSplit
from artifacts.manifest import read_manifest
from artifacts.vocab import load_vocab_map
from heads.acceptance import AcceptanceCounts
from heads.head_file import read_record, write_head
from heads.layers import EXCLUDED_FROM_EXPORT
from heads.reference_decoder import DraftHead
from target.launch import make_accelerator, setup_logging
from target.model import load_config, load_embedding_and_lm_head
from train.checkpoint import load_warm_start, save_checkpoint, trajectory_settings
from train.data import check_cache_matches_target
from train.losses.replay import replay_denominators, replay_loss
from train.metrics import append_record, check_finite, evaluate, start_trackers
from train.model import DraftWithLoss, build_draft, head_record, init_lm_head, num_loss_steps
from train.objectives import parse_objective
from train.optim import make_optimizer, make_scheduler
from train.resume import StopRequest, drop_records_after, resume_point
from train.rollouts import collate_rollouts, prompt_ids, read_rollouts, roll_out_all, write_rollouts

log = logging.getLogger("train")


class ReplayWithLoss(torch.nn.Module):
    """The head plus its replay loss in one forward, so that DDP sees a single module call."""

    def __init__(self, draft, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor, cfg):
        super().__init__()
        self.draft = draft
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        self.register_buffer("draft_to_target", draft_to_target, persistent=False)
        self.chunk_size, self.gamma = cfg.train.teacher_chunk_size, cfg.on_policy.gamma
        self.accepted = parse_objective(cfg.on_policy.accepted_loss, cfg.train.lk_eta, cfg.train.alpha_on)
        self.rejected = parse_objective(cfg.on_policy.rejected_loss, cfg.train.lk_eta, cfg.train.alpha_on)
        heads.attention.KERNEL = cfg.train.attention

    def forward(self, batch, denominators=None):
        return replay_loss(
            self.draft, batch, self.target_lm_head, self.draft_to_target, self.chunk_size, self.accepted,
            self.rejected, self.gamma, denominators,
        )  # fmt: skip


@dataclass
class Setup:
    """What `run` set up for `fit`."""

    cfg: DictConfig
    accelerator: object
    model: torch.nn.Module  # ReplayWithLoss, prepared (DDP)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    target: torch.nn.Module  # the HF target the rollouts decode with (fp32, frozen)
    stop_ids: list[int]
    draft_to_target: torch.Tensor
    train_split: CacheSplit
    eval_split: CacheSplit
    held_out_model: DraftWithLoss  # the same head with the supervised loss: train's held-out metrics
    out_dir: Path
    settings: dict  # trajectory settings, recorded in every checkpoint


def paths(cfg) -> tuple[Path, Path]:
    """(out_dir, init_from) of this stage, resolved."""
    run_dir = Path(cfg.run_dir).resolve()
    out_dir = Path(cfg.on_policy.out_dir or run_dir / "on_policy").resolve()
    init_from = Path(cfg.on_policy.init_from or run_dir / "draft_head").resolve()
    return out_dir, init_from


def run(cfg: DictConfig) -> dict | None:
    """The on-policy stage (train/main.py runs it for train.stage=on_policy); returns the final held-out
    metrics."""
    out_dir, init_from = paths(cfg)
    if not (init_from / "draft_config.json").exists():
        raise ValueError(
            f"{init_from}: no supervised head (draft_config.json) to start on-policy training from; train "
            "one first (train.stage=supervised) or name it with on_policy.init_from"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    accelerator = make_accelerator(
        cfg.process_group_timeout_s,
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        mixed_precision=cfg.train.mixed_precision,
        log_with="wandb" if cfg.train.report_to == "wandb" else None,
        project_dir=str(out_dir),
    )
    setup_logging(accelerator)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "train.stage=on_policy runs under DDP (accelerate's default config): every process drafts its "
            "rollouts with the whole head; launch it without the DeepSpeed config"
        )
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    cache_dir = Path(cfg.run_dir).resolve() / "cache"
    manifest = read_manifest(cache_dir)
    target_config = load_config(cfg.target)
    check_cache_matches_target(manifest, cfg, target_config)
    vocab = load_vocab_map(cache_dir / "vocab.safetensors")
    draft = build_draft(cfg, target_config, manifest, vocab)
    embed, lm_head = load_embedding_and_lm_head(cfg.target)
    draft.load_target_embedding(embed.float())
    init_lm_head(cfg, draft, lm_head, vocab.draft_to_target)
    load_warm_start(draft, init_from, vocab)
    model = ReplayWithLoss(draft, lm_head, vocab.draft_to_target, cfg)
    held_out_model = DraftWithLoss(draft, lm_head, vocab.draft_to_target, cfg, manifest["aux_layer_ids"])
    optimizer = make_optimizer(cfg, model)
    num_steps = cfg.on_policy.num_iterations * cfg.on_policy.num_steps
    scheduler = make_scheduler(cfg, optimizer, num_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    held_out_model.to(accelerator.device)
    accelerator.register_for_checkpointing(scheduler)
    settings = trajectory_settings(cfg, accelerator.num_processes, manifest.get("dataset_fingerprint"))
    settings |= {f"on_policy.{k}": v for k, v in OmegaConf.to_container(cfg.on_policy, resolve=True).items()}
    settings["on_policy.init_from"] = str(init_from)
    step, _ = resume_point(cfg, accelerator, out_dir, settings, optimizer, scheduler)
    if accelerator.is_main_process:
        drop_records_after(step, out_dir / "on_policy.jsonl")
        atomic.write_text(out_dir / "train.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    start_trackers(accelerator, cfg, manifest, out_dir)
    setup = Setup(
        cfg, accelerator, model, optimizer, scheduler, load_target(cfg, accelerator.device),
        rollout_stop_ids(cfg), vocab.draft_to_target.to(accelerator.device), CacheSplit(cache_dir, "train"),
        CacheSplit(cache_dir, "eval"), held_out_model, out_dir, settings,
    )  # fmt: skip
    log.info(
        "on-policy training from %s: %d iterations of %d rollouts (k=%d) and %d optimizer steps, %s head",
        init_from, cfg.on_policy.num_iterations, cfg.on_policy.num_prompts,
        cfg.on_policy.num_speculative_tokens, cfg.on_policy.num_steps, cfg.head.kind,
    )  # fmt: skip
    with StopRequest() as stop:
        history = fit(setup, step, num_steps, stop)
    final = history[-1] if history else None
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        head = accelerator.unwrap_model(model).draft
        weights = {k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}
        weights = {k: v for k, v in weights.items() if k not in EXCLUDED_FROM_EXPORT}
        steps_per_epoch = cfg.on_policy.num_steps  # an "epoch" here: one iteration's replay
        record = head_record(
            cfg, head, cache_dir, manifest, num_steps, steps_per_epoch, accelerator.num_processes,
            final["held_out"] if final else None,
        )  # fmt: skip
        supervised = read_record(init_from)
        record.training["stages"] = [
            {"stage": "supervised", "from": str(init_from), **supervised.training},
            {
                "stage": "on_policy",
                "k": cfg.on_policy.num_speculative_tokens,
                "temperature": cfg.on_policy.temperature,
                "max_new_tokens": cfg.on_policy.max_new_tokens,
                "iterations": read_records(out_dir / "on_policy.jsonl"),
            },
        ]
        write_head(out_dir / "draft_head", record, weights, cache_dir / "vocab.safetensors")
        log.info("final head: %s", out_dir / "draft_head")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final["held_out"] if final else None


def load_target(cfg, device) -> torch.nn.Module:
    """The target the rollouts decode with: fp32, as export verification's reference decoder runs it."""
    from transformers import AutoModelForCausalLM

    from target.model import target_dir

    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg.target), dtype=torch.float32)
    return target.eval().requires_grad_(False).to(device)


def rollout_stop_ids(cfg) -> list[int]:
    from artifacts.prompts import stop_token_ids
    from target.model import load_tokenizer, target_dir

    return stop_token_ids(load_tokenizer(cfg.target), target_dir(cfg.target))


def read_records(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def iteration_prompts(cfg, num_train: int, iteration: int, rank: int, world: int) -> list[int]:
    """This process's training prompts of an iteration: the iteration's slice of one seeded order of the
    train split (wrapping around), every world-th from `rank`."""
    order = list(range(num_train))
    random.Random(cfg.seed).shuffle(order)
    n = cfg.on_policy.num_prompts
    wanted = [order[(iteration * n + i) % num_train] for i in range(n)]
    return wanted[rank::world]


def rollouts_of(setup: Setup, iteration: int, draft) -> tuple[list, float]:
    """Every process's rollouts of `iteration` (this process rolls out its share, or reads it back when an
    earlier run wrote it), and the seconds this process spent decoding."""
    cfg, accelerator = setup.cfg, setup.accelerator
    rank, world = accelerator.process_index, accelerator.num_processes
    folder = setup.out_dir / "rollouts"
    mine = folder / f"iter-{iteration:05d}-rank-{rank}.safetensors"
    seconds = 0.0
    if not mine.exists():
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        indices = iteration_prompts(cfg, len(setup.train_split), iteration, rank, world)
        prompts = [prompt_ids(setup.train_split, i) for i in indices]
        seeds = [rollout_seed(cfg, iteration, i) for i in indices]
        rollouts = decode(setup, draft, prompts, seeds, f"rollouts {iteration}")
        write_rollouts(mine, rollouts)
        seconds = time.perf_counter() - start
    accelerator.wait_for_everyone()
    # in the iteration's prompt order (process r rolled out every world-th from r): the replay's batches
    # are the same whatever the number of processes
    shares = [read_rollouts(folder / f"iter-{iteration:05d}-rank-{i}.safetensors") for i in range(world)]
    return [shares[i % world][i // world] for i in range(sum(map(len, shares)))], seconds


def rollout_seed(cfg, iteration: int, index: int) -> int:
    """The random stream of a prompt's rollout at an iteration (-1: the held-out ones), the same whichever
    process or batch decodes it."""
    return (cfg.seed * 1_000_003 + iteration + 1) * 1_000_033 + index


def decode(setup: Setup, draft, prompts: list[list[int]], seeds: list[int], desc: str) -> list:
    """Rollouts of `prompts` with the head as it is now, losslessly (the target's own answers: greedy, or
    sampled at on_policy.temperature from each prompt's seeded stream)."""
    k, max_new = setup.cfg.on_policy.num_speculative_tokens, setup.cfg.on_policy.max_new_tokens
    temperature = setup.cfg.on_policy.temperature
    head = DraftHead(draft, setup.draft_to_target)
    was_training = draft.training
    draft.eval()
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not setup.accelerator.is_main_process,
               leave=False)  # fmt: skip
    rollouts = roll_out_all(
        setup.target, head, prompts, k, max_new, setup.stop_ids, temperature, seeds,
        setup.cfg.on_policy.rollout_batch_size, bar,
    )  # fmt: skip
    bar.close()
    draft.train(was_training)
    return rollouts


def held_out(setup: Setup, draft) -> dict:
    """The head on held-out prompts: its rollouts' acceptance (what it serves at, k of the stage) and train's
    supervised held-out metrics, both over every process."""
    cfg, accelerator = setup.cfg, setup.accelerator
    n = min(cfg.on_policy.num_eval_prompts, len(setup.eval_split))
    mine = range(accelerator.process_index, n, accelerator.num_processes)
    start = time.perf_counter()
    prompts = [prompt_ids(setup.eval_split, i) for i in mine]
    rollouts = decode(setup, draft, prompts, [rollout_seed(cfg, -1, i) for i in mine], "held-out rollouts")
    counts = sum((r.counts() for r in rollouts), AcceptanceCounts())
    k = cfg.on_policy.num_speculative_tokens
    local = torch.tensor(
        [counts.num_drafts, counts.num_accepted_tokens, *(counts.accepted_per_position + [0] * k)[:k]],
        dtype=torch.float64, device=accelerator.device,
    )  # fmt: skip
    total = accelerator.reduce(local, "sum").tolist()
    summed = AcceptanceCounts(int(total[0]), int(total[0]) * k, int(total[1]), [int(c) for c in total[2:]])
    metrics = evaluate(accelerator, setup.held_out_model, setup.eval_split, cfg.train.batch_size,
                       num_loss_steps(cfg))  # fmt: skip
    return {"num_prompts": n, "seconds": time.perf_counter() - start, **summed.summary(), **(metrics or {})}


def replay_plan(cfg, num_rollouts: int, iteration: int, world: int) -> list[list[int]]:
    """Rollout indices of each optimizer step of an iteration (the global batch, in one seeded order of the
    iteration's rollouts, wrapping around)."""
    order = list(range(num_rollouts))
    random.Random(cfg.seed * 1_000_003 + iteration).shuffle(order)
    size = cfg.train.batch_size * world * cfg.train.gradient_accumulation_steps
    return [
        [order[(s * size + i) % num_rollouts] for i in range(size)] for s in range(cfg.on_policy.num_steps)
    ]


def fit(setup: Setup, step: int, num_steps: int, stop: StopRequest) -> list[dict]:
    """Iterations of rollouts and replay until `num_steps` optimizer steps; returns their records."""
    cfg, accelerator, model = setup.cfg, setup.accelerator, setup.model
    world, rank = accelerator.num_processes, accelerator.process_index
    per_iteration, accumulation = cfg.on_policy.num_steps, cfg.train.gradient_accumulation_steps
    draft = accelerator.unwrap_model(model).draft
    history = read_records(setup.out_dir / "on_policy.jsonl")
    if step == 0 and cfg.on_policy.num_eval_prompts and not history:
        before = {"iteration": 0, "step": 0, "held_out": held_out(setup, draft)}
        history.append(log_iteration(setup, before))
    bar = tqdm(total=num_steps, initial=step, desc="on-policy", disable=not accelerator.is_main_process)
    while step < num_steps:
        iteration = step // per_iteration
        rollouts, rollout_seconds = rollouts_of(setup, iteration, draft)
        counts = sum((r.counts() for r in rollouts), AcceptanceCounts())
        plan = replay_plan(cfg, len(rollouts), iteration, world)
        replay_start, losses = time.perf_counter(), []
        for indices in plan[step - iteration * per_iteration :]:
            own = indices[rank::world]
            size = math.ceil(len(own) / accumulation)
            batches = [collate_rollouts([rollouts[i] for i in own[j : j + size]], accelerator.device)
                       for j in range(0, len(own), size)]  # fmt: skip
            # Each term a mean over the whole global batch: count first, then any split trains the same.
            counted = accelerator.reduce(
                sum(replay_denominators(b, cfg.on_policy.gamma) for b in batches), "sum"
            )
            denominators = counted / world  # DDP averages the processes' gradients
            total = 0.0
            for index, batch in enumerate(batches):
                sync = index == len(batches) - 1
                with accelerator.autocast(), accelerator.no_sync(model) if not sync else nullcontext():
                    loss, _ = model(batch, denominators)
                    accelerator.backward(loss)
                total += float(loss.detach())
            # each process's loss is world x its share of the global mean (DDP averages): the mean is that mean
            total = float(accelerator.reduce(torch.tensor(total, device=accelerator.device), "mean"))
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            check_finite(total, grad_norm, step + 1, setup.out_dir / "ckpt")
            lr = setup.scheduler.get_last_lr()[0]
            setup.optimizer.step()
            setup.scheduler.step()
            setup.optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            losses.append(total)
            logged = {"loss": total, "lr": lr, "grad_norm": float(grad_norm)}
            if accelerator.is_main_process:
                append_record(setup.out_dir / "train_steps.jsonl", {"step": step, **logged})
            accelerator.log({f"on_policy/{k}": v for k, v in logged.items()}, step=step)
            stop_now = (
                accelerator.reduce(torch.tensor(float(stop.requested), device=accelerator.device), "sum") > 0
            )
            end = step % per_iteration == 0
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or end or stop_now:
                save_checkpoint(
                    accelerator, setup.out_dir / "ckpt", step, iteration, cfg.train.keep_last, setup.settings
                )
            if stop_now:
                bar.close()
                raise KeyboardInterrupt(
                    f"stopped by a signal at step {step}; checkpoint saved; resume with train.resume=true"
                )
        done = iteration + 1
        record = {
            "iteration": done, "step": step, "rollouts": {"num": len(rollouts), **counts.summary(),
            "tokens": sum(len(r.anchors) + int(r.accepted.sum()) for r in rollouts), "seconds": rollout_seconds},
            "replay": {"seconds": time.perf_counter() - replay_start, "mean_loss": sum(losses) / max(len(losses), 1)},
        }  # fmt: skip
        if cfg.on_policy.num_eval_prompts and (done % cfg.on_policy.eval_every == 0 or step == num_steps):
            record["held_out"] = held_out(setup, draft)
        history.append(log_iteration(setup, record))
    bar.close()
    return [r for r in history if "held_out" in r]


def log_iteration(setup: Setup, record: dict) -> dict:
    """One iteration's record: on_policy.jsonl, the trackers and a status line."""
    accelerator = setup.accelerator
    if accelerator.is_main_process:
        append_record(setup.out_dir / "on_policy.jsonl", record)
    flat = {}
    for part in ("rollouts", "held_out"):
        for key, value in record.get(part, {}).items():
            if isinstance(value, (int, float)):
                flat[f"on_policy/{part}/{key.removeprefix('eval/')}"] = value
    accelerator.log(flat, step=record["step"])
    rollouts, held = record.get("rollouts", {}), record.get("held_out", {})
    log.info(
        "iteration %d | step %d | rollouts %s | held-out %s",
        record["iteration"], record["step"],
        f"{rollouts['mean_acceptance_length']:.3f} ({rollouts['num']}, {rollouts['seconds']:.0f} s)" if rollouts else "-",
        f"{held['mean_acceptance_length']:.3f}" if held else "-",
    )  # fmt: skip
    return record
