"""Streaming load generator for a vLLM OpenAI-compatible server: `concurrency` requests in flight over a
list of token-id prompts (`/v1/completions`, `stream: true`), with client-side timestamps per chunk.

    results, duration_s = asyncio.run(run_load(url, model, prompts, concurrency=4, max_tokens=128))
    summary = summarize(results, duration_s)

Latency definitions (docs/design.md#acceptance-metrics-and-economics): TTFT = first chunk - send;
TPOT = (last chunk - first chunk) / (tokens - 1), per token; ITL = gaps between engine steps as the client
sees them. vLLM streams the tokens of one verify step as separate chunks arriving together, so chunks
closer than STEP_GAP_S are one step: with speculative decoding ITL is per verify step, without it per
token. A failed request is counted and reported; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

STEP_GAP_S = 1e-3  # chunks closer than this arrived from one engine step


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    num_tokens: int = 0  # completion tokens (the server's usage count)
    ttft_s: float | None = None
    tpot_s: float | None = None
    itls_s: list[float] = field(default_factory=list)


async def one_request(session, url: str, payload: dict, timeout_s: float) -> RequestResult:
    import aiohttp

    result = RequestResult()
    start = time.perf_counter()
    chunk_times, text_tokens = [], 0
    try:
        async with session.post(
            f"{url}/v1/completions", json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    text_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunk_times.append(time.perf_counter())
    except Exception as error:  # network error, timeout, malformed stream: counted, the run goes on
        result.error = f"{type(error).__name__}: {error}"
        return result
    if not chunk_times:
        result.error = "no tokens streamed"
        return result
    result.ok, result.num_tokens = True, text_tokens or len(chunk_times)
    result.ttft_s = chunk_times[0] - start
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    result.itls_s = [gap for gap in gaps if gap >= STEP_GAP_S]
    if result.num_tokens > 1:
        result.tpot_s = (chunk_times[-1] - chunk_times[0]) / (result.num_tokens - 1)
    return result


async def run_load(
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt once with at most `concurrency` in flight; (results in prompt order, wall time)."""
    import aiohttp

    results: list[RequestResult | None] = [None] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    async def worker(session):
        while not queue.empty():
            i = queue.get_nowait()
            payload = {
                "model": model,
                "prompt": prompts[i],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": seed + i,
                "ignore_eos": ignore_eos,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            results[i] = await one_request(session, url, payload, timeout_s)

    start = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(prompts)))))
    return results, time.perf_counter() - start


def percentiles_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values_s) * 1000.0
    return {
        "mean": float(ms.mean()),
        "p50": float(np.percentile(ms, 50)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles_ms([gap for r in ok for gap in r.itls_s]),
    }
