"""eval.offline=true: acceptance without vLLM, from the reference decoder (heads/reference_decoder.py) running
the HF target and each exported head - the same figures vLLM's counters give at concurrency 1 in fp32
(export verification proves that), in minutes on a laptop; no latency or speedup. A conversation (MT-Bench)
is decoded turn by turn, each turn's prompt rendered from the decoded answers before it, as when served.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from eval.workloads import Conversation, Prompt, num_requests
from export.read_vllm import read_export
from heads.acceptance import AcceptanceCounts
from heads.reference_decoder import DraftHead, inference_device, on_target, speculative_generate

NO_LATENCY = {"mean": None, "p50": None, "p90": None, "p99": None}


def load_export_head(export_dir: Path, target) -> DraftHead:
    """An export (any format) as the reference decoder's head: exactly the weights vLLM would serve."""
    draft, draft_to_target = read_export(export_dir, target.get_input_embeddings().weight.detach().cpu())
    return on_target(draft, target, draft_to_target)


def decode_prompt(prompt: Prompt, generate) -> tuple[int, AcceptanceCounts]:
    """(output tokens, acceptance counts) of one workload item, `generate(prompt_ids) -> (output ids,
    counts)` decoding one request: a prompt once, a conversation once per turn, in order."""
    if not isinstance(prompt, Conversation):
        output, counts = generate(prompt)
        return len(output), counts
    answers, counts, num_tokens = [], AcceptanceCounts(), 0
    for _ in prompt.questions:
        output, c = generate(prompt.prompt(answers))
        answers.append(prompt.decode(output))
        counts, num_tokens = counts + c, num_tokens + len(output)
    return num_tokens, counts


def offline_runs(
    target_path: Path, heads: list[tuple[str, Path, list[int]]], workloads, prompts, stop_ids
) -> list:
    """One run record per (head, k, workload), shaped like eval's served runs (concurrency 1)."""
    from transformers import AutoModelForCausalLM

    target = (
        AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval().to(inference_device())
    )
    runs = []
    total = sum(len(ks) for _, _, ks in heads) * sum(num_requests(prompts[w.name]) for w in workloads)
    bar = tqdm(total=total, desc="reference decoder", unit="request")
    for name, path, ks in heads:
        head = load_export_head(path, target)
        for k in ks:
            for workload in workloads:
                counts, num_tokens = AcceptanceCounts(), 0
                generate = partial(
                    speculative_generate,
                    target,
                    head,
                    num_draft_tokens=k,
                    max_new_tokens=workload.max_tokens,
                    stop_token_ids=stop_ids,
                )
                for prompt in prompts[workload.name]:
                    n, c = decode_prompt(prompt, generate)
                    counts, num_tokens = counts + c, num_tokens + n
                    bar.update(num_requests([prompt]))
                runs.append(
                    {
                        "config": f"{name} k={k}",
                        "head": name,
                        "k": k,
                        "workload": workload.name,
                        "concurrency": 1,
                        "num_requests": num_requests(prompts[workload.name]),
                        "num_failed": 0,
                        "errors": [],
                        "output_tokens": num_tokens,
                        "duration_s": None,
                        "output_tokens_per_s": None,
                        "ttft_ms": NO_LATENCY,
                        "tpot_ms": NO_LATENCY,
                        "itl_ms": NO_LATENCY,
                        "acceptance": counts.summary(),
                        "source": "reference decoder",
                    }
                )
    bar.close()
    return runs
