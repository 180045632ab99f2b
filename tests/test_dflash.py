"""DFlash (block drafting): the block attention against a dense-mask reference written here, the training
forward against the reference decoder's rounds, losslessness, an overfit that learns every block position,
the default target layers, the export read back, and the config checks."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from artifacts.vocab import load_vocab_map
from export.to_vllm import export_head
from heads.attention import block_attention
from heads.dflash import DFlashConfig
from heads.reference_decoder import BlockDraftState, DraftHead, DraftState, speculative_generate
from target.model import default_aux_layer_ids
from tests.helpers import DFLASH, QUALITY_THREADS, random_draft, smoke_config, tiny_head_config
from train.losses import Dpace, block_forward, block_loss, loss_weights, sample_blocks, sample_generators


def tiny_dflash_config(**overrides) -> DFlashConfig:
    values = dict(
        draft_vocab_size=40, aux_layer_ids=[1, 2], num_hidden_layers=2, mask_token_id=3, block_size=4
    )
    return tiny_head_config(DFlashConfig, **{**values, **overrides})


def dense_block_attention(q_BNQD, k_BGQD, v_BGQD, ctx_k_BGSD, ctx_v_BGSD, starts_BM, causal, lengths_BM=None):
    """The reference: every block's queries against [all context keys, all blocks' keys] under one dense
    (Q x (S + Q)) mask - context positions < the block's start, its own block's keys (causally if asked;
    the first lengths[m] of block m's only, when given)."""
    b, n, q, d = q_BNQD.shape
    g, s, m = k_BGQD.shape[1], ctx_k_BGSD.shape[2], starts_BM.shape[1]
    j = q // m
    keys = torch.cat([ctx_k_BGSD, k_BGQD], 2).repeat_interleave(n // g, 1)
    values = torch.cat([ctx_v_BGSD, v_BGQD], 2).repeat_interleave(n // g, 1)
    out = torch.empty_like(q_BNQD)
    for row in range(b):
        visible = torch.zeros(q, s + q, dtype=torch.bool)
        for query in range(q):
            block, slot = divmod(query, j)
            visible[query, : int(starts_BM[row, block])] = True
            length = j if lengths_BM is None else int(lengths_BM[row, block])
            own = range(block * j, block * j + min(slot + 1 if causal else j, length))
            visible[query, [s + key for key in own]] = True
        scores = q_BNQD[row] @ keys[row].transpose(-1, -2) / math.sqrt(d)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        out[row] = probs @ values[row]
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shorter", [False, True], ids=["full", "shorter_blocks"])
def test_block_attention_equals_a_dense_mask(causal, shorter):
    torch.manual_seed(0)
    b, n, g, d, s, m, j = 2, 4, 2, 8, 11, 3, 4
    q = torch.randn(b, n, m * j, d)
    k, v = torch.randn(b, g, m * j, d), torch.randn(b, g, m * j, d)
    ctx_k, ctx_v = torch.randn(b, g, s, d), torch.randn(b, g, s, d)
    starts = torch.tensor([[1, 5, 9], [4, 0, 10]])  # a block at 0 sees no context, only itself
    lengths = torch.tensor([[2, 4, 3], [4, 3, 2]]) if shorter else None
    got = block_attention(q, k, v, ctx_k, ctx_v, starts, causal, lengths)
    want = dense_block_attention(q, k, v, ctx_k, ctx_v, starts, causal, lengths)
    # A block's slots from its length on are padding (no loss): compare the slots it has.
    real_BQ = torch.ones(b, m * j, dtype=torch.bool)
    if shorter:
        real_BQ = (torch.arange(j) < lengths[..., None]).view(b, m * j)
    torch.testing.assert_close(got.transpose(1, 2)[real_BQ], want.transpose(1, 2)[real_BQ])


def test_each_block_sees_only_the_context_before_its_anchor():
    """The batched training forward equals each block run alone on the context before it (the decoder's
    cached path): a block reads no later context and no other block."""
    draft = random_draft(tiny_dflash_config())
    aux, ids = torch.randn(1, 16, 2, 64), torch.randint(0, 40, (1, 16))
    anchors = torch.tensor([[9, 2, 5, 14]])
    out = block_forward(draft, ids, aux, anchors)
    for m, a in enumerate(anchors[0].tolist()):
        alone = block_forward(draft, ids[:, : a + 1], aux[:, : a + 1], torch.tensor([[a]]))
        torch.testing.assert_close(alone[0, 0], out[0, m], atol=1e-5, rtol=1e-5)
    aux_later = aux.clone()
    aux_later[:, 10:] += 5.0  # context at and after position 10 changes
    later = block_forward(draft, ids, aux_later, anchors)
    torch.testing.assert_close(later[0, :3], out[0, :3])  # anchors 9, 2, 5 read positions < 10 only
    assert not torch.allclose(later[0, 3], out[0, 3])


@pytest.fixture(scope="module")
def target_and_dflash(smoke_target_dir):
    """A two-layer DFlash head with random weights on the smoke target (parity, not quality)."""
    target = AutoModelForCausalLM.from_pretrained(smoke_target_dir, dtype=torch.float32).eval()
    config = DFlashConfig.from_target_config(
        AutoConfig.from_pretrained(smoke_target_dir), [1, 3, 4], 1024, num_hidden_layers=2, mask_token_id=7
    )
    draft = random_draft(config).eval().requires_grad_(False)
    draft.load_target_embedding(target.get_input_embeddings().weight)
    return target, DraftHead(draft, torch.arange(1024))


PROMPT = [5, 77, 301, 12, 9, 640, 33]


def test_block_drafting_is_lossless(target_and_dflash):
    target, head = target_and_dflash
    assert isinstance(DraftState.of(head), BlockDraftState)
    greedy = target.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
    for k in (1, 7):
        output, counts = speculative_generate(target, head, PROMPT, k, max_new_tokens=20)
        assert output == greedy[0, len(PROMPT) :].tolist()
        assert counts.num_draft_tokens == k * counts.num_drafts > 0


@pytest.mark.parametrize("k", range(1, 8))
def test_the_decoders_rounds_are_trainings_block_forward_at_every_k(target_and_dflash, k):
    """Round after round (the cache growing by the verified positions), the decoder's k drafts are the
    argmaxes of training's block of k + 1 tokens at the same anchor over the same target states - at every
    k a head of block 8 may serve (blocks of 2..8 inside training's padded 8-token blocks)."""
    _, head = target_and_dflash
    draft = head.draft
    torch.manual_seed(1)
    ids, aux = torch.randint(0, 1024, (1, 24)), torch.randn(1, 24, 3, 256)
    starts = [5, 6, 11, 19]  # the pending token's position each round: 1, 5 and 8 positions verified
    lengths = torch.full((1, len(starts)), k + 1)
    out_BMJH = block_forward(draft, ids, aux, torch.tensor([starts]), lengths)
    state, done = DraftState.of(head), 0
    for m, start in enumerate(starts):
        drafts = state.round(ids[0, :start].tolist(), int(ids[0, start]), aux[:, done:start], k)
        done = start
        assert state.length == start
        assert drafts == draft.logits(out_BMJH[0, m, 1 : k + 1]).argmax(-1).tolist()
    if k < 7:  # a full block of 8 is another block: a bidirectional slot sees the slots after it
        full = block_forward(draft, ids, aux, torch.tensor([starts]))
        assert not torch.allclose(full[0, :, 1 : k + 1], out_BMJH[0, :, 1 : k + 1], atol=1e-3)


def test_an_overfit_learns_every_block_position():
    """A fixed batch, every anchor a block: each of the K mask slots reaches full accuracy (the loss
    reaches every slot, whatever its weight)."""
    config = tiny_dflash_config(block_size=5, num_hidden_layers=1)
    draft = random_draft(config)
    torch.manual_seed(0)
    length = 24
    lm_head_VH = torch.randn(40, 64)
    batch = {
        "input_ids": torch.randint(4, 40, (2, length)),
        "loss_mask": torch.ones(2, length, dtype=torch.bool),
        "aux_hidden": torch.randn(2, length, 2, 64),
        "final_hidden": torch.randn(2, length, 64) * 3,
    }
    batch["loss_mask"][:, :4] = False  # a prompt
    weights = [math.exp(-k / 4.0) for k in range(4)]
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        blocks = sample_blocks(batch, 64, (5, 5), sample_generators(batch, generator))
        loss, _ = block_loss(draft, batch, weights, lm_head_VH, torch.arange(40), 64, blocks=blocks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    _, metrics = block_loss(draft, batch, weights, lm_head_VH, torch.arange(40), 64)
    assert [float(metrics[f"acc_{k}"]) for k in range(4)] == [1.0] * 4
    assert [int(metrics[f"num_valid_{k}"]) for k in range(4)] == [2 * (20 - k) for k in range(4)]


def test_dpace_weighs_each_prediction_by_its_blocks_reach():
    """D-PACE by hand: slot k of a block weighs sum_{j>=k} prod_{i<=j} (a + (1 - a) q_i(target's argmax)),
    over the slots that block predicts; each slot's loss stays a mean over its predictions; with
    head.dpace_norm=all the total is once over every prediction, counted over the global batch when the
    trainer passes its counts."""
    draft = random_draft(tiny_dflash_config(block_size=4))
    torch.manual_seed(1)
    length, a = 16, 0.5
    batch = {
        "input_ids": torch.randint(4, 40, (2, length)),
        "loss_mask": torch.ones(2, length, dtype=torch.bool),
        "aux_hidden": torch.randn(2, length, 2, 64),
        "final_hidden": torch.randn(2, length, 64) * 3,
    }
    batch["loss_mask"][:, :4] = False
    lm_head_VH = torch.randn(40, 64)
    blocks = sample_blocks(batch, 5, (2, 4), sample_generators(batch, torch.Generator().manual_seed(2)))

    def loss(norm, denominators=None):
        return block_loss(
            draft,
            batch,
            [1.0] * 3,
            lm_head_VH,
            torch.arange(40),
            64,
            denominators,
            blocks,
            dpace=Dpace(a, norm),
        )

    total, metrics = loss("position")
    with torch.no_grad():
        out = block_forward(
            draft, batch["input_ids"], batch["aux_hidden"], blocks.index_BM, blocks.lengths_BM
        )
        logq = torch.log_softmax(draft.logits(out).float(), -1)
        teacher = torch.softmax(batch["final_hidden"] @ lm_head_VH.T, -1)
    sums, counts = [0.0] * 3, [0] * 3
    for b in range(2):
        for m in range(blocks.index_BM.shape[1]):
            if not blocks.keep_BM[b, m]:
                continue
            anchor, block = int(blocks.index_BM[b, m]), int(blocks.lengths_BM[b, m])
            slots = [k for k in range(block - 1) if anchor + k + 1 < length]
            c = [a + (1 - a) * float(logq[b, m, k + 1, teacher[b, anchor + k].argmax()].exp()) for k in slots]
            reach = [math.prod(c[: i + 1]) for i in range(len(slots))]
            for i, k in enumerate(slots):
                ce = -float((teacher[b, anchor + k] * logq[b, m, k + 1]).sum())
                sums[k] += sum(reach[i:]) * ce
                counts[k] += 1
    assert counts[2] < counts[0]  # blocks of several lengths
    for k in range(3):
        assert float(metrics[f"loss_{k}"]) == pytest.approx(sums[k] / counts[k], rel=1e-4)
    assert float(total.detach()) == pytest.approx(sum(s / n for s, n in zip(sums, counts)), rel=1e-4)
    assert float(loss("all")[0].detach()) == pytest.approx(sum(sums) / sum(counts), rel=1e-4)
    global_counts = torch.tensor(counts, dtype=torch.float32) * torch.tensor([2.0, 3.0, 4.0])
    assert float(loss("all", global_counts)[0].detach()) == pytest.approx(
        sum(sums) / float(global_counts.sum()), rel=1e-4
    )


def test_loss_weights_decay_per_slot():
    class Head:
        kind, loss_decay, gamma, position_weights = "dflash", 4.0, 0.8, "decay"

    assert loss_weights(Head, 3) == [1.0, math.exp(-0.25), math.exp(-0.5)]
    Head.position_weights = "dpace"  # the weights are per prediction (block_loss)
    assert loss_weights(Head, 3) == [1.0] * 3
    Head.position_weights = "decay"
    Head.kind = "peagle"
    assert loss_weights(Head, 3) == [1.0, 0.8, 0.8**2]


def test_default_target_layers():
    """DFlash: five layer outputs evenly spaced over 1..L-3 (z-lab's rule), as vLLM aux ids (+1)."""
    assert default_aux_layer_ids(30, "dflash") == [2, 9, 15, 21, 28]  # SmolLM2-135M
    assert default_aux_layer_ids(36, "dflash") == [2, 10, 18, 26, 34]  # Qwen3-8B: z-lab's [1, 9, 17, 25, 33]
    assert default_aux_layer_ids(6, "dflash") == [2, 3, 4]  # de-duplicated on a shallow target
    assert default_aux_layer_ids(30, "eagle3") == default_aux_layer_ids(30, "peagle") == [2, 15, 27]


def test_config_refuses_a_block_without_mask_slots_or_mask_token():
    with pytest.raises(ValueError, match="block_size=1"):
        tiny_dflash_config(block_size=1)
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_dflash_config(mask_token_id=None)


# Export: what vLLM reads, read back; refused for another target; served by vLLM at the reference's rate.


@pytest.fixture(scope="module")
def dflash_run(smoke_run, tmp_path_factory):
    """The smoke cache plus a two-layer DFlash head trained 4 steps (shape and format, not quality)."""
    from train.main import run as train

    run_dir = tmp_path_factory.mktemp("dflash") / "run"
    shutil.copytree(smoke_run, run_dir)
    overrides = ["train.max_steps=4", "train.eval_every=0", "train.num_threads=1", *DFLASH]
    train(smoke_config(run_dir, *overrides))
    return run_dir


@pytest.mark.parametrize("fmt", ["plain", "speculators"])
def test_dflash_export_has_exactly_what_vllm_reads(dflash_run, fmt):
    target_config = smoke_target_config(dflash_run)
    out = export_head(dflash_run / "draft_head", dflash_run / fmt, target_config, "float32", fmt, "t", 4)
    config = json.loads((out / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    assert layer["model_type"] == "qwen3" and layer["num_hidden_layers"] == 2 and not layer["attention_bias"]
    assert layer["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}  # not vLLM's 1e6
    assert config["draft_vocab_size"] == 512 and config["target_hidden_size"] == 256
    if fmt == "plain":
        # The smoke cache's aux ids [1, 3, 4] are the outputs of layers 0, 2, 3.
        assert config["architectures"] == ["DFlashDraftModel"]
        assert config["dflash_config"] == {"target_layer_ids": [0, 2, 3], "mask_token_id": 5, "causal": False,
                                           "block_size": 5}  # fmt: skip
    else:  # no top-level model_type (else vLLM reads a Qwen3 model); non-causal stated (vLLM: causal = not it)
        assert "model_type" not in config and config["speculators_model_type"] == "dflash"
        assert config["aux_hidden_state_layer_ids"] == [1, 3, 4] and config["mask_token_id"] == 5
        assert config["sliding_window_non_causal"] is True and config["block_size"] == 5
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    layer = ["input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    layer += [f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
    wanted = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"}
    wanted |= {f"layers.{i}.{name}.weight" for i in range(2) for name in layer}
    wanted |= {"t2d"} if fmt == "speculators" else set()  # speculators reads it, vLLM skips it
    assert set(load_file(str(out / "model.safetensors"))) == wanted  # no embedding, no mask_hidden


@pytest.mark.parametrize("fmt", ["plain", "speculators"])
def test_dflash_export_reads_back_as_the_trained_head(dflash_run, fmt):
    from export.read_vllm import read_export
    from export.verify import export_differences
    from heads.reference_decoder import load_head

    out = export_head(
        dflash_run / "draft_head", dflash_run / "rt", smoke_target_config(dflash_run), "float32"
    )
    assert export_differences(out, dflash_run / "draft_head", "float32") == []
    target = AutoModelForCausalLM.from_pretrained(dflash_run / "smoke_target", dtype=torch.float32)
    trained = load_head(dflash_run / "draft_head", target).draft
    loaded, draft_to_target = read_export(out, target.get_input_embeddings().weight)
    assert loaded.config == trained.config
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, atol=0, rtol=0)
    vocab = load_vocab_map(dflash_run / "draft_head" / "vocab.safetensors")
    assert torch.equal(draft_to_target, vocab.draft_to_target)


def test_a_dflash_head_for_another_target_is_refused(dflash_run):
    other = smoke_target_config(dflash_run)
    other.hidden_size, other.num_hidden_layers = 512, 3
    with pytest.raises(ValueError, match=r"another target: hidden_size=256 \(target: 512\).*\[4\]"):
        export_head(dflash_run / "draft_head", dflash_run / "other", other)
    assert not (dflash_run / "other").exists()


def test_a_dflash_export_for_another_target_is_refused_before_any_server(dflash_run, tmp_path):
    from eval.main import run as evaluate

    head = export_head(dflash_run / "draft_head", tmp_path / "head", smoke_target_config(dflash_run))
    config = json.loads((head / "config.json").read_text())
    config["transformer_layer_config"]["hidden_size"] = 512  # the speculators format, the default
    (head / "config.json").write_text(json.dumps(config))
    cfg = smoke_config(dflash_run, f"eval.heads=[{{name:x,path:{head}}}]", f"eval.out_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=r"trained for another target: hidden_size=512 \(target: 256\)"):
        evaluate(cfg)
    assert not (tmp_path / "out" / "logs").exists()


@pytest.mark.parametrize("asked, served", [([2, 4, 6], [2, 4]), ([7, 8], [4])])
def test_eval_serves_a_dflash_head_at_the_k_it_drafts(dflash_run, tmp_path, asked, served):
    """Blocks of 2..5 draft k in 1..4: eval's sweep keeps the k among them, says which it dropped, and with
    none left serves the longest block - the config composes for every stage whatever eval lists."""
    from eval.grid import server_configs

    head = export_head(dflash_run / "draft_head", tmp_path / "head", smoke_target_config(dflash_run))
    ks = ",".join(map(str, asked))
    cfg = smoke_config(
        dflash_run, *DFLASH, f"eval.heads=[{{name:x,path:{head},num_speculative_tokens:[{ks}]}}]"
    )
    configs = server_configs(cfg, dflash_run, smoke_target_config(dflash_run))
    heads = [c for c in configs if c["head"]]
    assert (
        [c["k"] for c in heads]
        == [c["speculative_config"]["num_speculative_tokens"] for c in heads]
        == served
    )
    dropped = [k for k in asked if k not in served]
    assert f"head x: k={dropped} of eval.heads[].num_speculative_tokens not served" in heads[0]["note"]
    assert "trained to draft k in [1, 2, 3, 4]" in heads[0]["note"]


VLLM_OVERRIDES = [
    "train.eval_every=0",
    "train.save_every=0",
    QUALITY_THREADS,
    "train.num_epochs=5",  # mean acceptance ~1.54 at k=4 (measured; 8 epochs cost ~60 s more)
    *DFLASH,
]


@pytest.fixture(scope="module")
def dflash_regen_run(regen_run, tmp_path_factory):
    """A DFlash head trained on the regenerated smoke cache for k=4 (blocks of 2..5: DFLASH's min_block_size)."""
    from train.main import run as train

    run_dir = tmp_path_factory.mktemp("dflash_regen") / "run"
    shutil.copytree(regen_run, run_dir)
    train(smoke_config(run_dir, *VLLM_OVERRIDES, "export.num_speculative_tokens=4", experiment="smoke_regen"))
    return run_dir


# k=4 is the block trained on; k=2 a shorter one of the blocks it trained on (slow: a second vLLM engine).
@pytest.mark.parametrize("k", [4, pytest.param(2, marks=pytest.mark.slow)])
def test_vllm_drafts_a_dflash_head_at_the_reference_decoders_rate(dflash_regen_run, k):
    """Exported, then served by vLLM (the CPU build) at k mask slots: acceptance equals the reference
    decoder's per position, and the card says how to serve it."""
    from export.main import run as export

    overrides = [*VLLM_OVERRIDES, f"export.num_speculative_tokens={k}", "export.verify=true"]
    report = export(smoke_config(dflash_regen_run, *overrides, experiment="smoke_regen"))["verification"]
    served = report["vllm"]
    assert report["num_speculative_tokens"] == k
    assert served["accepted_per_position"] == report["reference"]["accepted_per_position"]
    assert report["parity"]["passed"] and report["num_identical_outputs"] == report["num_prompts"]
    assert served["accepted_per_position"][1] > 0 and (k < 4 or served["mean_acceptance_length"] >= 1.4)
    card = (dflash_regen_run / "export" / "README.md").read_text()
    assert '"method": "dflash"' in card and "DFlash" in card and "serve k in 1-4" in card


def smoke_target_config(run_dir):
    return AutoConfig.from_pretrained(run_dir / "smoke_target")


def test_a_head_reads_its_own_layers_of_a_cache_holding_more(smoke_run, tmp_path):
    """One cache for several kinds: head.aux_layer_ids picks the head's layers among the cache's (and the
    head's fc is as wide as they are); layers the cache lacks are refused naming the setting."""
    from train.main import run as train

    run_dir = tmp_path / "run"
    shutil.copytree(smoke_run, run_dir)
    train(
        smoke_config(run_dir, "train.max_steps=2", "train.eval_every=0", *DFLASH, "head.aux_layer_ids=[1,4]")
    )
    record = json.loads((run_dir / "draft_head" / "draft_config.json").read_text())
    assert record["config"]["aux_layer_ids"] == [1, 4] and record["cache"]["aux_layer_ids"] == [1, 3, 4]
    assert load_file(str(run_dir / "draft_head" / "model.safetensors"))["fc.weight"].shape == (256, 2 * 256)
    with pytest.raises(
        ValueError, match=r"head.aux_layer_ids=\[1, 2\]: must be a non-empty subset of the cache's"
    ):
        train(smoke_config(run_dir, "train.max_steps=2", *DFLASH, "head.aux_layer_ids=[1,2]"))


def test_held_out_reproduces_trains_estimate_and_measures_other_ks(dflash_run):
    """train/held_out.py on the trained head gives train's own final held-out metrics at the k train
    measured (export.num_speculative_tokens=3: blocks of 4), and measures the head at another k."""
    from train.held_out import held_out

    final = json.loads((dflash_run / "train_eval.jsonl").read_text().splitlines()[-1])
    measured = held_out(dflash_run / "draft_head", dflash_run, 3, ["experiment=smoke", "train.num_threads=1"])
    assert measured["eval/accept_len_k3"] == pytest.approx(final["eval/accept_len_k3"], rel=1e-5)
    assert measured["eval/loss_0"] == pytest.approx(final["eval/loss_0"], rel=1e-5)
    other = held_out(dflash_run / "draft_head", dflash_run, 1, ["experiment=smoke", "train.num_threads=1"])
    assert other["eval/accept_len_k1"] != pytest.approx(measured["eval/accept_len_k1"], rel=1e-6)
