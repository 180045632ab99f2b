"""How a stage starts: the accelerator (real multi-process on CPU too) and logging."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from datetime import timedelta

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import InitProcessGroupKwargs


def make_accelerator(timeout_s: float, **kwargs) -> Accelerator:
    """An Accelerator that is really distributed on CPU-only machines too, whose collectives wait
    `timeout_s` for the slowest rank (`process_group_timeout_s`).

    A plain `Accelerator()` under torchrun on a machine without a GPU silently runs every process alone
    (num_processes == 1); asking for the CPU explicitly gives real DDP over gloo.
    """
    # A stage's run() may be called several times in one process (tests, notebooks) with other settings
    # (e.g. mixed precision); accelerate keeps them in a singleton, so start each run from a clean one.
    # The process group (PartialState) is kept.
    AcceleratorState._reset_state()
    GradientState._reset_state()
    # Asking for the CPU would silently switch a requested DeepSpeed run to plain DDP; instead name the
    # CPU backend, without which accelerate counts one process per rank under DeepSpeed on CPU.
    wants_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    on_cpu = not torch.cuda.is_available()
    group = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s))
    if wants_deepspeed and on_cpu:
        group.backend = "gloo"
    kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), group]
    accelerator = Accelerator(cpu=on_cpu and not wants_deepspeed, **kwargs)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world != accelerator.num_processes:
        # Seen with DeepSpeed on CPU: every rank believes it is alone, so each would train on all the data.
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} process(es) but torch.distributed has {world} "
            f"({accelerator.distributed_type}); each rank would work alone. Check the launcher's settings "
            "(on CPU: `torchrun --nproc_per_node N <stage>/main.py ...`)."
        )
    return accelerator


def setup_logging(accelerator: Accelerator) -> None:
    """INFO on the main process, warnings only elsewhere, each line tagged with its rank."""
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank {accelerator.process_index}] %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def rank_devices(local_rank: int, count: int, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` of local rank r's engine over `count` devices: entries r*count ..
    r*count + count - 1 of the user's `visible` list (of the node's devices when it is unset), so TP4 x 2
    ranks fill 8 and a run given GPUs 4,5,6,7 stays on them."""
    wanted = range(local_rank * count, (local_rank + 1) * count)
    if not (visible or "").strip():
        return ",".join(str(i) for i in wanted)
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    if wanted.stop > len(devices):
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={visible}: local rank {local_rank} needs devices {wanted.start}.."
            f"{wanted.stop - 1} of that list ({count} per engine: capture.tensor_parallel_size), but it has "
            f"{len(devices)}; start fewer processes per node or make more devices visible"
        )
    return ",".join(devices[i] for i in wanted)


@contextmanager
def engine_devices(local_rank: int | None, count: int = 1):
    """Inside, processes started (a vLLM engine's) see only this rank's devices (`rank_devices`); the
    user's list is back afterwards, for this process and any later engine. None: no change (CPU)."""
    if local_rank is None:
        yield
        return
    user = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = rank_devices(local_rank, count, user)
    try:
        yield
    finally:
        if user is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = user
