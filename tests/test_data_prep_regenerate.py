"""Regeneration of the answers by the target itself, through real vLLM (the CPU build here)."""

import json
import shutil
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artifacts.cache import CacheSplit
from artifacts.config import check_config
from artifacts.manifest import read_manifest
from data_prep.main import run
from tests.helpers import REPO, smoke_config

pytest.importorskip("vllm")


def test_answers_are_the_targets_own_greedy_answers(regen_run, tmp_path):
    run_dir = tmp_path / "regen"
    shutil.copytree(regen_run, run_dir)  # built by experiment=smoke_regen (regen.max_new_tokens=128)
    manifest = read_manifest(run_dir / "cache")

    assert manifest["regeneration"] == {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 128, "seed": 0}
    record = manifest["regeneration_record"]
    assert sum(v for k, v in record.items() if k.startswith("finish_")) >= 64  # every answer of every turn
    assert record["vllm_version"] == "0.32.0" and list(record["files"]) == ["chunk-00000-of-00001.json"]

    originals = {}
    for line in (REPO / "artifacts/smoke_data/conversations.jsonl").open():
        source = json.loads(line)
        originals[source["id"]] = [t["value"] for t in source["conversations"] if t["from"] == "human"]
    target = AutoModelForCausalLM.from_pretrained(run_dir / "smoke_target", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "smoke_target")
    eval_conversations = [
        json.loads(line) for line in (run_dir / "cache" / "eval_conversations.jsonl").open()
    ]
    assert eval_conversations
    for conv in eval_conversations[:3]:
        messages = conv["messages"]
        users = [m["content"] for m in messages if m["role"] == "user"]
        # The user turns are the dataset's; each answer is what the target says greedily after them.
        assert users == originals[conv["id"]][: len(users)]
        first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tokenizer.apply_chat_template(
            messages[:first_answer], add_generation_prompt=True, return_tensors="pt"
        )
        out = target.generate(**prompt, max_new_tokens=128, do_sample=False)
        expected = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        assert messages[first_answer]["content"] == expected

    # The cache holds the regenerated conversations, not the originals.
    eval_split = CacheSplit(run_dir / "cache", "eval")
    first = eval_split[eval_split.ids.index(eval_conversations[0]["id"])]
    answer_text = tokenizer.decode(first["input_ids"][first["loss_mask"]])
    assert eval_conversations[0]["messages"][-1]["content"] in answer_text

    # A rerun reuses the regenerated answers (no second vLLM start) and the finished cache.
    again = run(smoke_config(run_dir, experiment="smoke_regen"))
    assert again["last_run"]["train"]["num_shards_written"] == 0
    assert read_manifest(run_dir / "cache")["regeneration_record"] == record


def one_process():
    from types import SimpleNamespace

    return SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                           device=SimpleNamespace(type="cpu"), wait_for_everyone=lambda: None)  # fmt: skip


def test_an_interrupted_regeneration_keeps_its_finished_chunks(tmp_path, monkeypatch):
    # The resume logic alone (no engine): chunk 1 fails the first time; the rerun redoes only chunk 1.
    from types import SimpleNamespace

    from data_prep import regenerate
    from data_prep.sources import Conversation

    calls = []

    def fake_regenerate(llm, tokenizer, conversations, cfg, capture=None, sink=None, template_kwargs=None):
        calls.append([c.id for c in conversations])
        if len(calls) == 2:
            raise KeyboardInterrupt
        answered = [
            Conversation(c.id, c.messages[:1] + [{"role": "assistant", "content": "ok"}])
            for c in conversations
        ]
        for number, c in enumerate(answered):
            sink({"id": c.id, "conversation": c, "input_ids": [1, 2, number], "loss_mask": [0, 1, 1]})
        return answered, {"finish_stop": len(conversations)}

    monkeypatch.setattr(regenerate, "start_engine", lambda *args: nullcontext(object()))
    monkeypatch.setattr(regenerate, "regenerate_conversations", fake_regenerate)
    accelerator = one_process()
    conversations = [
        Conversation(f"c{i}", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
        for i in range(5)
    ]
    cfg = SimpleNamespace(batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        regenerate.regenerate_rank_share(conversations, None, "target", cfg, tmp_path, accelerator)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk-00000-of-00003.json"]
    new, record, shards = regenerate.regenerate_rank_share(
        conversations, None, "target", cfg, tmp_path, accelerator
    )
    assert calls == [["c0", "c1"], ["c2", "c3"], ["c2", "c3"], ["c4"]]  # chunk 0 was not redone
    assert [c.id for c in new] == [f"c{i}" for i in range(5)]
    assert all(c.messages[-1]["content"] == "ok" for c in new)
    assert record["finish_stop"] == 5 and len(record["files"]) == 3
    # no capture: the chunks hold each sample's generated ids, read back in order
    assert [(x["id"], x["conversation"], x["input_ids"]) for x in shards] == [
        ("c0", "c0", [1, 2, 0]), ("c1", "c1", [1, 2, 1]), ("c2", "c2", [1, 2, 0]), ("c3", "c3", [1, 2, 1]),
        ("c4", "c4", [1, 2, 0]),
    ]  # fmt: skip


def test_another_batch_size_regenerates_chunks_it_changes_and_removes_stale_files(tmp_path, monkeypatch):
    # 20 conversations in chunks of 16 and then 17 are both 2 chunks with the same file names: the second
    # run must not take chunk 0 of 16 conversations for chunk 0 of 17 (conversation c16 would be lost).
    from types import SimpleNamespace

    from data_prep import regenerate
    from data_prep.sources import Conversation

    calls = []

    def fake_regenerate(llm, tokenizer, conversations, cfg, capture=None, sink=None, template_kwargs=None):
        calls.append(len(conversations))
        answered = [Conversation(c.id, c.messages[:1] + [{"role": "assistant", "content": "ok"}])
                    for c in conversations]  # fmt: skip
        return answered, {"finish_stop": len(conversations)}

    monkeypatch.setattr(regenerate, "start_engine", lambda *args: nullcontext(object()))
    monkeypatch.setattr(regenerate, "regenerate_conversations", fake_regenerate)
    conversations = [
        Conversation(f"c{i}", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
        for i in range(20)
    ]

    def regenerate_in(batch_size):
        cfg = SimpleNamespace(batch_size=batch_size)
        new, _, _ = regenerate.regenerate_rank_share(conversations, None, "t", cfg, tmp_path, one_process())
        return [c.id for c in new]

    assert regenerate_in(16) == [c.id for c in conversations] and calls == [16, 4]
    assert regenerate_in(17) == [c.id for c in conversations] and calls[2:] == [17, 3]
    assert regenerate_in(17) == [c.id for c in conversations] and calls[4:] == []  # all reused
    assert regenerate_in(8) == [c.id for c in conversations] and calls[4:] == [8, 8, 4]
    assert sorted(p.name for p in tmp_path.glob("chunk-*")) == [
        f"chunk-0000{i}-of-00003.json" for i in range(3)
    ]


def test_a_record_the_template_rejects_is_skipped_and_counted(tmp_path):
    from types import SimpleNamespace

    from artifacts.smoke import build_tokenizer
    from data_prep.regenerate import regenerate_conversations
    from data_prep.sources import Conversation

    tokenizer = build_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if 'forbidden' in m['content'] %}{{ raise_exception('no') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    class Engine:  # vLLM's LLM as regeneration uses it: answers "fine" to every prompt
        llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))

        def generate(self, prompts, params, use_tqdm=False):
            done = SimpleNamespace(text="fine", finish_reason="stop", token_ids=[1])
            return [SimpleNamespace(outputs=[done]) for _ in prompts]

    def conversation(i, second):
        turns = [("user", "hello"), ("assistant", "hi"), ("user", second), ("assistant", "ok")]
        return Conversation(f"c{i}", [{"role": r, "content": c} for r, c in turns])

    conversations = [conversation(0, "how are you"), conversation(1, "a forbidden question"),
                     conversation(2, "bye")]  # fmt: skip
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=8)
    new, counts = regenerate_conversations(Engine(), tokenizer, conversations, cfg)
    assert [c.id for c in new] == ["c0", "c2"] and counts["template_error"] == 1
    assert all([m["content"] for m in c.messages if m["role"] == "assistant"] == ["fine"] * 2 for c in new)


def test_sampled_answers_have_a_seed_of_their_own_and_greedy_settings_refuse_several():
    from types import SimpleNamespace

    from artifacts.manifest import regen_settings
    from data_prep.regenerate import answer_samples, sampling_params
    from data_prep.sources import Conversation

    cfg = SimpleNamespace(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=0, samples_per_prompt=3,
                          include_greedy=False)  # fmt: skip
    samples = answer_samples([Conversation("a", []), Conversation("b#1", [])], cfg)
    assert [c.id for c in samples] == ["a#0", "a#1", "a#2", "b#1#0", "b#1#1", "b#1#2"]
    seeds = {(c.id, turn): sampling_params(cfg, c.id, turn).seed for c in samples for turn in (0, 1)}
    assert len(set(seeds.values())) == len(seeds)  # per sample and turn
    assert sampling_params(cfg, "a#1", 0).seed == seeds[("a#1", 0)]  # the same request, the same seed
    assert sampling_params(cfg, "a#0", 0).temperature == 1.0 and sampling_params(cfg, "a#0", 0).top_p == 0.9
    mixed = SimpleNamespace(**{**vars(cfg), "include_greedy": True})
    assert (
        sampling_params(mixed, "a#0", 1).temperature == 0
        and sampling_params(mixed, "a#2", 1).temperature == 1
    )
    other = SimpleNamespace(**{**vars(cfg), "seed": 1})
    assert sampling_params(other, "a#1", 0).seed != seeds[("a#1", 0)]
    assert regen_settings(cfg)["samples_per_prompt"] == 3
    greedy = SimpleNamespace(**{**vars(cfg), "temperature": 0.0, "samples_per_prompt": 1})
    assert set(regen_settings(greedy)) == {"temperature", "top_p", "max_new_tokens", "seed"}  # as before
    assert answer_samples(samples, greedy) is samples

    for overrides, match in [
        (["regen.samples_per_prompt=2"], r"regen.samples_per_prompt=2: must be 1 at regen.temperature=0"),
        (
            ["regen.samples_per_prompt=2", "regen.temperature=1", "regen.enabled=false"],
            "1 without regeneration",
        ),
        (
            ["regen.include_greedy=true", "regen.temperature=1"],
            "regen.include_greedy=True: must be false unless",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            check_config(smoke_config("/tmp/unused", *overrides, experiment="smoke_regen"))


def test_a_head_records_the_temperature_of_its_answers(tmp_path):
    from artifacts.manifest import answer_temperatures
    from export.card import temperature_text
    from export.read_vllm import temperature_note

    greedy = {"temperature": 0.0, "top_p": 1.0, "max_new_tokens": 8, "seed": 0}
    sampled = {**greedy, "temperature": 1.0, "samples_per_prompt": 4, "include_greedy": False}
    assert answer_temperatures(None) is None and answer_temperatures(greedy) == [0.0]
    assert answer_temperatures(sampled) == [1.0]
    assert answer_temperatures({**sampled, "include_greedy": True}) == [0.0, 1.0]
    assert "4 answers per prompt" in temperature_text(sampled) and "greedy traffic" in temperature_text(
        greedy
    )
    assert temperature_note("h", [0.0], [0.0]) is None and temperature_note("h", None, [1.0]) is None
    assert temperature_note("h", [0.0, 1.0], [0.0, 1.0]) is None
    note = temperature_note("h", [0.0], [0.0, 1.0])
    assert note.startswith("head h: served at temperature 1;") and "generated at 0" in note


def test_a_question_the_data_leaves_unanswered_is_answered_by_the_target_and_trained(tmp_path):
    """`data.unanswered=answer`: a prompt alone, or a conversation whose last question no answer follows,
    is kept, and regeneration answers it: the target's answer is trained, after the whole history. A tool
    call in that answer is the answer, not a divergence from a logged call. Without regeneration the setting
    is refused."""
    from types import SimpleNamespace

    from artifacts.config import compose
    from artifacts.smoke import build_tokenizer
    from data_prep.regenerate import regenerate_conversations
    from data_prep.sources import load_conversations

    source = tmp_path / "prompts.jsonl"
    records = [
        {"id": "alone", "messages": [{"role": "user", "content": "explain this file"}]},
        {
            "id": "open",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "and now?"},
            ],
        },  # fmt: skip
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    from artifacts.config import DataConfig

    skipped = load_conversations(DataConfig(source=str(source)))
    assert [c.id for c in skipped.conversations] == ["open"] and skipped.skipped["no_assistant_turn"] == 1
    assert [m["role"] for m in skipped.conversations[0].messages] == ["user", "assistant"]  # as before
    records.append({"id": "asked", "messages": records[1]["messages"][:1]})  # answered in "open": merged
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = load_conversations(DataConfig(source=str(source), unanswered="answer"))
    assert loaded.merged["merged"] == 1
    assert [[m["role"] for m in c.messages] for c in loaded.conversations] == [
        ["user"],
        ["user", "assistant", "user"],
    ]

    tokenizer = build_tokenizer()
    answer_ids = tokenizer("the answer", add_special_tokens=False)["input_ids"]

    class Engine:  # vLLM's LLM as regeneration uses it: one answer to every prompt
        llm_engine = SimpleNamespace(model_config=SimpleNamespace(max_model_len=4096))

        def generate(self, prompts, params, use_tqdm=False):
            done = SimpleNamespace(text="the answer", finish_reason="stop", token_ids=answer_ids)
            return [SimpleNamespace(outputs=[done]) for _ in prompts]

    samples = []
    cfg = SimpleNamespace(temperature=0.0, top_p=1.0, max_new_tokens=8)
    new, counts = regenerate_conversations(
        Engine(), tokenizer, loaded.conversations, cfg, sink=samples.append
    )
    assert [[m["content"] for m in c.messages if m["role"] == "assistant"] for c in new] == [
        ["the answer"], ["the answer", "the answer"]
    ]  # fmt: skip
    assert counts["finish_stop"] == 3 and not counts["tool_call_diverged"]
    for sample in samples:  # the last answer generated, trained
        ids, mask = sample["input_ids"], sample["loss_mask"]
        assert ids[-len(answer_ids) :] == answer_ids and mask[-len(answer_ids) :] == [1] * len(answer_ids)
    assert sum(samples[1]["loss_mask"]) == 2 * len(answer_ids)  # both of the open conversation's answers

    cfg = compose("config", ["experiment=smoke", "run_dir=/tmp/x", f"data.source={source}",
                             "data.unanswered=answer"])  # fmt: skip
    with pytest.raises(ValueError, match=r"data.unanswered.*regen.enabled=true"):
        check_config(cfg)
