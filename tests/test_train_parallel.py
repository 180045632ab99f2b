"""P-EAGLE's parallel drafting for training: the forward against a dense-mask reference written here, COD
anchor subsampling, and the loss (shared with TTT at depth 0, gradients into the mask state)."""

import math

import pytest
import torch

from tests.helpers import random_draft, tiny_head_config
from train.losses import cod_anchors, parallel_forward, parallel_loss, ttt_loss

torch.set_num_threads(1)


def tiny_config(**overrides):
    return tiny_head_config(**{"aux_layer_ids": [1, 2], "mask_token_id": 3, **overrides})


def dense_parallel_reference(model, ids_BT, aux_BTAH, num_depths):
    """Every slot of every round as one sequence ordered (depth j, anchor s), attention through a dense
    [K*T, K*T] mask built entry by entry: slot (d, t) sees (0, s) for s <= t and (j, t) for 1 <= j <= d.
    Depth 0 reads (x_{t+1}, fc(aux_t)) at position t, depth d the mask token and fc(mask_hidden) at t + d."""
    b, t = ids_BT.shape
    k = num_depths
    mask = torch.zeros(k * t, k * t, dtype=torch.bool)
    for d in range(k):
        for q in range(t):
            for j in range(k):
                for s in range(t):
                    mask[d * t + q, j * t + s] = (j == 0 and s <= q) or (1 <= j <= d and s == q)
    next_ids = torch.cat([ids_BT[:, 1:], torch.zeros(b, 1, dtype=ids_BT.dtype)], dim=1)
    token_ids = torch.cat([next_ids] + [torch.full_like(ids_BT, model.config.mask_token_id)] * (k - 1), dim=1)
    mask_hidden = model.fc(model.mask_hidden)[None].expand(b, t, -1)
    hidden = torch.cat([model.fc(aux_BTAH.flatten(-2))] + [mask_hidden] * (k - 1), dim=1)
    positions = torch.cat([torch.arange(t) + d for d in range(k)])[None].expand(b, -1)
    cos, sin = model.rope(positions)
    embeds = model.embed_tokens(token_ids)
    for index, layer in enumerate(model.layers):
        if index == 0:
            q, kk, v, residual = layer.project(embeds, hidden, cos, sin)
        else:
            q, kk, v, residual = layer.project(hidden, cos, sin)
        group = q.shape[1] // kk.shape[1]
        kk, v = kk.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
        attn = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v
        hidden = layer.finish(attn, residual)
    return [hidden[:, d * t : (d + 1) * t] for d in range(k)]


@pytest.mark.parametrize("num_layers", [1, 3])
def test_parallel_forward_matches_dense_mask(num_layers):
    model = random_draft(tiny_config(num_hidden_layers=num_layers))
    torch.manual_seed(1)
    ids = torch.randint(0, 40, (2, 9))
    aux = torch.randn(2, 9, 2, 64)
    outs = parallel_forward(model, ids, aux, [None] * 4)
    reference = dense_parallel_reference(model, ids, aux, 4)
    for d in range(4):
        torch.testing.assert_close(outs[d], reference[d], atol=1e-5, rtol=1e-5)


def test_cod_anchors_are_nested_subsets_answer_positions_first():
    loss_mask = torch.zeros(2, 40, dtype=torch.bool)
    loss_mask[0, 10:30] = True
    loss_mask[1, 5:15] = True
    anchors = cod_anchors(loss_mask, 4, 0.5, torch.Generator().manual_seed(0))
    assert anchors[0] is None
    assert [a.shape[1] for a in anchors[1:]] == [10, 5, 3]  # ceil(20 * 0.5^d): row 0 has 20 answer anchors
    for shallow, deep in zip(anchors[1:], anchors[2:]):
        assert torch.equal(shallow[:, : deep.shape[1]], deep)
    # Anchors whose depth-0 target x_{t+2} is an answer token come first: row 0's are 8..27.
    assert ((anchors[1][0] >= 8) & (anchors[1][0] < 28)).all()
    assert cod_anchors(loss_mask, 3, 1.0) == [None, None, None]
    with pytest.raises(ValueError, match="cod_ratio"):
        cod_anchors(loss_mask, 3, 0.0)


def test_subsampled_depths_equal_the_full_forward_at_their_anchors():
    model = random_draft(tiny_config(num_hidden_layers=2))
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 40, (2, 12)), torch.randn(2, 12, 2, 64)
    full = parallel_forward(model, ids, aux, [None] * 3)
    anchors = cod_anchors(torch.ones(2, 12, dtype=torch.bool), 3, 0.6, torch.Generator().manual_seed(3))
    sub = parallel_forward(model, ids, aux, anchors)
    torch.testing.assert_close(sub[0], full[0])
    for d in (1, 2):
        expected = torch.stack([full[d][row, anchors[d][row]] for row in range(2)])
        torch.testing.assert_close(sub[d], expected, atol=1e-5, rtol=1e-5)


def loss_batch(seed=0, b=2, t=16, h=64, vocab=40):
    torch.manual_seed(seed)
    loss_mask = torch.zeros(b, t, dtype=torch.bool)
    loss_mask[:, 5:] = True
    return {
        "input_ids": torch.randint(0, vocab, (b, t)),
        "loss_mask": loss_mask,
        "attention_mask": torch.ones(b, t, dtype=torch.long),
        "aux_hidden": torch.randn(b, t, 2, h),
        "final_hidden": torch.randn(b, t, h),
    }


def test_depth_zero_is_eagle3s_first_ttt_step_and_gradients_reach_the_mask_state():
    model = random_draft(tiny_config())
    batch = loss_batch()
    lm_head, d2t = torch.randn(40, 64), torch.arange(24)
    parallel_total, parallel_metrics = parallel_loss(model, batch, 1, 0.8, lm_head, d2t, 7)
    ttt_total, ttt_metrics = ttt_loss(model, batch, 1, 0.8, lm_head, d2t, 7)
    torch.testing.assert_close(parallel_total, ttt_total)
    assert parallel_metrics["num_valid_0"] == ttt_metrics["num_valid_0"] > 0

    total, metrics = parallel_loss(model, batch, 3, 0.8, lm_head, d2t, 7)
    expected = sum(0.8**d * metrics[f"loss_{d}"] for d in range(3))
    torch.testing.assert_close(total.detach(), expected)
    total.backward()
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    for d in range(3):
        assert metrics[f"chain_total_{d}"] >= metrics[f"chain_hits_{d}"] >= 0


def test_a_head_without_a_mask_token_is_refused():
    model = random_draft(tiny_config(mask_token_id=None))
    with pytest.raises(ValueError, match="mask_token_id"):
        parallel_loss(model, loss_batch(), 3, 0.8, torch.randn(40, 64), torch.arange(24), 7)


def test_a_few_hundred_steps_learn_every_depth():
    """Overfit one batch: the parallel depths learn what the teacher says, not only depth 0."""
    model = random_draft(tiny_config(draft_vocab_size=40))
    batch = loss_batch(seed=4, t=24)
    lm_head = torch.randn(40, 64) * 3
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(300):
        total, metrics = parallel_loss(model, batch, 3, 0.8, lm_head, torch.arange(40), 64)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    assert all(float(metrics[f"acc_{d}"]) >= 0.9 for d in range(3)), metrics
