"""Long conversations from the shipped assets (artifacts/long_data.py): ShareGPT's split conversations
joined again, standard-library files with a question, and eval's long workloads on the held-out side of
data_prep's split."""

import itertools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from artifacts.long_data import (
    MAX_CODE_CHARS,
    code_conversations,
    conversations,
    join_parts,
    long_data_path,
    sharegpt_joined,
    stdlib_files,
)
from data_prep.sources import is_held_out


def part(conv_id, *turns):
    return {"id": conv_id, "conversations": [{"from": who, "value": text} for who, text in turns]}


def test_split_conversations_are_joined_in_order_up_to_the_first_missing_part():
    records = [
        part("a_0", ("human", "q1"), ("gpt", "a1 first half")),
        part("b_0", ("human", "only part")),
        part("a_2", ("human", "q3"), ("gpt", "a3")),
        part("a_1", ("gpt", "a1 second half"), ("human", "q2"), ("gpt", "a2")),
        part("c_0", ("human", "x")),
        part("c_2", ("human", "a gap before it")),
        part("d_1", ("human", "no part 0")),
    ]
    joined = sharegpt_joined(iter(records))
    assert [r["id"] for r in joined] == ["a"]  # b: one part; c: part 1 missing; d: no part 0
    turns = [(t["from"], t["value"]) for t in joined[0]["conversations"]]
    assert turns == [
        ("human", "q1"),
        ("gpt", "a1 first half\n\na1 second half"),  # the turn the cut divided, whole again
        ("human", "q2"),
        ("gpt", "a2"),
        ("human", "q3"),
        ("gpt", "a3"),
    ]
    assert join_parts([records[1]])["id"] == "b"


def test_the_shipped_sharegpt_gives_long_conversations_once_joined():
    joined = sharegpt_joined()
    assert len(joined) == 118  # of 9,460 conversations in the shipped (truncated) file
    chars = sorted(sum(len(t["value"]) for t in r["conversations"]) for r in joined)
    # each part is at most 2,048 Llama tokens (~8k characters); joined, most are longer than any part
    assert chars[len(chars) // 2] > 16000 and chars[-1] > 40000


def test_code_questions_cover_the_stdlib_without_tests_in_a_fixed_mixed_order():
    files = stdlib_files()
    assert len(files) > 400 and not any("test" in p.parts[:-1] or p.name.startswith("test_") for p in files)
    first = list(zip(range(40), code_conversations()))
    records = [r for _, r in first]
    assert records == [r for _, r in zip(range(40), code_conversations())]  # deterministic
    assert [r["id"] for r in records] != sorted(r["id"] for r in records)  # hash order: lengths mixed
    sources = [r["messages"][0]["content"] for r in records]
    assert all(len(s) <= MAX_CODE_CHARS + 300 for s in sources)
    assert len({s.split("```")[-1] for s in sources}) > 1  # more than one question


def test_the_data_file_and_its_resolver(tmp_path, monkeypatch):
    from artifacts.config import compose

    monkeypatch.setenv("EAGLE_ASSETS_DIR", str(tmp_path))
    mixed = conversations(6)
    assert [r["id"].startswith("stdlib/") for r in mixed] == [False, True] * 3  # chat and code in turn
    assert all(r["messages"][0]["role"] == "user" for r in mixed)
    cfg = compose(
        "config", ["experiment=smollm2_long", "run_dir=/tmp/x", "data.mix.1.source=${long_data:4,code}"]
    )
    path = cfg.data.mix[1].source
    assert path == long_data_path(4, "code") and path.startswith(str(tmp_path))
    rows = [json.loads(line) for line in open(path)]
    assert len(rows) == 4 and all(r["id"].startswith("stdlib/") for r in rows)
    with pytest.raises(ValueError, match="one of mixed, chat, code"):
        long_data_path(4, "books")


def test_eval_measures_long_prompts_none_of_which_data_prep_trains_on():
    """Every prompt of eval's long workloads is on the held-out side of data_prep's split of the same
    conversations (the prompt's hash), so training on the long data never trains an eval prompt."""
    from eval.long_context import long_agent_records, long_chat_messages, long_code_messages

    code = [m for _, m in zip(range(12), long_code_messages(0.05))]
    chat = [m for _, m in zip(range(12), long_chat_messages(0.05))]
    agent = [r["messages"] for _, r in zip(range(6), long_agent_records(0.05))]
    assert len(code) == 12 and len(chat) == 12 and len(agent) == 6
    for messages in code + chat + agent:
        assert is_held_out(SimpleNamespace(messages=messages), 0.05)
    trained = [
        r for r in conversations(200) if not is_held_out(SimpleNamespace(messages=r["messages"]), 0.05)
    ]
    assert len(trained) > 180
    eval_prompts = {m[0]["content"] for m in code}
    assert not eval_prompts & {r["messages"][0]["content"] for r in trained}


def test_an_agent_session_holds_real_tool_results_about_a_real_file():
    """The agent's calls and the tools' results are what the tools would return on this interpreter's own
    standard library: the directory's files, every line naming the definition, the file whole."""
    import sysconfig

    from artifacts.long_data import AGENT_TOOLS, agent_conversations

    root = Path(sysconfig.get_paths()["stdlib"])
    records = list(itertools.islice(agent_conversations(), 20))
    assert len({r["id"] for r in records}) == 20 and all(r["tools"] == AGENT_TOOLS for r in records)
    for record in records:
        user, _, listing, search, found, read, whole = record["messages"]
        path = root / record["id"].removeprefix("agent/")
        name = json.loads(search["tool_calls"][0]["function"]["arguments"])["name"]
        assert f"`{name}`" in user["content"] and re.search(rf"^(def|class) {name}\b", whole["content"], re.M)
        assert whole["content"] == path.read_text(encoding="utf-8", errors="replace").strip()
        assert f"{path.name}\t{path.stat().st_size} bytes" in listing["content"].splitlines()
        hits = found["content"].splitlines()
        assert hits and all(name in line for line in hits)
        assert [c["role"] for c in record["messages"]] == ["user"] + ["assistant", "tool"] * 3
        assert read["tool_calls"][0]["function"]["name"] == "read_file"
