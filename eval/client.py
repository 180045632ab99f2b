"""Streaming load generator for a vLLM OpenAI-compatible server: `concurrency` requests in flight over a
list of token-id prompts (`/v1/completions`, `stream: true`), with client-side timestamps per chunk. A
multi-turn workload item (eval/workloads.py `Conversation`, MT-Bench) sends its turns one after another,
each prompt rendered from the answers the server streamed to the turns before; different conversations
run concurrently, as single prompts do.

    results, duration_s = asyncio.run(run_load(url, model, prompts, concurrency=4, max_tokens=128))
    summary = summarize(results, duration_s)

Latency definitions (docs/design.md#acceptance-metrics-and-economics): TTFT = first chunk - send;
TPOT = (last chunk - first chunk) / (tokens - 1), per token; ITL = gaps between engine steps as the client
sees them. vLLM streams the tokens of one verify step as separate chunks arriving together, so chunks
closer than STEP_GAP_S are one step: with speculative decoding ITL is per verify step, without it per
token. A failed request is counted and reported; the run goes on. An answer with no text (the model ended
at once, the stream complete) is an answer: counted (`num_empty`), and its conversation's next turn is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from eval.workloads import Conversation, Prompt
from heads.acceptance import AcceptanceCounts, drafts_per_request, request_spread

STEP_GAP_S = 1e-3  # chunks closer than this arrived from one engine step


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    num_tokens: int = 0  # completion tokens (the server's usage count)
    ttft_s: float | None = None
    tpot_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    text: str = ""  # the answer as streamed: a conversation's next turn is rendered from it
    empty: bool = False  # a complete answer with no text (the model ended at once): an answer all the same
    prompt_tokens: int = 0  # the prompt's tokens (the server's usage count): the request's context length
    # vLLM's count of this request's own drafts (`metrics.speculative_decoding` of the last chunk, from a
    # server with --per-request-spec-decode-metrics): num_spec_steps, num_accepted_draft_tokens, ...
    spec: dict | None = None


async def one_request(session, url: str, payload: dict, timeout_s: float) -> RequestResult:
    import aiohttp

    result = RequestResult()
    start = time.perf_counter()
    chunk_times, text_tokens, texts, done = [], 0, [], False
    usage, spec = {}, None
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
                    done = True
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    text_tokens = usage["completion_tokens"]
                spec = (chunk.get("metrics") or {}).get("speculative_decoding") or spec
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    chunk_times.append(time.perf_counter())
                    texts.append(chunk["choices"][0]["text"])
    except Exception as error:  # network error, timeout, malformed stream: counted, the run goes on
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.prompt_tokens, result.spec = usage.get("prompt_tokens") or 0, spec
    if not chunk_times:
        if not done:
            result.error = "the stream ended before any token or [DONE]"
        else:  # answered with nothing: counted as an answer (no latency to time), the conversation goes on
            result.ok, result.empty, result.num_tokens = True, True, text_tokens
        return result
    result.ok, result.num_tokens, result.text = True, text_tokens or len(chunk_times), "".join(texts)
    result.ttft_s = chunk_times[0] - start
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    result.itls_s = [gap for gap in gaps if gap >= STEP_GAP_S]
    if result.num_tokens > 1:
        result.tpot_s = (chunk_times[-1] - chunk_times[0]) / (result.num_tokens - 1)
    return result


async def ask_conversation(
    session, url: str, conversation: Conversation, payload, timeout_s: float
) -> list[RequestResult]:
    """A conversation's turns in order, turn t's prompt rendered from the answers to turns < t. Rendering
    runs in the event loop, which keeps the one tokenizer out of several threads; it takes ~1 ms at most
    (0.7 ms for MT-Bench's longest second turn), against seconds per request. A turn after a failed one is
    not sent and counts as failed: it has no conversation to follow."""
    results, answers = [], []
    for turn in range(len(conversation.questions)):
        if results and not results[-1].ok:
            results.append(RequestResult(error="not sent: an earlier turn of its conversation failed"))
            continue
        result = await one_request(session, url, payload(conversation.prompt(answers), turn), timeout_s)
        results.append(result)
        answers.append(result.text)
    return results


async def run_load(
    url: str,
    model: str,
    prompts: list[Prompt],
    concurrency: int,
    max_tokens: int,
    temperature: float = 0.0,
    ignore_eos: bool = False,
    seed: int = 0,
    timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every prompt once, every turn of a conversation once, with at most `concurrency` requests in
    flight; (one result per request in prompt order, a conversation's turns in order; wall time)."""
    import aiohttp

    results: list[list[RequestResult] | None] = [None] * len(prompts)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)

    def payload_of(i: int):
        def payload(prompt: list[int], turn: int = 0) -> dict:
            return {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "seed": seed + i + turn * len(prompts),  # a seed per request; turn 0's as a single prompt's
                "ignore_eos": ignore_eos,
                "stream": True,
                "stream_options": {"include_usage": True},
            }

        return payload

    async def worker(session):
        while not queue.empty():
            i = queue.get_nowait()
            if isinstance(prompts[i], Conversation):
                results[i] = await ask_conversation(session, url, prompts[i], payload_of(i), timeout_s)
            else:
                results[i] = [await one_request(session, url, payload_of(i)(prompts[i]), timeout_s)]

    start = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(min(concurrency, len(prompts)))))
    return [r for item in results for r in item], time.perf_counter() - start


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


def context_bucket(prompt_tokens: int, bounds: list[int]) -> str:
    """The context-length bucket of a prompt: `<=512`, `513-2048`, ..., `>8192` for bounds [512, ..., 8192]."""
    lower = 0
    for bound in sorted(bounds):
        if prompt_tokens <= bound:
            return f"<={bound}" if lower == 0 else f"{lower + 1}-{bound}"
        lower = bound
    return f">{lower}"


def acceptance_of(specs: list[dict]) -> dict | None:
    """Requests' own counts summed, as the server's counters would hold them (heads/acceptance.py)."""
    if not specs:
        return None
    return sum(map(AcceptanceCounts.from_request_metrics, specs), AcceptanceCounts()).summary()


def by_context(ok: list[RequestResult], bounds: list[int]) -> list[dict]:
    """Per context-length bucket holding requests, in order: requests, their prompt tokens' range, mean time
    per output token and (with per-request metrics) vLLM's acceptance over that bucket's requests."""
    rows = {}
    for r in sorted(ok, key=lambda r: r.prompt_tokens):
        rows.setdefault(context_bucket(r.prompt_tokens, bounds), []).append(r)
    return [
        {
            "bucket": bucket,
            "num_requests": len(members),
            "prompt_tokens": [members[0].prompt_tokens, members[-1].prompt_tokens],
            "output_tokens": sum(r.num_tokens for r in members),
            "tpot_ms": percentiles_ms([r.tpot_s for r in members if r.tpot_s is not None])["mean"],
            "acceptance": acceptance_of([r.spec for r in members if r.spec]),
        }
        for bucket, members in rows.items()
    ]


def per_request(ok: list[RequestResult]) -> list[dict]:
    """Each request's context length and own draft counts (vLLM's per-request metrics), in prompt order:
    the watch weighs them by a served window's length mix (watch/expectation.py)."""
    rows = []
    for r in sorted(ok, key=lambda r: r.prompt_tokens):
        if r.spec:
            counts = AcceptanceCounts.from_request_metrics(r.spec)
            rows.append(
                {
                    "prompt_tokens": r.prompt_tokens,
                    "num_drafts": counts.num_drafts,
                    "accepted_per_position": counts.accepted_per_position,
                }
            )
    return rows


def spread_of(ok: list[RequestResult]) -> dict | None:
    """How alike one request's drafts are (`heads.acceptance.RequestSpread`): rho, and phi at these requests'
    own lengths, the factor by which their mean acceptance length varies more than independent drafts'
    would (the watch's band, watch/expectation.py). None with fewer than two requests with drafts."""
    counts = [AcceptanceCounts.from_request_metrics(r.spec) for r in ok if r.spec]
    spread = request_spread(counts)
    if spread is None:
        return None
    m = drafts_per_request(counts)
    return {
        "intraclass": spread.intraclass,
        "requests": spread.requests,
        "drafts_per_request": m,
        "dispersion": spread.dispersion(m),
    }


def summarize(results: list[RequestResult], duration_s: float, context_buckets: list[int] = ()) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.num_tokens for r in ok)
    return {
        "num_requests": len(results),
        "num_failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "num_empty": sum(r.empty for r in ok),
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles_ms([gap for r in ok for gap in r.itls_s]),
        "by_context": by_context(ok, list(context_buckets)) if context_buckets else [],
        "per_request": per_request(ok),
        "request_spread": spread_of(ok),
    }
