"""Tests for data_prep/sources.py, records.py and conversation.py: source kinds, record formats, skip
reasons, ids, robust JSON reading."""

from __future__ import annotations

import collections
import json
import re

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from artifacts.config import DataConfig, DataSourceConfig
from data_prep import records, sources
from data_prep.sources import load_conversations

# Non-ASCII text makes byte offsets and character offsets differ, so the tests can tell them apart.
UNICODE_ANSWER = "こんにちは、世界。" * 10


def sharegpt(record_id, *turns):
    return {"id": record_id, "conversations": [{"from": role, "value": text} for role, text in turns]}


def openai(record_id, *turns):
    return {"id": record_id, "messages": [{"role": role, "content": text} for role, text in turns]}


def qa(record_id, question=None, answer="hello"):
    """One exchange; the question names the id, so that records with other ids are other conversations."""
    return sharegpt(record_id, ("human", question or f"hi {record_id}"), ("gpt", answer))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
    return path


def write_json(path, records):
    path.write_text(json.dumps(records, ensure_ascii=False, indent=1))
    return path


def load(source, **overrides):
    return load_conversations(DataConfig(source=str(source), **overrides))


def test_sharegpt_json_maps_roles(tmp_path):
    record = sharegpt(
        "a", ("system", "be nice"), ("human", "hi"), ("gpt", "hello"), ("Human", "bye"), ("bard", "ok")
    )
    loaded = load(write_json(tmp_path / "d.json", [record]))
    assert loaded.conversations == [
        sources.Conversation(
            "a",
            [
                {"role": "system", "content": "be nice"},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"},
                {"role": "assistant", "content": "ok"},
            ],
        )
    ]
    assert loaded.skipped == collections.Counter() and loaded.problems == []


def test_openai_jsonl(tmp_path):
    records = [openai(1, ("user", "q1"), ("assistant", "a1")), openai(2, ("user", "q2"), ("assistant", "a2"))]
    loaded = load(write_jsonl(tmp_path / "d.jsonl", records), format="openai")
    assert [c.id for c in loaded.conversations] == ["1", "2"]
    assert loaded.conversations[1].messages[1] == {"role": "assistant", "content": "a2"}


def test_fields_format(tmp_path):
    record = {"uid": "x", "dialog": [{"speaker": "USER", "text": "q"}, {"speaker": "bot", "text": "a"}]}
    role_map = {"user": "user", "bot": "assistant"}
    cfg = DataConfig(
        source=str(write_jsonl(tmp_path / "d.jsonl", [record])),
        format="fields",
        messages_field="dialog",
        role_field="speaker",
        content_field="text",
        id_field="uid",
        role_map=role_map,
    )
    loaded = load_conversations(cfg)
    assert loaded.conversations[0].id == "x"
    assert [m["role"] for m in loaded.conversations[0].messages] == ["user", "assistant"]


def test_parquet_with_mixed_formats(tmp_path):
    # One Arrow schema holds both kinds, so each row has both columns and one of them is None.
    rows = [{**qa("s"), "messages": None}, openai("o", ("user", "q"), ("assistant", "a"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    loaded = load(tmp_path / "d.parquet")
    assert [c.id for c in loaded.conversations] == ["s", "o"]
    assert loaded.conversations[1].messages[1]["content"] == "a"


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list([qa("a"), qa("b")]).save_to_disk(str(tmp_path / "ds"))
    assert [c.id for c in load(tmp_path / "ds").conversations] == ["a", "b"]

    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([qa("t")]), "test": datasets.Dataset.from_list([qa("e")])}
    )
    splits.save_to_disk(str(tmp_path / "dd"))
    assert [c.id for c in load(tmp_path / "dd", split="test").conversations] == ["e"]
    with pytest.raises(ValueError, match="validation"):
        load(tmp_path / "dd", split="validation")


def test_directory_and_glob_read_files_in_sorted_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [qa("b")])
    write_json(tmp_path / "a.json", [qa("a")])
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / "more" / "deeper").mkdir(parents=True)  # subdirectories are read, not skipped
    write_jsonl(tmp_path / "more" / "c.jsonl", [qa("c")])
    write_jsonl(tmp_path / "more" / "deeper" / "d.jsonl", [qa("d")])
    assert [c.id for c in load(tmp_path).conversations] == ["a", "b", "c", "d"]
    assert [c.id for c in load(tmp_path / "*.jsonl").conversations] == ["b"]


def test_identical_conversations_are_one_whatever_their_ids_or_files(tmp_path):
    # The same conversation in two files of a directory, under other ids: kept once, counted as skipped.
    write_jsonl(tmp_path / "a.jsonl", [qa("x", "same question", "same answer"), qa("y")])
    write_jsonl(
        tmp_path / "b.jsonl", [qa("x", "same question", "same answer"), qa("z", "same question", "2")]
    )
    loaded = load(tmp_path)
    assert [c.id for c in loaded.conversations] == ["x", "y", "z"]
    assert loaded.skipped == collections.Counter({"duplicate_conversation": 1})


def test_the_split_goes_by_prompt_so_no_held_out_prompt_is_trained_on():
    from data_prep.sources import is_held_out

    # Same prompt, other ids and answers: one side of the split, whichever it is.
    for number in range(50):
        prompt = [{"role": "user", "content": f"question {number}"}]
        pair = [
            sources.Conversation(f"id-{number}", [*prompt, {"role": "assistant", "content": "one"}]),
            sources.Conversation(f"id-{number}#2", [*prompt, {"role": "assistant", "content": "two"}]),
        ]
        assert is_held_out(pair[0], 0.5) == is_held_out(pair[1], 0.5)
    held_out = [
        is_held_out(sources.Conversation("x", [{"role": "user", "content": f"q{n}"}]), 0.2)
        for n in range(2000)
    ]
    assert 0.17 < sum(held_out) / len(held_out) < 0.23
    assert not any(
        is_held_out(sources.Conversation("x", [{"role": "user", "content": f"q{n}"}]), 0) for n in range(200)
    )


def test_openai_multi_part_content_is_joined_and_non_text_parts_skipped(tmp_path):
    parts = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "text", "text": "here"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "seen"}]},
    ]}  # fmt: skip
    image = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": "x"}}]},
        {"role": "assistant", "content": "a cat"},
    ]}  # fmt: skip
    loaded = load(write_jsonl(tmp_path / "d.jsonl", [parts, image, qa("plain")]))
    assert loaded.conversations[0].messages == [
        {"role": "user", "content": "look\nhere"},
        {"role": "assistant", "content": "seen"},
    ]
    assert len(loaded.conversations) == 2
    assert loaded.skipped == collections.Counter({"non_text_content": 1})


def test_missing_path_raises_naming_the_source(tmp_path):
    for source in [tmp_path / "nope.jsonl", tmp_path / "*.parquet", tmp_path]:
        with pytest.raises(ValueError, match=re.escape(str(source))):
            load(source)


def test_hub_name_goes_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([qa("hub")])

    monkeypatch.setattr(records.datasets, "load_dataset", fake_load_dataset)
    loaded = load("someone/sharegpt-clean", split="train_sft")
    assert calls == [("someone/sharegpt-clean", "train_sft")]
    assert loaded.conversations[0].id == "hub"


@pytest.mark.parametrize(
    "bad_record, reason",
    [
        (["not", "a", "dict"], "malformed_record"),
        ({"id": "x", "text": "no turns field"}, "malformed_record"),
        ({"id": "x", "conversations": "a string"}, "malformed_record"),
        (sharegpt("x"), "empty_conversation"),
        (sharegpt("x", ("human", "q"), ("robot", "a")), "unknown_role"),
        (
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": 7}]},
            "malformed_record",
        ),
        ({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}, "malformed_record"),
        (sharegpt("x", ("human", "q"), ("gpt", "  \n")), "empty_assistant_turn"),
        (sharegpt("x", ("human", "q"), ("human", "q"), ("gpt", "a")), "not_alternating"),
        (sharegpt("x", ("human", "q"), ("gpt", "a"), ("gpt", "a")), "not_alternating"),
        (sharegpt("x", ("gpt", "a"), ("human", "q")), "no_assistant_turn"),  # orphan answer dropped first
        (sharegpt("x", ("human", "q"), ("system", "s"), ("gpt", "a")), "not_alternating"),
        (sharegpt("x", ("human", "q")), "no_assistant_turn"),
        (sharegpt("x", ("system", "s")), "no_assistant_turn"),
    ],
)
def test_skip_reasons(tmp_path, bad_record, reason):
    loaded = load(write_jsonl(tmp_path / "d.jsonl", [qa("good"), bad_record]))
    assert [c.id for c in loaded.conversations] == ["good"]
    assert loaded.skipped == collections.Counter({reason: 1})


def test_trailing_user_turn_is_dropped_not_skipped(tmp_path):
    record = sharegpt("x", ("human", "q"), ("gpt", "a"), ("human", "unanswered"))
    loaded = load(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert [m["content"] for m in loaded.conversations[0].messages] == ["q", "a"]
    assert not loaded.skipped


def test_leading_answer_without_its_question_is_dropped_not_skipped(tmp_path):
    record = sharegpt("x", ("system", "s"), ("gpt", "orphan"), ("human", "q"), ("gpt", "a"))
    loaded = load(write_jsonl(tmp_path / "d.jsonl", [record]))
    assert [m["content"] for m in loaded.conversations[0].messages] == ["s", "q", "a"]
    assert not loaded.skipped


def test_system_prompt_added_only_where_missing(tmp_path):
    records = [qa("plain"), sharegpt("own", ("system", "mine"), ("human", "q"), ("gpt", "a"))]
    loaded = load(write_jsonl(tmp_path / "d.jsonl", records), system_prompt="default")
    assert loaded.conversations[0].messages[0] == {"role": "system", "content": "default"}
    assert loaded.conversations[1].messages[0] == {"role": "system", "content": "mine"}


def test_num_samples_keeps_first_valid(tmp_path):
    records = [qa("a"), sharegpt("bad"), qa("b"), qa("c")]
    loaded = load(write_jsonl(tmp_path / "d.jsonl", records), num_samples=2)
    assert [c.id for c in loaded.conversations] == ["a", "b"]
    with pytest.raises(ValueError, match="num_samples"):
        load(tmp_path / "d.jsonl", num_samples=0)


def test_match_keeps_conversations_whose_first_question_matches(tmp_path):
    # A domain subset (here: code questions) of a general data set; the rest is counted, not lost silently.
    records = [qa("a", "write a python function"), qa("b", "tell me a joke"), qa("c", "fix my ```code```")]
    loaded = load(write_jsonl(tmp_path / "d.jsonl", records), match=r"(?i)python|```", num_samples=2)
    assert [c.id for c in loaded.conversations] == ["a", "c"]
    assert loaded.skipped["no_match"] == 1
    with pytest.raises(
        ValueError,
        match=r"data.match='\(': must be a valid regular expression \(missing \), unterminated subpattern",
    ):
        load(tmp_path / "d.jsonl", match="(")


def test_max_turns_keeps_the_first_exchanges(tmp_path):
    record = sharegpt("a", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3"))
    loaded = load(write_jsonl(tmp_path / "d.jsonl", [record]), max_turns=1, system_prompt="be brief")
    assert [m["content"] for m in loaded.conversations[0].messages] == ["be brief", "q1", "a1"]
    assert len(load(tmp_path / "d.jsonl", max_turns=5).conversations[0].messages) == 4
    with pytest.raises(ValueError, match="max_turns"):
        load(tmp_path / "d.jsonl", max_turns=0)


def test_ids_from_field_else_stable_hash(tmp_path):
    no_id = {"conversations": qa("ignored")["conversations"]}
    path = write_jsonl(tmp_path / "d.jsonl", [qa(42), no_id, {**qa("ignored", answer="other"), "id": None}])
    first, again = load(path), load(path)
    ids = [c.id for c in first.conversations]
    assert ids[0] == "42"
    assert re.fullmatch(r"[0-9a-f]{16}", ids[1]) and re.fullmatch(r"[0-9a-f]{16}", ids[2])
    assert ids[1] != ids[2]
    assert ids == [c.id for c in again.conversations]
    assert [c.id for c in load(path, id_field=None).conversations][1] == ids[1]  # same messages, same hash


def test_duplicate_ids_made_unique_in_order(tmp_path):
    records = [qa("a", answer="1"), qa("a#2", answer="2"), qa("a", answer="3"), qa("a", answer="4")]
    loaded = load(write_jsonl(tmp_path / "d.jsonl", records))
    assert [c.id for c in loaded.conversations] == ["a", "a#2", "a#3", "a#4"]
    assert not loaded.skipped


def byte_start_of_record(data: bytes, record_index: int) -> int:
    """Byte where element `record_index` of an `indent=1` array starts (each element opens with '\\n {')."""
    start = -1
    for _ in range(record_index + 1):
        start = data.index(b"\n {", start + 1) + 2
    return start


def test_truncated_json_array_keeps_complete_records(tmp_path):
    path = write_json(tmp_path / "d.json", [qa(i, answer=UNICODE_ANSWER) for i in range(5)])
    data = path.read_bytes()
    fourth = byte_start_of_record(data, 3)
    path.write_bytes(data[: fourth + 20])

    loaded = load(path)
    assert [c.id for c in loaded.conversations] == ["0", "1", "2"]
    assert loaded.conversations[2].messages[1]["content"] == UNICODE_ANSWER
    assert loaded.skipped == collections.Counter({"corrupt_json": 1})
    (problem,) = loaded.problems
    match = re.search(r"truncated/corrupt JSON at byte (\d+) after 3 complete records", problem)
    assert problem.startswith(str(path)) and match
    assert fourth <= int(match.group(1)) <= fourth + 20  # a byte offset: the text before it is multi-byte


def test_json_array_cut_between_records_and_mid_character(tmp_path):
    path = write_json(tmp_path / "d.json", [qa(i, answer=UNICODE_ANSWER) for i in range(3)])
    data = path.read_bytes()
    path.write_bytes(data[: byte_start_of_record(data, 2) - 3])  # just after "}," of the second record
    assert [c.id for c in load(path).conversations] == ["0", "1"]

    second = byte_start_of_record(data, 1)
    cut_in_character = data.index("世".encode(), second) + 1  # inside a 3-byte UTF-8 character
    path.write_bytes(data[:cut_in_character])
    loaded = load(path)
    assert [c.id for c in loaded.conversations] == ["0"]
    offset = int(re.search(r"at byte (\d+) after 1 complete records", loaded.problems[0]).group(1))
    assert second <= offset < cut_in_character


def test_corrupt_element_in_json_array_keeps_earlier_records(tmp_path):
    path = write_json(tmp_path / "d.json", [qa(i) for i in range(4)])
    data = path.read_bytes()
    third = byte_start_of_record(data, 2)
    path.write_bytes(data[:third] + b"{oops" + data[third + 1 :])
    loaded = load(path)
    assert [c.id for c in loaded.conversations] == ["0", "1"]
    assert "after 2 complete records" in loaded.problems[0]


def test_corrupt_jsonl_lines_are_skipped_and_reported(tmp_path):
    path = tmp_path / "d.jsonl"
    lines = [
        json.dumps(qa("a")),
        '{"id": "b", "conversations": [',
        json.dumps(qa("c")),
        json.dumps(qa("d"))[:30],
        '{"id": "e", "conversations": "unterminated',
    ]
    path.write_text("\n".join(lines))
    loaded = load(path)
    assert [c.id for c in loaded.conversations] == ["a", "c"]
    assert loaded.skipped == collections.Counter({"corrupt_json": 3})
    assert [p.split(", column")[0] for p in loaded.problems] == [f"{path}: line {n}" for n in (2, 4, 5)]
    assert loaded.problems[2].endswith(": Unterminated string starting")  # json's message ends in "at"


def test_strict_raises_instead_of_skipping(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(qa("a")) + "\n{broken\n")
    with pytest.raises(ValueError, match=r"d\.jsonl: line 2"):
        load(path, strict=True)

    truncated = tmp_path / "t.json"
    truncated.write_text(json.dumps([qa("a"), qa("b")])[:-20])
    with pytest.raises(ValueError, match=r"t\.json: truncated/corrupt JSON at byte \d+ after 1 complete"):
        load(truncated, strict=True)


def test_json_object_wrapping_a_list_and_jsonl_named_json(tmp_path):
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"version": 2, "data": [qa("a"), qa("b")]}))
    assert [c.id for c in load(wrapped).conversations] == ["a", "b"]

    single = tmp_path / "single.json"
    single.write_text(json.dumps(qa("only")))
    assert [c.id for c in load(single).conversations] == ["only"]

    lines = write_jsonl(tmp_path / "lines.json", [qa("x"), qa("y")])
    assert [c.id for c in load(lines).conversations] == ["x", "y"]


def test_fingerprint_tracks_content_and_order(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [qa("a"), qa("b")])
    reference = load(path).fingerprint
    assert re.fullmatch(r"[0-9a-f]{64}", reference)
    assert load(path).fingerprint == reference
    write_jsonl(path, [qa("a"), qa("b", answer="hello!")])
    assert load(path).fingerprint != reference
    write_jsonl(path, [qa("b"), qa("a")])
    assert load(path).fingerprint != reference


def test_works_with_omegaconf_structured_config(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt("a", ("Human", "q"), ("ChatGPT", "a"))])
    cfg = OmegaConf.structured(DataConfig(source=str(path), system_prompt="sys", num_samples=5))
    loaded = load_conversations(cfg)
    assert [m["role"] for m in loaded.conversations[0].messages] == ["system", "user", "assistant"]


def test_no_usable_conversations_raises_with_counts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt("x"), sharegpt("y", ("gpt", "a"))])
    with pytest.raises(ValueError, match=r"d\.jsonl.*empty_conversation': 1.*no_assistant_turn': 1"):
        load(path)


def test_a_parquet_file_with_other_columns_names_expected_and_found(tmp_path):
    rows = [{"question": "q", "answer": "a", "id": "1"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "qa.parquet")
    with pytest.raises(
        ValueError,
        match=re.escape("the records have the fields ['answer', 'id', 'question'], and the turns are read from "
                        "conversations or messages (another field: data.messages_field)"),
    ):  # fmt: skip
        load(tmp_path / "qa.parquet")


def test_bad_config_values_raise():
    with pytest.raises(ValueError, match="format"):
        load("x.jsonl", format="alpaca")
    with pytest.raises(ValueError, match="messages_field"):
        load("x.jsonl", format="fields")
    with pytest.raises(ValueError, match="role_map"):
        load("x.jsonl", role_map={"human": "customer"})
    for fraction in (-0.1, 1, 1.5):
        with pytest.raises(
            ValueError, match=re.escape(f"data.eval_fraction={fraction}: ") + ".*in \\[0, 1\\)"
        ):
            load("x.jsonl", eval_fraction=fraction)


def ultrachat(prompt_id, *turns):
    return {"prompt": turns[0][1], "prompt_id": prompt_id, **openai(None, *turns)}


def mix(*entries, **overrides):
    return load_conversations(DataConfig(mix=list(entries), **overrides))


def write_two_sources(tmp_path):
    """A ShareGPT JSON file and an UltraChat-shaped parquet file whose ids collide with the first's."""
    sharegpt_path = write_json(tmp_path / "sharegpt.json", [qa("1"), sharegpt("bad"), qa("2"), qa("3")])
    rows = [
        ultrachat("1", ("user", "q1"), ("assistant", "a1")),
        ultrachat("9", ("user", "q9"), ("assistant", "a9")),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ultrachat.parquet")
    return (
        DataSourceConfig(name="sharegpt", source=str(sharegpt_path), format="sharegpt", num_samples=2),
        DataSourceConfig(
            name="ultrachat",
            source=str(tmp_path / "ultrachat.parquet"),
            format="openai",
            id_field="prompt_id",
        ),
    )


def test_mix_reads_each_source_with_its_own_format_ids_and_num_samples(tmp_path):
    first, second = write_two_sources(tmp_path)
    loaded = mix(first, second, system_prompt="be brief")
    assert [c.id for c in loaded.conversations] == ["sharegpt/1", "sharegpt/2", "ultrachat/1", "ultrachat/9"]
    assert loaded.conversations[2].messages == [
        {"role": "system", "content": "be brief"},  # the shared settings apply to every source
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]
    assert loaded.skipped == collections.Counter({"empty_conversation": 1})
    # Typed like Hydra gives it, and a source read alone keeps its own ids.
    assert mix(first, second, system_prompt="be brief") == load_conversations(
        OmegaConf.structured(DataConfig(mix=[first, second], system_prompt="be brief"))
    )
    assert [c.id for c in load(first.source, format="sharegpt").conversations] == ["1", "2", "3"]


def test_mix_fingerprint_covers_every_source(tmp_path):
    first, second = write_two_sources(tmp_path)
    reference = mix(first, second).fingerprint
    assert mix(first, second).fingerprint == reference
    rows = [
        ultrachat("1", ("user", "q1"), ("assistant", "a1!")),
        ultrachat("9", ("user", "q9"), ("assistant", "a9")),
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "ultrachat.parquet")
    assert mix(first, second).fingerprint != reference  # one answer of the second source changed
    assert mix(second, first).fingerprint != mix(first, second).fingerprint
    second.num_samples = 1
    assert len(mix(first, second).conversations) == 3


def test_mix_hub_entries_use_their_own_split(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        return datasets.Dataset.from_list([ultrachat(split, ("user", f"q {split}"), ("assistant", "a"))])

    monkeypatch.setattr(records.datasets, "load_dataset", fake_load_dataset)
    entries = [
        DataSourceConfig(name=split, source="org/chat", split=split, format="openai", id_field="prompt_id")
        for split in ("train_sft", "train_gen")
    ]
    assert [c.id for c in mix(*entries).conversations] == ["train_sft/train_sft", "train_gen/train_gen"]
    assert calls == [("org/chat", "train_sft"), ("org/chat", "train_gen")]


def test_the_gpu_recipes_mix_reads_the_hub_datasets_in_their_published_shapes(monkeypatch):
    # The record shapes of the dataset cards: Aeala's ShareGPT (`id`, `conversations` of from/value) and
    # UltraChat-200k (`prompt`, `prompt_id`, `messages` of role/content); nothing is downloaded.
    from artifacts.config import compose

    hub = {
        ("Aeala/ShareGPT_Vicuna_unfiltered", "train"): [qa("QWJhYvA_0", "hi", "hello")],
        ("HuggingFaceH4/ultrachat_200k", "train_sft"): [ultrachat("f0e3", ("user", "q"), ("assistant", "a"))],
        ("HuggingFaceH4/ultrachat_200k", "train_gen"): [
            ultrachat("77ab", ("user", "q2"), ("assistant", "a"))
        ],
    }
    monkeypatch.setattr(
        records.datasets, "load_dataset", lambda name, split: datasets.Dataset.from_list(hub[(name, split)])
    )
    for experiment in ("llama31_8b", "qwen3_8b"):
        cfg = compose("config", [f"experiment={experiment}", "run_dir=/tmp/x"])
        loaded = load_conversations(cfg.data)
        assert [c.id for c in loaded.conversations] == [
            "sharegpt/QWJhYvA_0",
            "ultrachat/f0e3",
            "ultrachat_gen/77ab",
        ]
        assert not loaded.skipped


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"format": "alpaca"},
            r"data\.mix\[1\]\.format=alpaca: must be one of auto, sharegpt, openai, fields",
        ),
        (
            {"format": "fields"},
            r"data\.mix\[1\]\.messages_field=None: must be the record key holding the turns with "
            r"data\.mix\[1\]\.format=fields; change data\.mix\[1\]\.messages_field",
        ),
        ({"num_samples": 0}, r"data\.mix\[1\]\.num_samples=0: must be > 0 or null"),
        (
            {"name": "sharegpt"},
            r"data\.mix\[1\]\.name='sharegpt': must be non-empty and unique across the mix",
        ),
        ({"source": "missing.jsonl"}, r"data\.mix\[1\]\.source='missing\.jsonl' names no"),
        ({"format": "sharegpt"}, r"no usable conversations in data\.mix\[1\]\.source=.*ultrachat\.parquet"),
    ],
)
def test_a_bad_mix_entry_raises_naming_it(tmp_path, change, error):
    first, second = write_two_sources(tmp_path)
    for key, value in change.items():
        setattr(second, key, value)
    with pytest.raises(ValueError, match=error):
        mix(first, second)


def test_mix_and_single_source_settings_do_not_combine(tmp_path):
    first, second = write_two_sources(tmp_path)
    with pytest.raises(
        ValueError, match=r"data\.source='x\.json': must be null when data\.mix lists the sources"
    ):
        mix(first, second, source="x.json")
    with pytest.raises(
        ValueError, match=r"data\.num_samples=5: must be null with data\.mix: give each source its own"
    ):
        mix(first, second, num_samples=5)
    with pytest.raises(
        ValueError, match=r"data\.source=None: must be a hub dataset name, a `save_to_disk` directory"
    ):
        load_conversations(DataConfig())
