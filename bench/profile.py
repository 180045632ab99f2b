"""What one training step spends its time on: the measurements `python -m bench.memory --profile` adds to each
head kind's step (docs/benchmarks.md#a-profiled-step), on a GPU and on this CPU alike.

- `step_flops`: the step's model FLOPs (torch's FLOP formulas over forward, backward and the optimizer: `FlopCount`)
  and the recomputation of its checkpointed regions on top (the chunked loss rows and attention,
  heads/attention.py and train/losses/rows.py, each recomputed once in backward). MFU counts the model
  FLOPs, as the field does.
- `split`: the step's seconds by part - the teacher (target logits and softmax, no grad) and the draft's
  loss rows (lm_head, log-softmax, objective; forward and backward) each timed alone on this batch's
  shapes, the rest of forward and backward (the head's layers), the optimizer.
- `top_ops`: torch.profiler over one step, the ops by self time (the device's on CUDA, the CPU's here).
- `peak_flops`: the device's dense bf16 peak, from its name (None on a CPU: no MFU is claimed there).

    flops = step_flops(lambda: train_step(model, optimizer, batch, 1.0, device))
    mfu = flops["model"] / step_s / peak_flops(device)
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# Modules whose `checkpoint` recomputes a region in backward (each region once).
CHECKPOINTING = ("heads.attention", "train.losses.rows", "train.losses.eagle1")
# Dense bf16 peaks without sparsity, by the first name fragment found in torch.cuda.get_device_name (vendor
# data sheets); the more specific names first.
PEAK_BF16 = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
)


def peak_flops(device) -> float | None:
    """Dense bf16 FLOP/s of this CUDA device, or None (a CPU, or a GPU not in PEAK_BF16)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for fragment, peak in PEAK_BF16 if fragment in name), None)


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops run under it, by torch's own formulas (torch.utils.flop_counter's registry: matmuls,
    convolutions, attention). Not FlopCounterMode: its module tracker refuses the autograd.grad that the
    fused loss rows run inside the forward (train/losses/rows.py FusedRows)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out


def step_flops(step) -> dict[str, int]:
    """{"model", "recomputed", "executed"}: FLOPs of one call of `step` (a full training step).

    A dispatch mode sees the forward and the backward's own products but not what checkpointing recomputes
    in backward (measured: a checkpointed Linear's step counts three products, not four), so its count is
    the model's; each checkpointed region's forward, counted as it first runs with grad, is what backward
    runs once more."""
    import importlib

    recomputed = []

    def counting(original):
        def checkpoint(fn, *args, **kwargs):
            with FlopCount() as region:  # nested: the outer count sees these too
                out = original(fn, *args, **kwargs)
            if torch.is_grad_enabled():  # recomputed in backward only where a graph was kept
                recomputed.append(region.total)
            return out

        return checkpoint

    with ExitStack() as stack:
        for name in CHECKPOINTING:
            module = importlib.import_module(name)
            stack.enter_context(mock.patch.object(module, "checkpoint", counting(module.checkpoint)))
        with FlopCount() as counter:
            step()
    model, again = counter.total, sum(recomputed)
    return {"model": model, "recomputed": again, "executed": model + again}


def synchronized(device) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def loss_parts(model, batch: dict, device, precision: str = "bf16", repeats: int = 2) -> dict[str, float]:
    """{"teacher_s", "loss_s"}: the teacher of this batch, and the draft's loss rows forward and backward at
    its number of predictions (every depth's, as one call), each timed alone under `precision`'s
    autocast (train.mixed_precision); the fastest of `repeats`."""
    from bench.train_step import autocast
    from train.losses import batch_teacher, draft_rows

    draft = model.draft
    teacher_s, loss_s = [], []
    counts = model.prediction_counts(batch, model.draw(batch))
    g = torch.Generator(device).manual_seed(0)
    for _ in range(repeats):
        start = synchronized(device)
        teacher = batch_teacher(batch, model.target_lm_head, model.draft_to_target, model.chunk_size)
        teacher_s.append(synchronized(device) - start)
        m, n = int(counts.sum()), teacher.probs_NVd.shape[0]
        rows_M = torch.randint(0, max(n, 1), (m,), generator=g, device=device)
        out_MH = torch.randn(m, draft.config.hidden_size, generator=g, device=device, requires_grad=True)
        start = synchronized(device)
        with autocast(device, precision):
            rows = draft_rows(draft, model.objective, out_MH, teacher, rows_M)
        rows.loss.sum().backward()
        loss_s.append(synchronized(device) - start)
    draft.zero_grad(set_to_none=True)
    return {"teacher_s": min(teacher_s), "loss_s": min(loss_s)}


def split(phases: dict[str, float], parts: dict[str, float]) -> dict[str, float]:
    """The step's seconds by part: teacher, loss rows (forward and backward), the head's layers (the rest of
    forward and backward), optimizer; `phases` from bench.memory's train_step, `parts` from `loss_parts`."""
    layers = phases["fwd_s"] + phases["bwd_s"] - parts["teacher_s"] - parts["loss_s"]
    return {
        "teacher_s": parts["teacher_s"],
        "loss_s": parts["loss_s"],
        "layers_s": max(layers, 0.0),
        "optimizer_s": phases["opt_s"],
        "step_s": phases["step_s"],
    }


def top_ops(step, device, limit: int = 12) -> list[dict]:
    """torch.profiler over one call of `step`: the `limit` ops with the most self time (the device's on CUDA),
    each with its calls and share of the step's total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as prof:
        step()
        synchronized(device)
    events = prof.key_averages()

    def self_us(event) -> float:
        if cuda:
            return getattr(event, "self_device_time_total", 0) or getattr(event, "self_cuda_time_total", 0)
        return event.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1.0
    ranked = sorted(events, key=self_us, reverse=True)[:limit]
    return [
        {"op": e.key, "self_ms": round(self_us(e) / 1e3, 2), "calls": e.count,
         "share": round(self_us(e) / total, 3)}
        for e in ranked
    ]  # fmt: skip


def profile_line(m: dict) -> str:
    """The profile of one kind's step in a line: its split, FLOPs a token, MFU where the peak is known."""
    s, f = m["split"], m["flops_per_token"]
    mfu = f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else ""
    return (
        f"{m['kind']:7s} split: teacher {s['teacher_s']:.3f} s, loss rows {s['loss_s']:.3f} s, layers "
        f"{s['layers_s']:.3f} s, optimizer {s['optimizer_s']:.3f} s; {f['model'] / 1e9:.2f} GFLOP a token "
        f"(+{f['recomputed'] / 1e9:.2f} recomputed), {m['achieved_tflops']:.2f} TFLOP/s{mfu}; top ops: "
        + ", ".join(f"{o['op']} {o['share']:.0%}" for o in m["top_ops"][:5])
    )
