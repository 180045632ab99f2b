"""One training step of each head kind at a GPU recipe's real shapes, with random weights (nothing
downloaded): step time, tokens/s and peak memory, against the memory model of train/memory.py.

    python -m bench.memory --recipe llama31_8b --batch-size 1 --seq-len 512   # this CPU
    python -m bench.memory --recipe llama31_8b --steps 3 --online              # a GPU (recipe batch)
    python -m bench.memory --tiny                                             # seconds; tests
    python -m bench.memory --recipe llama31_8b --kinds eagle3 --batch-size 1 --seq-len 512 --profile \
        --lever train.fused_loss=false                                         # a lever's ratio, one run

Each head kind runs in a fresh child process (this script with `--child KIND`): the recipe's composed
config (conf/experiment/<recipe>.yaml) plus the kind's settings from docs/gpu.md (P-EAGLE: 4 layers, 4
depths, COD 0.7; DFlash: 5 layers, blocks of 16, 512 anchors, five target layers), the head built by
train's own `build_draft`, `DraftWithLoss` and AdamW, the target's shapes from TARGETS (its hub
config.json; `--tiny`: a small Llama shape). A micro-batch of random tokens, a quarter prompt and three
quarters answer, with random aux and final states (`--online`: a random bf16 target of the recipe's shape
computes them in the step, as `train.features=online` does). `--steps` full optimizer steps (forward under
train.mixed_precision's autocast, bf16 in every recipe; backward, clip, AdamW); the step time is the fastest after the first (the only one with
one step).

Peak memory over what the process held before the first step (weights, frozen target matrices, the batch,
an online target): on CUDA `torch.cuda.max_memory_allocated`; on CPU the peak resident set (Linux VmHWM,
reset before the step), allocator slack included. The model's prediction of the same quantity is printed
beside it, and its prediction for the recipe's own micro-batch (`train.batch_size` x `render.max_length`)
with DDP on 8 GPUs and online.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from artifacts.config import compose
from artifacts.vocab import VocabMap
from bench import new_file
from bench.train_step import autocast, mark_memory, peak_memory
from target.model import default_aux_layer_ids
from train.memory import GB, IN_SETUP, describe, peak_bytes, step_memory

REPO = Path(__file__).resolve().parent.parent

# The recipes' targets, from their hub config.json files (no download here).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
TARGETS = {
    "meta-llama/Llama-3.1-8B-Instruct": dict(
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=LLAMA3_ROPE,
        eos_token_id=128009,
    ),  # fmt: skip
    "Qwen/Qwen3-8B": dict(
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0},
        eos_token_id=151645,
    ),  # fmt: skip
    "Qwen/Qwen3-30B-A3B": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_theta": 1000000.0},
        eos_token_id=151645,
    ),  # fmt: skip
    "meta-llama/Llama-3.3-70B-Instruct": dict(
        model_type="llama",
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=LLAMA3_ROPE,
        eos_token_id=128009,
    ),  # fmt: skip
}
TINY = dict(
    model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=4096, rms_norm_eps=1e-5,
    eos_token_id=2,
)  # fmt: skip
# Each kind as docs/gpu.md runs it on the recipes (P-EAGLE: speculators' settings; DFlash: z-lab's).
KINDS = {
    "eagle3": [],
    "peagle": ["head.kind=peagle", "head.num_layers=4", "head.num_depths=4", "head.cod_ratio=0.7"],
    # One sample per micro-batch, 8 accumulated (the same global batch): 5 layers over 512 blocks of 16 per
    # sequence hold ~5.7x EAGLE-3's activations per sample (docs/gpu.md#memory).
    "dflash": ["head.kind=dflash", "head.num_layers=5", "head.block_size=16", "head.num_anchors=512",
               "head.norm_before_fc=false", "head.norm_output=false", "head.norm_before_residual=false",
               "train.batch_size=1", "train.gradient_accumulation_steps=8"],
}  # fmt: skip
ANSWER_FRACTION = 0.75


def recipe_config(recipe: str, kind: str, tiny: bool, extra: list[str]):
    """(cfg, target_config): the recipe composed with the kind's settings, and its target's shapes."""
    from transformers import AutoConfig

    overrides = [f"experiment={recipe}", "run_dir=/nonexistent", *KINDS[kind], "cache.aux_layer_ids=null"]
    if tiny:
        overrides += ["cache.draft_vocab_size=512", "head.num_anchors=64"]
    cfg = compose("config", [*overrides, *extra])
    fields = dict(TINY if tiny else TARGETS[cfg.target.path])
    return cfg, AutoConfig.for_model(fields.pop("model_type"), **fields)


def build_head(cfg, target_config, kind: str, device: str = "cpu"):
    """(draft, aux_ids, vocab): the head train builds for this recipe and kind, random, on `device`."""
    from train.model import build_draft

    v = target_config.vocab_size
    aux_ids = default_aux_layer_ids(target_config.num_hidden_layers, kind)
    vd = min(cfg.cache.draft_vocab_size, v)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[:vd] = True
    vocab = VocabMap(t2d, torch.zeros(vd, dtype=torch.int64), torch.zeros(v, dtype=torch.int64))
    with torch.device(device):
        draft = build_draft(cfg, target_config, {"aux_layer_ids": aux_ids}, vocab)
    if cfg.head.kind != "eagle1":
        draft.lm_head.weight.requires_grad_(not cfg.head.freeze_lm_head)  # as init_lm_head leaves it
    return draft, aux_ids, vocab


def predict(recipe: str, kind: str, batch_size: int | None, seq_len: int | None, world: int, zero_stage: int,
            online: bool | None, overrides: list[str] = (), answer_fraction: float = 1.0) -> dict:  # fmt: skip
    """The memory model's breakdown for one kind on a recipe (default: its own micro-batch, its own online
    setting), from the head built on the meta device: no weights allocated, instant at any size."""
    cfg, target_config = recipe_config(recipe, kind, False, list(overrides))
    draft, _, _ = build_head(cfg, target_config, kind, "meta")
    online = cfg.train.features == "online" if online is None else online
    return step_memory(cfg, draft, target_config, batch_size or cfg.train.batch_size,
                       seq_len or cfg.render.max_length, world, zero_stage, online, answer_fraction)  # fmt: skip


PACKED_SAMPLES = 4  # samples a packed row holds in the random batch (train.pack_length set)


def random_batch(cfg, target_config, aux_ids, batch_size: int, seq_len: int, device) -> dict:
    """Random tokens, a quarter prompt and the rest answer, with random aux and final states (fp32, as
    `collate` gives them), drawn on `device` from one seed: the same batch for every run on that device (a
    minute of random 8B-sized states on a GPU host's CPU, milliseconds on the GPU)."""
    device = torch.device(device)
    g = torch.Generator(device).manual_seed(0)
    b, t, h = batch_size, seq_len, target_config.hidden_size
    # With train.pack_length, PACKED_SAMPLES samples a row, each its own quarter prompt and answer.
    samples = PACKED_SAMPLES if cfg.train.pack_length is not None else 1
    starts_T = torch.arange(t, device=device) // -(-t // samples) * -(-t // samples)
    position_T = torch.arange(t, device=device) - starts_T
    length_T = torch.minimum(starts_T + -(-t // samples), torch.tensor(t, device=device)) - starts_T
    loss_mask = (position_T >= torch.round(length_T * (1 - ANSWER_FRACTION))).expand(b, t)
    batch = {
        "input_ids": torch.randint(0, target_config.vocab_size, (b, t), generator=g, device=device),
        "loss_mask": loss_mask.clone(),
        "attention_mask": torch.ones(b, t, dtype=torch.long, device=device),
        "aux_hidden": torch.randn(b, t, len(aux_ids), h, generator=g, device=device),
        "final_hidden": torch.randn(b, t, h, generator=g, device=device),
    }
    if samples > 1:
        batch["doc_starts"] = starts_T.expand(b, t).clone()
    return batch


def build_model(cfg, target_config, device) -> tuple:
    """(model, optimizer, aux_ids): train's DraftWithLoss around the head with random weights, and its AdamW,
    built on `device` (the random matrices too: seconds on a GPU where its host's CPU takes a minute)."""
    from train.model import DraftWithLoss
    from train.optim import make_optimizer

    v, h = target_config.vocab_size, target_config.hidden_size
    draft, aux_ids, vocab = build_head(cfg, target_config, cfg.head.kind, device)
    g = torch.Generator(device).manual_seed(1)
    lm_head = (0.02 * torch.randn(v, h, generator=g, device=device)).to(torch.bfloat16)
    draft.load_target_embedding(0.02 * torch.randn(v, h, generator=g, device=device))
    draft_to_target = vocab.draft_to_target.to(device)
    if cfg.head.lm_head_init == "target":  # init_lm_head without reading the target's norm from disk
        with torch.no_grad():
            draft.lm_head.weight.copy_(lm_head[draft_to_target].float())
    model = DraftWithLoss(draft, lm_head, draft_to_target, cfg, aux_ids).to(device)
    model.train()
    return model, make_optimizer(cfg, model), aux_ids


def synchronize(device) -> float:
    """perf_counter once the device has finished what was queued (phases of a step timed as they ran)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def train_step(
    model, optimizer, batch: dict, max_grad_norm: float, device, states=None, precision: str = "bf16"
) -> dict:
    """One optimizer step as train's loop takes it (forward under `precision`'s autocast, backward, clip,
    AdamW), each phase synchronised: its seconds by phase."""
    start = synchronize(device)
    step_batch = dict(batch)
    if states is not None:  # online: the target computes the states inside the step
        step_batch["aux_hidden"], step_batch["final_hidden"] = states(
            batch["input_ids"], batch["attention_mask"]
        )
    with autocast(device, precision):
        loss, _ = model(step_batch)
    forward = synchronize(device)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    backward = synchronize(device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    end = synchronize(device)
    return {
        "fwd_s": forward - start,
        "bwd_s": backward - forward,
        "opt_s": end - backward,
        "step_s": end - start,
    }


def child(args) -> dict:
    """One kind's setup and steps in this process; the measurement as a dict."""
    from train.data import OnlineStates

    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, target_config = recipe_config(args.recipe, args.child, args.tiny, args.override)
    args.batch_size = args.batch_size or (2 if args.tiny else cfg.train.batch_size)
    args.seq_len = args.seq_len or (256 if args.tiny else cfg.render.max_length)
    model, optimizer, aux_ids = build_model(cfg, target_config, device)
    draft = model.draft
    batch = random_batch(cfg, target_config, aux_ids, args.batch_size, args.seq_len, device)
    states = None
    if args.online:
        from transformers import AutoModelForCausalLM

        with torch.device(device):  # built where it runs: 8B random weights in seconds on a GPU
            target = AutoModelForCausalLM.from_config(target_config, dtype=torch.bfloat16).eval()
        states = OnlineStates(target, aux_ids)
        del batch["aux_hidden"], batch["final_hidden"]
    before, _ = mark_memory(device)
    precision = cfg.train.mixed_precision
    phases = [train_step(model, optimizer, batch, cfg.optim.max_grad_norm, device, states, precision)
              for _ in range(args.steps)]  # fmt: skip
    peak = peak_memory(device)
    fastest = min(phases[1:] or phases, key=lambda p: p["step_s"])
    predicted = step_memory(cfg, draft, target_config, args.batch_size, args.seq_len, online=args.online,
                            answer_fraction=ANSWER_FRACTION)  # fmt: skip
    recipe_batch = step_memory(cfg, draft, target_config, cfg.train.batch_size, cfg.render.max_length,
                               world=8, online=cfg.train.features == "online", answer_fraction=1.0)  # fmt: skip
    step_s = fastest["step_s"]
    profiled = (
        profile_step(args, model, optimizer, batch, cfg, device, states, fastest) if args.profile else {}
    )
    return {
        "kind": cfg.head.kind,
        "device": device_name(device),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "online": args.online,
        "step_s": round(step_s, 3),
        "tokens_per_s": round(args.batch_size * args.seq_len / step_s, 1),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_over_setup_gb": round((peak - before) / GB, 3),
        "predicted_over_setup_gb": round(peak_bytes(predicted, in_setup=False) / GB, 3),
        "predicted_breakdown": describe({k: v for k, v in predicted.items() if k not in IN_SETUP}, False),
        "peak_gb": round(peak / GB, 3),
        "predicted_gb": round(peak_bytes(predicted) / GB, 3),
        "recipe_batch": f"{cfg.train.batch_size} x {cfg.render.max_length}",
        "recipe_predicted_gb": round(peak_bytes(recipe_batch) / GB, 1),
        "recipe_breakdown": describe(recipe_batch),
        **profiled,
    }


def profile_step(args, model, optimizer, batch, cfg, device, states, phases: dict) -> dict:
    """bench/profile.py's measurements of this kind's step: its split by part, FLOPs a token (model and
    recomputed), achieved TFLOP/s and MFU, the top ops; after the timed steps, so they time nothing else."""
    from bench import profile

    precision = cfg.train.mixed_precision

    def step():
        return train_step(model, optimizer, batch, cfg.optim.max_grad_norm, device, states, precision)

    tokens = args.batch_size * args.seq_len
    flops = profile.step_flops(step)
    peak = profile.peak_flops(device)
    achieved = flops["model"] / phases["step_s"]
    return {
        "split": {
            k: round(v, 4)
            for k, v in profile.split(phases, profile.loss_parts(model, batch, device, precision)).items()
        },
        "flops_per_token": {k: round(v / tokens) for k, v in flops.items()},
        "achieved_tflops": round(achieved / 1e12, 3),
        "mfu": None if peak is None else round(achieved / peak, 4),
        "top_ops": profile.top_ops(step, device),
    }


def device_name(device) -> str:
    """The GPU's name, or the CPU's."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def result_line(m: dict) -> str:
    """One head kind's step beside the model, as the benchmark and the GPU check print it."""
    return (f"{m['kind']:7s} {m['batch_size']} x {m['seq_len']}{' online' if m['online'] else ''} on {m['device']}: "
            f"{m['step_s']:.3f} s/step, {m['tokens_per_s']:.0f} tokens/s, peak {m['peak_gb']:.2f} GB "
            f"(model {m['predicted_gb']:.2f}), over setup {m['peak_over_setup_gb']:.2f} GB "
            f"(model {m['predicted_over_setup_gb']:.2f})")  # fmt: skip


def child_result(command: list[str], label: str) -> dict:
    """Run a benchmark's child process (one setting, its memory returned at exit); its last stdout line, JSON."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(
            f"{label}: the benchmark's child failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="llama31_8b", help="conf/experiment/<recipe>.yaml")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--batch-size", type=int, default=None, help="default: the recipe's train.batch_size")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the recipe's render.max_length")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--online", action="store_true", help="a random bf16 target computes the states")
    parser.add_argument("--tiny", action="store_true", help="a small Llama shape: seconds, any machine")
    parser.add_argument("--override", nargs="*", default=[], help="more config overrides, key=value")
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also the step's split, FLOPs, MFU and top ops (bench/profile.py)",
    )
    parser.add_argument(
        "--lever", nargs="*", default=[],
        help="overrides each measured beside the default in the same run (train.fused_loss=false): step-time ratios",
    )  # fmt: skip
    parser.add_argument("--predict", action="store_true", help="only the model's breakdown (ZeRO-2, 8 GPUs)")
    parser.add_argument(
        "--child", choices=list(KINDS), help="one kind in this process, its result as a JSON line"
    )
    args = parser.parse_args()
    if args.predict:
        for kind in args.kinds:
            breakdown = predict(args.recipe, kind, args.batch_size, args.seq_len, 8, 2, None, args.override)
            print(f"{args.recipe} {kind:7s}: {describe(breakdown)}")
        return
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    settings = [("default", [])] + [(lever, [lever]) for lever in args.lever]
    for kind in args.kinds:
        steps = {}
        for name, extra in settings:  # each lever beside the default, one kind after the other
            command = [sys.executable, "-m", "bench.memory", "--child", kind, "--recipe", args.recipe, "--steps", str(args.steps),
                       "--override", *args.override, *extra]  # fmt: skip
            command += ["--online"] * args.online + ["--tiny"] * args.tiny + ["--profile"] * args.profile
            command += ["--batch-size", str(args.batch_size)] if args.batch_size else []
            command += ["--seq-len", str(args.seq_len)] if args.seq_len else []
            result = {**child_result(command, f"{kind} ({name})"), "setting": name}
            results.append(result)
            steps[name] = result["step_s"]
            label = "" if name == "default" else f" [{name}]"
            print(f"{args.recipe} {result_line(result)}{label}: {result['predicted_breakdown']}; recipe's "
                  f"{result['recipe_batch']} on 8 GPUs: {result['recipe_breakdown']}", flush=True)  # fmt: skip
            if args.profile:
                from bench.profile import profile_line

                print(f"{args.recipe} {profile_line(result)}{label}", flush=True)
        for lever in args.lever:
            print(f"{args.recipe} {kind:7s} step time {lever} / default: {steps[lever] / steps['default']:.3f} "
                  f"({steps[lever]:.3f} s against {steps['default']:.3f} s)", flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
