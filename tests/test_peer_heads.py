"""The peer heads (bench/peer_heads.py): speculators 0.9's own trainer fed from our cache. The adapter must
hand it our teacher and our trained positions (a wrong convention would pass for a weak recipe), and a head
it trains must be served by vLLM exactly as our reference decoder drafts with it."""

import json
import shutil

import pytest
import torch

from tests.helpers import smoke_config

speculators = pytest.importorskip("speculators")


def test_the_adapter_gives_speculators_our_teacher_and_our_trained_positions(smoke_run):
    """After speculators' own batch shift, its teacher (the verifier's norm and lm_head over the states it
    is handed) is ours at every position, and it trains the prediction of x_{t+2} exactly where we do."""
    from speculators.models.eagle3 import shift_batch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from artifacts.cache import CacheSplit
    from bench.speculators_train import speculators_sample
    from target.model import load_config, load_embedding_and_lm_head, load_final_norm

    cfg = smoke_config(smoke_run)
    target = load_config(cfg.target)
    norm = LlamaRMSNorm(target.hidden_size, target.rms_norm_eps)
    norm.weight.data = load_final_norm(cfg.target)
    lm_head_VH = load_embedding_and_lm_head(cfg.target)[1].float()
    split = CacheSplit(smoke_run / "cache", "train")
    trained = 0
    for index in range(len(split)):
        sample = split[index]
        t = len(sample["input_ids"])
        item = speculators_sample(sample, norm.weight.data, None)
        shifted = shift_batch({**item, "lengths": torch.tensor([t]), "position_ids": torch.arange(t)})
        # aligned position j: hidden of x_j, input x_{j+1}, teacher at j+1 (predicting x_{j+2})
        assert shifted["hidden_states"].shape == (t - 1, 3 * target.hidden_size)
        torch.testing.assert_close(shifted["hidden_states"], sample["aux_hidden"][:-1].flatten(1))
        assert torch.equal(shifted["input_ids"], sample["input_ids"][1:])
        with torch.no_grad():
            theirs_TV = torch.log_softmax(norm(shifted["verifier_last_hidden_states"]) @ lm_head_VH.T, -1)
        ours_TV = torch.log_softmax(sample["final_hidden"][1:].float() @ lm_head_VH.T, -1)
        # the teacher's distribution itself, not the states it comes from: argmax and KL
        assert torch.equal(theirs_TV.argmax(-1), ours_TV.argmax(-1))
        assert float((ours_TV.exp() * (ours_TV - theirs_TV)).sum(-1).max()) < 1e-4
        # ours trains the prediction at t (of x_{t+2}) where x_{t+2} is an answer token
        ours = torch.zeros(t - 1, dtype=torch.bool)
        ours[: t - 2] = sample["loss_mask"][2:]
        assert torch.equal(shifted["loss_mask"].bool(), ours)
        trained += int(ours.sum())
    assert 0 < trained < sum(split.lengths)  # prompts are not trained, answers are


def test_the_adapter_refuses_targets_whose_final_norm_it_cannot_undo(smoke_target_dir, tmp_path):
    """The adapter hands speculators x / w for it to re-apply the target's norm: a zero in w, or a norm
    that scales by 1 + w (Gemma), is refused naming the target, where it would give NaNs or wrong states."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GemmaConfig

    from bench.speculators_train import divisor_norm_weight

    def target_cfg(path):
        return smoke_config(tmp_path, f"target.path={path}")

    assert torch.equal(divisor_norm_weight(target_cfg(smoke_target_dir)), load_file(
        next(smoke_target_dir.glob("*.safetensors")))["model.norm.weight"].float())  # fmt: skip
    zeroed = tmp_path / "zeroed"
    shutil.copytree(smoke_target_dir, zeroed)
    (weights,) = zeroed.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"][3] = 0
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"zeroed: the final norm's weight is 0 in 1 of \d+ channels \(first 3\)"
    ):
        divisor_norm_weight(target_cfg(zeroed))
    gemma = tmp_path / "gemma"
    config = GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    torch.nn.init.uniform_(model.model.norm.weight, 0.5, 1.5)  # no zero: the norm's form is what is refused
    model.save_pretrained(gemma)
    with pytest.raises(
        ValueError, match=r"gemma: the target's final norm \(GemmaRMSNorm\) is not x / rms\(x\) \* w"
    ):
        divisor_norm_weight(target_cfg(gemma))


# slow (make test-all): 336 s in the suite here, beside the default run's ~40 min of CI; passed 2026-11-28
@pytest.mark.slow
def test_a_speculators_head_is_served_by_vllm_as_the_reference_decoder_drafts_it(regen_run, tmp_path):
    """A P-EAGLE head trained by speculators' own Trainer on the regenerated smoke cache, saved by its own
    save_pretrained, loads in vLLM and accepts exactly what our reference decoder, reading the same files
    as vLLM does, accepts - and near what its held-out estimate promises (the collapse check)."""
    from bench.peer_heads import estimate, verify_peer
    from bench.speculators_train import train

    run_dir = tmp_path / "run"
    shutil.copytree(regen_run, run_dir)
    overrides = ["experiment=smoke_regen", "cache.num_threads=1", "train.num_epochs=5"]
    # rows of 1,024 tokens (its default packs 8,192: one or two steps an epoch on this small cache)
    record = train(run_dir, tmp_path / "peer", "peagle", 0, overrides, ["--total-seq-len", "1024"])
    export = tmp_path / "peer" / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and record["num_steps"] >= 20
    held_out = estimate(run_dir, export, "peagle", 3, overrides)
    report = verify_peer(run_dir, export, "peagle", 3, held_out["eval/accept_len_k3"], overrides)
    assert report["parity"]["passed"] and report["num_identical_outputs"] == report["num_prompts"]
    assert report["parity"]["mean_acceptance_length_relative_gap"] == 0.0
    assert report["vllm"]["mean_acceptance_length"] > 1.1 and not report["collapsed"]
