"""How a stage starts: the accelerator (real multi-process on CPU too) and logging."""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState


def make_accelerator(**kwargs) -> Accelerator:
    """An Accelerator that is really distributed on CPU-only machines too.

    A plain `Accelerator()` under torchrun on a machine without a GPU silently runs every process alone
    (num_processes == 1); asking for the CPU explicitly gives real DDP over gloo.
    """
    # A stage's run() may be called several times in one process (tests, notebooks) with other settings
    # (e.g. mixed precision); accelerate keeps them in a singleton, so start each run from a clean one.
    # The process group (PartialState) is kept.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(cpu=not torch.cuda.is_available(), **kwargs)


def setup_logging(accelerator: Accelerator) -> None:
    """INFO on the main process, warnings only elsewhere, each line tagged with its rank."""
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank {accelerator.process_index}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
