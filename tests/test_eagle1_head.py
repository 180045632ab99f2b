"""The EAGLE-1 head and loss: layer parity with explicit matmuls, vLLM weight names, the loss's alignment on
a hand-computed example, chunking, noise, and a tiny overfit."""

import math

import pytest
import torch
from transformers import LlamaConfig

from heads.eagle1 import Eagle1Config, Eagle1Draft
from heads.layers import exported_state_dict
from train.losses import add_feature_noise, eagle1_loss

torch.set_num_threads(1)

# What vLLM 0.32 loads for an EAGLE-1 Llama head (no input_layernorm, norm or lm_head):
# docs/design.md#what-vllm-loads.
VLLM_EAGLE1_WEIGHTS = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}


def tiny_config(**overrides) -> Eagle1Config:
    values = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=40,
        rope_theta=1000.0,
        max_position_embeddings=128,
    )
    return Eagle1Config(**{**values, **overrides})


def random_draft(config: Eagle1Config, seed: int = 0) -> Eagle1Draft:
    """A head with every weight random, norm weight included (ones would hide a misplaced norm)."""
    torch.manual_seed(seed)
    model = Eagle1Draft(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 1 / math.sqrt(param.shape[-1]))
    return model


# ---- independent reference: explicit matmuls, one sample, dense causal mask ----


def ref_rope(x_TD, positions_T, theta):
    half = x_TD.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x_TD.shape[-1])
    angle = positions_T.double()[:, None] * freqs[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x_TD[:, :half], x_TD[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_forward(sd, cfg, ids_T, features_TH, positions_T):
    """vLLM's EAGLE-1 forward written out: fc(cat(emb, f)); identity input norm; attention; fused
    add + post_attention_layernorm; SwiGLU; final residual add."""
    p = "layers.0."
    x = torch.cat([sd["embed_tokens.weight"][ids_T], features_TH], dim=-1) @ sd["fc.weight"].T
    t, d = x.shape[0], cfg.head_dim
    mask = torch.full((t, t), float("-inf")).triu(1)  # dense causal mask
    q, k, v = (x @ sd[p + f"self_attn.{n}_proj.weight"].T for n in "qkv")
    per_kv = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = []
    for n in range(cfg.num_attention_heads):
        g = n // per_kv
        qn = ref_rope(q[:, n * d : (n + 1) * d], positions_T, cfg.rope_theta)
        kg = ref_rope(k[:, g * d : (g + 1) * d], positions_T, cfg.rope_theta)
        scores = qn @ kg.T / math.sqrt(d) + mask
        heads.append(torch.softmax(scores, dim=-1) @ v[:, g * d : (g + 1) * d])
    residual = x + torch.cat(heads, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
    w = sd[p + "post_attention_layernorm.weight"]
    normed = w * residual / torch.sqrt((residual * residual).mean(-1, keepdim=True) + cfg.rms_norm_eps)
    gate = normed @ sd[p + "mlp.gate_proj.weight"].T
    up = normed @ sd[p + "mlp.up_proj.weight"].T
    mlp = (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return residual + mlp


def test_forward_matches_explicit_reference():
    cfg = tiny_config()
    model = random_draft(cfg)
    torch.manual_seed(1)
    ids_BT = torch.randint(0, cfg.vocab_size, (2, 7))
    features_BTH = torch.randn(2, 7, cfg.hidden_size)
    positions_BT = torch.stack([torch.arange(7), torch.arange(3, 10)])  # an offset row checks RoPE
    out_BTH = model(ids_BT, features_BTH, positions_BT)
    sd = model.state_dict()
    for b in range(2):
        expected = ref_forward(sd, cfg, ids_BT[b], features_BTH[b], positions_BT[b])
        torch.testing.assert_close(out_BTH[b], expected, rtol=1e-4, atol=1e-5)


def test_embedding_comes_first_in_fc():
    cfg = tiny_config()
    model = random_draft(cfg)
    with torch.no_grad():
        model.fc.weight[:, cfg.hidden_size :] = 0  # fc now reads only its first half
    ids_BT = torch.randint(0, cfg.vocab_size, (1, 5))
    a = model(ids_BT, torch.randn(1, 5, cfg.hidden_size), torch.arange(5)[None])
    b = model(ids_BT, torch.randn(1, 5, cfg.hidden_size), torch.arange(5)[None])
    torch.testing.assert_close(a, b)  # the features were in the ignored second half


def test_vllm_weight_names():
    model = Eagle1Draft(tiny_config())
    assert set(model.state_dict()) == VLLM_EAGLE1_WEIGHTS | {"embed_tokens.weight"}
    exported = exported_state_dict(model)
    assert set(exported) == VLLM_EAGLE1_WEIGHTS
    assert tuple(exported["fc.weight"].shape) == (32, 64)
    assert not model.embed_tokens.weight.requires_grad


def test_config_from_target_and_round_trip():
    target = LlamaConfig(
        hidden_size=32,
        intermediate_size=80,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    cfg = Eagle1Config.from_target_config(target, intermediate_size=48)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.intermediate_size) == (8, 2, 48)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope_scaling) == (1e-5, 256, None)
    assert Eagle1Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="hidden_size"):
        Eagle1Config.from_target_config(target, hidden_size=64)
    with pytest.raises(ValueError, match="unknown"):
        Eagle1Config.from_target_config(target, draft_vocab_size=8)
    with pytest.raises(ValueError, match="multiple"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(NotImplementedError, match="yarn"):
        tiny_config(rope_scaling={"rope_type": "yarn", "factor": 2.0})


# ---- the loss ----


def identity_draft() -> Eagle1Draft:
    """H=2, V=3: o_proj and down_proj zero and fc = [0 | I], so f_pred_t = (noisy) f_t exactly."""
    model = Eagle1Draft(
        Eagle1Config(
            hidden_size=2,
            intermediate_size=2,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
            vocab_size=3,
        )
    )
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
        model.layer.self_attn.o_proj.weight.zero_()
        model.layer.mlp.down_proj.weight.zero_()
        model.fc.weight.copy_(torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]]))
    return model


F_TH = [[0.5, -1.0], [2.0, 0.0], [1.0, 1.5], [0.0, 0.0], [-1.0, 2.0]]
LM_HEAD = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]


def hand_smooth_l1(a, b):
    return sum(0.5 * (x - y) ** 2 if abs(x - y) < 1 else abs(x - y) - 0.5 for x, y in zip(a, b)) / len(a)


def hand_soft_ce(pred, true):
    def logits(f):
        return [sum(w * x for w, x in zip(row, f)) for row in LM_HEAD]

    def softmax(z):
        exps = [math.exp(v) for v in z]
        return [e / sum(exps) for e in exps]

    teacher, student = softmax(logits(true)), softmax(logits(pred))
    return -sum(p * math.log(q) for p, q in zip(teacher, student))


def tiny_batch(**extra):
    return {
        "input_ids": torch.tensor([[0, 1, 2, 1, 0]]),
        "final_hidden": torch.tensor([F_TH]),
        **extra,
    }


@pytest.mark.parametrize(
    "loss_mask, attention_mask, pairs",
    [
        # loss_mask[t+2] picks t: x_{t+2} is the token the draft at t proposes; (t, t+1) = (f_t, f_{t+1}).
        ([0, 0, 1, 1, 1], None, [(0, 1), (1, 2), (2, 3)]),
        ([0, 0, 0, 1, 0], None, [(1, 2)]),
        ([0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [(0, 1), (1, 2)]),  # x_4 is padding: no loss at t = 2
    ],
)
def test_loss_on_hand_computed_example(loss_mask, attention_mask, pairs):
    extra = {"loss_mask": torch.tensor([loss_mask], dtype=torch.bool)}
    if attention_mask is not None:
        extra["attention_mask"] = torch.tensor([attention_mask])
    lm_head = torch.tensor(LM_HEAD)
    total, metrics = eagle1_loss(
        identity_draft(), tiny_batch(**extra), lm_head, chunk_size=2, add_noise=False
    )
    reg = sum(hand_smooth_l1(F_TH[a], F_TH[b]) for a, b in pairs) / len(pairs)
    ce = sum(hand_soft_ce(F_TH[a], F_TH[b]) for a, b in pairs) / len(pairs)
    assert metrics["num_valid"] == len(pairs)
    assert metrics["loss_regression"].item() == pytest.approx(reg, rel=1e-5)
    assert metrics["loss_ce"].item() == pytest.approx(ce, rel=1e-5)
    assert total.item() == pytest.approx(reg + 0.1 * ce, rel=1e-5)

    def argmax(f):
        return max(range(3), key=lambda v: sum(w * x for w, x in zip(LM_HEAD[v], f)))

    hits = sum(argmax(F_TH[a]) == argmax(F_TH[b]) for a, b in pairs)
    assert metrics["acc_0"].item() == pytest.approx(hits / len(pairs))


def random_batch(cfg, b=3, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    attention_mask = torch.ones(b, t, dtype=torch.long)
    attention_mask[1, t - 3 :] = 0  # right padding
    return {
        "input_ids": torch.randint(0, cfg.vocab_size, (b, t), generator=g),
        "loss_mask": torch.rand(b, t, generator=g) < 0.7,
        "final_hidden": torch.randn(b, t, cfg.hidden_size, generator=g),
        "attention_mask": attention_mask,
    }


def test_chunked_teacher_equals_unchunked():
    cfg = tiny_config()
    batch = random_batch(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) / 3
    results = []
    for chunk_size in (1, 4, 10_000):
        model = random_draft(cfg)
        total, metrics = eagle1_loss(model, batch, lm_head, chunk_size, add_noise=False)
        total.backward()
        results.append((total.detach(), metrics["acc_0"], model.fc.weight.grad.clone()))
    for total, acc, grad in results[:-1]:
        torch.testing.assert_close(total, results[-1][0])
        torch.testing.assert_close(acc, results[-1][1])
        torch.testing.assert_close(grad, results[-1][2])
    assert results[-1][2].abs().sum() > 0


def test_alpha_objectives_on_the_full_vocabulary_need_no_renormalising():
    """EAGLE-1 trains against the target's whole distribution (its mass 1): an alpha objective gives the same
    loss whichever p `train.alpha_on` names."""
    from train.objectives import parse_objective

    cfg = tiny_config()
    batch = random_batch(cfg)
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) / 3
    model = random_draft(cfg)
    objectives = [parse_objective("nla", alpha_on=on) for on in ("target", "draft_vocab")]
    totals = [eagle1_loss(model, batch, lm_head, 4, add_noise=False, objective=o)[0] for o in objectives]
    torch.testing.assert_close(totals[0], totals[1])


def test_noise_is_bounded_and_reproducible():
    features = torch.randn(4, 50, 16)
    noisy = add_feature_noise(features, 0.1, torch.Generator().manual_seed(3))
    noise = noisy - features
    assert noise.abs().max() <= 0.1 + 1e-6
    assert noise.min() < -0.08 and noise.max() > 0.08  # uniform over the whole range, both signs
    assert abs(noise.mean()) < 0.01
    torch.testing.assert_close(add_feature_noise(features, 0.1, torch.Generator().manual_seed(3)), noisy)

    # Through the loss: the identity head predicts the noisy feature, so the noise shows in the loss;
    # restoring the generator's state (a resume) replays it, with an explicit generator or the global RNG.
    model, lm_head = identity_draft(), torch.tensor(LM_HEAD)
    batch = tiny_batch(loss_mask=torch.ones(1, 5, dtype=torch.bool))
    clean, _ = eagle1_loss(model, batch, lm_head, 4, add_noise=False)
    gen = torch.Generator().manual_seed(7)
    state = gen.get_state()
    first, _ = eagle1_loss(model, batch, lm_head, 4, generator=gen)
    second, _ = eagle1_loss(model, batch, lm_head, 4, generator=gen)
    gen.set_state(state)
    replayed, _ = eagle1_loss(model, batch, lm_head, 4, generator=gen)
    assert first != clean and first != second and replayed == first
    global_state = torch.get_rng_state()
    from_global, _ = eagle1_loss(model, batch, lm_head, 4)
    torch.set_rng_state(global_state)
    assert eagle1_loss(model, batch, lm_head, 4)[0] == from_global


def test_tiny_head_overfits():
    """The recipe's loss (ce_weight 0.1, noise on) drives a tiny head to the target's argmax."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = Eagle1Draft(cfg)
    model.load_target_embedding(torch.randn(cfg.vocab_size, cfg.hidden_size))
    # A peaked teacher: near-ties in the target's argmax would make acc_0 a coin toss.
    lm_head = torch.randn(cfg.vocab_size, cfg.hidden_size) / math.sqrt(cfg.hidden_size) * 8
    batch = random_batch(cfg, b=4, t=12, seed=1)
    batch["loss_mask"] = torch.ones(4, 12, dtype=torch.bool)
    with torch.no_grad():
        _, before = eagle1_loss(model, batch, lm_head, 16, add_noise=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        total, _ = eagle1_loss(model, batch, lm_head, 16, generator=gen)
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
    with torch.no_grad():
        _, after = eagle1_loss(model, batch, lm_head, 16, add_noise=False)
    assert after["num_valid"] > 30
    assert before["acc_0"] < 0.2
    assert after["loss"] < 0.1 * before["loss"]
    assert after["acc_0"] >= 0.9, after
