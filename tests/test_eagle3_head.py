"""The EAGLE-3 head: decoder layer parity with explicit matmuls, RoPE parity with HF Llama, vLLM weight names,
config round trips."""

import math

import pytest
import torch
from transformers import LlamaConfig

from heads.eagle3 import Eagle3Config, Eagle3Draft
from heads.layers import apply_rope, exported_state_dict
from tests.helpers import random_draft, tiny_head_config

torch.set_num_threads(1)

# What vLLM 0.32 loads for an EAGLE-3 Llama head (embed_tokens optional; not exported):
# docs/design.md#what-vllm-loads.
VLLM_EAGLE3_WEIGHTS = {
    "fc.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
}


# ---- independent reference: explicit matmuls, one sample, fp32 ----


def ref_rms(x, w, eps):
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_rope(x_TD, positions_T, theta):
    half = x_TD.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x_TD.shape[-1])
    angle = positions_T.double()[:, None] * freqs[None, :]
    cos, sin = angle.cos().float(), angle.sin().float()
    x1, x2 = x_TD[:, :half], x_TD[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_qkv(sd, cfg, embeds_TH, hidden_TH, positions_T):
    """Per-head rotated q [N][T, D], k [G][T, D], v [G][T, D] and the residual, written out by hand."""
    p = "layers.0."
    e = ref_rms(embeds_TH, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    hn = ref_rms(hidden_TH, sd[p + "hidden_norm.weight"], cfg.rms_norm_eps)
    x = torch.cat([e, hn], dim=-1)
    d = cfg.head_dim
    q = x @ sd[p + "self_attn.q_proj.weight"].T
    k = x @ sd[p + "self_attn.k_proj.weight"].T
    v = x @ sd[p + "self_attn.v_proj.weight"].T
    qs = [
        ref_rope(q[:, n * d : (n + 1) * d], positions_T, cfg.rope_theta)
        for n in range(cfg.num_attention_heads)
    ]
    ks = [
        ref_rope(k[:, g * d : (g + 1) * d], positions_T, cfg.rope_theta)
        for g in range(cfg.num_key_value_heads)
    ]
    vs = [v[:, g * d : (g + 1) * d] for g in range(cfg.num_key_value_heads)]
    return qs, ks, vs, (hn if cfg.norm_before_residual else hidden_TH)


def ref_attend(cfg, qs, ks, vs, mask_TS):
    """Dense-mask attention; query head n reads key/value head n // (N/G)."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = []
    for n, q in enumerate(qs):
        scores = q @ ks[n // group].T / math.sqrt(cfg.head_dim)
        scores = scores.masked_fill(~mask_TS, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ vs[n // group])
    return torch.cat(heads, dim=-1)


def ref_finish(sd, cfg, attn_TND, residual_TH):
    p = "layers.0."
    h = attn_TND @ sd[p + "self_attn.o_proj.weight"].T + residual_TH
    x = ref_rms(h, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate = x @ sd[p + "mlp.gate_proj.weight"].T
    up = x @ sd[p + "mlp.up_proj.weight"].T
    return h + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_decoder_layer_matches_explicit_reference(norm_before_residual, num_kv_heads):
    cfg = tiny_head_config(norm_before_residual=norm_before_residual, num_key_value_heads=num_kv_heads)
    model = random_draft(cfg)
    sd = model.state_dict()
    b, t = 2, 12
    input_ids_BT = torch.randint(0, cfg.vocab_size, (b, t))
    aux_BTAH = torch.randn(b, t, cfg.num_aux, cfg.hidden_size)
    positions_BT = torch.stack([torch.arange(t), torch.arange(t) + 5])  # rows start at different positions
    with torch.no_grad():
        hidden_BTH = model.combine_aux(aux_BTAH)
        out_BTH = model(input_ids_BT, hidden_BTH, positions_BT)
        logits_BTVd = model.logits(out_BTH)
    causal_TT = torch.ones(t, t, dtype=torch.bool).tril()
    for i in range(b):
        hidden = aux_BTAH[i].flatten(-2) @ sd["fc.weight"].T  # aux concatenated in ascending layer order
        embeds = sd["embed_tokens.weight"][input_ids_BT[i]]
        qs, ks, vs, residual = ref_qkv(sd, cfg, embeds, hidden, positions_BT[i])
        ref_out = ref_finish(sd, cfg, ref_attend(cfg, qs, ks, vs, causal_TT), residual)
        ref_logits = ref_rms(ref_out, sd["norm.weight"], cfg.rms_norm_eps) @ sd["lm_head.weight"].T
        torch.testing.assert_close(out_BTH[i], ref_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits_BTVd[i], ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm_before_fc,fc_norm", [(True, False), (False, True), (True, True)])
def test_fc_norms_match_explicit_reference(norm_before_fc, fc_norm):
    """vLLM's combine_hidden_states: input_norm over the A*H concatenation, then one norm per aux state,
    then fc - for the aux states and for P-EAGLE's mask_hidden alike; weights under vLLM's names."""
    cfg = tiny_head_config(norm_before_fc=norm_before_fc, fc_norm=fc_norm, mask_token_id=3)
    model = random_draft(cfg)
    sd = model.state_dict()
    expected_names = {"input_norm.weight"} if norm_before_fc else set()
    expected_names |= {f"fc_norm.{i}.weight" for i in range(3)} if fc_norm else set()
    assert {k for k in sd if k.startswith(("input_norm", "fc_norm"))} == expected_names
    aux_BTAH = torch.randn(2, 5, cfg.num_aux, cfg.hidden_size) * 7

    def reference(x):
        if norm_before_fc:
            x = ref_rms(x, sd["input_norm.weight"], cfg.rms_norm_eps)
        if fc_norm:
            chunks = x.split(cfg.hidden_size, dim=-1)
            x = torch.cat(
                [ref_rms(c, sd[f"fc_norm.{i}.weight"], cfg.rms_norm_eps) for i, c in enumerate(chunks)], -1
            )
        return x @ sd["fc.weight"].T

    with torch.no_grad():
        torch.testing.assert_close(
            model.combine_aux(aux_BTAH), reference(aux_BTAH.flatten(-2)), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(model.mask_state()[0], reference(sd["mask_hidden"]), rtol=1e-5, atol=1e-5)
        # The norms are real: the output does not scale with the aux states any more.
        torch.testing.assert_close(
            model.combine_aux(aux_BTAH * 3), model.combine_aux(aux_BTAH), rtol=1e-4, atol=1e-4
        )


def test_norm_output_carries_the_post_norm_state():
    """vLLM's `aux_output`: a chain's next step reads norm(out) with norm_output, the pre-norm out without."""
    out_BTH = torch.randn(2, 3, 64) * 5
    plain, normed = random_draft(tiny_head_config()), random_draft(tiny_head_config(norm_output=True))
    with torch.no_grad():
        assert torch.equal(plain.carry(out_BTH), out_BTH)
        w = normed.state_dict()["norm.weight"]
        torch.testing.assert_close(normed.carry(out_BTH), ref_rms(out_BTH, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_embedding_goes_first_in_the_attention_input():
    """Layer 0's queries are q_proj(cat(input_layernorm(embedding), hidden_norm(hidden))), rotated at their
    positions: the values of the explicit reference, which the swapped order does not give."""
    cfg = tiny_head_config()
    model = random_draft(cfg)
    sd = model.state_dict()
    ids_BT = torch.randint(0, cfg.vocab_size, (1, 6))
    hidden_BTH = torch.randn(1, 6, cfg.hidden_size)
    positions_BT = torch.arange(6)[None] + 9
    cos, sin = model.rope(positions_BT)
    layer = model.layer
    with torch.no_grad():
        q_ok = layer.project(model.embed(ids_BT), hidden_BTH, cos, sin)[0]
        x_swapped = torch.cat([layer.hidden_norm(hidden_BTH), layer.input_layernorm(model.embed(ids_BT))], -1)
        q_swapped = layer.self_attn.project(x_swapped, cos, sin)[0]
    embeds_TH = sd["embed_tokens.weight"][ids_BT[0]]
    reference_NTD = torch.stack(ref_qkv(sd, cfg, embeds_TH, hidden_BTH[0], positions_BT[0])[0])
    torch.testing.assert_close(q_ok[0], reference_NTD, rtol=1e-4, atol=1e-4)
    assert (q_swapped[0] - reference_NTD).abs().max() > 0.1


def test_rope_rotates_each_pair_by_position_times_its_frequency():
    """head_dim 4, theta 100: frequencies 100^0 = 1 and 100^(-2/4) = 0.1, rotating the pairs of dims (0, 2)
    and (1, 3) (rotate_half's layout: HF's and vLLM's neox style). The values are written out here."""
    cfg = tiny_head_config(num_attention_heads=1, num_key_value_heads=1, head_dim=4, rope_theta=100.0)
    model = Eagle3Draft(cfg)
    assert model.inv_freq.tolist() == pytest.approx([1.0, 0.1])
    positions = [0, 1, 5, 100]
    cos, sin = model.rope(torch.tensor([positions]))
    x_BNTD = torch.tensor([1.0, 2.0, 3.0, 4.0]).expand(1, 1, len(positions), 4)
    rotated_TD = apply_rope(x_BNTD, cos, sin)[0, 0]
    assert rotated_TD[0].tolist() == [1.0, 2.0, 3.0, 4.0]  # position 0: no rotation
    for row, p in zip(rotated_TD, positions):
        a, b = p * 1.0, p * 0.1  # the angle of each pair
        expected = [
            1 * math.cos(a) - 3 * math.sin(a),
            2 * math.cos(b) - 4 * math.sin(b),
            3 * math.cos(a) + 1 * math.sin(a),
            4 * math.cos(b) + 2 * math.sin(b),
        ]
        assert row.tolist() == pytest.approx(expected, abs=1e-5), p
    # What attention relies on: a query-key score depends on the distance between their positions only.
    q_BNTD, k_BNTD = torch.randn(2, 1, 1, 1, 4)

    def score(q_position, k_position):
        q_cos, q_sin = model.rope(torch.tensor([[q_position]]))
        k_cos, k_sin = model.rope(torch.tensor([[k_position]]))
        return float((apply_rope(q_BNTD, q_cos, q_sin) * apply_rope(k_BNTD, k_cos, k_sin)).sum())

    assert score(7, 3) == pytest.approx(score(57, 53), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_matches_hf_llama(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=16,
        max_position_embeddings=4096,
        rope_parameters={**(rope or {}), "rope_theta": 500000.0},
    )
    cfg = Eagle3Config.from_target_config(hf, [1], 32, vocab_size=40)
    assert cfg.rope_scaling == (None if rope is None else rope)
    model = Eagle3Draft(cfg)
    positions_BT = torch.tensor([[0, 1, 7, 100, 2000, 4000]])
    q_BNTD = torch.randn(1, 4, 6, 16)
    cos, sin = model.rope(positions_BT)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(q_BNTD, positions_BT)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        apply_rope(q_BNTD, cos, sin), apply_rotary_pos_emb(q_BNTD, q_BNTD, hf_cos, hf_sin)[0]
    )


def test_weight_names_are_what_vllm_loads():
    cfg = tiny_head_config()
    model = Eagle3Draft(cfg)
    assert set(model.state_dict()) == VLLM_EAGLE3_WEIGHTS | {"embed_tokens.weight"}
    exported = exported_state_dict(model)
    assert set(exported) == VLLM_EAGLE3_WEIGHTS
    h = cfg.hidden_size
    assert exported["fc.weight"].shape == (h, cfg.num_aux * h)
    assert exported["lm_head.weight"].shape == (cfg.draft_vocab_size, h)
    assert exported["layers.0.self_attn.q_proj.weight"].shape == (
        cfg.num_attention_heads * cfg.head_dim,
        2 * h,
    )
    assert exported["layers.0.self_attn.k_proj.weight"].shape == (
        cfg.num_key_value_heads * cfg.head_dim,
        2 * h,
    )
    assert not model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "embed_tokens.weight")


def test_target_embedding_is_loaded_and_shape_checked():
    model = Eagle3Draft(tiny_head_config())
    weight = torch.randn(40, 64)
    model.load_target_embedding(weight)
    assert torch.equal(model.embed_tokens.weight, weight)
    with pytest.raises(ValueError, match="does not match"):
        model.load_target_embedding(torch.randn(41, 64))


def test_config_from_target_and_round_trip():
    hf = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=40,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=5e5,
    )
    cfg = Eagle3Config.from_target_config(hf, [1, 2, 3], draft_vocab_size=24, norm_before_residual=True)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (64, 16, 2, 40)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings) == (
        1e-5,
        5e5,
        None,
        256,
    )
    assert cfg.norm_before_residual and cfg.draft_vocab_size == 24
    assert Eagle3Config.from_dict(cfg.to_dict()) == cfg
    # A draft vocabulary at least as big as the target's means no pruning, as in artifacts/vocab.py.
    assert Eagle3Config.from_target_config(hf, [1], 32000).draft_vocab_size == 40


def test_bad_configs_fail_clearly():
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, vocab_size=40)
    with pytest.raises(ValueError, match="must equal the target"):
        Eagle3Config.from_target_config(hf, [1], 24, hidden_size=128)
    with pytest.raises(ValueError, match="unknown"):
        Eagle3Config.from_target_config(hf, [1], 24, hidden_sise=64)
    with pytest.raises(ValueError, match="ascending"):
        tiny_head_config(aux_layer_ids=[3, 1])
    with pytest.raises(ValueError, match="multiple"):
        tiny_head_config(num_key_value_heads=3)
    with pytest.raises(NotImplementedError, match="yarn"):
        tiny_head_config(rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="unknown"):
        Eagle3Config.from_dict({**tiny_head_config().to_dict(), "bogus": 1})


def test_qwen3_target_config_composes_and_trains():
    # Qwen3 targets (q/k norms, explicit head_dim) get the Llama-style EAGLE-3 layer vLLM serves for them.
    from transformers import Qwen3Config

    from train.losses import ttt_loss

    target = Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=1e6,
    )  # fmt: skip
    config = Eagle3Config.from_target_config(target, aux_layer_ids=[1, 3, 4], draft_vocab_size=200)
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (32, 2, 1e6)
    draft = random_draft(config)
    torch.manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 300, (2, 16)),
        "loss_mask": torch.ones(2, 16, dtype=torch.bool),
        "aux_hidden": torch.randn(2, 16, 3, 64),
        "final_hidden": torch.randn(2, 16, 64),
    }
    loss, _ = ttt_loss(draft, batch, 3, 0.8, torch.randn(300, 64), torch.arange(200), 64)
    loss.backward()
    assert torch.isfinite(loss) and draft.fc.weight.grad.abs().sum() > 0
