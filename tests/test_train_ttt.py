"""TTT for the EAGLE-3 head: attention and rollout against a dense-mask reference, teacher, validity, loss,
gradient flow, acceptance estimate and a small overfit run."""

import math
import time

import pytest
import torch

from heads.acceptance import chain_counts, conditional_accuracies, expected_acceptance_length
from heads.attention import attention, causal_attention
from heads.eagle3 import Eagle3Config, Eagle3Draft
from tests.helpers import random_draft, tiny_head_config
from train.losses import (
    step_loss,
    step_valid_mask,
    teacher_probs,
    ttt_loss,
    ttt_rollout,
)

torch.set_num_threads(1)


def tiny_config(**overrides) -> Eagle3Config:
    return tiny_head_config(**{"aux_layer_ids": [1, 2], **overrides})


def ttt_dense_mask(t: int, step: int) -> torch.Tensor:
    """[T, (step+1)*T] bool over keys ordered (step j, position s): query (step, t) sees step 0 at s <= t and
    steps 1..step at s == t. Built entry by entry, the way docs/design.md#training-time-test states it."""
    mask = torch.zeros(t, (step + 1) * t, dtype=torch.bool)
    for q in range(t):
        for j in range(step + 1):
            for s in range(t):
                mask[q, j * t + s] = (j == 0 and s <= q) or (j >= 1 and s == q)
    return mask


def dense_attention(q_BNTD, k_BGSD, v_BGSD, mask_TS):
    group = q_BNTD.shape[1] // k_BGSD.shape[1]
    k_BNSD = k_BGSD.repeat_interleave(group, dim=1)
    v_BNSD = v_BGSD.repeat_interleave(group, dim=1)
    scores = q_BNTD @ k_BNSD.transpose(-1, -2) / math.sqrt(q_BNTD.shape[-1])
    return torch.softmax(scores.masked_fill(~mask_TS, float("-inf")), dim=-1) @ v_BNSD


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_the_one_attention_with_earlier_steps_matches_dense_mask(num_kv_heads):
    torch.manual_seed(0)
    b, n, t, d, num_steps = 2, 4, 7, 8, 4  # steps 0..3: up to three diagonal keys
    qs = [torch.randn(b, n, t, d) for _ in range(num_steps)]
    ks = [torch.randn(b, num_kv_heads, t, d) for _ in range(num_steps)]
    vs = [torch.randn(b, num_kv_heads, t, d) for _ in range(num_steps)]
    for step in range(num_steps):
        if step == 0:
            out = attention(qs[0], ks[0], vs[0])
        else:
            diag_k = torch.stack(ks[1 : step + 1], dim=3)
            diag_v = torch.stack(vs[1 : step + 1], dim=3)
            out = attention(qs[step], ks[0], vs[0], extra_k_BGTJD=diag_k, extra_v_BGTJD=diag_v)
        ref = dense_attention(
            qs[step],
            torch.cat(ks[: step + 1], dim=2),
            torch.cat(vs[: step + 1], dim=2),
            ttt_dense_mask(t, step),
        )
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        if step == 0:  # the plain causal pass's fused kernel computes the same function
            torch.testing.assert_close(causal_attention(qs[0], ks[0], vs[0]), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [2, 3, 5])
def test_a_sliding_window_sees_a_querys_own_position_and_the_window_before_it(window):
    """vLLM's window: the query at position p sees keys p - window + 1 .. p; a drafting step j at anchor t
    stands at t + j, so it sees the sequence from t + j - window + 1 and its own earlier steps."""
    from heads.attention import KVCache, attend

    torch.manual_seed(0)
    b, n, g, t, d = 1, 4, 2, 9, 8
    q, k, v = torch.randn(b, n, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    rows, cols = torch.arange(t)[:, None], torch.arange(t)[None]
    in_window = (cols <= rows) & (cols > rows - window)
    torch.testing.assert_close(attend(q, k, v, None, window=window), dense_attention(q, k, v, in_window))
    cache = KVCache(1, steps=True)
    cache.layers[0].attend(q, k, v, None, window)
    q1, k1, v1 = torch.randn(b, n, t, d), torch.randn(b, g, t, d), torch.randn(b, g, t, d)
    out = cache.layers[0].attend(q1, k1, v1, None, window)
    # step 1 at anchor a: sequence keys a - window + 2 .. a, then its own key (position a + 1)
    mask = torch.cat([(cols <= rows) & (cols > rows + 1 - window), torch.eye(t, dtype=torch.bool)], dim=1)
    both_k, both_v = torch.cat([k, k1], dim=2), torch.cat([v, v1], dim=2)
    torch.testing.assert_close(out, dense_attention(q1, both_k, both_v, mask), rtol=1e-5, atol=1e-5)


def dense_rollout(model: Eagle3Draft, input_ids_T, aux_TAH, num_steps):
    """Reference rollout for one unpadded sample: every step's keys kept in one list, a dense mask."""
    layer, t = model.layer, input_ids_T.shape[0]
    hidden = model.combine_aux(aux_TAH[None])
    keys, values, outs = [], [], []
    for step in range(num_steps):
        ids = torch.tensor([input_ids_T[s + 1 + step] if s + 1 + step < t else 0 for s in range(t)])
        cos, sin = model.rope(torch.tensor([[s + step for s in range(t)]]))
        q, k, v, residual = layer.project(model.embed(ids[None]), hidden, cos, sin)
        keys.append(k)
        values.append(v)
        attn = dense_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), ttt_dense_mask(t, step))
        out = layer.finish(attn, residual)
        outs.append(out[0])
        hidden = model.norm(out) if model.config.norm_output else out  # vLLM's aux_output
    return outs


@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "norm_before_fc": True, "fc_norm": True}])
def test_rollout_matches_dense_reference_on_a_right_padded_batch(flags):
    cfg = tiny_config(num_key_value_heads=2, **flags)
    model = random_draft(cfg)
    torch.manual_seed(1)
    t, lengths, num_steps = 10, [10, 6], 4
    input_ids_BT = torch.randint(0, cfg.vocab_size, (2, t))
    aux_BTAH = torch.randn(2, t, cfg.num_aux, cfg.hidden_size)
    # Garbage in the padding: it must not change a single real position.
    input_ids_BT[1, lengths[1] :] = 39
    aux_BTAH[1, lengths[1] :] = 100.0
    with torch.no_grad():
        outs = ttt_rollout(model, input_ids_BT, aux_BTAH, num_steps)
        for i, length in enumerate(lengths):
            refs = dense_rollout(model, input_ids_BT[i, :length], aux_BTAH[i, :length], num_steps)
            for step in range(num_steps):
                # Positions whose token input x_{t+1+step} is real; later ones read a placeholder id.
                real = length - 1 - step
                torch.testing.assert_close(outs[step][i, :real], refs[step][:real], rtol=1e-4, atol=1e-4)


def test_teacher_is_restricted_renormalised_and_chunk_independent():
    torch.manual_seed(0)
    b, t, h, v = 2, 5, 16, 12
    final_BTH = torch.randn(b, t, h)
    lm_head_VH = torch.randn(v, h)
    draft_to_target = torch.tensor([0, 2, 3, 7, 11])
    probs, in_draft = teacher_probs(final_BTH, lm_head_VH, draft_to_target, chunk_size=10_000)
    probs3, in_draft3 = teacher_probs(final_BTH, lm_head_VH, draft_to_target, chunk_size=3)
    assert probs.dtype == torch.float32 and probs.shape == (b, t, 5)
    torch.testing.assert_close(probs3, probs)
    assert torch.equal(in_draft3, in_draft)
    logits = final_BTH @ lm_head_VH.T
    ref = torch.exp(logits[..., draft_to_target]) / torch.exp(logits[..., draft_to_target]).sum(
        -1, keepdim=True
    )
    torch.testing.assert_close(probs, ref)
    ref_in_draft = torch.isin(logits.argmax(-1), draft_to_target)
    assert torch.equal(in_draft, ref_in_draft) and 0 < int(in_draft.sum()) < b * t


def test_teacher_flags_an_argmax_outside_the_draft_vocab():
    lm_head_VH = torch.eye(4)  # logits = the hidden state itself
    final_BTH = torch.tensor([[[0.0, 5.0, 1.0, 0.0], [0.0, 1.0, 2.0, 0.0]]])
    probs, in_draft = teacher_probs(final_BTH, lm_head_VH, torch.tensor([0, 2]), chunk_size=1)
    assert in_draft.tolist() == [[False, True]]  # argmax 1 is not a draft token; argmax 2 is
    torch.testing.assert_close(probs[0, 0], torch.softmax(torch.tensor([0.0, 1.0]), -1))


def test_valid_positions_by_hand():
    #                 t: 0  1  2  3  4  5  6  7
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    in_draft = torch.tensor([[1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    attention = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    # Step 0 at t: loss_mask[t+2] & in_draft[t+1] & real[t+2]; t+2 < 8.
    # t=0: lm[2]=1, in[1]=1 -> 1. t=1: lm[3]=1, in[2]=1 -> 1. t=2: lm[4]=1, in[3]=0 -> 0 (argmax outside).
    # t=3: lm[5]=1, in[4]=1 -> 1. t=4: lm[6]=0 -> 0. t=5: lm[7]=1 but pad -> 0. t=6, 7: past the end.
    assert step_valid_mask(loss_mask, in_draft, 0, attention).int().tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert step_valid_mask(loss_mask, in_draft, 0).int().tolist() == [[1, 1, 0, 1, 0, 1, 0, 0]]
    # Step 1 at t: loss_mask[t+3] & in_draft[t+2]. t=0: lm[3], in[2] -> 1. t=1: in[3]=0 -> 0. t=2: lm[5], in[4]
    # -> 1. t=3: lm[6]=0. t=4: pad. t>=5: past the end.
    assert step_valid_mask(loss_mask, in_draft, 1, attention).int().tolist() == [[1, 0, 1, 0, 0, 0, 0, 0]]


def test_step_loss_and_accuracy_by_hand():
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [1.0, 0.0, 0.0], [5.0, 0.0, 0.0]]])
    teacher = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    valid = torch.tensor([[True, True, False]])  # the third position would be a huge loss: it must not count
    loss, correct, num_valid = step_loss(logits, teacher, valid)
    # Position 0: log-softmax = [log 1/4, log 1/4, log 2/4]; CE = -(0.5 log 1/4 + 0.5 log 1/2) = 1.5 log 2.
    # Position 1: CE = -log(e / (e + 2)). Mean of the two.
    expected = (1.5 * math.log(2.0) - math.log(math.e / (math.e + 2))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # argmax: draft [2, 0, 0], teacher [1 (first of a tie), 0, 1]: position 1 right, 0 wrong, 2 not valid.
    assert correct.tolist() == [[False, True, False]] and int(num_valid) == 2


def test_acceptance_estimate_by_hand():
    # Four chains (positions), three depths. Depth 0: 3 of 4 right. Depth 1 among those 3: 2 right.
    # Depth 2 among those 2: chain 0 right, chain 1 not eligible (end of the answer).
    correct = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 1], [1, 0, 0, 1]], dtype=torch.bool)[:, None, :]
    eligible = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)[:, None, :]
    hits, totals = chain_counts(correct, eligible)
    assert hits.tolist() == [3, 2, 1] and totals.tolist() == [4, 3, 1]
    accs = conditional_accuracies(hits, totals)
    assert accs == pytest.approx([0.75, 2 / 3, 1.0])
    assert expected_acceptance_length(accs) == pytest.approx(1 + 0.75 + 0.5 + 0.5)
    assert conditional_accuracies(torch.tensor([0]), torch.tensor([0])) == [0.0]


def random_batch(cfg: Eagle3Config, b: int, t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "loss_mask": torch.ones(b, t, dtype=torch.bool),
        "aux_hidden": torch.randn(b, t, cfg.num_aux, cfg.hidden_size, generator=g).to(torch.bfloat16),
        "final_hidden": torch.randn(b, t, cfg.hidden_size, generator=g).to(torch.bfloat16),
    }


def test_gradient_flows_through_the_fed_back_hidden_state():
    cfg = tiny_config()
    model = random_draft(cfg)
    batch = random_batch(cfg, 1, 8, seed=0)
    probs, in_draft = teacher_probs(batch["final_hidden"], torch.randn(40, 64), torch.arange(24), 64)
    outs = ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], 2)
    outs[0].retain_grad()
    valid = step_valid_mask(batch["loss_mask"], torch.ones_like(in_draft), 1)
    loss_1, _, _ = step_loss(model.logits(outs[1][:, :6]), probs[:, 2:], valid[:, :6])  # teacher at t + 2
    loss_1.backward()
    # Step 1 reads step 0's output only as its fed-back hidden state, so this gradient is that path alone.
    assert outs[0].grad is not None and outs[0].grad.abs().sum() > 0
    assert model.fc.weight.grad.abs().sum() > 0
    assert model.embed_tokens.weight.grad is None


def test_ttt_loss_aligns_teacher_with_tokens_and_weights_steps():
    cfg = tiny_config()
    model = random_draft(cfg)
    t, num_steps = 12, 3
    batch = random_batch(cfg, 2, t, seed=1)
    batch["loss_mask"][0, 3] = False
    batch["attention_mask"] = torch.ones(2, t, dtype=torch.bool)
    batch["attention_mask"][1, 8:] = False
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size)
    # A pruned vocabulary: the even ids and four odd ones (24 of 40).
    draft_to_target = torch.unique(
        torch.cat([torch.arange(0, cfg.vocab_size, 2), torch.tensor([1, 3, 5, 7])])
    )
    training_total, training = ttt_loss(model, batch, num_steps, 0.8, lm_head, draft_to_target, chunk_size=5)
    with torch.no_grad():  # held-out evaluation: the temperature-1 estimates too (training computes none)
        total, metrics = ttt_loss(model, batch, num_steps, 0.8, lm_head, draft_to_target, chunk_size=5)
    assert not any(key.startswith(("greedy_t1", "sampled_t1")) for key in training)
    torch.testing.assert_close(training_total.detach(), total)
    # Expected by explicit indexing: step k at t predicts x_{t+2+k}, teacher = target distribution at t+1+k.
    logits_full = (batch["final_hidden"].float() @ lm_head.T).float()
    with torch.no_grad():
        outs = ttt_rollout(model, batch["input_ids"], batch["aux_hidden"], num_steps)
    for k in range(num_steps):
        logprobs = torch.log_softmax(model.logits(outs[k]).detach().float(), -1)
        ces, greedy, sampled, predictions = [], [], [], 0
        for i in range(2):
            for pos in range(t):
                target_pos, predicted = pos + 1 + k, pos + 2 + k
                if predicted >= t or not (
                    batch["loss_mask"][i, predicted] and batch["attention_mask"][i, predicted]
                ):
                    continue
                predictions += 1  # a prediction; a loss only where the target's argmax is a draft token
                if logits_full[i, target_pos].argmax() not in draft_to_target:
                    continue
                teacher = torch.softmax(logits_full[i, target_pos, draft_to_target], -1)
                ces.append(-(teacher * logprobs[i, pos]).sum())
                # At temperature 1 the target's full-vocabulary probabilities of the draft tokens decide.
                p_draft = torch.softmax(logits_full[i, target_pos], -1)[draft_to_target]
                greedy.append(p_draft[logprobs[i, pos].argmax()])
                sampled.append(torch.minimum(p_draft, logprobs[i, pos].exp()).sum())
        assert int(metrics[f"num_valid_{k}"]) == len(ces) > 0 and int(metrics[f"num_pred_{k}"]) == predictions
        assert predictions > len(ces)  # some targets outside the pruned vocabulary: they count, with loss 0
        expected = torch.stack(ces).sum() / predictions
        torch.testing.assert_close(metrics[f"loss_{k}"], expected, rtol=1e-3, atol=1e-3)
        if k == 0:  # depth 0's chain is every prediction: the sums of the per-row estimates
            torch.testing.assert_close(
                metrics["greedy_t1_hits_0"], torch.stack(greedy).sum(), rtol=1e-4, atol=1e-5
            )
            torch.testing.assert_close(
                metrics["sampled_t1_hits_0"], torch.stack(sampled).sum(), rtol=1e-4, atol=1e-5
            )
            assert float(metrics["greedy_t1_total_0"]) == predictions
            assert (
                0 < metrics["greedy_t1_hits_0"] < predictions
                and 0 < metrics["sampled_t1_hits_0"] < predictions
            )
    weighted = sum(0.8**k * metrics[f"loss_{k}"] for k in range(num_steps))
    torch.testing.assert_close(total.detach(), weighted)
    names = ("loss", "acc", "num_valid", "chain_hits", "chain_total", "greedy_t1_hits", "sampled_t1_total")
    assert all(f"{name}_{k}" in metrics for name in names for k in range(num_steps))
    with pytest.raises(ValueError, match="num_steps"):
        ttt_loss(model, batch, 0, 0.8, lm_head, draft_to_target, 5)
    with pytest.raises(ValueError, match="chunk_size"):
        ttt_loss(model, batch, 1, 0.8, lm_head, draft_to_target, 0)


def test_small_head_overfits_a_few_samples():
    """Random "target" data, pruned vocabulary, two TTT steps: both depths learn to agree with the teacher."""
    cfg = tiny_config(vocab_size=32, draft_vocab_size=24)
    model = random_draft(cfg, seed=0)
    batch = random_batch(cfg, 4, 32, seed=2)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    draft_to_target = torch.arange(24) + torch.tensor([0] * 16 + [8] * 8)  # ids 0..15 and 24..31
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    start = time.perf_counter()
    for step in range(300):
        total, metrics = ttt_loss(model, batch, 2, 0.8, lm_head, draft_to_target, chunk_size=16)
        if step == 0:
            first_loss = total.item()
        if metrics["acc_0"] >= 0.95 and metrics["acc_1"] >= 0.95:
            break
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    assert metrics["num_valid_0"] > 60
    assert metrics["acc_0"] >= 0.9 and metrics["acc_1"] >= 0.9, metrics
    assert total.item() < 0.3 * first_loss
    assert time.perf_counter() - start < 30
