"""P-EAGLE's parallel drafting for training: the forward against a dense-mask reference written here, COD
anchor subsampling, and the loss (shared with TTT at depth 0, gradients into the mask state)."""

import math

import pytest
import torch

from tests.helpers import random_draft, tiny_head_config
from train.losses import (
    Dpace,
    cod_anchors,
    parallel_forward,
    parallel_loss,
    sample_blocks,
    sample_generators,
    ttt_loss,
)

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
    batch = {"loss_mask": loss_mask}
    anchors = cod_anchors(batch, 4, 0.5, sample_generators(batch, torch.Generator().manual_seed(0)))
    assert anchors[0] is None
    # ceil(n_b * 0.5^d) per row: row 0 has 20 anchors with an answer token to predict, row 1 ten.
    assert [a.index_BM.shape[1] for a in anchors[1:]] == [10, 5, 3]
    assert [a.keep_BM.sum(1).tolist() for a in anchors[1:]] == [[10, 5], [5, 3], [3, 2]]
    for shallow, deep in zip(anchors[1:], anchors[2:]):
        assert torch.equal(shallow.index_BM[:, : deep.index_BM.shape[1]], deep.index_BM)
    # Anchors whose depth-0 target x_{t+2} is an answer token come first: row 0's are 8..27, row 1's 3..12.
    assert ((anchors[1].index_BM[0] >= 8) & (anchors[1].index_BM[0] < 28)).all()
    kept_1 = anchors[1].index_BM[1][anchors[1].keep_BM[1]]
    assert ((kept_1 >= 3) & (kept_1 < 13)).all()
    assert cod_anchors(batch, 3, 1.0, []) == [None, None, None]
    with pytest.raises(ValueError, match="cod_ratio"):
        cod_anchors(batch, 3, 0.0, [])


def test_a_samples_draws_do_not_depend_on_its_batch():
    """Anchors and block lengths come from the sample's own seed: the same in a batch of one or beside a
    longer sample (more padding) - what makes one process and two train the same."""
    loss_mask = torch.zeros(2, 30, dtype=torch.bool)
    loss_mask[0, 4:12] = True
    loss_mask[1, 6:30] = True
    attention_mask = torch.zeros(2, 30, dtype=torch.bool)
    attention_mask[0, :12] = True
    attention_mask[1] = True
    pair = {"loss_mask": loss_mask, "attention_mask": attention_mask, "draw_seeds": torch.tensor([11, 12])}
    alone = {
        "loss_mask": loss_mask[:1, :12],
        "attention_mask": attention_mask[:1, :12],
        "draw_seeds": torch.tensor([11]),
    }
    for batch_draw in (
        lambda batch: cod_anchors(batch, 3, 0.5, sample_generators(batch))[2],
        lambda batch: sample_blocks(batch, 5, (2, 6), sample_generators(batch)),
    ):
        in_pair, by_itself = batch_draw(pair), batch_draw(alone)
        n = int(by_itself.keep_BM.sum())
        assert int(in_pair.keep_BM[0].sum()) == n > 0
        for field in range(len(by_itself)):  # index, keep (and block lengths): the same draws
            torch.testing.assert_close(in_pair[field][0, :n], by_itself[field][0, :n])


def test_subsampled_depths_equal_the_full_forward_at_their_anchors():
    model = random_draft(tiny_config(num_hidden_layers=2))
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 40, (2, 12)), torch.randn(2, 12, 2, 64)
    full = parallel_forward(model, ids, aux, [None] * 3)
    batch = {"loss_mask": torch.ones(2, 12, dtype=torch.bool)}
    anchors = cod_anchors(batch, 3, 0.6, sample_generators(batch, torch.Generator().manual_seed(3)))
    sub = parallel_forward(model, ids, aux, anchors)
    torch.testing.assert_close(sub[0], full[0])
    for d in (1, 2):
        expected = torch.stack([full[d][row, anchors[d].index_BM[row]] for row in range(2)])
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


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_dpace_weighs_each_depth_by_its_anchors_chain(kind):
    """D-PACE over TTT steps and P-EAGLE depths (COD anchors: deeper depths keep fewer), by hand: depth d at
    anchor t weighs sum_{m>=d} prod_{i<=m} (a + (1 - a) q_i(target's argmax)) over the depths that anchor
    trains, a target argmax outside the draft vocabulary counting q = 0; each depth's loss stays a mean, and
    with head.dpace_norm=all the total is once over every prediction."""
    from train.losses import ttt_rollout

    model = random_draft(tiny_config())
    batch, a, num_depths = loss_batch(seed=6), 0.5, 3
    lm_head, d2t = torch.randn(40, 64) * 3, torch.arange(24)
    anchors = [None] * num_depths
    if kind == "peagle":
        anchors = cod_anchors(
            batch, num_depths, 0.6, sample_generators(batch, torch.Generator().manual_seed(3))
        )

    def loss(norm):
        if kind == "peagle":
            return parallel_loss(
                model, batch, num_depths, 0.8, lm_head, d2t, 7, anchors=anchors, dpace=Dpace(a, norm)
            )
        return ttt_loss(model, batch, num_depths, 0.8, lm_head, d2t, 7, dpace=Dpace(a, norm))

    total, metrics = loss("position")
    with torch.no_grad():
        if kind == "peagle":
            outs = parallel_forward(model, batch["input_ids"], batch["aux_hidden"], anchors)
        else:
            outs = ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], num_depths)
        logits = batch["final_hidden"] @ lm_head.T
        teacher = torch.softmax(logits[..., d2t], -1)
    b, t = batch["input_ids"].shape
    sums, counts, outside = [0.0] * num_depths, [0] * num_depths, 0
    for row in range(b):
        for anchor in range(t):
            depths, logqs = [], []
            for d in range(num_depths):
                kept = anchors[d] is None or anchor in anchors[d].index_BM[row][anchors[d].keep_BM[row]]
                if not kept or anchor + 2 + d >= t or not batch["loss_mask"][row, anchor + 2 + d]:
                    continue
                m = (
                    anchor
                    if anchors[d] is None
                    else int((anchors[d].index_BM[row] == anchor).nonzero()[0, 0])
                )
                depths.append(d)
                logqs.append(torch.log_softmax(model.logits(outs[d][row, m]).detach().float(), -1))
            c = []
            for d, logq in zip(depths, logqs):
                argmax = int(logits[row, anchor + 1 + d].argmax())
                q = float(logq[argmax].exp()) if argmax < 24 else 0.0
                c.append(a + (1 - a) * q)
            for i, (d, logq) in enumerate(zip(depths, logqs)):
                counts[d] += 1
                if int(logits[row, anchor + 1 + d].argmax()) >= 24:
                    outside += 1
                    continue  # no loss: the target's token is outside the draft vocabulary
                weight = sum(math.prod(c[: j + 1]) for j in range(i, len(depths)))
                sums[d] += weight * -float((teacher[row, anchor + 1 + d] * logq).sum())
    assert outside > 0
    if kind == "peagle":
        assert counts[2] < counts[1] < counts[0]  # COD: fewer anchors deeper
    for d in range(num_depths):
        assert int(metrics[f"num_pred_{d}"]) == counts[d]
        assert float(metrics[f"loss_{d}"]) == pytest.approx(sums[d] / counts[d], rel=1e-4)
    assert float(total.detach()) == pytest.approx(sum(s / n for s, n in zip(sums, counts)), rel=1e-4)
    assert float(loss("all")[0].detach()) == pytest.approx(sum(sums) / sum(counts), rel=1e-4)


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


def extended(batch: dict, extra: int, seed: int = 9) -> dict:
    """The batch with `extra` more answer tokens (random ids and states) after every row's last."""
    generator = torch.Generator().manual_seed(seed)
    b = batch["input_ids"].shape[0]
    more = {
        "input_ids": torch.randint(0, 40, (b, extra), generator=generator),
        "loss_mask": torch.ones(b, extra, dtype=torch.bool),
        "attention_mask": torch.ones(b, extra, dtype=torch.long),
        "aux_hidden": torch.randn(b, extra, *batch["aux_hidden"].shape[2:], generator=generator),
        "final_hidden": torch.randn(b, extra, batch["final_hidden"].shape[2], generator=generator),
    }
    return {key: torch.cat([batch[key], more[key]], dim=1) for key in more}


def test_each_depths_loss_is_the_mean_over_its_anchors_whatever_the_answer_tokens_beyond():
    """P-EAGLE's COD depths and DFlash's slots: with the same anchors drawn, more answer tokens after them
    leave each depth's loss unchanged (a mean over its predictions); a loss divided by the answer tokens,
    as before, would shrink by their ratio (here 11 answer tokens against 11 + 40)."""
    from heads.dflash import DFlashConfig
    from train.losses import Anchors, Blocks, block_loss

    batch = loss_batch(seed=5)
    longer = extended(batch, 40)
    lm_head, d2t = torch.randn(40, 64), torch.arange(24)
    model = random_draft(tiny_config(num_hidden_layers=2))
    index_BM = torch.tensor([[5, 9, 12], [6, 7, 11]])  # three anchors per row: the cap
    anchors = [None] + [Anchors(index_BM[:, : 3 - d], torch.ones(2, 3 - d, dtype=torch.bool)) for d in (1, 2)]
    _, short_metrics = parallel_loss(model, batch, 3, 0.8, lm_head, d2t, 7, anchors=anchors)
    _, long_metrics = parallel_loss(model, longer, 3, 0.8, lm_head, d2t, 7, anchors=anchors)
    for d in (1, 2):
        assert int(short_metrics[f"num_pred_{d}"]) == 2 * (3 - d)
        torch.testing.assert_close(long_metrics[f"loss_{d}"], short_metrics[f"loss_{d}"])

    dflash = random_draft(tiny_head_config(DFlashConfig, aux_layer_ids=[1, 2], mask_token_id=3, block_size=4))
    blocks = Blocks(index_BM, torch.ones(2, 3, dtype=torch.bool), torch.tensor([[4, 3, 2], [4, 4, 4]]))
    short_total, short_metrics = block_loss(dflash, batch, [1.0, 0.5, 0.25], lm_head, d2t, 7, blocks=blocks)
    long_total, long_metrics = block_loss(dflash, longer, [1.0, 0.5, 0.25], lm_head, d2t, 7, blocks=blocks)
    # Slot k of a block of length L exists for k < L - 1: 6, 5 and 4 predictions (row 0's shorter blocks).
    assert [int(short_metrics[f"num_pred_{k}"]) for k in range(3)] == [6, 5, 4]
    torch.testing.assert_close(long_total, short_total)
    assert int(batch["loss_mask"].sum()) * 4 < int(longer["loss_mask"].sum())


def test_given_the_global_counts_the_micro_batches_losses_add_up_to_the_whole_batchs_mean():
    """What the trainer does with several processes or micro-batches: each part divides its sum by the
    count over all of them; the parts' losses then add up to the loss of the whole batch in one piece."""
    from heads.dflash import DFlashConfig
    from train.losses import block_loss, slot_predictions

    whole = loss_batch(seed=6, b=4, t=20)
    whole["draw_seeds"] = torch.tensor([3, 1, 4, 1])
    parts = [{key: value[rows] for key, value in whole.items()} for rows in (slice(0, 1), slice(1, 4))]
    lm_head, d2t = torch.randn(40, 64), torch.arange(24)
    dflash = random_draft(tiny_head_config(DFlashConfig, aux_layer_ids=[1, 2], mask_token_id=3, block_size=5))
    weights = [1.0, 0.6, 0.3, 0.1]

    def blocks_of(batch):
        return sample_blocks(batch, 6, (2, 5), sample_generators(batch))

    whole_loss, _ = block_loss(dflash, whole, weights, lm_head, d2t, 7, blocks=blocks_of(whole))
    counts = sum(
        torch.stack([slot_predictions(p, blocks_of(p), k)[1].sum() for k in range(4)]) for p in parts
    )
    part_losses = [
        block_loss(dflash, p, weights, lm_head, d2t, 7, denominators=counts.float(), blocks=blocks_of(p))[0]
        for p in parts
    ]
    torch.testing.assert_close(sum(part_losses), whole_loss)


@pytest.mark.parametrize("kind", ["peagle", "dflash"])
def test_the_trainers_denominators_are_each_depths_predictions_not_the_answer_tokens(kind, tmp_path):
    """The trainer divides each depth's sum by the predictions `prediction_counts` finds for the draws it
    passes: with one micro-batch that is exactly the batch's own mean, and under an anchor cap far fewer
    than the answer tokens it used to divide by."""
    from heads.dflash import DFlashConfig
    from tests.helpers import smoke_config
    from train.model import DraftWithLoss

    cfg = smoke_config(
        tmp_path, f"head.kind={kind}", "head.cod_ratio=0.5", "head.num_anchors=4", "head.block_size=4",
        "head.min_block_size=2", "head.mask_token_id=3", "export.num_speculative_tokens=3",
    )  # fmt: skip
    if kind == "dflash":
        draft = random_draft(
            tiny_head_config(DFlashConfig, aux_layer_ids=[1, 2], mask_token_id=3, block_size=4)
        )
    else:
        draft = random_draft(tiny_config())
    model = DraftWithLoss(draft, torch.randn(40, 64), torch.arange(24), cfg).train()
    batch = {**loss_batch(seed=7, t=40), "draw_seeds": torch.tensor([5, 6])}
    draws = model.draw(batch)
    counts = model.prediction_counts(batch, draws)
    mean_total, mean_metrics = model(batch, None, draws)
    total, metrics = model(batch, counts.float(), draws)
    torch.testing.assert_close(total, mean_total)
    assert [int(metrics[f"num_pred_{k}"]) for k in range(3)] == counts.tolist()
    # 35 answer tokens a row; DFlash draws 4 anchors a row, COD keeps ~35 * 0.5^d at depth d.
    assert int(batch["loss_mask"].sum()) == 70 and (counts[1:] <= {"peagle": 36, "dflash": 8}[kind]).all()
