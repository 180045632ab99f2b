"""The bounded-memory attention and loss (issue 33): query chunks under activation checkpointing and the
fused causal kernel give what the dense single-pass code gave before them (kept below as the reference),
forward and backward, in every mode a head attends in; the loss's logits in checkpointed row chunks give
the same loss and gradients as one pass; the teacher is computed only where a loss needs it."""

import pytest
import torch

import heads.attention as attention_module
import train.losses as losses
import train.losses.rows as loss_rows
from heads.attention import attention, block_attention
from tests.helpers import head_and_loss

torch.set_num_threads(1)


def reference_attention(
    q_BNTD, k_BGSD, v_BGSD, query_positions_BT=None, extra_k=None, extra_v=None, visible=None
):
    """The one attention as it was before issue 33, verbatim: dense [T, S] scores in one pass."""
    b, n, t, d = q_BNTD.shape
    g, s = k_BGSD.shape[1], k_BGSD.shape[2]
    q_BGRTD = q_BNTD.view(b, g, n // g, t, d) * d**-0.5
    scores_BGRTS = torch.einsum("bgrtd,bgsd->bgrts", q_BGRTD, k_BGSD)
    if query_positions_BT is None:
        future = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
    else:
        future = (torch.arange(s) > query_positions_BT[..., None])[:, None, None]
    scores_BGRTS = scores_BGRTS.masked_fill(future, float("-inf"))
    if extra_k is None:
        probs_BGRTS = torch.softmax(scores_BGRTS.float(), dim=-1).to(q_BNTD.dtype)
        return torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTS, v_BGSD).reshape(b, n, t, d)
    scores_BGRTJ = torch.einsum("bgrtd,bgtjd->bgrtj", q_BGRTD, extra_k)
    if visible is not None:
        scores_BGRTJ = scores_BGRTJ.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(torch.cat([scores_BGRTS, scores_BGRTJ], dim=-1).float(), dim=-1).to(q_BNTD.dtype)
    probs_BGRTS, probs_BGRTJ = probs.split([s, extra_k.shape[3]], dim=-1)
    out = torch.einsum("bgrts,bgsd->bgrtd", probs_BGRTS, v_BGSD)
    return (out + torch.einsum("bgrtj,bgtjd->bgrtd", probs_BGRTJ, extra_v)).reshape(b, n, t, d)


def cases(b=2, n=4, g=2, t=9, d=8, j=3):
    """(name, inputs) for every way a head attends: a causal pass, decoding after a cache, TTT steps with
    diagonal keys, P-EAGLE's anchors, DFlash's masked block keys."""
    torch.manual_seed(0)
    q, k, v = torch.randn(b, n, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    extra_k, extra_v = torch.randn(b, g, t, j, d), torch.randn(b, g, t, j, d)
    anchors = torch.stack([torch.randperm(t)[:5] for _ in range(b)])
    visible = torch.rand(5, j) > 0.4
    visible[:, 0] = True  # every query sees at least one key of its own (its block's anchor)
    return [
        ("causal", (q, k, v)),
        ("decoding", (q[:, :, :4], k, v)),
        ("steps", (q, k, v, None, extra_k, extra_v)),
        ("anchors", (q[:, :, :5], k, v, anchors, extra_k[:, :, :5], extra_v[:, :, :5])),
        ("blocks", (q[:, :, :5], k, v, anchors, extra_k[:, :, :5], extra_v[:, :, :5], visible)),
    ]


@pytest.mark.parametrize("budget", [None, 1])
@pytest.mark.parametrize("case", range(5))
def test_attention_equals_the_dense_reference_forward_and_backward(monkeypatch, case, budget):
    if budget is not None:  # one query per chunk, each checkpointed
        monkeypatch.setattr(attention_module, "SCORE_BUDGET_BYTES", budget)
    name, inputs = cases()[case]
    ours = [x.clone().requires_grad_(x.is_floating_point()) if x is not None else None for x in inputs]
    ref = [x.clone().requires_grad_(x.is_floating_point()) if x is not None else None for x in inputs]
    out, expected = attention(*ours), reference_attention(*ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5, msg=name)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for mine, theirs in zip(ours, ref):
        if mine is not None and mine.is_floating_point():
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_chunked_attention_keeps_no_scores_for_backward(monkeypatch):
    """What autograd keeps of a TTT step: the dense pass holds its [T, S] scores; chunked, it does not."""
    b, n, g, t, d = 1, 4, 2, 256, 16
    q = torch.randn(b, n, t, d, requires_grad=True)
    k, v = torch.randn(b, g, t, d, requires_grad=True), torch.randn(b, g, t, d, requires_grad=True)
    extra = torch.randn(b, g, t, 2, d, requires_grad=True)

    def saved_bytes():
        storages = {}  # a tensor saved by several chunks (the keys) counts once

        def pack(x):
            storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            attention(q, k, v, None, extra, extra)
        return sum(storages.values())

    dense = saved_bytes()
    monkeypatch.setattr(attention_module, "SCORE_BUDGET_BYTES", 64 * 1024)
    chunked = saved_bytes()
    scores = b * n * t * t * 4
    assert dense > scores  # at least one [T, S] fp32 tensor
    assert chunked < scores / 2  # the inputs and the output, no scores


def test_block_attention_chunked_equals_one_pass(monkeypatch):
    torch.manual_seed(1)
    b, n, g, s, d, m, j = 2, 4, 2, 12, 8, 3, 4
    q, k, v = torch.randn(b, n, m * j, d), torch.randn(b, g, m * j, d), torch.randn(b, g, m * j, d)
    ck, cv = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    starts = torch.tensor([[2, 5, 9], [1, 7, 11]])
    for causal in (False, True):
        whole = block_attention(q, k, v, ck, cv, starts, causal)
        monkeypatch.setattr(attention_module, "SCORE_BUDGET_BYTES", 1)
        chunked = block_attention(q, k, v, ck, cv, starts, causal)
        monkeypatch.undo()
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)


def test_teacher_rows_only_where_needed():
    torch.manual_seed(2)
    final, lm_head, d2t = torch.randn(2, 6, 16), torch.randn(30, 16), torch.arange(0, 30, 3)
    needed = torch.rand(2, 6) > 0.5
    teacher = losses.teacher_rows(final, lm_head, d2t, 4, needed)
    assert teacher.probs_NVd.shape == (int(needed.sum()), 10)  # one row per needed position, no more
    assert (teacher.row_BT >= 0).eq(needed).all()
    full, in_draft = losses.teacher_probs(final, lm_head, d2t, 4)
    torch.testing.assert_close(teacher.probs_NVd[teacher.row_BT[needed]], full[needed])
    assert in_draft[needed].eq(teacher.in_draft_BT[needed]).all() and not teacher.in_draft_BT[~needed].any()


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_loss_in_checkpointed_chunks_equals_one_pass(monkeypatch, kind):
    """Every head's loss and gradients with its logits and attention in one-row chunks against one pass."""
    model, loss_fn = head_and_loss(kind)

    def loss_and_grads():
        model.zero_grad()
        total, _ = loss_fn()
        total.backward()
        return total.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    whole_loss, whole_grads = loss_and_grads()
    # draft_rows reads the budget in its own module: train.losses re-exports a copy of it.
    monkeypatch.setattr(loss_rows, "LOGIT_BUDGET_BYTES", 1)
    monkeypatch.setattr(attention_module, "SCORE_BUDGET_BYTES", 1)
    chunked_loss, chunked_grads = loss_and_grads()
    assert whole_loss > 0
    torch.testing.assert_close(chunked_loss, whole_loss, rtol=1e-5, atol=1e-6)
    assert whole_grads.keys() == chunked_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
