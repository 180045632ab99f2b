"""The three products of a Linear layer's training step - forward x W^T, input gradient g W, weight gradient
g^T x - timed in fp32 and bf16 on this machine: where half precision is slower than fp32, and by how much
(docs/benchmarks.md#half-precision-on-a-cpu-without-it).

    python -m bench.gemm                              # 128 tokens through an 8B MLP's 4,096 x 14,336 matrix
    python -m bench.gemm --tokens 32 --shape 4096 4096

On an x86 CPU without AVX512-BF16 or AMX, PyTorch's bf16 products that oneDNN does not take fall to its
scalar reference GEMM (`cpublas_gemm_impl`, one thread), which is what made bench.memory's bf16 steps at
8B widths take minutes.
"""

from __future__ import annotations

import argparse
import time

import torch

from artifacts.config.resolvers import half_precision_computes_here


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` calls of `fn` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def products(tokens: int, d_in: int, d_out: int, repeats: int = 3) -> dict[str, dict[str, float]]:
    """{dtype: {product: GFLOP/s}} for the forward, input-gradient and weight-gradient products."""
    g = torch.Generator().manual_seed(0)
    flops = 2 * tokens * d_in * d_out
    result = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, d_in, generator=g).to(dtype)
        w = torch.randn(d_out, d_in, generator=g).to(dtype)
        grad = torch.randn(tokens, d_out, generator=g).to(dtype)
        cases = {"forward x W^T": lambda x=x, w=w: x @ w.t(), "input grad g W": lambda grad=grad, w=w: grad @ w,
                 "weight grad g^T x": lambda grad=grad, x=x: grad.t() @ x}  # fmt: skip
        result[str(dtype).removeprefix("torch.")] = {
            name: flops / best_seconds(fn, repeats) / 1e9 for name, fn in cases.items()
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--shape", type=int, nargs=2, default=[4096, 14336], metavar=("IN", "OUT"))
    args = parser.parse_args()
    print(f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, half precision computes "
          f"here: {half_precision_computes_here()}; {args.tokens} x {args.shape[0]} -> {args.shape[1]}")  # fmt: skip
    result = products(args.tokens, *args.shape)
    for name in result["float32"]:
        fp32, bf16 = result["float32"][name], result["bfloat16"][name]
        print(f"{name:18s} fp32 {fp32:7.1f} GFLOP/s  bf16 {bf16:7.1f} GFLOP/s  bf16 / fp32 {bf16 / fp32:.3f}")


if __name__ == "__main__":
    main()
