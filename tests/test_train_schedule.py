"""train/optim.py's learning-rate schedule: its values by hand, transformers' cosine as the reference after
the warmup (and why it is not used: its warmup starts at 0), and a scheduler restored mid-run going on as
the uninterrupted one."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from train.optim import lr_factor, make_scheduler

NUM_STEPS, WARMUP_RATIO, MIN_RATIO = 20, 0.1, 0.1  # 2 warmup steps


def lrs(scheduler, optimizer, num_steps: int) -> list[float]:
    """The learning rate each optimizer step runs with, stepping the scheduler as train/main.py does."""
    out = []
    for _ in range(num_steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def tiny_optimizer(lr: float = 1.0) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_warmup_then_cosine_to_the_minimum_by_hand():
    factor = [lr_factor(s, NUM_STEPS, WARMUP_RATIO, MIN_RATIO) for s in range(NUM_STEPS + 1)]
    assert factor[:3] == [0.5, 1.0, 1.0]  # linear warmup over 2 steps, from lr / 2; the cosine starts at 1
    assert factor[11] == pytest.approx(MIN_RATIO + (1 - MIN_RATIO) / 2)  # half way through the cosine
    assert factor[19] == pytest.approx(MIN_RATIO + (1 - MIN_RATIO) * (1 + math.cos(math.pi * 17 / 18)) / 2)
    assert factor[NUM_STEPS] == pytest.approx(MIN_RATIO)
    assert all(a >= b for a, b in zip(factor[1:], factor[2:]))


def test_after_the_warmup_it_is_transformers_cosine_with_min_lr():
    cfg = OmegaConf.create({"optim": {"warmup_ratio": WARMUP_RATIO, "min_lr_ratio": MIN_RATIO}})
    optimizer = tiny_optimizer(lr=3e-4)
    ours = lrs(make_scheduler(cfg, optimizer, NUM_STEPS), optimizer, NUM_STEPS)
    optimizer = tiny_optimizer(lr=3e-4)
    reference = get_cosine_with_min_lr_schedule_with_warmup(optimizer, 2, NUM_STEPS, min_lr_rate=MIN_RATIO)
    theirs = lrs(reference, optimizer, NUM_STEPS)
    assert ours[2:] == pytest.approx(theirs[2:], rel=1e-12)
    # transformers' first step runs at lr 0; ours at lr / warmup steps (why train/optim.py keeps its own).
    assert theirs[:2] == pytest.approx([0.0, 1.5e-4]) and ours[:2] == pytest.approx([1.5e-4, 3e-4])


def test_a_restored_scheduler_goes_on_as_the_uninterrupted_one():
    cfg = OmegaConf.create({"optim": {"warmup_ratio": WARMUP_RATIO, "min_lr_ratio": MIN_RATIO}})
    optimizer = tiny_optimizer()
    scheduler = make_scheduler(cfg, optimizer, NUM_STEPS)
    uninterrupted = lrs(scheduler, optimizer, NUM_STEPS)

    optimizer = tiny_optimizer()
    scheduler = make_scheduler(cfg, optimizer, NUM_STEPS)
    first = lrs(scheduler, optimizer, 7)
    saved = optimizer.state_dict(), scheduler.state_dict()  # what a checkpoint holds of them
    optimizer = tiny_optimizer()
    scheduler = make_scheduler(cfg, optimizer, NUM_STEPS)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert first + lrs(scheduler, optimizer, NUM_STEPS - 7) == uninterrupted
