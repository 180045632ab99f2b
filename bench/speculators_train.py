"""speculators 0.9's own trainer (vLLM's) on this pipeline's cache: the peer heads of bench/peer_heads.py.

    python -m bench.speculators_train --run-dir runs/peer --out runs/peer/peer/peagle/speculators_s0 \
        --kind peagle --seed 0 -- experiment=smollm2_quick

It trains exactly what our trainer trains on (the cache's train split: the same tokens, loss masks, aux and
final hidden states, draft vocabulary) with speculators' code end to end: its CLI's config resolution and
defaults (`TrainConfig.resolve`), its model builder (`build_draft_model`: the verifier's embedding, lm_head
rows and final norm read from the target's own safetensors), its packing sampler and collate with its
batch shift (`_setup_dataloader`, `shift_batch`), its `Trainer` (Muon + AdamW, its schedule, its loss
normalisation) and its checkpointer (`save_pretrained`). What we set, and why:
- the head's shape as ours (layers, the depths or TTT steps served, the aux layer ids, the draft
  vocabulary as d2t/t2d files), so that the two heads differ in their recipe only;
- the number of epochs (ours), so that both see the same tokens;
- on a CPU: `--draft-attn-impl sdpa` and `--loss-implementation eager` (FlexAttention has no CPU backward,
  its fused losses need Triton on CUDA), `--hidden-states-dtype float32` (its trainer autocasts on CUDA
  only, so on a CPU its head computes in fp32 and takes fp32 inputs: our bf16 states, exactly), and no
  data-loader workers.
The adapter (`CacheDataset`) hands speculators unshifted samples, as its own dataset does, with two
conventions translated:
- `verifier_last_hidden_states` is the target's last state BEFORE its final norm (speculators norms it with
  the verifier's norm itself); our cache holds it after the norm, and x / w (w the norm's weight) is the
  state whose norm is ours again (its RMS is 1 up to the norm's epsilon);
- its loss mask at token j trains the prediction made where x_j is the input token (of x_{j+1}); ours trains
  the prediction of an answer token, so its mask is ours shifted left by one.
`tests/test_peer_heads.py` holds both: its teacher at every trained position equals ours.
The last epoch's checkpoint (config.json + model.safetensors, as `save_pretrained` wrote them) is copied to
<out>/export, which vLLM serves as it is; <out>/speculators.json records the settings and the step times.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from artifacts import atomic
from artifacts.cache import CacheSplit
from artifacts.config import compose
from artifacts.vocab import load_vocab_map
from bench.peer import record_steps, speculators_on_this_machine
from target.model import load_final_norm, target_dir
from train.model import head_layer_ids

# speculators' algorithm names for our head kinds (DFlash: its trainer reads the cache's layers otherwise,
# and needs a target's last layer the cache may not hold: not adapted here)
ALGORITHMS = {"eagle3": "eagle3", "peagle": "peagle"}


def speculators_argv(
    cfg, kind: str, aux_ids: list[int], vocab_dir: Path, save_path: Path, seed: int
) -> list[str]:
    """speculators' CLI arguments for a head of our shape on our data; everything else its defaults."""
    if kind not in ALGORITHMS:
        raise ValueError(f"head.kind={kind}: speculators is driven here for {sorted(ALGORITHMS)} only")
    cpu = not torch.cuda.is_available()
    argv = [
        "--speculator-type", ALGORITHMS[kind],
        "--verifier-name-or-path", str(target_dir(cfg.target)),
        "--data-path", str(save_path / "unused_data"),  # its own dataset is not read: ours is handed in
        "--save-path", str(save_path),
        "--epochs", str(cfg.train.num_epochs),
        "--seed", str(seed),
        "--target-layer-ids", *map(str, aux_ids),
        "--draft-vocab-size", str(len(np.load(vocab_dir / "d2t.npy"))),
        "--d2t-path", str(vocab_dir / "d2t.npy"),
        "--t2d-path", str(vocab_dir / "t2d.npy"),
        "--draft-arch", "llama",  # our heads' layer (its P-EAGLE default is Qwen3's)
        "--num-workers", "0",
    ]  # fmt: skip
    if kind == "peagle":
        argv += ["--num-layers", str(cfg.head.num_layers), "--num-depths", str(cfg.head.num_depths)]
    else:
        argv += ["--ttt-steps", str(cfg.head.num_ttt_steps)]
    if cpu:  # its trainer autocasts on CUDA only: on a CPU the head computes in fp32, so its inputs must be
        argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
                 "--hidden-states-dtype", "float32"]  # fmt: skip
    return argv


def write_vocab_files(cache_dir: Path, out: Path) -> Path:
    """Our draft vocabulary as the d2t / t2d .npy files speculators' CLI loads (`_load_mappings`)."""
    vocab = load_vocab_map(cache_dir / "vocab.safetensors")
    if vocab.d2t is None:
        raise ValueError(
            f"{cache_dir}: an unpruned draft vocabulary; speculators is driven with d2t/t2d files"
        )
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "d2t.npy", vocab.d2t.numpy())
    np.save(out / "t2d.npy", vocab.t2d.numpy())
    return out


def speculators_sample(sample: dict, norm_weight_H: torch.Tensor, aux_index: list[int] | None) -> dict:
    """One cache sample as speculators' dataset yields it (unshifted: its collate's `shift_batch` shifts)."""
    aux_TAH = sample["aux_hidden"] if aux_index is None else sample["aux_hidden"][:, aux_index]
    mask_T = torch.zeros_like(sample["loss_mask"])
    mask_T[:-1] = sample["loss_mask"][1:]
    return {
        "hidden_states": aux_TAH.flatten(1),  # [T, A * H], ascending layer ids as vLLM concatenates
        "input_ids": sample["input_ids"],
        "verifier_last_hidden_states": sample["final_hidden"].float() / norm_weight_H,
        "loss_mask": mask_T,
    }


def divisor_norm_weight(cfg) -> torch.Tensor:
    """The final norm's weight w by which `speculators_sample` divides our post-norm states: speculators
    applies the target's final norm to what it is handed, and RMSNorm(x / w) = x only where that norm is
    x / rms(x) * w with no zero in w. Refused, naming the target, where either fails: checked on the target's
    own norm module (built on the meta device, run on a random state), so a (1 + w) norm (Gemma, Qwen3.5,
    Qwen3-Next) is caught whatever its name."""
    import copy

    from transformers import AutoModelForCausalLM

    from target.model import load_config

    weight_H = load_final_norm(cfg.target)
    where = target_dir(cfg.target)
    zeros = (weight_H == 0).nonzero().flatten()
    if len(zeros):
        raise ValueError(
            f"{where}: the final norm's weight is 0 in {len(zeros)} of {len(weight_H)} channels (first "
            f"{int(zeros[0])}): our post-norm states cannot be divided back for speculators' trainer"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(cfg.target))
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise ValueError(f"{where}: {type(model).__name__} has no model.norm: not a target the adapter knows")
    norm = copy.deepcopy(norm).to_empty(device="cpu").float()
    x_TH = torch.randn(4, len(weight_H), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        norm.weight.copy_(weight_H)
        expected = x_TH * torch.rsqrt(x_TH.pow(2).mean(-1, keepdim=True) + norm_eps(norm)) * weight_H
        plain = torch.allclose(norm(x_TH), expected, rtol=1e-4, atol=1e-5)
    if not plain:
        raise ValueError(
            f"{where}: the target's final norm ({type(norm).__name__}) is not x / rms(x) * w (Gemma and "
            "Qwen3.5-style norms scale by 1 + w): the speculators adapter cannot hand it our states"
        )
    return weight_H


def norm_eps(norm) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        if isinstance(getattr(norm, name, None), float):
            return getattr(norm, name)
    return 1e-6


def cache_dataset(split: CacheSplit, norm_weight_H: torch.Tensor, aux_index, max_len: int, dtype):
    """Our cache split as a speculators dataset (its `BaseDataset`: lengths for its packing sampler,
    `lengths` and `position_ids` added by its __getitem__)."""
    from speculators.train.data import BaseDataset

    class CacheDataset(BaseDataset):
        def _compute_approx_lengths(self):
            return list(split.lengths)

        def __len__(self):
            return len(split)

        def _get_raw_data(self, index):
            return speculators_sample(split[index], norm_weight_H, aux_index)

    return CacheDataset(max_len, dtype)


def train(run_dir: Path, out: Path, kind: str, seed: int, overrides: list[str], extra: list[str]) -> dict:
    """Train one speculators head on `run_dir`'s cache into `out` (export/ and speculators.json)."""
    from speculators.model import SpeculatorModel
    from speculators.models.eagle3 import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig
    from speculators.train.dataloader import _setup_dataloader
    from speculators.train.trainer import Trainer, TrainerConfig

    cfg = compose("config", [f"run_dir={run_dir}", *overrides, f"head.kind={kind}"])
    cache_dir = run_dir / "cache"
    split = CacheSplit(cache_dir, "train")
    aux_ids = head_layer_ids(cfg, split.manifest)
    cached = list(split.manifest["aux_layer_ids"])
    aux_index = None if aux_ids == cached else [cached.index(i) for i in aux_ids]
    save_path = out / "speculators"
    vocab_dir = write_vocab_files(cache_dir, out / "vocab")
    argv = speculators_argv(cfg, kind, aux_ids, vocab_dir, save_path, seed) + extra
    spec = TrainConfig.resolve(argv)
    args = argparse.Namespace(**spec.flatten())
    set_seed(args.seed, args.deterministic_cuda)
    speculators_on_this_machine()
    d2t, t2d, vocab_size = parse_vocab_mappings(args)
    model = build_draft_model(args, SpeculatorModel.registry[args.speculator_type], t2d, d2t, vocab_size)
    hidden_dtype = getattr(torch, args.hidden_states_dtype)
    dataset = cache_dataset(split, divisor_norm_weight(cfg), aux_index, args.total_seq_len, hidden_dtype)
    loader = _setup_dataloader(
        dataset, args.total_seq_len, model.config.transformer_layer_config.hidden_size, num_workers=0,
        num_target_layers=len(aux_ids), prefetch_factor=None, preprocess=shift_batch, seed=args.seed,
    )  # fmt: skip
    train_kwargs, _ = SpeculatorModel.registry[args.speculator_type].get_trainer_kwargs(**vars(args))
    trainer_config = TrainerConfig(
        num_epochs=args.epochs, save_path=args.save_path, lr=args.lr, resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs, optimizer=args.optimizer, weight_decay=args.weight_decay,
        muon_lr=args.muon_lr, muon_momentum=args.muon_momentum, muon_weight_decay=args.muon_weight_decay,
        muon_ns_steps=args.muon_ns_steps, muon_adjust_lr_fn=args.muon_adjust_lr_fn,
        scheduler_type=args.scheduler_type, scheduler_warmup_steps=args.scheduler_warmup_steps,
        scheduler_warmup_ratio=args.scheduler_warmup_ratio, scheduler_total_steps=args.scheduler_total_steps,
        scheduler_num_cosine_cycles=args.scheduler_num_cosine_cycles, checkpoint_freq=args.checkpoint_freq,
        hidden_states_dtype=hidden_dtype, log_freq=args.log_freq, max_steps=args.max_steps,
    )  # fmt: skip
    times = record_steps()
    start = time.perf_counter()
    Trainer(model, trainer_config, loader, None).run_training()
    seconds = time.perf_counter() - start
    last = save_path / str(args.epochs - 1)
    export = out / "export"
    export.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(last / name, export / name)
    step_s = [s["profile"]["step_ms"] / 1e3 for s in times.steps]
    record = {
        "trainer": f"speculators {importlib.metadata.version('speculators')}",
        "kind": kind,
        "seed": seed,
        "argv": argv + extra,
        "settings": {k: args_value(v) for k, v in sorted(vars(args).items())},
        "num_steps": len(step_s),
        "tokens_per_step": [round(s["profile"]["tokens_per_s"] * s["profile"]["step_ms"] / 1e3) for s in times.steps],
        "step_s_median": statistics.median(step_s) if step_s else None,
        "train_seconds": seconds,
        "first_step_metrics": times.steps[0]["train"] if times.steps else None,
        "last_step_metrics": times.steps[-1]["train"] if times.steps else None,
        "compute_dtype": "float32 (autocast is CUDA-only in its trainer)" if not torch.cuda.is_available()
        else str(hidden_dtype),
        "hidden_states_dtype": args.hidden_states_dtype,
        "threads": torch.get_num_threads(),
        "checkpoint": str(last),
    }  # fmt: skip
    atomic.write_text(out / "speculators.json", json.dumps(record, indent=1))
    return record


def args_value(value):
    return value if isinstance(value, (int, float, str, bool, type(None), list)) else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run-dir", type=Path, required=True, help="the run whose cache to train on")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for this head")
    parser.add_argument("--kind", choices=sorted(ALGORITHMS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speculators-arg", action="append", default=[],
                        help="one more speculators CLI argument (repeat; e.g. --speculators-arg=--optimizer "
                        "--speculators-arg=adamw): an ablation")  # fmt: skip
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    if any((args.out / name).exists() for name in ("speculators", "export")):
        raise SystemExit(f"{args.out} holds a head already: choose a new --out (nothing is replaced)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    record = train(
        args.run_dir.resolve(), args.out.resolve(), args.kind, args.seed, overrides, args.speculators_arg
    )
    print(json.dumps({k: record[k] for k in ("kind", "seed", "num_steps", "step_s_median", "train_seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
