"""Packed rows (`train.pack_length`): several samples in one row, each seeing only itself, train exactly as
the same samples one a row - every head kind's loss, its metrics and its gradients - and the plan packs
every sample of an epoch once, into rows that fit."""

import pytest
import torch

from bench.padding import packed_padding, padded_fractions
from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.layers import fused_rows
from tests.helpers import random_draft, tiny_head_config
from train import losses
from train.data import collate, plan_epoch
from train.objectives import KL, parse_objective

LENGTHS = [9, 5, 12, 7, 3, 10]
PER_ROW = [2, 3, 1]  # rows of 14, 22 and 10 tokens


def samples(hidden: int, vocab: int, seed: int = 0) -> list[dict]:
    """Cache samples: a 3-token prompt then the answer; the last aux row zero, as the cache stores it."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        aux = torch.randn(n, 2, hidden, generator=g)
        aux[-1] = 0
        out.append(
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=g),
                "loss_mask": torch.arange(n) >= 3,
                "aux_hidden": aux,
                "final_hidden": torch.randn(n, hidden, generator=g),
            }
        )
    return out


def build(kind: str):
    """A tiny random head of `kind` and its loss on a batch, the draws from the batch's own seeds."""
    from heads.dflash import DFlashConfig

    if kind == "eagle1":
        torch.manual_seed(0)
        model = Eagle1Draft(Eagle1Config(**{k: v for k, v in vars(tiny_head_config()).items() if k in
                                            Eagle1Config.__dataclass_fields__}))  # fmt: skip
        for param in model.parameters():
            torch.nn.init.normal_(param, 0, 0.2) if param.requires_grad else None
    else:
        extra = {"peagle": dict(mask_token_id=3), "dflash": dict(mask_token_id=3, block_size=4)}.get(kind, {})
        config = tiny_head_config(DFlashConfig if kind == "dflash" else None, aux_layer_ids=[1, 2], **extra)
        model = random_draft(config)
    h, v = model.config.hidden_size, model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    lm_head, d2t = torch.randn(v, h, generator=g), torch.arange(24)
    if kind == "eagle1":
        model.load_target_lm_head(lm_head)

    def loss(batch, **kwargs):
        gens = losses.sample_generators(batch)
        if kind == "eagle1":
            return losses.eagle1_loss(model, batch, lm_head, 5, add_noise=False, **kwargs)
        if kind == "eagle3":
            return losses.ttt_loss(model, batch, 3, 0.8, lm_head, d2t, 5, **kwargs)
        if kind == "peagle":
            anchors = losses.cod_anchors(batch, 3, 0.6, gens)
            return losses.parallel_loss(model, batch, 3, 0.8, lm_head, d2t, 5, anchors=anchors, **kwargs)
        blocks = losses.sample_blocks(batch, 3, (2, 4), gens)
        return losses.block_loss(model, batch, [1.0, 0.7, 0.5], lm_head, d2t, 5, blocks=blocks, **kwargs)

    return model, loss


def loss_and_grads(model, loss, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    total, metrics = loss(batch, **kwargs)
    total.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return total.detach(), metrics, grads


SETTINGS = [
    ("eagle1", {}),
    ("eagle3", {}),
    ("eagle3", {"objective": parse_objective("0.5*kl+0.5*tv", 3.0, "target", True)}),
    ("peagle", {}),
    ("peagle", {"dpace": losses.Dpace()}),
    ("dflash", {}),
    ("dflash", {"dpace": losses.Dpace(norm="all")}),
]


@pytest.mark.parametrize("kind,kwargs", SETTINGS, ids=[f"{k}-{'-'.join(kw) or 'kl'}" for k, kw in SETTINGS])
@pytest.mark.parametrize("chunked", [False, True], ids=["dense", "chunked"])
def test_packed_rows_train_as_the_samples_alone(kind, kwargs, chunked, monkeypatch):
    """The same six samples and per-sample draws, one a row (padded to 12) and packed three rows: the
    loss, every depth's sums and counts, and every gradient agree; so do the chunked attention and
    loss rows (budgets forced down), which packed rows take."""
    if chunked:
        monkeypatch.setattr("heads.attention.SCORE_BUDGET_BYTES", 4 * 2 * 4 * 30 * 3)
        monkeypatch.setattr("train.losses.rows.LOGIT_BUDGET_BYTES", 4 * 24 * 3)
    model, loss = build(kind)
    data = samples(model.config.hidden_size, model.config.vocab_size)
    seeds = [11, 22, 33, 44, 55, 66]
    alone = collate(data, "cpu", seeds=seeds)
    packed = collate(data, "cpu", seeds=seeds, per_row=PER_ROW)
    assert packed["input_ids"].shape == (3, 22) and alone["input_ids"].shape == (6, 12)
    assert packed["doc_starts"][1].tolist()[:24] == [0] * 12 + [12] * 7 + [19] * 3
    assert losses.documents(packed) == [losses.Document(0, 0, 9), losses.Document(0, 9, 5),
                                        losses.Document(1, 0, 12), losses.Document(1, 12, 7),
                                        losses.Document(1, 19, 3), losses.Document(2, 0, 10)]  # fmt: skip
    total_a, metrics_a, grads_a = loss_and_grads(model, loss, alone, **kwargs)
    total_p, metrics_p, grads_p = loss_and_grads(model, loss, packed, **kwargs)
    assert float(metrics_a.get("num_pred_0", metrics_a.get("num_valid"))) > 10  # something is trained
    torch.testing.assert_close(total_p, total_a, rtol=1e-5, atol=1e-6)
    for name in metrics_a:
        if name.startswith(("loss", "num_", "chain_", "acc_")):
            torch.testing.assert_close(
                metrics_p[name].float(), metrics_a[name].float(), rtol=1e-5, atol=1e-6, msg=name
            )
    assert grads_p.keys() == grads_a.keys() and grads_a
    for name, grad in grads_a.items():
        # equal up to float summation order: within 1e-5 of the tensor's largest entry
        torch.testing.assert_close(
            grads_p[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name
        )


def test_a_packed_sample_sees_nothing_of_its_neighbours():
    """Changing one sample changes nothing of the loss rows of the others in its packed row: each sees
    only itself (an attention or position leak between documents would show here)."""
    model, loss = build("eagle3")
    data = samples(model.config.hidden_size, model.config.vocab_size)
    seeds = list(range(6))
    before = losses.ttt_rollout(model, *map(collate(data, "cpu", seeds=seeds, per_row=PER_ROW).get,
                                            ("input_ids", "aux_hidden")), 2,
                                collate(data, "cpu", per_row=PER_ROW)["doc_starts"])  # fmt: skip
    data[3] = samples(model.config.hidden_size, model.config.vocab_size, seed=9)[3]  # row 1, 12..18
    batch = collate(data, "cpu", seeds=seeds, per_row=PER_ROW)
    after = losses.ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], 2, batch["doc_starts"])
    for step, (a, b) in enumerate(zip(before, after)):
        # step k at t reads x_{t+1+k}: the sample before's last 1+k positions read the changed one's tokens
        # (placeholders that train nothing: they predict past their sample's end)
        torch.testing.assert_close(
            a[1, : 11 - step], b[1, : 11 - step], msg=f"step {step}: the sample before"
        )
        torch.testing.assert_close(a[1, 19:22], b[1, 19:22], msg=f"step {step}: the sample after")
        assert not torch.allclose(a[1, 12:18], b[1, 12:18])
        torch.testing.assert_close(a[[0, 2]], b[[0, 2]])


def test_the_plan_packs_each_sample_once_into_rows_that_fit():
    lengths = [int(n) for n in torch.randint(20, 500, (400,), generator=torch.Generator().manual_seed(0))]
    plan = plan_epoch(lengths, 2, 2, 2, seed=3, epoch=1, pack_length=512)
    rows = [row for step in plan for rank in step for micro in rank for row in micro]
    ids = [i for row in rows for i in row]
    assert len(ids) == len(set(ids)) and len(ids) > 0.9 * len(lengths)  # the last step's rows are dropped
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    # Rows nearly full, padded as collate pads them (to each micro-batch's longest row): first fit in the
    # epoch's random order leaves 1.1% here (uniform lengths up to a row's length, the hard case), the
    # whole epoch packed longest first 0.2%
    micro = [rows for step in plan for rank in step for rows in rank]
    padding = padded_fractions(lengths, [0] * len(lengths), micro)["padding"]
    assert packed_padding(lengths, 512, 2) <= padding < packed_padding(lengths, 512, 2) + 0.015
    # one row a micro-batch: no padding at all, and the bound says so (it padded every row to 512)
    alone = [rows for step in plan_epoch(lengths, 1, 1, 1, 3, 1, 512) for rank in step for rows in rank]
    assert (
        padded_fractions(lengths, [0] * len(lengths), alone)["padding"]
        == 0
        == packed_padding(lengths, 512, 1)
    )
    assert plan == plan_epoch(lengths, 2, 2, 2, seed=3, epoch=1, pack_length=512)  # deterministic
    assert plan != plan_epoch(lengths, 2, 2, 2, seed=3, epoch=2, pack_length=512)
    # the same global batches whatever the number of processes
    one = plan_epoch(lengths, 2, 1, 4, seed=3, epoch=1, pack_length=512)
    assert [sorted(map(tuple, sum(sum(step, []), []))) for step in one] == [
        sorted(map(tuple, sum(sum(step, []), []))) for step in plan
    ]
    unpacked = plan_epoch(lengths, 2, 2, 2, seed=3, epoch=1)
    assert all(len(row) == 1 for step in unpacked for rank in step for micro in rank for row in micro)
    with pytest.raises(ValueError, match="train sample .* more than train.pack_length=400"):
        plan_epoch(lengths, 2, 2, 2, seed=3, epoch=1, pack_length=400)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "peagle", "dflash"])
@pytest.mark.parametrize("packed", [False, True], ids=["alone", "packed"])
def test_flex_attention_equals_the_chunked_attention(kind, packed, monkeypatch):
    """`train.attention=flex` (FlexAttention's block masks) computes what the chunked attention does, for
    every head kind's training forward, one sample a row and packed: the loss and every metric (forward
    only: FlexAttention has no backward on a CPU; the GPU check runs its backward)."""
    model, loss = build(kind)
    data = samples(model.config.hidden_size, model.config.vocab_size)
    batch = collate(data, "cpu", seeds=[1, 2, 3, 4, 5, 6], per_row=PER_ROW if packed else None)
    import heads.attention

    calls, flex_attend = [], heads.attention.flex_attend
    monkeypatch.setattr("heads.attention.flex_attend", lambda *a: calls.append(1) or flex_attend(*a))
    with torch.no_grad():
        total_c, metrics_c = loss(batch)
        assert not calls
        monkeypatch.setattr("heads.attention.KERNEL", "flex")
        total_f, metrics_f = loss(batch)
    # every call but a plain causal pass, one sample a row (PyTorch's fused kernel either way): EAGLE-3's
    # step 0 and P-EAGLE's depth 0, EAGLE-1's one call
    assert len(calls) == {"eagle1": 0, "eagle3": 2, "peagle": 2, "dflash": 1}[kind] + int(
        packed and kind != "dflash"
    )
    torch.testing.assert_close(total_f, total_c, rtol=1e-5, atol=1e-6)
    assert metrics_f.keys() == metrics_c.keys()
    for name, value in metrics_c.items():
        torch.testing.assert_close(metrics_f[name].float(), value.float(), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window"])
@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("kind,cod", [("eagle3", None), ("peagle", None), ("peagle", 0.6)])
@pytest.mark.parametrize("packed", [False, True], ids=["alone", "packed"])
@pytest.mark.parametrize("prompts", ["long", "short"])
def test_the_last_layer_at_trained_rows_only_trains_as_every_row(kind, cod, layers, window, packed, prompts):
    """The last layer's queries only at the rows some depth trains (keys at every row; long prompts, or
    packed, or windowed), or at every row through the fused kernel and then taken there (short prompts one
    a row), give the loss, every metric and every gradient of the same forward at all rows."""
    extra = {"mask_token_id": 3} if kind == "peagle" else {}
    config = tiny_head_config(aux_layer_ids=[1, 2], num_hidden_layers=layers, sliding_window=window, **extra)
    model = random_draft(config)
    g = torch.Generator().manual_seed(4)
    data = []
    lengths = {"long": [(40, 34), (11, 6), (16, 12), (9, 5)], "short": [(20, 3), (11, 2), (16, 4), (9, 2)]}
    for n, prompt in lengths[prompts]:
        data.append({
            "input_ids": torch.randint(0, config.vocab_size, (n,), generator=g),
            "loss_mask": torch.arange(n) >= prompt,
            "aux_hidden": torch.randn(n, 2, config.hidden_size, generator=g),
            "final_hidden": torch.randn(n, config.hidden_size, generator=g),
        })  # fmt: skip
    batch = collate(data, "cpu", seeds=[1, 2, 3, 4], per_row=[2, 2] if packed else None)
    lm_head, d2t = torch.randn(config.vocab_size, config.hidden_size, generator=g), torch.arange(24)
    starts, ids, aux = batch.get("doc_starts"), batch["input_ids"], batch["aux_hidden"]
    if cod is None:
        anchors = [None] * 3
    else:
        anchors = losses.cod_anchors(batch, 3, cod, losses.sample_generators(batch))

    def trained(_):
        if kind == "eagle3":
            return losses.ttt_loss(model, batch, 3, 0.8, lm_head, d2t, 5)
        return losses.parallel_loss(model, batch, 3, 0.8, lm_head, d2t, 5, anchors=anchors)

    def every_row(_):  # the same forward, the last layer's outputs at all T rows
        if kind == "eagle3":
            outs = losses.ttt_rollout(model, ids, aux, 3, starts)
        else:
            outs = losses.parallel_forward(model, ids, aux, anchors, starts)
        teacher = losses.batch_teacher(batch, lm_head, d2t, 5)
        return losses.depth_losses(model, KL, outs, batch, teacher, [1, 0.8, 0.64], None, anchors)

    m = losses.prediction_anchors(batch, range(3)).index_BM.shape[1]
    anchored = not fused_rows("doc_starts" in batch, window, m, batch["input_ids"].shape[1])
    assert anchored == (prompts == "long" or packed or window is not None)
    total_a, metrics_a, grads_a = loss_and_grads(model, trained, batch)
    total_r, metrics_r, grads_r = loss_and_grads(model, every_row, batch)
    assert float(metrics_r["num_pred_2"]) >= 5  # something is trained at the last depth
    torch.testing.assert_close(total_a, total_r, rtol=1e-5, atol=1e-6)
    assert metrics_a.keys() == metrics_r.keys()
    for name in metrics_r:
        torch.testing.assert_close(
            metrics_a[name].float(), metrics_r[name].float(), rtol=1e-5, atol=1e-6, msg=name
        )
    assert grads_a.keys() == grads_r.keys()
    for name, grad in grads_r.items():
        torch.testing.assert_close(
            grads_a[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name
        )
