"""Agentic request logs: tool calls, tool results, reasoning and parts, rendered with the agent smoke
target's thinking-and-tools template (artifacts/smoke.py) and masked token by token; regenerated turn by
turn with the server's parsers."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from artifacts.config import DataConfig
from artifacts.conversation import SkippedRecord, extract_turns, normalize_messages
from artifacts.smoke import AGENT_DATA, build_tokenizer
from data_prep.render import render_prompt, render_samples
from data_prep.sources import load_conversations


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(agent=True)


@pytest.fixture(scope="module")
def conversations():
    loaded = load_conversations(DataConfig(source=str(AGENT_DATA)))
    assert not loaded.skipped  # every hand-written record is usable
    return {c.id: c for c in loaded.conversations}


def runs(tokenizer, sample, masked=1):
    """The decoded text of each maximal run of tokens whose mask is `masked`."""
    pieces, run = [], []
    for token, bit in zip(sample.input_ids + [None], sample.loss_mask + [1 - masked]):
        if bit == masked:
            run.append(token)
        elif run:
            pieces.append(tokenizer.decode(run))
            run = []
    return pieces


def test_records_are_read_as_servers_log_them(conversations):
    parallel = conversations["weather-parallel"]
    assert [t["function"]["name"] for t in parallel.tools] == ["get_weather", "get_time"]
    call = parallel.messages[2]
    assert call["content"] == "" and call["reasoning_content"].startswith("Two cities")
    assert call["tool_calls"][1] == {"type": "function", "id": "call_3",
                                     "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}  # fmt: skip
    assert [m["tool_call_id"] for m in parallel.messages[3:7]] == ["call_2", "call_3", "call_4", "call_5"]
    # `reasoning` as vLLM names it, a legacy `function_call` and its `function` result, text parts
    assert conversations["docs-multi-turn"].messages[1]["reasoning_content"] == "Search the docs for resume."
    legacy = conversations["legacy-function-call"].messages
    assert legacy[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "fahrenheit"}
    assert legacy[2] == {"role": "tool", "content": legacy[2]["content"], "name": "get_weather"}
    assert (
        conversations["thinking-inline"].messages[0]["content"] == "Name a prime number\nbetween 10 and 20."
    )


@pytest.mark.parametrize(
    "messages, reason",
    [
        ([{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}],
         "orphan_tool_result"),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "tool_call_id": "c9", "content": "r"}, {"role": "assistant", "content": "a"}],
         "unmatched_tool_result"),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
         "malformed_tool_arguments"),
        ([{"role": "user", "content": "q"},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "user", "content": "never mind"}, {"role": "assistant", "content": "a"}],
         "not_alternating"),  # a call nothing answered, then the user
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}], "empty_assistant_turn"),
        ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}], "empty_assistant_turn"),
        ([{"role": "system", "content": "s"}, {"role": "tool", "content": "r"}, {"role": "user", "content": "q"},
          {"role": "assistant", "content": "a"}], "orphan_tool_result"),  # a result whose call the log lost
    ],
)  # fmt: skip
def test_agentic_records_the_template_cannot_be_given_are_skipped_by_reason(messages, reason):
    cfg = DataConfig(source="x")
    with pytest.raises(SkippedRecord) as skipped:
        normalize_messages(extract_turns({"messages": messages}, cfg), dict(cfg.role_map), None)
    assert skipped.value.reason == reason


def test_masks_cover_reasoning_answers_and_calls_never_results(tokenizer, conversations):
    conv = conversations["python-failed-call"]
    (sample,) = render_samples(tokenizer, conv.id, conv.messages, conv.tools)
    assert runs(tokenizer, sample) == [
        "<think>\nA big number: run Python.\n</think>\n\nLet me compute it.\n<tool_call>\n"
        '{"name": "run_python", "arguments": {"code": "print(2 ** 100"}}\n</tool_call><|im_end|>',
        "<think>\nI forgot a parenthesis. Try again.\n</think>\n\n<tool_call>\n"
        '{"name": "run_python", "arguments": {"code": "print(2 ** 100)"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\n2 to the power of 100 is 1267650600228229401496703205376.<|im_end|>",
    ]
    prompt_runs = runs(tokenizer, sample, masked=0)
    assert prompt_runs[0].startswith("<|im_start|>system\nYou may call these tools")
    assert prompt_runs[1:] == [
        "\n<|im_start|>user\n<tool_response>\nSyntaxError: unexpected EOF while parsing\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\n<tool_response>\n1267650600228229401496703205376\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    # token by token: a token is trained on iff its characters lie in an answer
    text = tokenizer.decode(sample.input_ids)
    answers = runs(tokenizer, sample)
    assert sum(sample.loss_mask) == sum(
        len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers
    )
    assert all(a in text for a in answers)


def test_parallel_results_are_one_user_turn_and_untrained(tokenizer, conversations):
    conv = conversations["weather-parallel"]
    (sample,) = render_samples(tokenizer, conv.id, conv.messages, conv.tools)
    results = runs(tokenizer, sample, masked=0)[1]
    assert results.count("<tool_response>") == 4 and results.count("<|im_start|>user") == 1
    assert runs(tokenizer, sample)[0].count("<tool_call>") == 4


def test_history_that_drops_reasoning_gives_one_sample_per_user_turn(tokenizer, conversations):
    conv = conversations["docs-multi-turn"]
    first, second = render_samples(tokenizer, conv.id, conv.messages, conv.tools)
    assert (first.id, second.id) == ("docs-multi-turn/turn2", "docs-multi-turn/turn4")
    # each sample holds its user turn's answers with their reasoning; the earlier exchange as history
    assert [r.count("<think>") for r in runs(tokenizer, first)] == [1, 1]
    assert [r.count("<think>") for r in runs(tokenizer, second)] == [1, 1]
    history = tokenizer.decode(second.input_ids[: second.loss_mask.index(1)])
    assert "Search the docs for resume" not in history and "restarts from its last checkpoint" in history
    assert second.input_ids[: len(render_prompt(tokenizer, conv.id, conv.messages[:5], conv.tools).input_ids)] \
        == render_prompt(tokenizer, conv.id, conv.messages[:5], conv.tools).input_ids  # fmt: skip


def test_thinking_off_keeps_the_empty_think_block_out_of_the_loss(tokenizer, conversations):
    conv = conversations["weather-no-call"]
    messages = [conv.messages[0], {"role": "assistant", "content": "You are welcome."}]
    off = {"enable_thinking": False}
    (sample,) = render_samples(tokenizer, conv.id, messages, conv.tools, off)
    assert runs(tokenizer, sample) == ["You are welcome.<|im_end|>"]
    assert tokenizer.decode(
        render_prompt(tokenizer, conv.id, messages[:1], conv.tools, off).input_ids
    ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


class ReplayEngine:
    """vLLM's LLM as regeneration uses it, answering each prompt with the logged answer of the turn it asks
    for - or, for the prompts in `replace`, with another text - so that a regenerated conversation whose
    answers read back as logged asks exactly the logged conversation's prompts."""

    def __init__(self, tokenizer, conversations, replace=None, template_kwargs=None):
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))
        self.tokenizer, self.answers, self.prompts = tokenizer, {}, []
        for conv in conversations:
            for i, message in enumerate(conv.messages):
                if message["role"] == "assistant":
                    kwargs = template_kwargs
                    before = render_prompt(
                        tokenizer, conv.id, conv.messages[:i], conv.tools, kwargs
                    ).input_ids
                    (through,) = [s for s in render_samples(tokenizer, conv.id, conv.messages[: i + 1], conv.tools, kwargs)
                                  if s.input_ids[: len(before)] == before][-1:]  # fmt: skip
                    text = tokenizer.decode(through.input_ids[len(before) :]).rstrip()
                    self.answers[tuple(before)] = (replace or {}).get((conv.id, i), text)

    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for prompt in prompts:
            ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.prompt_token_ids
            self.prompts.append(ids)
            text = self.answers[tuple(ids)].removesuffix("<|im_end|>")
            done = SimpleNamespace(text=text, finish_reason="stop",
                                   token_ids=self.tokenizer(text + "<|im_end|>")["input_ids"])  # fmt: skip
            outputs.append(SimpleNamespace(outputs=[done]))
        return outputs


def test_regeneration_reads_calls_as_the_server_and_ends_where_a_call_diverges(tokenizer, conversations):
    from data_prep.regenerate import regenerate_conversations

    chosen = [
        conversations[k] for k in ("python-failed-call", "weather-two-cities-sequential", "docs-multi-turn")
    ]
    other_call = '<think>\nParis instead.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = ReplayEngine(tokenizer, chosen, replace={("weather-two-cities-sequential", 3): other_call})
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=64, tool_parser="hermes",
                          reasoning_parser="qwen3")  # fmt: skip
    new, counts = regenerate_conversations(engine, tokenizer, chosen, cfg)
    by_id = {c.id: c for c in new}
    # read back as logged: the same messages (ids of the calls kept), so the same prompts were asked
    for key in ("python-failed-call", "docs-multi-turn"):
        logged = [
            {k: v for k, v in m.items() if k != "reasoning_content" or v} for m in conversations[key].messages
        ]
        regenerated = [{k: (v.strip() if k in ("content", "reasoning_content") else v) for k, v in m.items()}
                       for m in by_id[key].messages]  # fmt: skip
        assert [m.get("tool_calls") for m in regenerated] == [m.get("tool_calls") for m in logged]
        assert [m["content"].strip() for m in regenerated] == [m["content"] for m in logged]
    # the second call differs: the conversation ends with it (the logged Madrid result no longer answers it)
    diverged = by_id["weather-two-cities-sequential"].messages
    assert diverged[-1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert len(diverged) == 4 and counts["tool_call_diverged"] == 1
    assert counts["tool_calls_regenerated"] == 2 + 2 + 2  # python, weather (Berlin, then Paris), docs
    assert len(engine.prompts) == 3 + 2 + 4


def test_regenerating_tools_without_the_servers_parser_is_refused(tokenizer, conversations):
    from data_prep.regenerate import regenerate_conversations

    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=8)
    with pytest.raises(ValueError, match="regen.tool_parser"):
        regenerate_conversations(None, tokenizer, [conversations["weather-one-call"]], cfg)


class ReplayCapture:
    """target/capture.CaptureEngine as regeneration uses it, over a ReplayEngine: zero states, and the
    outputs it was told to discard."""

    def __init__(self, engine):
        self.engine, self.discarded = engine, []

    def generate(self, prompts, params, greedy, progress=False):
        return self.engine.generate([{"prompt_token_ids": p} for p in prompts], params)

    def states(self, output, ids, where):
        import torch

        return torch.zeros(len(ids), 3, 4), torch.zeros(len(ids), 4)

    def discard(self, output):
        self.discarded.append(output)


def test_capturing_while_regenerating_keeps_a_sample_per_request_the_template_rewrites(
    tokenizer, conversations
):
    from data_prep.regenerate import regenerate_conversations

    chosen = [conversations[k] for k in ("python-failed-call", "docs-multi-turn")]
    engine = ReplayEngine(tokenizer, chosen)
    capture, samples = ReplayCapture(engine), []
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=64, tool_parser="hermes",
                          reasoning_parser="qwen3")  # fmt: skip
    regenerate_conversations(engine, tokenizer, chosen, cfg, capture, samples.append)
    by_id = {s["id"]: s for s in samples}
    # One request holds the whole agent loop (its turns keep their reasoning); the second user turn's
    # request drops the first turn's reasoning, so the first user turn's last request is a sample too:
    # the samples render_samples makes of the logged conversations, with their prompts and answers.
    expected = {s.id: s for c in chosen for s in render_samples(tokenizer, c.id, c.messages, c.tools)}
    assert (
        sorted(by_id)
        == sorted(expected)
        == ["docs-multi-turn/turn2", "docs-multi-turn/turn4", "python-failed-call"]
    )
    assert len(capture.discarded) == 2 + 2  # superseded requests: python's first two, docs' first and third
    for sample_id, rendered in expected.items():
        sample = SimpleNamespace(
            input_ids=by_id[sample_id]["input_ids"], loss_mask=by_id[sample_id]["loss_mask"]
        )
        assert len(runs(tokenizer, sample)) == len(runs(tokenizer, rendered)), sample_id
        start = rendered.loss_mask.index(1)
        assert sample.loss_mask.index(1) == start and sample.input_ids[:start] == rendered.input_ids[:start]


class ScriptedEngine:
    """vLLM's LLM as regeneration uses it, answering its prompts in turn with scripted (text, finish reason)
    pairs: the ids of the text, and the end of turn unless it was cut at the token limit."""

    def __init__(self, tokenizer, answers):
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))
        self.tokenizer, self.answers, self.generated = tokenizer, iter(answers), []

    def generate(self, prompts, params, use_tqdm=False):
        outputs = []
        for _ in prompts:
            text, finish = next(self.answers)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += [] if finish == "length" else [self.tokenizer.convert_tokens_to_ids("<|im_end|>")]
            self.generated.append(ids)
            outputs.append(
                SimpleNamespace(outputs=[SimpleNamespace(text=text, finish_reason=finish, token_ids=ids)])
            )
        return outputs


def masked_ids(sample) -> list[list[int]]:
    """The token ids of each maximal run of trained tokens."""
    pieces, run = [], []
    for token, bit in zip(sample["input_ids"] + [None], sample["loss_mask"] + [0]):
        if bit:
            run.append(token)
        elif run:
            pieces, run = pieces + [run], []
    return pieces


@pytest.mark.parametrize("captured", [False, True], ids=["text", "capture"])
def test_a_cut_answer_is_trained_as_cut_with_exactly_the_generated_ids(tokenizer, conversations, captured):
    """Both regeneration paths train each answer's generated ids once, as generated: a turn cut at
    regen.max_new_tokens gets no closing `</think>` or end of turn, however the next request renders it
    (the capture path's samples stop before the last token, which no forward pass reads)."""
    from data_prep.regenerate import regenerate_conversations

    conv = conversations["plain-chat"]
    engine = ScriptedEngine(tokenizer, [("<think>\nThe user asks for the capital of Ita", "length"),
                                        ("<think>\nSpain.\n</think>\n\nMadrid.", "stop")])  # fmt: skip
    capture, samples = (ReplayCapture(engine) if captured else None), []
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=12, reasoning_parser="qwen3")
    new, counts = regenerate_conversations(engine, tokenizer, [conv], cfg, capture, samples.append)
    assert counts["finish_length"] == 1 and len(new[0].messages) == len(conv.messages)
    trained = [run for sample in samples for run in masked_ids(sample)]
    cut, whole = engine.generated
    assert len(samples) == 2  # the template rewrote the cut answer in the second request: a sample each
    assert trained == ([cut[:-1], whole[:-1]] if captured else [cut, whole])
    assert "</think>" not in tokenizer.decode(trained[0]) and "<|im_end|>" not in tokenizer.decode(trained[0])
    for sample in samples:  # every sample is a request's ids, then the answer's as generated
        answer = next(
            ids
            for ids in engine.generated
            if sample["input_ids"][-len(ids) + captured :] == ids[: len(ids) - captured]
        )
        assert sum(sample["loss_mask"]) == len(answer) - captured


def test_a_call_after_text_is_trained_as_generated_though_its_history_renders_another_newline(conversations):
    """hermes reads `text\n<tool_call>...` as content `text\n` and the call; the template renders that
    history as `text\n\n<tool_call>`. The turn is trained as generated, in the request that generated it."""
    from data_prep.regenerate import regenerate_conversations

    tokenizer = build_tokenizer(agent=True)  # as Qwen3's template: the content's trailing newline kept
    tokenizer.chat_template = tokenizer.chat_template.replace("content.strip('\\n')", "content.lstrip('\\n')")
    assert "content.lstrip" in tokenizer.chat_template
    conv = conversations["weather-one-call"]
    call = '<think>\nCall it.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = ScriptedEngine(
        tokenizer, [(call, "stop"), ("<think>\nDone.\n</think>\n\nCloudy, 18 degrees.", "stop")]
    )
    cfg = SimpleNamespace(
        temperature=0.0, top_p=1.0, max_new_tokens=64, tool_parser="hermes", reasoning_parser="qwen3"
    )
    samples = []
    new, counts = regenerate_conversations(engine, tokenizer, [conv], cfg, None, samples.append)
    assert counts["tool_call_diverged"] == 0 and new[0].messages[1]["content"].lstrip() == "Let me check.\n"
    assert "Let me check.\n\n<tool_call>" in tokenizer.decode(samples[-1]["input_ids"])  # the history
    assert [run for s in samples for run in masked_ids(s)] == engine.generated  # each turn once, as generated


@pytest.mark.parametrize("captured", [False, True], ids=["text", "capture"])
def test_a_request_holding_a_cut_answer_trains_it_once_and_not_the_end_of_turn_its_template_adds(captured):
    """A template that keeps history (ChatML) renders the cut answer with an end of turn in the next request:
    one sample holds both answers, and of the first only the ids the target generated are trained."""
    from artifacts.conversation import Conversation
    from artifacts.smoke import build_tokenizer
    from data_prep.regenerate import regenerate_conversations

    chatml = build_tokenizer()
    turns = [
        ("user", "Capital of Italy?"),
        ("assistant", "Rome."),
        ("user", "And Spain?"),
        ("assistant", "Madrid."),
    ]
    conv = Conversation("two-turns", [{"role": r, "content": c} for r, c in turns])
    engine = ScriptedEngine(chatml, [("The capital of Italy is", "length"), ("Madrid.", "stop")])
    capture, samples = (ReplayCapture(engine) if captured else None), []
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=5)
    regenerate_conversations(engine, chatml, [conv], cfg, capture, samples.append)
    cut, whole = engine.generated
    (sample,) = samples
    assert sample["id"] == "two-turns" and masked_ids(sample) == [cut, whole[: len(whole) - captured]]
    after_cut = sample["input_ids"].index(cut[-1]) + 1
    assert (
        chatml.decode(sample["input_ids"][after_cut]) == "<|im_end|>" and not sample["loss_mask"][after_cut]
    )


def test_reasoning_off_asks_the_target_not_to_think_and_its_answers_carry_none(tokenizer, conversations):
    """regen.reasoning=off: the template kwargs gain regen.reasoning_off_kwargs (the thinking mode of the
    cache and the head); the answers regenerated under them are read without reasoning."""
    from artifacts.config import compose
    from artifacts.prompts import served_template_kwargs
    from data_prep.regenerate import regenerate_conversations

    cfg = compose("config", ["experiment=smoke_agent", "run_dir=/tmp/x", "regen.reasoning=off"])
    off = served_template_kwargs(cfg)
    assert off == {"enable_thinking": False}
    assert served_template_kwargs(compose("config", ["experiment=smoke_agent", "run_dir=/tmp/x"])) == {}
    conv = conversations["plain-chat"]
    plain = type(conv)(
        conv.id, [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv.messages]
    )
    engine = ReplayEngine(tokenizer, [plain], template_kwargs=off)
    new, _ = regenerate_conversations(engine, tokenizer, [plain], cfg.regen, template_kwargs=off)
    answers = [m for m in new[0].messages if m["role"] == "assistant"]
    assert [m["content"] for m in answers] == ["Rome.", "Madrid."]
    assert all(not m.get("reasoning_content") for m in answers)
    assert all(
        tokenizer.decode(p).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") for p in engine.prompts
    )


def test_the_agent_workload_sends_every_request_of_its_conversations_with_their_tools(tokenizer, tmp_path):
    from artifacts.agent_data import AGENT_WORKLOAD_SEED, conversations
    from eval.workloads import workload_prompts

    prompts = workload_prompts("agent", tokenizer, tmp_path, 7)
    first = conversations(1, AGENT_WORKLOAD_SEED)[0]  # one weather call: asked, then answered from its result
    texts = [tokenizer.decode(p) for p in prompts]
    assert len(prompts) == 7 and all('"name": "get_weather"' in t for t in texts[:2])
    assert texts[0].endswith(first["messages"][-4]["content"] + "<|im_end|>\n<|im_start|>assistant\n")
    assert "<tool_response>" in texts[1] and texts[1].startswith(texts[0])
    assert workload_prompts("agent", tokenizer, tmp_path, 7) == prompts  # the same requests every run


def test_a_template_that_drops_tools_is_refused_per_conversation_and_counted(conversations):
    """SmolLM2's own template renders neither `tools` nor `tool_calls`: its samples would train on empty
    answers, so they are skipped as `template_drops_tools`; its tools template renders both."""
    from dataclasses import replace

    from artifacts.assets import SMOLLM2_CHAT_TEMPLATE
    from artifacts.config.resolvers import _chat_template
    from data_prep.render import render_all

    tokenizer = build_tokenizer()
    with_reasoning = [conversations[k] for k in ("weather-one-call", "long-reasoning")]
    chosen = [replace(c, messages=[{k: v for k, v in m.items() if k != "reasoning_content"} for m in c.messages])
              for c in with_reasoning]  # fmt: skip
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    samples, skipped, _ = render_all(tokenizer, chosen, 2048, "truncate")
    assert [s.id for s in samples] == ["long-reasoning"] and skipped == {"template_drops_tools": 1}
    tokenizer.chat_template = Path(_chat_template("smollm2_tools.jinja")).read_text()
    samples, skipped, _ = render_all(tokenizer, chosen, 2048, "truncate")
    assert [s.id for s in samples] == ["weather-one-call", "long-reasoning"] and not skipped
    # neither template has a place for reasoning: answers that reason are counted, not trained without it
    assert render_all(tokenizer, with_reasoning, 2048, "truncate")[1] == {"template_drops_reasoning": 2}
    assert '"name": "get_weather", "arguments": {"city": "Paris"}' in runs(tokenizer, samples[0])[0]


# Slow (~2 min: a vLLM engine regenerating 20 conversations turn by turn): the agentic parts run by default
# above on the same parsers and template with a replayed engine; this is the path `experiment=smoke_agent`
# runs, end to end in data_prep (docs/recipe.md#agents has the whole smoke run, train to eval).
@pytest.mark.slow
def test_the_agent_smoke_run_regenerates_and_captures_in_one_pass_through_vllm(tmp_path):
    pytest.importorskip("vllm")
    from artifacts.cache import CacheSplit
    from artifacts.manifest import read_manifest
    from data_prep.main import run
    from tests.helpers import smoke_config

    overrides = ["capture.engine=vllm", "data.mix.0.num_samples=8", "regen.max_new_tokens=24"]
    manifest = run(smoke_config(tmp_path, *overrides, experiment="smoke_agent"))
    record = manifest["regeneration_record"]
    assert manifest["skipped"] == {} and manifest["regeneration"]["tool_parser"] == "hermes"
    assert (
        record["tool_call_diverged"] == 8
    )  # the random target calls no tool: each call turn ends its conversation
    ids = CacheSplit(tmp_path / "cache", "train").ids + CacheSplit(tmp_path / "cache", "eval").ids
    assert any("/turn" in i for i in ids)  # a request whose history the template rewrote is its own sample
    assert read_manifest(tmp_path / "cache")["chat_template_kwargs"] == {}
