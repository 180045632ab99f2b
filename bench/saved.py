"""What autograd keeps for backward in one training forward at a recipe's real shapes, tensor by tensor,
against train/memory.py's model of it (docs/benchmarks.md#what-autograd-keeps).

    python -m bench.saved                                          # each kind and objective, llama31_8b
    python -m bench.saved --settings eagle3 eagle3:train.loss=tv --seq-len 512

The recipe's head, one sample of its micro-batch (`--batch-size`; the per-token counts are the whole
micro-batch's, and four 8B-width samples' activations do not fit a 24 GB machine) and a random batch as
bench/memory.py builds them (a kind's settings from
its KINDS), the forward of train's DraftWithLoss under train.mixed_precision's autocast (bf16 in every
recipe), with `torch.autograd.graph.saved_tensors_hooks` seeing every tensor it saves. What is counted is
what the graph still holds when the forward returns (the fused loss rows' per-chunk graphs are freed
inside it), each storage once, split into the head's own weights (not counted), their half-precision
copies (`half_weight_copies` in the model) and the rest (the model's `activations` and `teacher`), with
the ops that made the largest ones.

Its products are skipped: `Skip` hands back zeros of each matrix product's and attention kernel's output
(its shape, strides and dtype, found on the meta device), so that an 8B-width forward of 4 x 2,048 tokens
takes a minute on a 2-core CPU rather than hours. What autograd saves follows the shapes, and one choice
that values make: the zeros make the teacher's argmax token 0, in the draft vocabulary, so every answer
position trains - the case the model counts (a random head's real forward would train only the quarter of
positions whose random argmax falls in the draft vocabulary). tests/test_train_memory.py checks that the
skipped forward saves what the real one does where the draft vocabulary is the target's.
"""

from __future__ import annotations

import argparse
import json
import sys
import weakref
from collections import defaultdict

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from bench import new_file
from bench.memory import ANSWER_FRACTION, KINDS, build_model, child_result, random_batch, recipe_config
from bench.train_step import autocast
from train.memory import GB, step_memory

aten = torch.ops.aten
# The products a forward (and the fused loss rows' gradients within it) computes: skipped by `Skip`.
PRODUCTS = {
    aten.mm.default,
    aten.addmm.default,
    aten.bmm.default,
    aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
# Each kind with the default objective, then EAGLE-3 with each other objective and loss path.
SETTINGS = [
    "eagle3",
    "peagle",
    "dflash:head.num_layers=1",  # five layers of 8B-width blocks do not fit a 24 GB machine: one
    "eagle3:train.loss=tv",
    "eagle3:train.loss=nla",
    "eagle3:train.loss=lk",
    "eagle3:train.loss=0.1*kl+0.9*tv",
    "eagle3:train.alpha_on=draft_vocab,train.loss=tv",
    "eagle3:head.position_weights=dpace",
    "peagle:head.position_weights=dpace",
    "dflash:head.num_layers=1,head.position_weights=dpace",
    "eagle3:train.fused_loss=false",
]


class Skip(TorchDispatchMode):
    """Runs every op but the PRODUCTS, whose outputs it gives as zeros of their shape, strides and dtype;
    remembers which op made each storage (`made_by`: storage pointer -> op name; views and in-place ops
    keep their input's; a cast of one of the `weights` storages is "weight cast")."""

    def __init__(self, skip: bool = True, weights: frozenset = frozenset()):
        super().__init__()
        self.skip, self.weights, self.made_by, self.skipped = skip, weights, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.skip and func in PRODUCTS:
            meta = pytree.tree_map_only(torch.Tensor, lambda x: x.to("meta"), (args, kwargs))
            shapes, self.skipped = func(*meta[0], **meta[1]), self.skipped + 1
            out = pytree.tree_map_only(torch.Tensor, lambda m: zeros_as(m, args), shapes)
        else:
            out = func(*args, **kwargs)
        inputs = {storage(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        name = "weight cast" if func is aten._to_copy.default and inputs <= self.weights else func.__name__
        for x in pytree.tree_leaves(out):
            if isinstance(x, torch.Tensor) and storage(x) not in inputs:
                self.made_by[storage(x)] = name
        return out


def storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


def zeros_as(meta: torch.Tensor, args) -> torch.Tensor:
    """Zeros with `meta`'s shape, strides and dtype on the device of the op's first tensor argument."""
    device = next(x.device for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor))
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device).zero_()


def saved_by_forward(model, batch: dict, precision: str, skip: bool = True) -> tuple[dict, dict, int]:
    """({storage pointer: bytes}, {storage pointer: (dtype, op)}, products skipped) of what one forward of
    `model` on `batch` leaves saved for backward."""
    refs = []

    def pack(x):
        refs.append(weakref.ref(x))
        return x

    mode = Skip(skip, frozenset(storage(w) for w in model.parameters()))
    with mode, autocast("cpu", precision), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, _ = model(batch)
    assert loss.requires_grad
    sizes, about = {}, {}
    for ref in refs:
        if (x := ref()) is not None:
            ptr = storage(x)
            sizes[ptr] = x.untyped_storage().nbytes()
            about[ptr] = (x.dtype, mode.made_by.get(ptr, "input"))
    del loss
    return sizes, about, mode.skipped


def count(model, sizes: dict, about: dict) -> dict:
    """The saved bytes split as the memory model splits them: the head's weights (held anyway), their
    half-precision copies (autocast's casts of a matrix), the rest (activations and teacher), with the
    largest producers of the rest by op and dtype."""
    weights = {storage(p) for p in [*model.parameters(), *model.buffers()]}
    split = {"weights": 0, "half_weight_copies": 0, "activations": 0}
    producers = defaultdict(int)
    for ptr, nbytes in sizes.items():
        dtype, op = about[ptr]
        if ptr in weights:
            split["weights"] += nbytes
        elif op == "weight cast":
            split["half_weight_copies"] += nbytes
        else:
            split["activations"] += nbytes
            producers[f"{op} {str(dtype).removeprefix('torch.')}"] += nbytes
    top = sorted(producers.items(), key=lambda kv: -kv[1])[:8]
    return {**split, "producers": {name: round(b / GB, 3) for name, b in top}}


def measure(recipe: str, setting: str, batch_size: int = 1, seq_len: int | None = None) -> dict:
    """One setting ("kind" or "kind:key=value,key=value"): saved bytes against the model's."""
    kind, _, extra = setting.partition(":")
    torch.manual_seed(0)
    cfg, target_config = recipe_config(recipe, kind, False, [e for e in extra.split(",") if e])
    b, t = batch_size, seq_len or cfg.render.max_length
    model, _, aux_ids = build_model(cfg, target_config, "cpu")
    batch = random_batch(cfg, target_config, aux_ids, b, t, "cpu")
    sizes, about, _ = saved_by_forward(model, batch, cfg.train.mixed_precision)
    measured = count(model, sizes, about)
    packed = cfg.train.pack_length is not None
    predicted = step_memory(
        cfg, model.draft, target_config, b, t, answer_fraction=ANSWER_FRACTION, packed=packed
    )
    modelled = predicted["activations"]  # the teacher rows are held beside the graph, never saved in it
    return {
        "setting": setting,
        "shape": f"{b} x {t}",
        "saved_gb": round(measured["activations"] / GB, 3),
        "model_gb": round(modelled / GB, 3),
        "ratio": round(modelled / measured["activations"], 3),
        "weight_copies_gb": round(measured["half_weight_copies"] / GB, 3),
        "model_weight_copies_gb": round(predicted["half_weight_copies"] / GB, 3),
        "producers": measured["producers"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="llama31_8b", help="conf/experiment/<recipe>.yaml")
    parser.add_argument("--settings", nargs="+", default=SETTINGS, help='"kind" or "kind:key=value,..."')
    parser.add_argument("--batch-size", type=int, default=1, help="samples in the micro-batch")
    parser.add_argument("--seq-len", type=int, default=None, help="default: the recipe's render.max_length")
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help="one setting in this process, as a JSON line")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.recipe, args.settings[0], args.batch_size, args.seq_len)))
        return
    results = []
    for setting in args.settings:  # each in a fresh process: an 8B-width head's memory is returned at exit
        if setting.partition(":")[0] not in KINDS:
            parser.error(f"{setting}: the kind must be one of {', '.join(KINDS)}")
        command = [sys.executable, "-m", "bench.saved", "--child", "--recipe", args.recipe, "--settings", setting,
                   "--batch-size", str(args.batch_size)] + ["--seq-len", str(args.seq_len)] * bool(args.seq_len)  # fmt: skip
        r = child_result(command, setting)
        results.append(r)
        print(f"{args.recipe} {r['setting']} {r['shape']}: saved {r['saved_gb']:.2f} GB, model {r['model_gb']:.2f} "
              f"GB ({r['ratio'] - 1:+.1%}); bf16 weight copies {r['weight_copies_gb']:.2f} GB, model "
              f"{r['model_weight_copies_gb']:.2f}; largest: {r['producers']}", flush=True)  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
