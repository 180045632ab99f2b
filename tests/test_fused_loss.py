"""The fused loss rows (train/losses/rows.py FusedRows, `train.fused_loss`): each chunk's gradients computed in
the forward give the loss and gradients of the checkpointed path, recomputed in backward, for every head kind
and objective - KL, RKL, TV, NLA, LK, a weighted sum, alpha on the target, D-PACE's per-prediction weights -
with a trainable or a frozen lm_head, in fp32 and under bf16 autocast.

Tolerances: the loss within rtol 1e-5. In fp32 each gradient's entries within rtol 1e-5 and atol 1e-6 of the
gradient's largest entry (the same products; each row's upstream gradient applied after its own backward
instead of before). Under bf16 autocast both paths are ~1% of the largest entry off fp32's gradients (their
bf16 products round differently): the fused one at most twice the checkpointed one's distance, and under 3%."""

import pytest
import torch

import train.losses as losses
import train.losses.rows as loss_rows
from tests.helpers import head_and_loss, tiny_head_config
from train.losses import Dpace
from train.objectives import parse_objective

torch.set_num_threads(1)


def loss_and_grads(kind: str, objective, dpace=None, bf16: bool = False, freeze: bool = False):
    """A tiny random head of `kind` (tests/helpers.py head_and_loss), its loss on a fixed batch, and every
    weight's gradient."""
    model, loss = head_and_loss(kind, 16, objective=objective, dpace=dpace)
    model.lm_head.weight.requires_grad_(not freeze)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        total, _ = loss()
    total.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return total.detach(), grads


def assert_fused_equals_checkpointed(monkeypatch, kind, spec, alpha_on="draft_vocab", dpace=None, **kw):
    monkeypatch.setattr(loss_rows, "LOGIT_BUDGET_BYTES", 24 * 4 * 5)  # chunks of five rows: several a call
    fused_loss, fused_grads = loss_and_grads(kind, parse_objective(spec, 3.0, alpha_on, True), dpace, **kw)
    plain_loss, plain_grads = loss_and_grads(kind, parse_objective(spec, 3.0, alpha_on, False), dpace, **kw)
    assert plain_loss > 0
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=0)
    assert fused_grads.keys() == plain_grads.keys() and "norm.weight" in plain_grads
    assert ("lm_head.weight" in plain_grads) == (not kw.get("freeze"))
    if kw.get("bf16"):  # both paths against fp32's gradients: the fused one no further off
        _, exact = loss_and_grads(
            kind, parse_objective(spec, 3.0, alpha_on, False), dpace, freeze=kw.get("freeze")
        )
    for name, grad in plain_grads.items():
        size = grad.abs().max()
        if kw.get("bf16"):
            fused_off, plain_off = ((g - exact[name]).abs().max() / size for g in (fused_grads[name], grad))
            assert fused_off <= max(2 * plain_off, 1e-3) and fused_off < 0.03, (name, fused_off, plain_off)
        else:  # entries near zero: against the gradient's own size
            torch.testing.assert_close(
                fused_grads[name], grad, rtol=1e-5, atol=1e-6 * size, msg=lambda m, n=name: f"{n}: {m}"
            )


@pytest.mark.parametrize("spec", ["kl", "rkl", "tv", "nla", "lk", "0.1*kl+0.9*tv"])
def test_every_objective_fused_equals_the_checkpointed_loss(monkeypatch, spec):
    assert_fused_equals_checkpointed(monkeypatch, "eagle3", spec)


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_every_kind_with_alpha_on_the_target_and_dpace_weights(monkeypatch, kind):
    assert_fused_equals_checkpointed(monkeypatch, kind, "lk", alpha_on="target")
    assert_fused_equals_checkpointed(monkeypatch, kind, "nla", dpace=Dpace(0.5, "position"))  # rows weighed


def test_a_frozen_lm_head_and_bf16_autocast(monkeypatch):
    assert_fused_equals_checkpointed(monkeypatch, "eagle3", "kl", freeze=True)
    assert_fused_equals_checkpointed(monkeypatch, "eagle3", "lk", alpha_on="target", bf16=True)
    assert_fused_equals_checkpointed(monkeypatch, "eagle3", "kl", dpace=Dpace(0.5, "all"), bf16=True)


def test_rows_weighed_each_their_own_way_without_saying_so_are_refused():
    from heads.eagle3 import Eagle3Draft

    model = Eagle3Draft(tiny_head_config(aux_layer_ids=[1, 2]))
    probs = torch.softmax(torch.randn(6, 24), -1)
    teacher = losses.Teacher(probs, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(6))
    out = torch.randn(6, 64, requires_grad=True)
    rows = losses.draft_rows(model, parse_objective("kl"), out, teacher, torch.arange(6))
    with pytest.raises(RuntimeError, match="weighed=True"):
        (rows.loss * torch.arange(6.0)).sum().backward()
