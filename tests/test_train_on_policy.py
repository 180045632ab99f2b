"""On-policy training (train.stage=on_policy): the replay loss against a dense hand computation, rollouts
against the reference decoder's decoding, the replay forward drafting what the rollout drafted (every
drafting scheme), gradients on the head only, and the stage itself: its head, records and an exact resume."""

import json
import math
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers import (
    DFLASH,
    PEAGLE,
    REPO,
    assert_same_head,
    smoke_config,
    step_losses,
    tiny_head_config,
    wandb_items,
    wandb_records,
)

KINDS = {"eagle3": (), "peagle": PEAGLE, "dflash": DFLASH}


def rollout_batch(config, k: int, seed: int = 1) -> dict:
    """Two rows of a tiny vocabulary with rounds at increasing anchors, some drafts accepted."""
    g = torch.Generator().manual_seed(seed)
    b, t, m, h = 2, 14, 3, config.hidden_size
    anchors = torch.tensor([[2, 5, 9], [3, 7, 0]])
    return {
        "input_ids": torch.randint(0, config.vocab_size, (b, t), generator=g),
        "aux_hidden": torch.randn(b, t, 2, h, generator=g),
        "anchor_BM": anchors,
        "round_mask": torch.tensor([[True, True, True], [True, True, False]]),
        "drafts_BMK": torch.randint(0, config.vocab_size, (b, m, k), generator=g),
        "accepted_BM": torch.tensor([[0, 2, k], [1, 0, 0]]),
        "final_BMKH": torch.randn(b, m, k, h, generator=g),
    }


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_the_replay_loss_is_the_hand_computation(kind):
    """Half the accepted drafts' mean forward KL (as train's `kl`: the cross-entropy, the same gradient) plus half the rejected drafts' gamma^i-weighted mean reverse
    KL, against the target's draft-vocabulary distribution at each; the gradients too (the fused rows)."""
    from heads.dflash import DFlashConfig
    from tests.helpers import random_draft
    from train.losses.replay import replay_loss, replay_outputs
    from train.objectives import parse_objective

    k, gamma = 3, 0.8
    extra = {"peagle": dict(mask_token_id=3), "dflash": dict(mask_token_id=3, block_size=4)}.get(kind, {})
    config = tiny_head_config(DFlashConfig if kind == "dflash" else None, aux_layer_ids=[1, 2], **extra)
    model = random_draft(config)
    model.load_target_embedding(torch.randn(config.vocab_size, config.hidden_size))
    batch = rollout_batch(config, k)
    lm_head, d2t = torch.randn(config.vocab_size, config.hidden_size), torch.arange(24) + 7
    total, metrics = replay_loss(
        model, batch, lm_head, d2t, 5, parse_objective("kl"), parse_objective("rkl"), gamma
    )
    grads = torch.autograd.grad(total, [p for p in model.parameters() if p.requires_grad])

    out = replay_outputs(model, batch)
    logq = torch.log_softmax(model.logits(out).float(), -1)
    logp = torch.log_softmax((batch["final_BMKH"] @ lm_head.T)[..., d2t], -1)
    forward_sum, count, reverse_sum, weights = 0.0, 0, 0.0, 0.0
    for row in range(2):
        for r in range(3):
            if not batch["round_mask"][row, r]:
                continue
            for i in range(k):
                p, q = logp[row, r, i], logq[row, r, i]
                if i < batch["accepted_BM"][row, r]:
                    forward_sum = forward_sum - (p.exp() * q).sum()  # KL up to p's entropy
                    count += 1
                else:
                    reverse_sum = reverse_sum + gamma**i * (q.exp() * (q - p)).sum()
                    weights += gamma**i
    assert count == 6 and math.isclose(
        weights, 1 + 0.8 + 0.64 + 0.64 + 1 + 0.8 + 0.64 + 0.8 + 0.64, rel_tol=1e-6
    )
    expected = (forward_sum / count + reverse_sum / weights) / 2
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["loss_accepted"], forward_sum / count, rtol=1e-5, atol=1e-6)
    expected_grads = torch.autograd.grad(expected, [p for p in model.parameters() if p.requires_grad])
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert [int(metrics[f"num_{i}"]) for i in range(k)] == [5, 5, 5]


def smoke_head_of(kind: str, run_dir, seed: int = 0):
    """A head of `kind` on the smoke target with every weight random (drafts that vary), its target and
    draft-to-target map."""
    from transformers import AutoModelForCausalLM

    from artifacts.manifest import read_manifest
    from artifacts.vocab import load_vocab_map
    from target.model import load_config, load_embedding_and_lm_head, target_dir
    from train.model import build_draft

    cfg = smoke_config(run_dir, *KINDS[kind])
    manifest = read_manifest(run_dir / "cache")
    vocab = load_vocab_map(run_dir / "cache" / "vocab.safetensors")
    draft = build_draft(cfg, load_config(cfg.target), manifest, vocab)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() > 1:
                param.normal_(0, 2 / math.sqrt(param.shape[-1]))
    draft.load_target_embedding(load_embedding_and_lm_head(cfg.target)[0].float())
    target = AutoModelForCausalLM.from_pretrained(target_dir(cfg.target), dtype=torch.float32).eval()
    return cfg, draft.eval(), target, vocab.draft_to_target


# The heads rolled out: trained ones (whose drafts the target accepts, so both terms and the fed drafts are
# exercised) for EAGLE-3 and P-EAGLE, a random DFlash head on the smoke target.
TRAINED = {"eagle3": "regen_head", "peagle": "regen_peagle_head"}


def rolled_out_head(request, smoke_run, kind: str):
    """The run, target and head (`TRAINED`'s for its kinds, else a random one) that the rollout tests roll
    out."""
    from heads.reference_decoder import DraftHead, load_head

    if kind in TRAINED:
        run_dir = request.getfixturevalue(TRAINED[kind])
        _, _, target, _ = smoke_head_of("eagle3", run_dir)
        return run_dir, target, load_head(run_dir / "draft_head", target)
    _, draft, target, d2t = smoke_head_of(kind, smoke_run)
    return smoke_run, target, DraftHead(draft, d2t)


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_batched_rollouts_are_the_reference_decoders_rollouts(request, smoke_run, kind):
    """Prompts of different lengths rolled out together (one target forward verifies every row's round,
    rows finishing at different rounds, a stop token among them) give each prompt's batch-1 rollout: the
    same sequence, anchors, drafts and decisions; features and teacher states equal but for the batched
    arithmetic's rounding."""
    from artifacts.cache import CacheSplit
    from train.rollouts import prompt_ids, roll_out, roll_out_batch

    run_dir, target, head = rolled_out_head(request, smoke_run, kind)
    split = CacheSplit(run_dir / "cache", "train")
    prompts = [prompt_ids(split, i) for i in range(4)]
    assert len({len(p) for p in prompts}) > 1, "rows of different lengths: left padding exercised"
    alone = [roll_out(target, head, p, 3, 24, ()) for p in prompts]
    stop = int(alone[1].input_ids[len(prompts[1]) + 5])  # row 1 stops early; others may too
    for temperature in (0.0, 1.0):  # greedy, then sampled: each prompt from its own seeded stream
        seeds = [7 * i for i in range(len(prompts))]
        alone = [roll_out(target, head, p, 3, 24, [stop], temperature, s) for p, s in zip(prompts, seeds)]
        batched = roll_out_batch(target, head, prompts, 3, 24, [stop], temperature, seeds)
        assert len({len(r.anchors) for r in alone}) > 1, "rows finish at different rounds"
        for one, together in zip(alone, batched):
            for name in ("input_ids", "anchors", "drafts", "accepted"):
                assert torch.equal(getattr(one, name), getattr(together, name)), (temperature, name)
            for name in ("features", "final"):
                torch.testing.assert_close(getattr(together, name).float(), getattr(one, name).float(),
                                           atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_a_replay_drafts_what_the_rollout_drafted_and_decides_as_the_reference_decoder(
    request, smoke_run, kind
):
    """The rollout is the reference decoder's decoding (same output, same counts), and the replay forward
    at its anchors - fed the rollout's drafts, on the stored features - drafts the same tokens at every
    round: training sees the head exactly as it drafted when served."""
    from artifacts.cache import CacheSplit
    from heads.reference_decoder import speculative_generate
    from train.losses.replay import replay_outputs
    from train.rollouts import collate_rollouts, prompt_ids, read_rollouts, roll_out, write_rollouts

    run_dir, target, head = rolled_out_head(request, smoke_run, kind)
    draft, d2t = head.draft, head.draft_to_target
    split = CacheSplit(run_dir / "cache", "train")
    prompts = [prompt_ids(split, i) for i in range(3)]
    rollouts = [roll_out(target, head, p, 3, 24, ()) for p in prompts]
    for prompt, rollout in zip(prompts, rollouts):
        output, counts = speculative_generate(target, head, prompt, 3, 24)
        assert rollout.counts() == counts
        assert rollout.input_ids[: len(prompt)].tolist() == prompt
        # the target read the output but its last token; past max_new_tokens it also read what the last
        # round accepted, which the output cuts off
        read = rollout.input_ids[len(prompt) :].tolist()
        common = min(len(read), len(output))
        assert common >= len(output) - 1 and read[:common] == output[:common]
        # each round's next anchor: the accepted drafts and the bonus token later
        assert (rollout.anchors[1:] == rollout.anchors[:-1] + rollout.accepted[:-1] + 1).all()
    if kind in TRAINED:
        assert sum(int(r.accepted.sum()) for r in rollouts) > 0, "some drafts accepted: both terms trained"
    path = request.getfixturevalue("tmp_path") / f"rollouts-{kind}.safetensors"
    write_rollouts(path, rollouts)
    batch = collate_rollouts(read_rollouts(path), "cpu")
    with torch.no_grad():
        replayed = d2t[draft.logits(replay_outputs(draft, batch)).argmax(-1)]
    mask = batch["round_mask"]
    assert torch.equal(replayed[mask], batch["drafts_BMK"][mask])
    # The teacher rows are the verification's: the target's greedy token at the first rejected draft.
    from train.losses.rows import target_logits

    lm_head = target.get_output_embeddings().weight.float()
    final_BMKH = batch["final_BMKH"]
    greedy = target_logits(final_BMKH.flatten(0, 2), lm_head).argmax(-1).view(final_BMKH.shape[:3])
    accepted = mask[..., None] & (torch.arange(3) < batch["accepted_BM"][..., None])
    assert torch.equal(greedy[accepted], batch["drafts_BMK"][accepted])
    rejected_first = batch["accepted_BM"].clamp(max=2)[..., None]
    first_rejection = mask & (batch["accepted_BM"] < 3)
    assert (
        greedy.gather(2, rejected_first)[..., 0] != batch["drafts_BMK"].gather(2, rejected_first)[..., 0]
    )[first_rejection].all()


def test_gradients_reach_the_head_only(smoke_run):
    """The replay's gradient reaches every trainable weight of the head and nothing of the target's: its
    embedding, lm_head, and the rollout's stored states."""
    from artifacts.cache import CacheSplit
    from heads.reference_decoder import DraftHead
    from train.losses.replay import replay_loss
    from train.objectives import parse_objective
    from train.rollouts import collate_rollouts, prompt_ids, roll_out

    cfg, draft, target, d2t = smoke_head_of("peagle", smoke_run)
    split = CacheSplit(smoke_run / "cache", "train")
    rollouts = [roll_out(target, DraftHead(draft, d2t), prompt_ids(split, i), 3, 16, ()) for i in range(2)]
    batch = collate_rollouts(rollouts, "cpu")
    lm_head = target.get_output_embeddings().weight.detach().clone().requires_grad_()
    draft.train()
    loss, _ = replay_loss(draft, batch, lm_head, d2t, 64, parse_objective("kl"), parse_objective("rkl"), 0.8)
    loss.backward()
    trainable = {name: p for name, p in draft.named_parameters() if p.requires_grad}
    assert trainable and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable.values())
    assert "embed_tokens.weight" not in trainable
    assert lm_head.grad is None and all(p.grad is None for p in target.parameters())


@pytest.fixture
def on_policy_run(smoke_head, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(smoke_head, run_dir)
    return run_dir


STAGE = (
    "train.stage=on_policy",
    "on_policy.num_iterations=2",
    "on_policy.num_prompts=3",
    "on_policy.num_steps=2",
    "on_policy.max_new_tokens=16",
    "on_policy.num_eval_prompts=2",
    "train.batch_size=2",
    "train.save_every=2",
    "train.num_threads=1",
)


def test_the_stage_trains_from_the_supervised_head_and_a_resume_equals_an_uninterrupted_run(
    on_policy_run, monkeypatch
):
    from safetensors.torch import load_file

    from export.card import stages_section
    from heads.head_file import read_record
    from train.main import run

    out = on_policy_run / "on_policy"
    monkeypatch.setenv("WANDB_SILENT", "true")
    held_out = run(smoke_config(on_policy_run, *STAGE, "train.report_to=wandb"))
    assert held_out is not None and "mean_acceptance_length" in held_out and "eval/acc_0" in held_out
    records = [json.loads(line) for line in (out / "on_policy.jsonl").open()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    assert all("held_out" in r for r in records) and records[1]["rollouts"]["num"] == 3
    record = read_record(out / "draft_head")
    stages = record.training["stages"]
    assert [s["stage"] for s in stages] == ["supervised", "on_policy"]
    assert (stages[1]["k"], stages[1]["temperature"], stages[1]["max_new_tokens"]) == (3, 0.0, 16)
    assert stages[0]["num_steps"] == 4 and len(stages[1]["iterations"]) == 3
    assert record.training["num_steps"] == 4
    card = "\n".join(stages_section(stages))
    assert "- supervised: 4 optimizer steps" in card and "- on-policy: 2 iterations" in card
    assert "drafting k=3, the target verifying at temperature 0)" in card
    assert card.count("\n| ") == 1 + 3  # the header and iterations 0 (before any), 1 and 2
    uninterrupted = [json.loads(line)["loss"] for line in (out / "train_steps.jsonl").open()]
    # W&B (offline): every step's loss as train_steps.jsonl holds it, each iteration's held-out acceptance
    (file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    deadline, logged = time.time() + 60, wandb_records(file)
    while not any(r.HasField("exit") for r in logged) and time.time() < deadline:
        time.sleep(0.5)  # wandb's service may still be flushing the run file
        logged = wandb_records(file)
    history = {}
    for r in logged:
        if r.HasField("history"):
            history.setdefault(r.history.step.num, {}).update(wandb_items(r.history.item))
    assert [history[s]["on_policy/loss"] for s in (1, 2, 3, 4)] == uninterrupted
    assert [history[s]["on_policy/held_out/mean_acceptance_length"] for s in (0, 2, 4)] == [
        r["held_out"]["mean_acceptance_length"] for r in records
    ]
    final = load_file(out / "draft_head" / "model.safetensors")
    # A crash in iteration 2 before its rollouts were written: the step-2 checkpoint survives.
    for name in ("step-000003", "step-000004"):
        shutil.rmtree(out / "ckpt" / name, ignore_errors=True)
    for path in (out / "rollouts").glob("iter-00001-*"):
        path.unlink()
    shutil.rmtree(out / "draft_head")
    for name, keep in (("train_steps.jsonl", 3), ("on_policy.jsonl", 2)):
        lines = (out / name).read_text().splitlines()[:keep]
        (out / name).write_text("\n".join(lines) + "\n")
    run(smoke_config(on_policy_run, *STAGE, "train.resume=true"))
    resumed = [json.loads(line)["loss"] for line in (out / "train_steps.jsonl").open()]
    assert resumed == uninterrupted
    assert [json.loads(line)["iteration"] for line in (out / "on_policy.jsonl").open()] == [0, 1, 2]
    again = load_file(out / "draft_head" / "model.safetensors")
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


def test_two_processes_train_as_one_process_with_the_same_global_batch(
    on_policy_run, tmp_path, subprocess_env
):
    """Under DDP each process rolls out its share of the prompts (sampled from each prompt's own seeded
    stream), the replay's global batch is the same rollouts in the same order, and each term is a mean over
    that batch: the run equals one process's."""
    from train.main import run

    settings = [o for o in STAGE if not o.startswith("train.batch_size")]
    settings += ["on_policy.num_iterations=1", "on_policy.temperature=1"]  # sampled: each prompt its stream
    run(smoke_config(on_policy_run, *settings, "train.batch_size=2"))
    ddp = tmp_path / "ddp"
    shutil.copytree(on_policy_run, ddp, ignore=shutil.ignore_patterns("on_policy"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "train/main.py",
               "experiment=smoke", f"run_dir={ddp}", "cache.num_threads=1", *settings, "train.batch_size=1"]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = on_policy_run / "on_policy", ddp / "on_policy"
    assert step_losses(two) == pytest.approx(step_losses(one), rel=1e-4)
    iterations = [[json.loads(line) for line in (d / "on_policy.jsonl").open()] for d in (one, two)]
    for part in ("rollouts", "held_out"):
        counts = [[r[part]["accepted_per_position"] for r in runs if part in r] for runs in iterations]
        assert counts[0] == counts[1] and counts[0]
    assert_same_head(one, two, atol=2e-5)


def test_settings_that_cannot_apply_are_refused(on_policy_run):
    from artifacts.config import check_config
    from train.main import run

    with pytest.raises(ValueError, match="head.kind=eagle1: must be eagle3, peagle or dflash"):
        check_config(smoke_config(on_policy_run, "train.stage=on_policy", "head.kind=eagle1"))
    with pytest.raises(ValueError, match="on_policy.num_speculative_tokens=4"):
        check_config(
            smoke_config(
                on_policy_run, "train.stage=on_policy", *PEAGLE, "on_policy.num_speculative_tokens=4"
            )
        )
    with pytest.raises(ValueError, match="on_policy.num_speculative_tokens=0"):
        check_config(
            smoke_config(on_policy_run, "train.stage=on_policy", "on_policy.num_speculative_tokens=0")
        )
    missing = on_policy_run / "nowhere"
    with pytest.raises(ValueError, match="no supervised head"):
        run(smoke_config(on_policy_run, "train.stage=on_policy", f"on_policy.init_from={missing}"))


# slow (make test-all): a benchmark tool, 36 s in the suite here; the stage it runs is in the default suite
@pytest.mark.slow
def test_the_bench_trains_both_at_matched_compute_and_measures_them(on_policy_run):
    """bench/on_policy.py: the on-policy stage and continued supervised training from the same head, the
    latter for the steps the former's compute buys, all three heads decoded on the same held-out prompts."""
    command = [
        sys.executable, "-m", "bench.on_policy", "--run-dir", str(on_policy_run), "--seeds", "0",
        "--prompts", "2", "--max-new-tokens", "8", "--", "experiment=smoke", "cache.num_threads=1",
        "train.num_threads=1", "train.batch_size=2", "on_policy.num_iterations=1", "on_policy.num_prompts=2",
        "on_policy.num_steps=2", "on_policy.max_new_tokens=8", "on_policy.num_eval_prompts=1",
    ]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True)
    rows = {
        r["name"]: r for r in json.loads((on_policy_run / "on_policy_bench" / "results.json").read_text())
    }
    assert rows.keys() == {"start", "on_policy_s0", "supervised_s0"}
    opd, sup = rows["on_policy_s0"], rows["supervised_s0"]
    assert opd["num_steps"] == 2 and opd["rollout_seconds"] > 0 and len(opd["curve"]) == 2
    assert sup["num_steps"] == math.ceil(
        (opd["rollout_seconds"] + opd["replay_seconds"]) / sup["start_step_s"]
    )
    assert len(step_losses(on_policy_run / "on_policy_bench" / "supervised_s0")) == sup["num_steps"]
    assert all(r["held_out"]["num_prompts"] == 2 and r["held_out"]["num_drafts"] > 0 for r in rows.values())
    assert "| on_policy_s0 | 2 |" in (on_policy_run / "on_policy_bench" / "results.md").read_text()
