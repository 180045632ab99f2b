"""The measurement tools: the scripts that produced the numbers in the README and docs/, kept apart from the
code a user's run executes (the stages import nothing from here). Each runs from the repository root as a
module, `python -m bench.<name> --help`; `make bench` runs the data_prep and train ones at small settings.

    capture.py         data_prep: hidden-state caching (transformers, vLLM) against a plain forward
    regen.py           data_prep: regeneration alone against regeneration that captures in the same pass
    train_step.py      train: EAGLE-3 steps, tokens/s and peak memory per TTT depth K
    attention.py       train: the training attention alone at a recipe's shapes
    memory.py          train: one step per head kind at a GPU recipe's shapes beside the memory model
    profile.py         train: a step's split, FLOPs, MFU and top ops (bench.memory --profile)
    saved.py           train: what autograd keeps in one forward at a recipe's shapes, against the model
    padding.py         train: the share of padding in train's batches, one sample a row and packed
    gemm.py            train: a Linear's three products in fp32 and bf16 on this machine
    online.py          train: online training against training from the cache
    peer.py            train: our EAGLE-3 trainer beside speculators' (vLLM's own trainer)
    grid.py            train: several recipes on one cache at one budget, ranked by acceptance
    sampling_check.py  serving: does speculative decoding at temperature > 0 keep the target's text
    watch_trial.py     the watch: a head watched on real vLLM servers, then made to fail
    two_nodes.py       data_prep and train as two machines on this host, one of them lost mid-way
    gpu_check.py       what a lent GPU can prove in one call (docs/gpu.md#the-gpu-check)
"""

from argparse import ArgumentTypeError
from pathlib import Path

from artifacts.atomic import file_above


def new_file(value: str) -> Path:
    """argparse type of a tool's --out result file, checked before the tool runs for minutes: refused where
    something is there already (a result would be replaced without a word; a directory would fail at the
    end) or where it lies under a file."""
    path = Path(value)
    if path.exists() or path.is_symlink():
        what = "a directory" if path.is_dir() else "a file"
        raise ArgumentTypeError(f"{path} exists ({what}): name a new file, or move it away yourself")
    if (under := file_above(path)) is not None:
        raise ArgumentTypeError(f"{path} lies under {under}, which is a file: name a path in a directory")
    return path
