"""The profiled training step (bench/profile.py, `python -m bench.memory --profile`): FLOPs counted as the step
runs them, the checkpointed regions' recomputation apart, and every kind's profile at a small shape."""

import json
import subprocess
import sys

import torch

from bench import profile
from train.losses import rows

REPO_ROOT = profile.__file__.rsplit("/bench/", 1)[0]


def test_flops_count_a_linear_layer_and_its_recomputation_apart():
    b, i, o = 8, 16, 32
    layer = torch.nn.Linear(i, o, bias=False)
    x = torch.randn(b, i, requires_grad=True)

    def step():
        rows.checkpoint(layer, x, use_reentrant=False).sum().backward()  # a region recomputed in backward

    flops = profile.step_flops(step)
    matmul = 2 * b * i * o
    # the forward, then the input's and the weight's gradients; the forward once more in backward
    assert flops == {"model": 3 * matmul, "recomputed": matmul, "executed": 4 * matmul}
    assert layer.weight.grad is not None  # the step ran as written under the count


def test_the_split_gives_the_layers_what_the_teacher_and_loss_rows_leave():
    phases = {"fwd_s": 1.0, "bwd_s": 2.0, "opt_s": 0.25, "step_s": 3.25}
    parts = {"teacher_s": 0.5, "loss_s": 0.75}
    assert profile.split(phases, parts) == {
        "teacher_s": 0.5, "loss_s": 0.75, "layers_s": 1.75, "optimizer_s": 0.25, "step_s": 3.25
    }  # fmt: skip
    assert profile.peak_flops("cpu") is None  # no MFU is claimed on a CPU


def test_every_kind_is_profiled_with_its_parts_flops_and_top_ops(tmp_path):
    out = tmp_path / "profile.json"
    command = [sys.executable, "-m", "bench.memory", "--tiny", "--profile", "--steps", "2", "--seq-len", "128",
               "--kinds", "eagle3", "peagle", "dflash", "--override", "head.num_ttt_steps=3", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if " split: " in line]
    assert [line.split()[1] for line in lines] == ["eagle3", "peagle", "dflash"]
    results = json.loads(out.read_text())
    for m in results:
        split, flops = m["split"], m["flops_per_token"]
        assert all(split[k] > 0 for k in ("teacher_s", "loss_s", "layers_s", "optimizer_s")), m["kind"]
        assert flops["executed"] == flops["model"] + flops["recomputed"] and flops["model"] > 0
        assert m["mfu"] is None and m["achieved_tflops"] > 0
        assert m["top_ops"][0]["op"].startswith("aten::") and 0 < m["top_ops"][0]["share"] <= 1
    # EAGLE-3, K=3: one 2H-input layer plus lm_head a step, three times the forward - the count's order
    h, i, vd = 128, 352, 512
    per_step = 2 * (2 * h * h + 2 * 2 * h * 64 + h * h + 3 * h * i + h * vd)
    assert 0.5 * 3 * 3 * per_step < results[0]["flops_per_token"]["model"] < 3 * 3 * 3 * per_step
