"""Traffic for a live server: conversations' first questions sent through eval's client (eval/client.py) one
batch of `concurrency` after another, in a background thread, until stopped; each answered request logged
with the answer it was served as an OpenAI-style JSONL record - the request log a deployment keeps, which
data_prep reads (`data.source=<log> data.format=openai`) and the watch's retrain commands name.

    with Traffic(url, model, tokenizer, conversations, log_path, concurrency=1, max_tokens=128) as traffic:
        ...  # traffic.requests, traffic.failed, traffic.position grow as it runs
    Traffic(..., start=traffic.position)  # the next server gets the conversations after these
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path

from artifacts.prompts import first_turn_prompt, prompt_token_ids
from eval.client import run_load

log = logging.getLogger("traffic")


class Traffic:
    def __init__(
        self,
        url: str,
        model: str,
        tokenizer,
        conversations: list[dict],  # {"id", "messages"}: their first questions are sent
        log_path: Path,
        concurrency: int = 1,
        max_tokens: int = 128,
        temperature: float = 0.0,
        start: int = 0,
    ):
        if not conversations:
            raise ValueError("traffic: no conversations to send")
        self.url, self.model, self.tokenizer = url, model, tokenizer
        self.conversations, self.log_path = conversations, Path(log_path)
        self.concurrency, self.max_tokens, self.temperature = concurrency, max_tokens, temperature
        self.position = start  # the next conversation (modulo the list: it starts over when all were sent)
        self.requests = self.failed = 0
        self.started_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Traffic:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.started_s = time.time()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop after the batch in flight (its requests are answered and logged)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"traffic to {self.url} stopped: {self.error}") from self.error

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._send_batch()
        except BaseException as error:  # reported by stop(), in the caller's thread
            self.error = error

    def _send_batch(self) -> None:
        n = len(self.conversations)
        batch = [self.conversations[(self.position + i) % n] for i in range(self.concurrency)]
        questions = [first_turn_prompt(c["messages"]) for c in batch]
        prompts = [prompt_token_ids(self.tokenizer, q, c.get("tools")) for q, c in zip(questions, batch)]
        results, _ = asyncio.run(
            run_load(
                self.url, self.model, prompts, self.concurrency, self.max_tokens, self.temperature,
                seed=self.position,
            )
        )  # fmt: skip
        with self.log_path.open("a", encoding="utf-8") as out:
            for conversation, question, result in zip(batch, questions, results):
                if not result.ok:
                    self.failed += 1
                    log.warning("request for %s failed: %s", conversation.get("id"), result.error)
                    continue
                answer = {"role": "assistant", "content": result.text}
                record = {"id": conversation["id"], "messages": [*question, answer]}
                if conversation.get("tools"):  # logged as a server logs the request
                    record["tools"] = conversation["tools"]
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.requests += 1
        self.position += len(batch)
