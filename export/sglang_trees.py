"""SGLang's EAGLE-2 tree settings for a head, estimated where SGLang cannot serve (heads/tree.py): the
accepted tokens per round of a grid of (`--speculative-num-steps`, `--speculative-eagle-topk`,
`--speculative-num-draft-tokens`) on the held-out prompts, the chain of k beside them, SGLang's default for
Llama targets (5, 4, 8), and the recommendation the model card gives: the highest estimated acceptance
within SGLang's default budget of 8 verified tokens (more tokens cost verification compute that a batch
pays for; what a GPU run must confirm: docs/sglang.md#trees).

    python export/sglang_trees.py experiment=smollm2_eagle3 run_dir=runs/smollm2_eagle3   # <run_dir>/sglang_trees.json

export/main.py runs it for `export.engine=sglang|both` and writes the result beside the export.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from tqdm import tqdm

from artifacts import atomic
from artifacts.config import check_config, register_configs
from artifacts.prompts import stop_token_ids
from export.verify import verification_prompts
from heads.acceptance import AcceptanceCounts
from heads.head_file import read_record
from heads.reference_decoder import inference_device, load_head
from heads.tree import chain_accepted, greedy_run, tree_counts
from target.model import DTYPES, load_tokenizer, target_dir

log = logging.getLogger("sglang_trees")

SGLANG_DEFAULT = (5, 4, 8)  # SGLang 0.5.23's choice for Llama targets (speculative_hook.py:1430-1461)
BUDGET = 8  # verified tokens per round the recommendation stays within: SGLang's default


def grid(k: int) -> list[tuple[int, int, int]]:
    """(num_steps, topk, num_draft_tokens): chains of k and 5, trees of 3 and 5 steps, topk 2 and 4, 4 to
    16 verified tokens (each at most the nodes drafted)."""
    settings = {(k, 1, k + 1), (5, 1, 6)}
    for steps in (3, 5):
        for topk in (2, 4):
            for tokens in (4, 8, 16):
                if tokens - 1 <= topk + (steps - 1) * topk * topk:
                    settings.add((steps, topk, tokens))
    return sorted(settings)


@torch.inference_mode()
def tree_grid(
    target_path: Path,
    head_dir: Path,
    prompts: list[list[int]],
    k: int,
    max_new_tokens: int,
    stop_ids,
    dtype: str = "float32",
) -> dict:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=DTYPES[dtype]).eval()
    target = target.to(inference_device())
    head = load_head(head_dir, target)
    settings = grid(k)
    longest = max(steps for steps, _, _ in settings)
    runs = [
        greedy_run(target, head, prompt, max_new_tokens + longest, stop_ids)
        for prompt in tqdm(prompts, desc="greedy runs", unit="prompt")
    ]
    rows = []
    for steps, topk, tokens in tqdm(settings, desc="tree settings", unit="setting"):
        total, below_chain = AcceptanceCounts(), 0
        for run in runs:

            def against_chain(position, out_B1H, state, accepted, run=run, steps=steps):
                nonlocal below_chain
                greedy = run.ids[position + 1 : position + 1 + steps]
                below_chain += accepted < chain_accepted(state, out_B1H, steps, greedy)

            total = total + tree_counts(head, run, steps, topk, tokens, max_new_tokens, against_chain)
        rows.append(
            {
                "num_steps": steps,
                "topk": topk,
                "num_draft_tokens": tokens,
                "mean_acceptance_length": total.mean_acceptance_length,
                "rounds": total.num_drafts,
                # rounds on which the chain of as many steps, drafted from the same position, accepts more:
                # SGLang keeps the K best beams per depth, which can drop the chain's own path
                "rounds_below_chain": below_chain,
                "per_depth": total.per_position,
            }
        )

    def row(steps, topk, tokens):
        return next(
            r for r in rows if (r["num_steps"], r["topk"], r["num_draft_tokens"]) == (steps, topk, tokens)
        )

    within = [r for r in rows if r["num_draft_tokens"] <= BUDGET]
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "rows": rows,
        "chain": row(k, 1, k + 1),
        "sglang_default": row(*SGLANG_DEFAULT),
        "recommended": max(within, key=lambda r: r["mean_acceptance_length"]),
        "budget": BUDGET,
    }


def run_trees(cfg: DictConfig, head_dir: Path, out_path: Path, tokenizer, prompts: list[list[int]]) -> dict:
    """The grid for `head_dir` on the verification's prompts (`prompts`, export.verify_max_new_tokens
    each), written to `out_path`."""
    path = target_dir(cfg.target)
    trees = tree_grid(
        path,
        head_dir,
        prompts,
        cfg.export.num_speculative_tokens,
        cfg.export.verify_max_new_tokens,
        stop_token_ids(tokenizer, path),
        cfg.export.verify_dtype,
    )
    atomic.write_json(out_path, trees)
    for r in trees["rows"]:
        log.info(
            "steps %d topk %d draft tokens %2d: %.3f tokens per round",
            r["num_steps"], r["topk"], r["num_draft_tokens"], r["mean_acceptance_length"],
        )  # fmt: skip
    return trees


@hydra.main(config_path="../conf", config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    check_config(cfg)

    run_dir = Path(cfg.run_dir)
    head_dir = Path(cfg.export.head_dir or run_dir / "draft_head")
    tokenizer = load_tokenizer(cfg.target)
    prompts = verification_prompts(cfg, tokenizer, read_record(head_dir), run_dir)
    trees = run_trees(cfg, head_dir, run_dir / "sglang_trees.json", tokenizer, prompts)
    print(json.dumps({key: trees[key] for key in ("chain", "sglang_default", "recommended")}, indent=2))


register_configs()

if __name__ == "__main__":
    main()
