"""Logs written the way a server writes them: one record per request (the history it was sent, then its
response), agent loops whose re-sent history lost its reasoning, thinking modes per request, the `developer`
role, tool markers that are special tokens; every rendering held against vLLM 0.32's own chat-completion
request path (its renderer, called here)."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from artifacts.agent_data import request_log
from artifacts.config import DataConfig
from artifacts.smoke import AGENT_DATA, build_smoke_target, build_tokenizer
from data_prep.render import render_prompt, render_samples
from data_prep.request_log import merge_requests
from data_prep.sources import load_conversations


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(agent=True)


@pytest.fixture(scope="module")
def logged():
    """The agent smoke data's records as logged: {id: record}."""
    return {r["id"]: r for r in map(json.loads, AGENT_DATA.read_text(encoding="utf-8").splitlines())}


def load(tmp_path, records, **settings):
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return load_conversations(DataConfig(source=str(path), **settings))


def trained_runs(tokenizer, samples) -> list[str]:
    """The decoded text of every run of trained tokens, over all samples."""
    pieces = []
    for sample in samples:
        run = []
        for token, bit in zip(sample.input_ids + [None], sample.loss_mask + [0]):
            if bit:
                run.append(token)
            elif run:
                pieces, run = pieces + [tokenizer.decode(run)], []
    return pieces


@pytest.mark.parametrize("shape", ["request", "messages"])
def test_an_agent_loop_logged_per_request_trains_each_turn_once_with_its_reasoning(
    tokenizer, logged, tmp_path, shape
):
    whole = load(tmp_path, [logged["docs-multi-turn"]]).conversations[0]
    records = request_log(logged["docs-multi-turn"], shape)
    last = records[-1]["request"]["messages"] if shape == "request" else records[-1]["messages"]
    assert len(records) == 4 and not any(m.get("reasoning") for m in last[:-1])  # the re-sent history
    loaded = load(tmp_path, records)
    (merged,) = loaded.conversations
    # every turn back with the reasoning its own response logged, and marked as sent back without it
    assert [
        {k: v for k, v in m.items() if k != "history_without_reasoning"} for m in merged.messages
    ] == whole.messages
    assert [m.get("history_without_reasoning") for m in merged.messages if m["role"] == "assistant"] == [
        True
    ] * 3 + [None]
    assert dict(loaded.merged) == {"merged": 3, "reasoning_lent": 3}
    samples = render_samples(tokenizer, merged.id, merged.messages, merged.tools)
    runs = trained_runs(tokenizer, samples)
    assert len(runs) == 4 and all(r.startswith("<think>\n") and len(r.split("</think>")[0]) > 9 for r in runs)
    # Each response is trained after its own request, rendered as the server rendered it (vLLM's equal:
    # test_every_request_shape_renders_as_vllm_renders_it), and never elsewhere.
    for k, record in enumerate(load(tmp_path, [r], merge_requests=False).conversations[0] for r in records):
        prompt = render_prompt(tokenizer, record.id, record.messages[:-1], record.tools).input_ids
        holding = [s for s in samples if s.input_ids[: len(prompt)] == prompt and s.loss_mask[len(prompt)]]
        assert len(holding) == 1, k
        answer = holding[0].loss_mask[len(prompt) :]
        answer = answer[: answer.index(0) if 0 in answer else len(answer)]
        assert tokenizer.decode(holding[0].input_ids[len(prompt) : len(prompt) + len(answer)]) == runs[k]
    # Kept apart, the loop trains its earlier turns again and again, and the re-sent ones without reasoning.
    apart = load(tmp_path, records, merge_requests=False).conversations
    runs_apart = [
        r
        for c in apart
        for r in trained_runs(tokenizer, render_samples(tokenizer, c.id, c.messages, c.tools))
    ]
    assert (
        len(runs_apart) == 1 + 2 + 3 + 4 and sum(r.startswith("<think>\n\n</think>") for r in runs_apart) > 0
    )


def test_requests_that_part_after_a_shared_history_train_the_shared_turns_once(tokenizer, logged):
    from artifacts.conversation import Conversation

    first = load_conversations(DataConfig(source=str(AGENT_DATA))).conversations
    loop = next(c for c in first if c.id == "docs-multi-turn")
    retried = Conversation("retry", [*loop.messages[:4], {"role": "user", "content": "Thanks!"},
                                     {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Nothing to look up."}], loop.tools)  # fmt: skip
    kept, counts = merge_requests([loop, retried])
    assert [c.id for c in kept] == ["docs-multi-turn", "retry"] and counts["shared_turns"] == 2
    assert [m.get("weight") for m in kept[1].messages if m["role"] == "assistant"] == [0, 0, None]
    runs = trained_runs(tokenizer, render_samples(tokenizer, "retry", kept[1].messages, kept[1].tools))
    assert runs == ["<think>\nNothing to look up.\n</think>\n\nYou are welcome.<|im_end|>"]
    assert merge_requests(first) == (
        first,
        {"merged": 0, "shared_turns": 0, "reasoning_lent": 0},
    )  # whole logs


def test_each_request_renders_in_its_own_thinking_mode(tokenizer, logged, tmp_path):
    from data_prep.render import render_all

    plain = logged["plain-chat"]
    records = [
        {**plain, "id": "on"},
        {**plain, "id": "off", "chat_template_kwargs": {"enable_thinking": False},
         "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in plain["messages"]]},
        {**plain, "id": "effort-none", "reasoning_effort": "none",
         "messages": [{k: v for k, v in m.items() if k != "reasoning_content"} for m in plain["messages"]]},
    ]  # fmt: skip
    loaded = load(tmp_path, records)
    by_id = {c.id: c for c in loaded.conversations}
    assert by_id["off"].template_kwargs == {"enable_thinking": False}
    assert by_id["effort-none"].template_kwargs == {"enable_thinking": False, "reasoning_effort": "none"}
    samples, skipped, _ = render_all(
        tokenizer, loaded.conversations, 4096, "truncate", {"enable_thinking": True}
    )
    assert not skipped
    texts = {s.id.split("/")[0]: tokenizer.decode(s.input_ids) for s in samples}
    off_runs = trained_runs(tokenizer, [s for s in samples if s.id.startswith("off")])
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in texts["off"]  # the empty block is its prompt's
    assert off_runs and not any("think>" in r for r in off_runs)
    from data_prep.main import samples_by_mode
    from export.card import modes_text

    modes = samples_by_mode(samples, loaded.conversations, {"enable_thinking": True})
    assert modes == {'{"enable_thinking": true}': 2, '{"enable_thinking": false}': 2,
                     '{"enable_thinking": false, "reasoning_effort": "none"}': 2}  # fmt: skip
    assert modes_text(modes).startswith('2 with `{"enable_thinking": true}`; 2 with')
    on_runs = trained_runs(tokenizer, [s for s in samples if s.id.startswith("on")])
    assert all(
        r.startswith("<think>\n") and len(r.split("</think>")[0]) > len("<think>\n\n") for r in on_runs
    )


def test_a_response_cut_at_the_token_limit_is_trained_up_to_its_last_token(tokenizer, logged, tmp_path):
    record = request_log(logged["plain-chat"])[0]  # the first question's request
    record["response"]["choices"][0] |= {"finish_reason": "length",
                                         "message": {"role": "assistant", "content": "", "reasoning_content": "The capital of"}}  # fmt: skip
    (conv,) = load(tmp_path, [record]).conversations
    (sample,) = render_samples(tokenizer, conv.id, conv.messages, conv.tools)
    assert trained_runs(tokenizer, [sample]) == ["<think>\nThe capital of"]


def test_a_template_with_no_place_for_reasoning_skips_the_answers_it_would_drop_it_from():
    from artifacts.conversation import Conversation
    from data_prep.render import render_all

    chatml = build_tokenizer()  # the smoke target's ChatML template: no reasoning in it
    question = {"role": "user", "content": "Capital of Italy?"}
    conversations = [
        Conversation(
            "reasoning-only", [question, {"role": "assistant", "content": "", "reasoning_content": "Rome."}]
        ),
        Conversation(
            "reasoning",
            [question, {"role": "assistant", "content": "Rome.", "reasoning_content": "It is Rome."}],
        ),
        Conversation("plain", [question, {"role": "assistant", "content": "Rome."}]),
    ]
    samples, skipped, _ = render_all(chatml, conversations, 512, "truncate")
    assert [s.id for s in samples] == ["plain"] and skipped == {"template_drops_reasoning": 2}


class SpecialMarkerEngine:
    """vLLM's LLM as regeneration uses it: each prompt answered with one tool call whose markers are special
    tokens, decoded as vLLM's detokenizer decodes it (the request's `skip_special_tokens`)."""

    def __init__(self, tokenizer, text):
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))
        self.tokenizer, self.text, self.params = tokenizer, text, []

    def generate(self, prompts, params, use_tqdm=False):
        self.params += params
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        ids += [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
        done = [SimpleNamespace(text=self.tokenizer.decode(ids[:-1], skip_special_tokens=p.skip_special_tokens),
                                finish_reason="stop", token_ids=ids) for p in params]  # fmt: skip
        return [SimpleNamespace(outputs=[d]) for d in done]


def test_tool_markers_that_are_special_tokens_keep_their_calls_through_regeneration(logged, tmp_path):
    from data_prep.regenerate import regenerate_conversations

    special = build_tokenizer(agent=True)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert "<tool_call>" not in special.decode(special("<tool_call>")["input_ids"], skip_special_tokens=True)
    (conv,) = load(tmp_path, [logged["weather-one-call"]]).conversations
    conv.messages = conv.messages[:2]  # the call
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = SpecialMarkerEngine(special, call)
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=64, tool_parser="hermes")
    new, counts = regenerate_conversations(engine, special, [conv], cfg)
    assert [p.skip_special_tokens for p in engine.params] == [False]  # as hermes' adjust_request asks
    assert counts["tool_call_diverged"] == 0 and counts["tool_calls_regenerated"] == 1
    assert new[0].messages[-1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }


def test_the_developer_role_is_rendered_as_system(tokenizer, logged, tmp_path):
    record = {**logged["weather-one-call"], "id": "dev"}
    record["messages"] = [{"role": "developer", "content": "Answer in one sentence."}, *record["messages"]]
    loaded = load(tmp_path, [record])
    assert not loaded.skipped
    (conv,) = loaded.conversations
    text = tokenizer.decode(
        render_prompt(tokenizer, conv.id, conv.messages[:1] + conv.messages[1:2], conv.tools).input_ids
    )
    assert text.startswith("<|im_start|>system\nAnswer in one sentence.\n\nYou may call these tools")
    assert "developer" not in text


# --- vLLM 0.32's own request path --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_renderer(tmp_path_factory):
    """vLLM's OnlineRenderer for the agent smoke target, as `vllm serve --tool-call-parser hermes
    --enable-auto-tool-choice` builds it (config and tokenizer read; no weights, no engine)."""
    pytest.importorskip("vllm")
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    target = build_smoke_target(tmp_path_factory.mktemp("agent_target") / "target", agent=True)
    model_config = ModelConfig(model=str(target), tokenizer=str(target), max_model_len=2048)
    return OnlineRenderer(model_config=model_config, renderer=renderer_from_config(VllmConfig(model_config=model_config)),
                          request_logger=None, chat_template=None, chat_template_content_format="auto",
                          trust_request_chat_template=False, enable_auto_tools=True, tool_parser="hermes",
                          reasoning_parser=None, default_chat_template_kwargs=None)  # fmt: skip


def served_prompt(renderer, request: dict) -> list[int]:
    """The token ids vLLM's chat-completion path sends the engine for `request` (an OpenAI request body)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    result = asyncio.run(
        renderer.render_chat(ChatCompletionRequest.model_validate({"model": "target", **request}))
    )
    assert isinstance(result, tuple), result  # else vLLM's ErrorResponse
    _, (engine_input,) = result
    return list(engine_input["prompt_token_ids"])


def test_every_request_shape_renders_as_vllm_renders_it(tokenizer, logged, vllm_renderer, tmp_path):
    """Every request of the agent smoke data logged per request (re-sent history without reasoning, tool
    calls with string arguments, parallel results, text parts, reasoning inline or as `reasoning`), a
    developer message, thinking off and reasoning effort: rendered as data_prep renders it, alone and within
    the merged loop, equal to vLLM's own rendering token for token. (The legacy `function_call` departs on
    purpose: docs/recipe.md#per-request-logs.)"""
    records = [
        r for key, record in logged.items() if key != "legacy-function-call" for r in request_log(record)
    ]
    developer = request_log(logged["weather-one-call"])[0]
    developer["request"]["messages"].insert(0, {"role": "developer", "content": "Answer in one sentence."})
    off = request_log(logged["plain-chat"])[1]
    off["request"]["chat_template_kwargs"] = {"enable_thinking": False}
    effort = request_log(logged["plain-chat"])[0]
    effort["request"]["reasoning_effort"] = "none"
    records += [developer, off, effort]
    for record in records:
        (conv,) = load(tmp_path, [record], merge_requests=False).conversations
        ours = render_prompt(
            tokenizer, conv.id, conv.messages[:-1], conv.tools, conv.template_kwargs
        ).input_ids
        assert ours == served_prompt(vllm_renderer, record["request"]), record["id"]
    assert len(records) == 25 + 3
    # The merged loop renders each of its requests as the server rendered it (history without the reasoning
    # the client dropped, though the loop now holds it).
    loop = request_log(logged["docs-multi-turn"])
    (merged,) = load(tmp_path, loop).conversations
    answers = [i for i, m in enumerate(merged.messages) if m["role"] == "assistant"]
    for index, record in zip(answers, loop, strict=True):
        ours = render_prompt(tokenizer, merged.id, merged.messages[:index], merged.tools).input_ids
        assert ours == served_prompt(vllm_renderer, record["request"]), record["id"]
