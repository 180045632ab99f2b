"""Benchmark hidden-state caching against a plain forward of the same target on the same batches.

    python -m bench.capture --out runs/bench/smoke.json -- experiment=smoke run_dir=runs/bench/smoke
    python -m bench.capture --num-samples 256 -- run_dir=runs/bench/smollm2      # SmolLM2 + ShareGPT

Everything after `--` is a data_prep config override. Both paths run on the batches caching forms
(length-sorted, padded to `cache.max_tokens_per_batch`), interleaved and repeated, in one process:
  plain forward    `model(input_ids, attention_mask)` (logits, as a user would run the target)
  decoder forward  the same without the lm_head (exactly the compute caching needs)
  caching          decoder forward + aux-layer capture + bf16 copy + writing the safetensors shards
  vllm capture     the same shard through vLLM (capture.engine=vllm, prompt-only): the engine's own
                   batching, its capture files read back, checked and written (`--engines hf` to skip)
Reported: tokens/s of each, caching / plain ratio (target >= 0.90), vLLM capture / transformers caching,
bytes on disk per token against 2 x (n_aux + 1) x H. The engine is started (and warmed up) once before the
timed passes, as data_prep starts it once per run; its arguments are `capture.vllm_kwargs`.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from artifacts.cache import write_shard
from artifacts.config import compose
from bench import new_file
from data_prep.capture import capture_engine, capture_layers
from data_prep.hidden_states import compute_shard, hf_states, pad_batch, plan_batches, vllm_states
from data_prep.main import build_embedded_target
from data_prep.render import render_all
from data_prep.sources import load_conversations
from target.model import load_config, load_model, load_tokenizer, resolve_aux_layer_ids, target_dir
from target.reaper import leash
from target.vllm import vllm_log_file


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-samples", type=int, default=None, help="conversations to use (default: all)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the batches, per path")
    parser.add_argument("--out", type=new_file, default=None, help="write the results as JSON here")
    parser.add_argument(
        "--engines", default="hf,vllm", help="hf (always) and vllm: the capture engines timed"
    )
    parser.add_argument("overrides", nargs="*", help="data_prep config overrides")
    args = parser.parse_args()
    overrides = list(args.overrides) + ([f"data.num_samples={args.num_samples}"] if args.num_samples else [])
    cfg = compose("config", overrides)
    if cfg.cache.num_threads:
        torch.set_num_threads(cfg.cache.num_threads)

    build_embedded_target(cfg.target)
    tokenizer = load_tokenizer(cfg.target)
    target_config = load_config(cfg.target)
    aux_ids = resolve_aux_layer_ids(cfg.cache.aux_layer_ids, target_config.num_hidden_layers, cfg.head.kind)
    samples, _, _ = render_all(
        tokenizer, load_conversations(cfg.data).conversations, cfg.render.max_length, cfg.render.overlong
    )
    model = load_model(cfg.target)
    lengths = [len(s.input_ids) for s in samples]
    indices = list(range(len(samples)))
    batches = [
        pad_batch(samples, b, tokenizer.pad_token_id or 0, "cpu")
        for b in plan_batches(indices, lengths, cfg.cache.max_tokens_per_batch)
    ]
    num_tokens = sum(lengths)

    @torch.inference_mode()
    def plain_forward():
        for input_ids, attention_mask in batches:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    @torch.inference_mode()
    def decoder_forward():
        for input_ids, attention_mask in batches:
            model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    out_dir = Path(tempfile.mkdtemp(prefix="cache_bench_"))

    def caching():
        states_of = hf_states(
            model, aux_ids, cfg.cache.max_tokens_per_batch, tokenizer.pad_token_id or 0, "cpu"
        )
        shard = compute_shard(states_of, samples, indices, lambda n: None)
        return write_shard(out_dir / "shard-00000.safetensors", shard)

    paths = {"plain_forward": plain_forward, "decoder_forward": decoder_forward, "caching": caching}
    with ExitStack() as stack:
        if "vllm" in args.engines.split(","):
            stack.enter_context(vllm_log_file(out_dir / "vllm.log"))
            stack.enter_context(leash(out_dir, "bench_capture", remove=[out_dir / ".capture"]))
            layers = capture_layers(cfg, target_config, aux_ids)
            engine = stack.enter_context(
                capture_engine(cfg, str(target_dir(cfg.target)), layers, out_dir / ".capture", None, False)
            )

            def vllm_capture():
                shard = compute_shard(
                    vllm_states(engine, cfg.capture.batch_size), samples, indices, lambda n: None
                )
                return write_shard(out_dir / "shard-vllm.safetensors", shard)

            paths["vllm_capture"] = vllm_capture
            vllm_capture()  # warm-up: the engine's first batches (and compilation, when it compiles)
        decoder_forward()  # warm-up: first-call allocations and kernel selection
        times = {name: [] for name in paths}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits every path alike
            for name, path in paths.items():
                times[name].append(timed(path))
    info = caching()

    best = {name: min(values) for name, values in times.items()}
    tok_s = {name: num_tokens / seconds for name, seconds in best.items()}
    budget = 2 * (len(aux_ids) + 1) * target_config.hidden_size
    result = {
        "target": cfg.target.path,
        "dtype": cfg.target.dtype,
        "aux_layer_ids": aux_ids,
        "hidden_size": target_config.hidden_size,
        "num_samples": len(samples),
        "num_tokens": num_tokens,
        "num_batches": len(batches),
        "tokens_per_s": {k: round(v, 1) for k, v in tok_s.items()},
        "caching_over_plain_forward": round(tok_s["caching"] / tok_s["plain_forward"], 3),
        "caching_over_decoder_forward": round(tok_s["caching"] / tok_s["decoder_forward"], 3),
        "vllm_capture_over_caching": (
            round(tok_s["vllm_capture"] / tok_s["caching"], 3) if "vllm_capture" in tok_s else None
        ),
        "vllm_kwargs": dict(cfg.capture.vllm_kwargs) if "vllm_capture" in tok_s else None,
        "bytes_per_token": round(info["num_bytes"] / num_tokens, 1),
        "hidden_state_bytes_per_token": budget,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n{cfg.target.path}: caching {tok_s['caching']:.0f} tok/s = {result['caching_over_plain_forward']:.2f}x "
        f"plain forward ({tok_s['plain_forward']:.0f} tok/s), {result['caching_over_decoder_forward']:.2f}x "
        f"decoder-only forward; {result['bytes_per_token']} bytes/token on disk "
        f"(hidden states {budget} = 2 x {len(aux_ids) + 1} x {target_config.hidden_size})"
    )
    if "vllm_capture" in tok_s:
        print(
            f"vLLM capture (prompt-only) {tok_s['vllm_capture']:.0f} tok/s = "
            f"{result['vllm_capture_over_caching']:.2f}x transformers caching"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
