"""train: fit a draft head on the cache: EAGLE-3 with training-time test (TTT), P-EAGLE with parallel
drafting, or EAGLE-1.

    python train/main.py experiment=smoke run_dir=/tmp/smoke
    accelerate launch --num_processes 8 train/main.py run_dir=/runs/llama31 train.report_to=wandb
    accelerate launch --config_file conf/accelerate/zero2.yaml train/main.py run_dir=...   # DeepSpeed ZeRO-2

Reads <run_dir>/cache (data_prep), with the target's hidden states in it (train.features=cache) or
computed by the frozen target in each training step (train.features=online, for a cache made with
cache.hidden_states=false); writes checkpoints to <run_dir>/ckpt, held-out metrics to
<run_dir>/train_eval.jsonl and the final head to <run_dir>/draft_head (what export reads).
The TTT math is in train/ttt.py, parallel drafting's in train/parallel.py; the heads in heads/eagle3.py
(EAGLE-3 and P-EAGLE) and heads/eagle1.py; this file is the loop around them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from artifacts.cache import CacheSplit
from artifacts.config import check_config, register_configs
from artifacts.manifest import read_manifest
from artifacts.vocab import load_vocab_map
from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.eagle3 import EXCLUDED_FROM_EXPORT, NORM_FLAGS, Eagle3Config, Eagle3Draft
from target.launch import make_accelerator, setup_logging
from target.model import (
    load_config,
    load_embedding_and_lm_head,
    load_final_norm,
    load_model,
    target_dir,
    weights_bytes,
    weights_hash,
)
from train.checkpoint import (
    changed_settings,
    checkpoint_dirs,
    load_checkpoint,
    load_warm_start,
    save_checkpoint,
    save_head,
    trajectory_settings,
)
from train.data import OnlineStates, collate, plan_epoch
from train.eagle1_loss import eagle1_loss
from train.parallel import parallel_loss
from train.ttt import conditional_accuracies, expected_acceptance_length, ttt_loss

log = logging.getLogger("train")


class DraftWithLoss(torch.nn.Module):
    """The head plus its objective in one forward, so DDP / DeepSpeed see a single module call.

    EAGLE-3: the TTT loss (train/ttt.py). P-EAGLE: the parallel-drafting loss (train/parallel.py), with
    COD subsampling while training only (held-out metrics see every anchor); `head.aux_noise` perturbs the
    aux states while training only. EAGLE-1: feature regression + soft CE (train/eagle1_loss.py), reported
    as one step (loss_0, acc_0) so the loop treats all alike.
    """

    def __init__(self, draft, target_lm_head: torch.Tensor, draft_to_target: torch.Tensor, cfg):
        super().__init__()
        self.draft, self.kind, self.head_cfg = draft, cfg.head.kind, cfg.head
        self.register_buffer("target_lm_head", target_lm_head, persistent=False)
        self.register_buffer("draft_to_target", draft_to_target, persistent=False)
        self.num_steps, self.chunk_size = num_loss_steps(cfg), cfg.train.teacher_chunk_size

    def forward(self, batch, denominator=None):
        if self.training and self.head_cfg.aux_noise and "aux_hidden" in batch:
            aux = batch["aux_hidden"].float()
            noise = (torch.rand_like(aux) * 2 - 1) * self.head_cfg.aux_noise
            batch = {**batch, "aux_hidden": aux + noise}
        if self.kind == "peagle":
            return parallel_loss(
                self.draft, batch, self.num_steps, self.head_cfg.gamma, self.target_lm_head,
                self.draft_to_target, self.chunk_size, denominator,
                cod_ratio=self.head_cfg.cod_ratio if self.training else 1.0,
            )  # fmt: skip
        if self.kind == "eagle3":
            return ttt_loss(
                self.draft, batch, self.num_steps, self.head_cfg.gamma, self.target_lm_head,
                self.draft_to_target, self.chunk_size, denominator,
            )  # fmt: skip
        total, metrics = eagle1_loss(
            self.draft, batch, self.target_lm_head, self.chunk_size, noise_range=self.head_cfg.eagle1_noise,
            ce_weight=self.head_cfg.eagle1_ce_weight, add_noise=self.training,
        )  # fmt: skip
        if denominator is not None:  # a mean over this batch's valid positions -> a sum over the global count
            total = total * metrics["num_valid"] / denominator
        return total, {
            "loss_0": total.detach(),
            "acc_0": metrics["acc_0"],
            "num_valid_0": metrics["num_valid"],
            "chain_hits_0": metrics["chain_hits_0"],
            "chain_total_0": metrics["chain_total_0"],
        }


def num_loss_steps(cfg) -> int:
    """Drafting depths the objective trains and reports: K for EAGLE-3 and P-EAGLE, one for EAGLE-1."""
    return {"eagle1": 1, "peagle": cfg.head.num_depths}.get(cfg.head.kind, cfg.head.num_ttt_steps)


def check_cache_matches_target(cache_manifest: dict, cfg, target_config) -> None:
    """Refuse a cache made for another target or other layers before any training."""
    found = {
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_hidden_layers": target_config.num_hidden_layers,
        "target_hash": weights_hash(target_dir(cfg.target)),
    }
    if cfg.cache.aux_layer_ids is not None:
        found["aux_layer_ids"] = list(cfg.cache.aux_layer_ids)
    differing = [k for k, v in found.items() if cache_manifest.get(k) != v]
    if differing:
        lines = [
            f"  {k}: cache has {cache_manifest.get(k)!r}, config/target has {found[k]!r}" for k in differing
        ]
        raise ValueError(
            f"{cfg.run_dir}/cache was made for another target or layers than train is given "
            f"(target.path={cfg.target.path}):\n" + "\n".join(lines)
        )


# Online training refuses a target taking more than this share of a GPU's free memory: the rest is the
# head, its optimizer state, the teacher's lm_head and the activations of a micro-batch.
ONLINE_TARGET_SHARE = 0.6


def online_states(cfg, accelerator, train_split: CacheSplit) -> OnlineStates | None:
    """The frozen target for `train.features=online` (None for `cache`), after checking that the cache suits
    the mode: online needs a tokens-only cache, cache mode a cache with hidden states.

    The target is loaded whole on every rank, in `target.dtype`, beside the head: DeepSpeed / DDP wrap only
    the head, so ZeRO-3 does not shard it. A target that does not fit on the device is refused here.
    """
    cache_dir = train_split.cache_dir
    if cfg.train.features == "cache":
        if not train_split.hidden_states:
            raise ValueError(
                f"{cache_dir} holds no hidden states (data_prep ran with cache.hidden_states=false): train "
                "with train.features=online (the target runs in each training step), or rerun data_prep "
                "with cache.hidden_states=true into another run_dir"
            )
        return None
    if train_split.hidden_states:
        raise ValueError(
            f"train.features=online, but {cache_dir} holds the target's hidden states already: train on them "
            "with train.features=cache (the target's forwards are paid for), or make a tokens-only cache "
            "(data_prep with cache.hidden_states=false) in another run_dir"
        )
    device = torch.device(accelerator.device)
    if device.type == "cuda":
        needed, free = weights_bytes(cfg.target), torch.cuda.mem_get_info(device)[0]
        if needed > ONLINE_TARGET_SHARE * free:
            raise ValueError(
                f"train.features=online: the target {cfg.target.path} takes {needed / 1e9:.1f} GB in "
                f"target.dtype={cfg.target.dtype}, more than {ONLINE_TARGET_SHARE:.0%} of the "
                f"{free / 1e9:.1f} GB free on {device}, and every rank holds it whole beside the head (it "
                "is not sharded); use GPUs with more memory, or train.features=cache (data_prep caches "
                "the hidden states, rank by rank, with cache.hidden_states=true)"
            )
    return OnlineStates(load_model(cfg.target, device), train_split.manifest["aux_layer_ids"])


def build_draft(cfg, target_config, cache_manifest, vocab):
    """A freshly initialised head of `head.kind`, sized from the target and the cache."""
    torch.manual_seed(cfg.seed)
    if cfg.head.kind not in ("eagle3", "peagle", "eagle1"):
        raise ValueError(f"head.kind={cfg.head.kind!r}: choose eagle3, peagle or eagle1")
    if cfg.head.num_layers != 1 and cfg.head.kind != "peagle":
        raise ValueError(
            f"head.num_layers={cfg.head.num_layers}: only P-EAGLE heads (head.kind=peagle) stack several "
            f"decoder layers here; {cfg.head.kind} heads have one"
        )
    if cfg.head.kind == "eagle1":
        eagle3_only = {
            **{flag: getattr(cfg.head, flag) for flag in NORM_FLAGS},
            "lm_head_init": cfg.head.lm_head_init != "random",
            "freeze_lm_head": cfg.head.freeze_lm_head,
            "aux_noise": bool(cfg.head.aux_noise),
        }
        if any(eagle3_only.values()):
            raise ValueError(
                f"head.kind=eagle1: {', '.join(f'head.{k}' for k, v in eagle3_only.items() if v)} belong to "
                "EAGLE-3 / P-EAGLE heads (an EAGLE-1 head has no aux states, fc norms or lm_head of its own)"
            )
        return Eagle1Draft(Eagle1Config.from_target_config(target_config))
    parallel = {}
    if cfg.head.kind == "peagle":
        parallel = {
            "num_hidden_layers": cfg.head.num_layers,
            "mask_token_id": mask_token_id(cfg, target_config),
        }
    config = Eagle3Config.from_target_config(
        target_config,
        aux_layer_ids=cache_manifest["aux_layer_ids"],
        draft_vocab_size=vocab.draft_vocab_size,
        **{flag: bool(getattr(cfg.head, flag)) for flag in NORM_FLAGS},
        **parallel,
    )
    return Eagle3Draft(config)


@torch.no_grad()
def init_lm_head(cfg, draft, target_lm_head_VH: torch.Tensor, draft_to_target: torch.Tensor) -> None:
    """`head.lm_head_init` and `head.freeze_lm_head` (EAGLE-3 / P-EAGLE heads).

    `target`: the lm_head starts as the target's rows of the draft vocabulary and the final norm as the
    target's, so the head starts decoding as the target does (speculators' recipe; it freezes the rows).
    """
    if cfg.head.lm_head_init not in ("random", "target"):
        raise ValueError(f"head.lm_head_init={cfg.head.lm_head_init!r}: choose random or target")
    if cfg.head.lm_head_init == "target":
        draft.lm_head.weight.copy_(target_lm_head_VH[draft_to_target].float())
        draft.norm.weight.copy_(load_final_norm(cfg.target))
    if cfg.head.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)


def mask_token_id(cfg, target_config) -> int:
    """P-EAGLE's mask token: `head.mask_token_id`, else the target's pad token, else its (first) eos token.

    An existing token, frozen: vLLM feeds the mask slots the target's own embedding of this id, so a learned
    mask embedding would mean shipping a whole embedding table; the learned `mask_hidden` (A*H wide,
    through `fc`) carries what the slots need to learn.
    """
    if cfg.head.mask_token_id is not None:
        return int(cfg.head.mask_token_id)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(target_config, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int):
            return value
    raise ValueError(
        f"target {cfg.target.path}: its config names no pad or eos token; give P-EAGLE's mask token with "
        "head.mask_token_id=<token id>"
    )


def drop_records_after(step: int, *paths: Path) -> None:
    """Remove the records of steps after `step` (logged before a kill, replayed after the resume), so
    that each step is in the logs once."""
    for path in paths:
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] <= step]  # fmt: skip
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text("".join(kept))
            os.replace(tmp, path)


def resume_mode(value) -> str:
    """train.resume as never | always | auto (true/false are accepted for always/never)."""
    mode = {"true": "always", "false": "never"}.get(str(value).lower(), str(value).lower())
    if mode not in ("never", "always", "auto"):
        raise ValueError(f"train.resume={value!r}: choose never, always (true) or auto")
    return mode


def train_lengths(cfg, train_split: CacheSplit) -> list[int]:
    """Lengths of the samples this run trains on: the split, or its first `train.num_samples`."""
    if cfg.train.num_samples is not None and not 0 < cfg.train.num_samples <= len(train_split):
        raise ValueError(
            f"train.num_samples={cfg.train.num_samples}: the cache's train split holds {len(train_split)} samples"
        )
    return train_split.lengths[: cfg.train.num_samples]


def lr_factor(step: int, num_steps: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup then cosine to `min_ratio`, sized from the real number of optimizer steps."""
    warmup = max(1, round(warmup_ratio * num_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(
    accelerator, model, eval_split: CacheSplit, batch_size: int, num_steps: int, states=None
) -> dict | None:
    """Held-out loss, per-step accuracy, conditional accuracy and expected acceptance length for 1..K drafts;
    None without a held-out split (data.eval_fraction=0): not measured, never zeros from zero samples."""
    if not len(eval_split):
        return None
    model.eval()
    sums = torch.zeros(3, num_steps, device=accelerator.device)  # per step: ce sum, valid, correct
    chain = torch.zeros(2, num_steps, device=accelerator.device)  # per depth: chain hits, chain totals
    world = accelerator.num_processes
    mine = list(range(accelerator.process_index, len(eval_split), world))
    # Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively: a rank with one
    # batch fewer would leave the others waiting forever); a rank out of samples reruns its first batch
    # and discards it.
    num_batches = math.ceil(math.ceil(len(eval_split) / world) / batch_size)
    for index in range(num_batches):
        ids = mine[index * batch_size : (index + 1) * batch_size]
        samples = [eval_split[i] for i in (ids or mine[:batch_size] or [0])]
        batch = collate(samples, accelerator.device, states)
        with accelerator.autocast():
            _, metrics = model(batch, denominator=1.0)  # per-step sums
        if not ids:
            continue
        for k in range(num_steps):
            n = metrics[f"num_valid_{k}"].float()
            sums[:, k] += torch.stack([metrics[f"loss_{k}"].float(), n, metrics[f"acc_{k}"].float() * n])
            chain[:, k] += torch.stack(
                [metrics[f"chain_hits_{k}"].float(), metrics[f"chain_total_{k}"].float()]
            )
    sums, chain = accelerator.reduce(sums, "sum"), accelerator.reduce(chain, "sum")
    model.train()
    cond = conditional_accuracies(chain[0].long().cpu(), chain[1].long().cpu())
    result = {f"eval/loss_{k}": float(sums[0, k] / sums[1, k].clamp(min=1)) for k in range(num_steps)}
    result |= {f"eval/acc_{k}": float(sums[2, k] / sums[1, k].clamp(min=1)) for k in range(num_steps)}
    result |= {f"eval/cond_acc_{k}": cond[k] for k in range(num_steps)}
    result |= {f"eval/accept_len_k{n}": expected_acceptance_length(cond[:n]) for n in range(1, num_steps + 1)}
    return result


class StopRequest:
    """While active, SIGINT / SIGTERM set a flag; the loop checkpoints at the end of the step and exits.

    The previous handlers come back on exit, so a run() inside a larger program leaves Ctrl-C as it was.
    """

    def __enter__(self):
        self.requested = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        self.requested = True


def run(cfg: DictConfig) -> dict:
    """Train the head; returns the final held-out metrics."""
    check_config(cfg)
    accelerator = make_accelerator(
        # The target's lm_head is a buffer, identical on every rank: DDP need not re-send it each step.
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
        mixed_precision=cfg.train.mixed_precision,
        log_with="wandb" if cfg.train.report_to == "wandb" else None,
        project_dir=cfg.run_dir,
    )
    setup_logging(accelerator)
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    run_dir = Path(cfg.run_dir).resolve()
    cache_dir, ckpt_dir = run_dir / "cache", run_dir / "ckpt"
    cache_manifest = read_manifest(cache_dir)
    target_config = load_config(cfg.target)
    check_cache_matches_target(cache_manifest, cfg, target_config)
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
    model = DraftWithLoss(draft, lm_head, vocab.draft_to_target, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trainable, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    world, accumulation = accelerator.num_processes, cfg.train.gradient_accumulation_steps
    steps_per_epoch = len(
        plan_epoch(train_lengths(cfg, train_split), cfg.train.batch_size, world, accumulation, cfg.seed, 0)
    )
    num_steps = cfg.train.num_epochs * steps_per_epoch
    if cfg.train.max_steps:
        num_steps = min(num_steps, cfg.train.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, num_steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
    )
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed does the accumulating and clipping itself: give it this run's numbers, not "auto".
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
        ds_config["gradient_accumulation_steps"] = accumulation
        ds_config["train_batch_size"] = cfg.train.batch_size * accumulation * world
        ds_config["gradient_clipping"] = cfg.optim.max_grad_norm
        # ZeRO-3: gather the sharded weights when the final head is written.
        ds_config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
    # The scheduler is stepped by hand once per optimizer step (accelerate would step it once per process).
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    step, start_epoch = 0, 0
    resume = resume_mode(cfg.train.resume)
    if checkpoint_dirs(ckpt_dir) and resume == "never":
        raise ValueError(
            f"{ckpt_dir} holds checkpoints of an earlier run: continue it with train.resume=true, or use "
            "another run_dir (or delete that ckpt/) to train from scratch"
        )
    if resume == "always" and not checkpoint_dirs(ckpt_dir):
        raise ValueError(f"train.resume=true but {ckpt_dir} has no complete checkpoint to resume from")
    settings = trajectory_settings(cfg, world, cache_manifest.get("dataset_fingerprint"))
    if checkpoint_dirs(ckpt_dir) and resume != "never":
        latest = checkpoint_dirs(ckpt_dir)[-1]
        state = load_checkpoint(accelerator, latest)
        changed = changed_settings(state.get("settings"), settings)
        if changed and not cfg.train.resume_changed:
            raise ValueError(
                f"{latest} was written with other settings than this run's:\n  " + "\n  ".join(changed)
                + "\nResume with the checkpoint's values, or add train.resume_changed=true to go on with these "
                "(the schedule and data order the checkpoint holds go on as they were)"
            )  # fmt: skip
        if changed:
            log.warning(
                "resuming with changed settings (train.resume_changed=true):\n  %s", "\n  ".join(changed)
            )
        step, start_epoch = state["step"], state["epoch"]
        log.info("resumed from %s (step %d)", latest, step)
        if accelerator.is_main_process:
            drop_records_after(step, run_dir / "train_steps.jsonl", run_dir / "train_eval.jsonl")
    if accelerator.is_main_process:
        (run_dir / "train.yaml").write_text(OmegaConf.to_yaml(cfg))
    accelerator.init_trackers(
        cfg.train.wandb_project,
        config={
            **OmegaConf.to_container(cfg, resolve=True),
            "cache_manifest": {k: v for k, v in cache_manifest.items() if k != "splits"},
        },
        init_kwargs={"wandb": {"dir": str(run_dir), "mode": cfg.train.wandb_mode, "name": run_dir.name}},
    )
    log.info(
        "training %d optimizer steps (%d per epoch, %d samples per step, %d processes), %s head, K=%d depths",
        num_steps, steps_per_epoch, cfg.train.batch_size * world * accumulation, world, cfg.head.kind,
        num_loss_steps(cfg),
    )  # fmt: skip
    with StopRequest() as stop:
        history = fit(
            cfg, accelerator, model, optimizer, scheduler, train_split, eval_split, step, start_epoch,
            num_steps, ckpt_dir, stop, settings, states,
        )  # fmt: skip

    if not history:  # resumed a run that had already finished: measure the head it has
        measured = evaluate(accelerator, model, eval_split, cfg.train.batch_size, num_loss_steps(cfg), states)
        history = [{"step": step, **measured}] if measured else []
    final_eval = history[-1] if history else None  # None: no held-out split, not measured
    # On every rank: under ZeRO-3 the parameters are sharded and gathered here.
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        head = accelerator.unwrap_model(model).draft
        exported = {k.removeprefix("draft."): v for k, v in state.items() if k.startswith("draft.")}
        save_head(
            run_dir / "draft_head",
            {k: v for k, v in exported.items() if k not in EXCLUDED_FROM_EXPORT},
            cache_dir / "vocab.safetensors",
            {
                "kind": cfg.head.kind,
                "config": head.config.to_dict(),
                "target": {"path": str(cfg.target.path), "hash": cache_manifest["target_hash"]},
                "cache": {
                    "path": str(cache_dir),
                    **{
                        k: cache_manifest.get(k)
                        for k in (
                            "aux_layer_ids",
                            "tokenizer_hash",
                            "dataset_fingerprint",
                            "data_source",
                            "num_samples",
                            "num_tokens",
                            "regeneration",
                        )
                    },
                },
                "training": {
                    "num_steps": num_steps,
                    "num_processes": world,
                    "settings": OmegaConf.to_container(
                        OmegaConf.masked_copy(cfg, ["head", "optim", "train"]), resolve=True
                    ),
                    "held_out": final_eval,
                },
            },
        )
        log.info("final head: %s", run_dir / "draft_head")
    accelerator.end_training()
    return final_eval


def fit(
    cfg,
    accelerator,
    model,
    optimizer,
    scheduler,
    train_split,
    eval_split,
    step,
    start_epoch,
    num_steps,
    ckpt_dir,
    stop,
    settings,
    states,
):
    """The training loop: steps of accumulated micro-batches; log, eval and checkpoint every N steps."""
    run_dir = ckpt_dir.parent
    world, rank = accelerator.num_processes, accelerator.process_index
    accumulation, num_ttt = cfg.train.gradient_accumulation_steps, num_loss_steps(cfg)
    deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
    history, window_tokens, window_start = [], 0, time.perf_counter()

    def held_out_eval(at_step: int) -> None:
        measured = evaluate(accelerator, model, eval_split, cfg.train.batch_size, num_ttt, states)
        if measured is None:
            return  # no held-out split: nothing measured (logged once at the start)
        result = {"step": at_step, **measured}
        history.append(result)
        accelerator.log(result, step=at_step)
        if accelerator.is_main_process:
            with open(run_dir / "train_eval.jsonl", "a") as f:
                f.write(json.dumps(result) + "\n")
        log.info(
            "eval step %d | acc@0 %.3f | acceptance length (k=3) %.3f",
            at_step,
            result["eval/acc_0"],
            result.get("eval/accept_len_k3", float("nan")),
        )

    if not len(eval_split):
        log.warning("the cache has no held-out split (data.eval_fraction=0): held-out metrics not measured")
    if step == 0 and cfg.train.init_from and cfg.train.eval_every:
        held_out_eval(0)  # a warm start's starting point: the older head on this data, before any step
    model.train()
    bar = tqdm(total=num_steps, initial=step, desc="train", disable=not accelerator.is_main_process)
    epoch = start_epoch
    while step < num_steps:
        plan = plan_epoch(
            train_lengths(cfg, train_split), cfg.train.batch_size, world, accumulation, cfg.seed, epoch
        )
        steps_per_epoch = len(plan)
        for micro_batches in plan[step - epoch * steps_per_epoch :]:
            if step >= num_steps:
                break
            step_start = time.perf_counter()
            batches = [
                collate([train_split[i] for i in ids], accelerator.device, states)
                for ids in micro_batches[rank]
            ]
            # Normalise by the loss tokens of the whole global batch: any split across processes and
            # micro-batches then gives the same gradient (DDP averages, hence the factor world).
            counts = accelerator.reduce(
                torch.stack(
                    [sum(b[k].sum() for b in batches).float() for k in ("loss_mask", "attention_mask")]
                ),
                "sum",
            )
            denominator, step_tokens = counts[0].clamp(min=1) / world, int(counts[1])
            window_tokens += step_tokens
            step_metrics = torch.zeros(3, num_ttt, device=accelerator.device)  # loss sum, valid, correct
            for index, batch in enumerate(batches):
                sync = index == len(batches) - 1
                if deepspeed:  # DeepSpeed steps (and clips) inside backward at the accumulation boundary
                    accelerator.gradient_state._set_sync_gradients(sync)
                with accelerator.autocast(), accelerator.no_sync(model) if not sync else nullcontext():
                    loss, metrics = model(batch, denominator)
                    # DeepSpeed divides by its accumulation steps; the loss is already a global-batch mean.
                    accelerator.backward(loss * accumulation if deepspeed else loss)
                for k in range(num_ttt):
                    n = metrics[f"num_valid_{k}"].float()
                    step_metrics[:, k] += torch.stack(
                        [metrics[f"loss_{k}"] * denominator, n, metrics[f"acc_{k}"] * n]
                    )
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
            step_metrics = accelerator.reduce(step_metrics, "sum")
            total_loss = float(
                (
                    step_metrics[0]
                    / step_metrics[1].clamp(min=1)
                    * torch.tensor([cfg.head.gamma**k for k in range(num_ttt)], device=step_metrics.device)
                ).sum()
            )
            if not math.isfinite(total_loss) or not math.isfinite(float(grad_norm)):
                last = checkpoint_dirs(ckpt_dir)
                raise FloatingPointError(
                    f"non-finite loss or gradient at step {step + 1} (loss {total_loss}, grad norm {float(grad_norm)}); "
                    f"the last good checkpoint is {last[-1] if last else 'none (no checkpoint yet)'}"
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if accelerator.is_main_process:  # every step's loss: what resume and golden-loss tests compare
                record = {
                    "step": step,
                    "loss": total_loss,
                    "grad_norm": float(grad_norm),
                    "tokens": step_tokens,
                    "seconds": time.perf_counter() - step_start,  # data, online target included: benchmarks
                }
                with open(run_dir / "train_steps.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")

            if step % cfg.train.log_every == 0 or step == num_steps:
                seconds = time.perf_counter() - window_start
                record = {
                    "train/loss": total_loss,
                    "train/lr": scheduler.get_last_lr()[0],
                    "train/grad_norm": float(grad_norm),
                    "train/tok_per_s": window_tokens / seconds,
                }
                record |= {
                    f"train/loss_{k}": float(step_metrics[0, k] / step_metrics[1, k].clamp(min=1))
                    for k in range(num_ttt)
                }
                record |= {
                    f"train/acc_{k}": float(step_metrics[2, k] / step_metrics[1, k].clamp(min=1))
                    for k in range(num_ttt)
                }
                accelerator.log(record, step=step)
                accs = " ".join(f"{record[f'train/acc_{k}']:.2f}" for k in range(num_ttt))
                log.info(
                    "step %d | loss %.4f | acc@0..%d %s | lr %.2e | grad %.2f | %.0f tok/s",
                    step,
                    total_loss,
                    num_ttt - 1,
                    accs,
                    record["train/lr"],
                    record["train/grad_norm"],
                    record["train/tok_per_s"],
                )
                window_tokens, window_start = 0, time.perf_counter()
            if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == num_steps:
                held_out_eval(step)
            stop_now = (
                accelerator.reduce(torch.tensor(float(stop.requested), device=accelerator.device), "sum") > 0
            )
            if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == num_steps or stop_now:
                path = save_checkpoint(
                    accelerator,
                    ckpt_dir,
                    step,
                    epoch if step % steps_per_epoch else epoch + 1,
                    cfg.train.keep_last,
                    settings,
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
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
