"""The training attention alone at a recipe's shapes: one TTT step's attention (the sequence's keys and J
earlier steps' keys at each position), forward and backward, three ways - the dense single pass this
project used before issue 33 (heads.attention.dense_attention over every query), the chunked and
checkpointed `attention` it uses now, and PyTorch's FlexAttention (compiled, a block mask over the
sequence and the J diagonals, as speculators and SpecForge do it).

    python -m bench.attention --seq-len 2048 --extra 6 --out runs/bench/attention.json
    python -m bench.attention --seq-len 256 --repeats 1          # seconds

Llama-3.1-8B's heads by default (32 query, 8 key/value heads of 128), batch 1, bf16. Reported per way:
the best of `--repeats` forward+backward times after a warm-up (FlexAttention's compilation is timed
apart), and the peak memory over what was held before (CUDA: max_memory_allocated; CPU: peak RSS).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench import new_file
from bench.train_step import mark_memory, peak_memory
from heads.attention import attention, dense_attention


def inputs(b, n, g, t, d, j, device, dtype):
    g_ = torch.Generator().manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g_).to(device, dtype).requires_grad_()  # noqa: E731
    return make(b, n, t, d), make(b, g, t, d), make(b, g, t, d), make(b, g, t, j, d), make(b, g, t, j, d)


def flex_step(j: int, t: int, device):
    """FlexAttention over [sequence keys, then step 1's, .., step j's]: query t sees sequence keys <= t and
    each step's key at t. Compiled once; returns the attention function of (q, k, v, extra_k, extra_v)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def visible(b, h, q, kv):
        return torch.where(kv < t, kv <= q, (kv - t) % t == q)

    block_mask = create_block_mask(visible, None, None, t, t * (1 + j), device=str(device))
    compiled = torch.compile(flex_attention, dynamic=False)

    def run(q, k, v, extra_k, extra_v):
        b, g, _, _, d = extra_k.shape
        keys = torch.cat([k, extra_k.permute(0, 1, 3, 2, 4).reshape(b, g, j * t, d)], dim=2)
        values = torch.cat([v, extra_v.permute(0, 1, 3, 2, 4).reshape(b, g, j * t, d)], dim=2)
        return compiled(q, keys, values, block_mask=block_mask, enable_gqa=True)

    return run


def measure(fn, args, repeats: int, device) -> dict:
    """Best forward+backward time of `repeats` after one warm-up, and the peak memory over the start."""

    def once():
        for x in args:
            x.grad = None
        out = fn(*args)
        out.float().square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    once()  # warm-up (FlexAttention compiles here)
    first = time.perf_counter() - start
    before, _ = mark_memory(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    peak = peak_memory(device)
    return {
        "seconds": round(min(times), 4),
        "first_call_s": round(first, 2),
        "peak_over_start_gb": round((peak - before) / 1e9, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--extra", type=int, default=6, help="earlier steps' keys per query (TTT step j+1)")
    parser.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("N", "G", "D"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ways", nargs="+", default=["dense", "chunked", "flex"])
    parser.add_argument("--out", type=new_file, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, g, d = args.heads
    t, j = args.seq_len, args.extra
    tensors = inputs(1, n, g, t, d, j, device, torch.bfloat16)
    positions = torch.arange(t, device=device).expand(1, t)
    ways = {
        "dense": lambda q, k, v, ek, ev: dense_attention(q, k, v, positions, ek, ev, None),
        "chunked": lambda q, k, v, ek, ev: attention(q, k, v, None, ek, ev),
    }
    results = {}
    for way in args.ways:
        fn = flex_step(j, t, device) if way == "flex" else ways[way]
        try:
            results[way] = measure(fn, tensors, args.repeats, device)
        except Exception as error:  # FlexAttention may not compile on this machine: say so, go on
            results[way] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        print(f"{way:8s} T={t} J={j} on {device}: {results[way]}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"seq_len": t, "extra": j, "heads": args.heads, "device": str(device),
                                        "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
