"""The held-out estimate of a trained head at the k it would be served with: train's held-out metrics
(`train/metrics.py evaluate`: per-position accuracy, conditional accuracy, expected acceptance length) for
any `draft_head/`, on a run's cache, without training - e.g. an older head, or one trained before its
held-out metrics were taken as it is served (a DFlash head's blocks are 1 + k long here).

    python train/held_out.py runs/before_dflash/draft_head --run-dir runs/smollm2 --k 3
    python train/held_out.py HEAD --run-dir RUN --k 3 experiment=smollm2_dflash   # + config overrides

Prints one JSON line: the head, k, and the metrics train logs as eval/* (eval/accept_len_k<k> the estimate).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from accelerate import Accelerator

from artifacts.cache import CacheSplit
from artifacts.config import compose
from artifacts.vocab import load_vocab_map
from heads.head_file import load_draft
from target.model import load_embedding_and_lm_head
from train.metrics import evaluate
from train.model import DraftWithLoss, num_loss_steps


def held_out(head_dir: Path, run_dir: Path, k: int, overrides: list[str]) -> dict:
    """Train's held-out metrics of the head in `head_dir` on `run_dir`'s cache, served at k."""
    record, draft = load_draft(head_dir)
    settings = record.training.get("settings", {}).get("head", {})
    head = [f"head.{key}={value}" for key, value in settings.items() if isinstance(value, (int, float, str))]
    vocab = load_vocab_map(head_dir / "vocab.safetensors")
    metrics = held_out_of(
        draft, vocab.draft_to_target, record.cache.get("aux_layer_ids"), run_dir, k,
        [*overrides, *head, f"head.kind={record.kind}"],
    )  # fmt: skip
    return {"head": str(head_dir), **metrics}


def held_out_of(
    draft, draft_to_target, cache_layer_ids: list[int] | None, run_dir: Path, k: int, overrides: list[str]
) -> dict:
    """Train's held-out metrics of any draft (one trained here, or an export read back as vLLM reads it:
    bench/peer_heads.py) on `run_dir`'s cache, served at k; `overrides` name its head.kind and settings."""
    cfg = compose("config", [f"run_dir={run_dir}", *overrides, f"export.num_speculative_tokens={k}"])
    embed, lm_head = load_embedding_and_lm_head(cfg.target)
    draft.load_target_embedding(embed.float())
    if draft_to_target is None:  # an unpruned vocabulary: draft ids are target ids
        draft_to_target = torch.arange(lm_head.shape[0])
    model = DraftWithLoss(draft, lm_head, draft_to_target, cfg, cache_layer_ids)
    with torch.no_grad():
        metrics = evaluate(
            Accelerator(cpu=True), model, CacheSplit(run_dir / "cache", "eval"), 4, num_loss_steps(cfg)
        )
    return {"k": k, **(metrics or {})}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("head_dir", type=Path, help="a draft_head/ directory")
    parser.add_argument(
        "--run-dir", type=Path, required=True, help="the run whose cache's held-out split to use"
    )
    parser.add_argument("--k", type=int, required=True, help="drafts per round, as served")
    args, overrides = parser.parse_known_args()  # the rest: config overrides (the run's experiment=...)
    print(json.dumps(held_out(args.head_dir, args.run_dir.resolve(), args.k, overrides)), flush=True)


if __name__ == "__main__":
    main()
