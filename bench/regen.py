"""Benchmark regeneration alone against regeneration that captures the hidden states in the same pass.

    python -m bench.regen --num-prompts 64 --max-tokens 64 -- experiment=smollm2 run_dir=runs/bench/regen

Everything after `--` is a data_prep config override. The first user turns of the data's first
conversations (those shorter than the engine's `max_model_len` allows) go, as token ids, to two engines
one after the other, with regeneration's engine arguments (`regen.vllm_kwargs`): the plain engine that
`capture.engine=hf` regenerates with, and the capture engine of `capture.engine=vllm`, which also writes
the states of every prompt and generated token (read back and deleted here, as data_prep does). Greedy,
`ignore_eos`, so both generate the same number of tokens. Each engine is warmed up on a few prompts first.
Reported: generated tokens/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from artifacts.config import compose
from bench import new_file
from data_prep.capture import capture_engine, capture_layers
from data_prep.main import build_embedded_target
from data_prep.regenerate import start_engine, token_prompts
from data_prep.render import render_prompt
from data_prep.sources import load_conversations
from target.model import load_config, load_tokenizer, resolve_aux_layer_ids, target_dir
from target.reaper import leash
from target.vllm import vllm_log_file


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument("overrides", nargs="*", help="data_prep config overrides")
    args = parser.parse_args()
    cfg = compose("config", list(args.overrides))
    from vllm import SamplingParams

    build_embedded_target(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    target_config = load_config(cfg.target)
    limit = cfg.regen.vllm_kwargs.get("max_model_len", target_config.max_position_embeddings)
    prompts = []
    for conv in load_conversations(cfg.data).conversations:
        question = [next(m for m in conv.messages if m["role"] == "user")]
        ids = render_prompt(tokenizer, conv.id, question).input_ids
        if len(ids) + args.max_tokens <= limit:
            prompts.append(ids)
        if len(prompts) == args.num_prompts:
            break
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_up = SamplingParams(max_tokens=4)
    aux_ids = resolve_aux_layer_ids(cfg.cache.aux_layer_ids, target_config.num_hidden_layers, cfg.head.kind)
    work = Path(tempfile.mkdtemp(prefix="regen_bench_"))
    seconds, tokens = {}, {}
    with vllm_log_file(work / "vllm.log"), leash(work, "bench_regen", remove=[work / "states"]):
        with start_engine(str(target_dir(cfg.target)), cfg.regen) as llm:
            llm.generate(token_prompts(prompts[:4]), warm_up, use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
            seconds["plain"] = time.perf_counter() - start
            tokens["plain"] = sum(len(o.outputs[0].token_ids) for o in outputs)

        layers = capture_layers(cfg, target_config, aux_ids)
        with capture_engine(cfg, str(target_dir(cfg.target)), layers, work / "states", None, True) as engine:
            for output in engine.generate(prompts[:4], warm_up, True):
                engine.discard(output)
            start = time.perf_counter()
            outputs = engine.generate(prompts, params, True)
            for output, prompt in zip(outputs, prompts):  # read, checked and deleted, as data_prep does
                engine.states(output, prompt + list(output.outputs[0].token_ids)[:-1], "benchmark")
            seconds["with_capture"] = time.perf_counter() - start
            tokens["with_capture"] = sum(len(o.outputs[0].token_ids) for o in outputs)

    tok_s = {k: tokens[k] / seconds[k] for k in seconds}
    result = {
        "target": cfg.target.path,
        "vllm_kwargs": dict(cfg.regen.vllm_kwargs),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "captured_layer_ids": layers.captured_ids,
        "generated_tokens": tokens,
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
        "tokens_per_s": {k: round(v, 1) for k, v in tok_s.items()},
        "with_capture_over_plain": round(tok_s["with_capture"] / tok_s["plain"], 3),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n{cfg.target.path}: regeneration {tok_s['plain']:.1f} tok/s, with capture in the same pass "
        f"{tok_s['with_capture']:.1f} tok/s ({result['with_capture_over_plain']:.2f}x)"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
