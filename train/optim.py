"""The optimizer and its learning-rate schedule (`optim.*` in the config): AdamW over the head's trainable
parameters; linear warmup then cosine decay, sized from the run's real number of optimizer steps; and,
under DeepSpeed (which accumulates and clips inside its engine), this run's batch and clipping numbers.

Built by `run` in train/main.py before `accelerator.prepare`; the scheduler is stepped by hand once per
optimizer step (accelerate would step it once per process).
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import DistributedType


def make_optimizer(cfg, model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW over the parameters that train (a frozen lm_head, the target's buffers: not)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        trainable, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )


# Not transformers' get_cosine_with_min_lr_schedule_with_warmup: its warmup starts at lr 0 (a wasted first
# step; its `_lr_rate` variant warms up as here but decays a step earlier): the golden losses would change.
def lr_factor(step: int, num_steps: int, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warmup then cosine to `min_ratio`, sized from the real number of optimizer steps."""
    warmup = max(1, round(warmup_ratio * num_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_scheduler(
    cfg, optimizer: torch.optim.Optimizer, num_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """`lr_factor` times optim.lr at each optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, num_steps, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
    )


def configure_deepspeed(accelerator, cfg) -> None:
    """DeepSpeed does the accumulating and clipping itself: give it this run's numbers, not "auto"."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    world, accumulation = accelerator.num_processes, cfg.train.gradient_accumulation_steps
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    ds_config["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
    ds_config["gradient_accumulation_steps"] = accumulation
    ds_config["train_batch_size"] = cfg.train.batch_size * accumulation * world
    ds_config["gradient_clipping"] = cfg.optim.max_grad_norm
    # ZeRO-3: gather the sharded weights when the final head is written.
    ds_config.setdefault("zero_optimization", {})["stage3_gather_16bit_weights_on_model_save"] = True
