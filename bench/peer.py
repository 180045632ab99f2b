"""Our EAGLE-3 trainer beside speculators 0.9's (vLLM's own trainer) on one device, the same random data and
the same head: step time by phase, tokens/s and peak memory of each, and the ratio.

    python -m bench.peer --out runs/bench/peer.json      # a GPU: K=3 and K=7, 4 x 2,048
    python -m bench.peer --tiny --steps 2 --warmup 1    # tiny shapes, any machine

Each (trainer, K) runs in a fresh child process (this script with `--child ours|speculators`), in the order
ours K=3, speculators K=3, ours K=7, speculators K=7 (K=3: speculators' default and published setting; K=7:
our recipe's), so that a run cut short still holds a pair.

- The data: bench/memory.py's random micro-batch, drawn on the device from one seed: the
  llama31_8b recipe's 4 x 2,048 tokens (a quarter prompt), random aux and final states at Llama-3.1-8B's
  widths. Ours trains it as the padded batch train's `collate` gives; speculators gets the same four
  samples through its own collate (`CollateFn` with EAGLE-3's `shift_batch`: one packed row of 8,192 with
  document ids, one token per sample dropped by the shift, hidden states in bf16).
- The head, alike in both: EAGLE-3 with one decoder layer at Llama-3.1-8B's shapes, draft vocabulary
  32,000, `norm_before_fc`, `norm_output`, `norm_before_residual` (the recipe's, and speculators' CLI
  defaults for EAGLE-3), the embedding and lm_head frozen; forward KL in both (speculators' default for
  EAGLE-3; the recipe trains LK, `--loss` changes ours).
- Ours: the recipe's trainer step (bench/memory.py `train_step`: bf16 autocast, AdamW, clip 0.5)
  with its position weights and aux noise; the batch is moved to the device each step, as accelerate's
  loader does.
- Speculators: its own `Trainer.train_epoch` over a DataLoader of the collated batch, with its CLI's
  defaults: bf16 autocast, the forward under torch.compile with FlexAttention block masks on CUDA (on a
  CPU, a rehearsal: uncompiled, its eager attention with dense masks, FlexAttention having no CPU backward), its fused Triton losses on CUDA (the eager ones on a CPU), Muon for the matrices and
  AdamW for the rest, lr 1e-3, clip 1.0, a linear schedule. Its own step profile (`_StepTimer` at
  log_freq=1, each phase synchronised) gives the phases.
- Times: wall seconds per optimizer step, the median over `--steps` steps after `--warmup` (compilation and
  the allocator's first steps); tokens/s counts the tokens each trainer processed. Peak memory:
  torch.cuda.max_memory_allocated over the whole process (weights, optimizer states and the steps: both
  hold the same head); on a CPU, the peak resident set.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench import new_file
from bench.memory import (
    build_model,
    device_name,
    random_batch,
    recipe_config,
    synchronize,
    train_step,
)
from bench.train_step import peak_memory
from target.model import default_aux_layer_ids
from train.memory import GB

REPO = Path(__file__).resolve().parent.parent

RECIPE = "llama31_8b"
# The head both trainers build (speculators' CLI defaults for EAGLE-3 and the recipe's head settings agree).
HEAD = ["head.norm_before_fc=true", "head.norm_output=true", "head.norm_before_residual=true"]


def setting(args, ttt_steps: int):
    """(cfg, target_config, batch_size, seq_len): the recipe with K TTT steps at the benchmark's shapes."""
    overrides = [*HEAD, f"head.num_ttt_steps={ttt_steps}", f"train.loss={args.loss}", *args.override]
    cfg, target_config = recipe_config(RECIPE, "eagle3", args.tiny, overrides)
    batch_size = args.batch_size or (2 if args.tiny else cfg.train.batch_size)
    seq_len = args.seq_len or (256 if args.tiny else cfg.render.max_length)
    return cfg, target_config, batch_size, seq_len


def run_ours(args, device) -> dict:
    """Our trainer's steps on the batch, moved to the device each step from the host."""
    cfg, target_config, b, t = setting(args, args.ttt_steps)
    model, optimizer, aux_ids = build_model(cfg, target_config, device)
    batch = {k: v.cpu() for k, v in random_batch(cfg, target_config, aux_ids, b, t, device).items()}
    if device.type == "cuda":
        batch = {k: v.pin_memory() for k, v in batch.items()}
    steps = []
    for _ in range(args.warmup + args.steps):
        start = synchronize(device)
        on_device = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        h2d = synchronize(device) - start
        phases = train_step(model, optimizer, on_device, cfg.optim.max_grad_norm, device,
                            precision=cfg.train.mixed_precision)  # fmt: skip
        steps.append({**phases, "h2d_s": h2d, "step_s": phases["step_s"] + h2d})
    return summary("ours", args, steps, b * t, device)


def speculators_model(cfg, target_config, aux_ids: list[int], ttt_steps: int, work: Path, device):
    """speculators' Eagle3DraftModel as its CLI builds it (`build_draft_model` -> `from_training_args`), from
    a verifier directory holding only the target's config.json; the verifier's embedding, lm_head rows and
    norm random (its weights are not read: nothing to download)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.cli import create_transformer_layer_config

    verifier = work / "verifier"
    verifier.mkdir()
    target_config.architectures = ["LlamaForCausalLM"]
    target_config.save_pretrained(verifier)
    # The CLI's defaults: one llama layer, SiLU, every layer sliding-window attention of 2,048 (no
    # --full-attention-indices), which is full causal attention for samples of up to 2,048 tokens.
    layer_config = create_transformer_layer_config(
        str(verifier), num_layers=1, draft_arch="llama", hidden_act=None, sliding_window=2048,
        full_attention_indices=[],
    )  # fmt: skip
    # FlexAttention has no backward on a CPU: there its eager path (dense float masks) stands in.
    layer_config._attn_implementation = "simple_flex_attention" if device.type == "cuda" else "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config,
        draft_vocab_size=cfg.cache.draft_vocab_size,
        norm_before_residual=cfg.head.norm_before_residual,
        norm_before_fc=cfg.head.norm_before_fc,
        norm_output=cfg.head.norm_output,
        embed_requires_grad=False,
        eagle_aux_hidden_state_layer_ids=aux_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(verifier)),
        ),
    )
    v, vd, h = target_config.vocab_size, cfg.cache.draft_vocab_size, target_config.hidden_size
    with torch.device(device):
        model = Eagle3DraftModel(config)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[:vd] = True  # the draft vocabulary: the first vd target ids, as in ours
    model.load_vocab_mappings(t2d.to(device), torch.zeros(vd, dtype=torch.long, device=device))
    g = torch.Generator(device).manual_seed(1)
    with torch.no_grad():  # what load_verifier_weights reads from the verifier's checkpoint
        embedding = 0.02 * torch.randn(v, h, generator=g, device=device)
        lm_head = 0.02 * torch.randn(v, h, generator=g, device=device)
        model.embed_tokens.weight.copy_(embedding)
        model.lm_head.weight.copy_(lm_head[:vd])
        model.verifier_lm_head.weight.copy_(lm_head[:vd])
        model.verifier_norm.weight.fill_(1.0)
    return model


def speculators_batch(batch: dict, total_seq_len: int):
    """The batch's samples through speculators' own dataset item shape and collate (EAGLE-3's shift_batch):
    one packed row with document ids, hidden states in bf16, on the host as its loader yields them."""
    from speculators.models.eagle3 import shift_batch
    from speculators.train.data import CollateFn

    b, t = batch["input_ids"].shape
    samples = [
        {
            "hidden_states": batch["aux_hidden"][i].flatten(1).cpu(),  # [T, num_aux * H]
            "input_ids": batch["input_ids"][i].cpu(),
            "verifier_last_hidden_states": batch["final_hidden"][i].cpu(),
            "loss_mask": batch["loss_mask"][i].cpu(),
            "lengths": torch.tensor([t]),
            "position_ids": torch.arange(t),
        }
        for i in range(b)
    ]
    hidden_size = batch["final_hidden"].shape[-1]
    num_aux = batch["aux_hidden"].shape[2]
    collate = CollateFn(total_seq_len, hidden_size, num_aux, torch.bfloat16, preprocess=shift_batch)
    return collate(samples)


class StepRecords(logging.Handler):
    """speculators' metric log records, kept: each step's profile (its _StepTimer's phases, synchronised)
    and its training metrics (loss, accuracies)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.steps = []

    def emit(self, record):
        if isinstance(record.msg, dict) and record.msg.get("profile"):
            self.steps.append({"profile": record.msg["profile"], "train": record.msg.get("train", {})})


def record_steps() -> StepRecords:
    """Keep every step speculators' trainer logs from now on (its `speculators.metrics` logger)."""
    records = StepRecords()
    metrics = logging.getLogger("speculators.metrics")
    metrics.setLevel(logging.INFO)
    metrics.addHandler(records)
    return records


def speculators_on_this_machine() -> None:
    """speculators' trainer assumes an accelerator (local rank = device index, synchronised timers); on a
    CPU its device is "cpu" and its synchronisation a no-op. Nothing changes on CUDA."""
    if torch.cuda.is_available():
        return
    import speculators.train.trainer as trainer_module

    trainer_module.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *_: None


def run_speculators(args, device) -> dict:
    """speculators' Trainer.train_epoch over warmup + steps copies of the batch."""
    from speculators.losses import resolve_loss_config
    from speculators.train.trainer import Trainer, TrainerConfig

    cfg, target_config, b, t = setting(args, args.ttt_steps)
    aux_ids = default_aux_layer_ids(target_config.num_hidden_layers, "eagle3")  # as build_model's head
    work = Path(tempfile.mkdtemp(prefix="speculators_bench_"))
    model = speculators_model(cfg, target_config, aux_ids, args.ttt_steps, work, device)
    batch = speculators_batch(random_batch(cfg, target_config, aux_ids, b, t, device), b * t)
    num_tokens = int((batch["document_ids"] != -1).sum())
    num_steps = args.warmup + args.steps
    # Its loader pins memory (speculators.train.dataloader): the host-to-device copy as it runs.
    loader = torch.utils.data.DataLoader(
        [batch] * num_steps, batch_size=None, pin_memory=device.type == "cuda"
    )
    # Its CLI's defaults (speculators.train.config.schema): Muon + AdamW at lr 1e-3, a linear schedule
    # with 1% warmup, forward KL; the fused Triton losses need CUDA.
    loss = "fused" if device.type == "cuda" else "eager"
    call = {"ttt_steps": args.ttt_steps, "ttt_step_loss_decay": 1.0,
            "loss_config": resolve_loss_config("kl_div", loss)}  # fmt: skip
    trainer_config = TrainerConfig(
        lr=1e-3, num_epochs=1, save_path=str(work / "checkpoints"), train_call_kwargs=call,
        optimizer=args.speculators_optimizer, hidden_states_dtype=torch.bfloat16, log_freq=1,
        max_steps=num_steps,
    )  # fmt: skip
    if loss == "fused":
        # Its two fused kernels share one list of autotune configs (one triton.autotune decorator applied
        # twice); torch 2.11's dynamo, tracing the loss inside the compiled metrics, refuses one list reached
        # from two sources ("ListVariable ... is already tracked for mutation", H200, 2026-11-27). A list of
        # its own per kernel: the same configs, nothing else changed.
        from speculators.losses import fused

        for kernel in (fused.loss_forward_kernel, fused.loss_backward_kernel):
            kernel.configs = list(kernel.configs)
    speculators_on_this_machine()  # on a CPU, a rehearsal
    records = record_steps()
    trainer = Trainer(model, trainer_config, loader)
    trainer.train_epoch(0)
    steps = [
        {"fwd_s": p["fwd_ms"] / 1e3, "bwd_s": p["bwd_ms"] / 1e3, "opt_s": p["opt_ms"] / 1e3,
         "h2d_s": p["h2d_ms"] / 1e3, "step_s": p["step_ms"] / 1e3}
        for p in (step["profile"] for step in records.steps)
    ]  # fmt: skip
    if len(steps) != num_steps:
        raise RuntimeError(f"speculators logged {len(steps)} step profiles for {num_steps} steps")
    result = summary("speculators", args, steps, num_tokens, device)
    result["optimizer"] = args.speculators_optimizer
    result["loss_implementation"] = loss
    result["compiled"] = device.type == "cuda"
    result["attention"] = model.config.transformer_layer_config._attn_implementation
    return result


def summary(trainer: str, args, all_steps: list[dict], num_tokens: int, device) -> dict:
    """Medians over the timed steps (those after `args.warmup`), tokens/s and the process's peak memory;
    the untimed first steps' seconds apart (compilation, autotuning)."""
    steps = all_steps[args.warmup :]
    median = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return {
        "trainer": trainer,
        "setting": " ".join(args.override) if trainer == "ours" and args.override else "default",
        "ttt_steps": args.ttt_steps,
        "first_steps_s": [round(s["step_s"], 2) for s in all_steps[: args.warmup]],
        "device": device_name(device),
        "tokens": num_tokens,
        "timed_steps": len(steps),
        **{k: round(v, 4) for k, v in median.items()},
        "tokens_per_s": round(num_tokens / median["step_s"], 1),
        "peak_gb": round(peak_memory(device) / GB, 3),
    }


def ratios(results: list[dict]) -> list[dict]:
    """Per K with both trainers measured: ours over speculators in tokens/s, and in peak memory."""
    theirs_by_k = {r["ttt_steps"]: r for r in results if r["trainer"] == "speculators"}
    out = []
    for ours in results:
        k = ours["ttt_steps"]
        theirs = theirs_by_k.get(k)
        if ours["trainer"] == "ours" and theirs:
            out.append({
                "ttt_steps": k,
                "setting": ours.get("setting", "default"),
                "tokens_per_s_ratio": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
                "peak_memory_ratio": round(ours["peak_gb"] / theirs["peak_gb"], 3),
            })  # fmt: skip
    return out


def result_line(r: dict) -> str:
    """One trainer's result, as the benchmark and the GPU check print it."""
    return (f"{r['trainer']:11s} K={r['ttt_steps']} ({r.get('setting', 'default')}) {r['tokens']} tokens on "
            f"{r['device']}: {r['step_s']:.3f} s/step (first {r.get('first_steps_s')}) "
            f"(h2d {r['h2d_s']:.3f}, fwd {r['fwd_s']:.3f}, bwd {r['bwd_s']:.3f}, opt {r['opt_s']:.3f}), "
            f"{r['tokens_per_s']:.0f} tokens/s, peak {r['peak_gb']:.2f} GB")  # fmt: skip


def ratio_line(r: dict) -> str:
    return (f"K={r['ttt_steps']} ({r.get('setting', 'default')}): ours / speculators tokens/s {r['tokens_per_s_ratio']:.2f}x, "
            f"peak memory {r['peak_memory_ratio']:.2f}x")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ttt-steps", type=int, nargs="+", default=[3, 7])
    parser.add_argument(
        "--trainers", nargs="+", default=["ours", "speculators"], choices=["ours", "speculators"]
    )
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps first (torch.compile, allocator)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's train.batch_size")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the recipe's render.max_length")
    parser.add_argument("--loss", default="kl", help="our train.loss (speculators trains forward KL)")
    parser.add_argument("--speculators-optimizer", default="muon", choices=["muon", "adamw"],
                        help="speculators' --optimizer (its CLI's default: muon)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="a small Llama shape: seconds, any machine")
    parser.add_argument("--override", nargs="*", default=[],
                        help="our trainer's config overrides (train.compile=true, train.attention=flex)")  # fmt: skip
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument("--child", choices=["ours", "speculators"],
                        help="one trainer at the first K in this process, its result as a JSON line")  # fmt: skip
    args = parser.parse_args()
    if args.child:
        torch.manual_seed(0)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        args.ttt_steps = args.ttt_steps[0]
        run = run_ours if args.child == "ours" else run_speculators
        print(json.dumps(run(args, device)))
        return 0
    results, failed = [], []
    for k in args.ttt_steps:
        for trainer in args.trainers:
            command = [sys.executable, "-m", "bench.peer", "--child", trainer, "--ttt-steps", str(k), "--steps",
                       str(args.steps), "--warmup", str(args.warmup), "--loss", args.loss,
                       "--speculators-optimizer", args.speculators_optimizer]  # fmt: skip
            command += ["--tiny"] * args.tiny
            command += ["--override", *args.override] if args.override and trainer == "ours" else []
            command += ["--batch-size", str(args.batch_size)] if args.batch_size else []
            command += ["--seq-len", str(args.seq_len)] if args.seq_len else []
            done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                print(
                    f"{trainer} K={k}: the child failed:\n{done.stderr[-3000:]}", file=sys.stderr, flush=True
                )
                failed.append(f"{trainer} K={k}")
                continue
            r = json.loads(done.stdout.strip().splitlines()[-1])
            results.append(r)
            print(result_line(r), flush=True)
    for r in ratios(results):
        print(ratio_line(r))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"results": results, "ratios": ratios(results), "failed": failed}, indent=1)
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
