"""Read records from .json / .jsonl / .parquet files, keeping every complete record of a damaged file.

Real dumps ship cut off (the ShareGPT V3 file on PyPI ends mid-string): a truncated JSON array keeps its
complete elements, a corrupt JSONL line is skipped, and each problem is reported with the file and the
byte offset or line number. Used by `data_prep/records.py` and `artifacts/long_data.py`.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

# raw_decode does not skip the whitespace JSON allows between values; this is the set json itself uses.
JSON_WHITESPACE = re.compile(r"[ \t\n\r]*")

# Called with one line per file-level problem; logs it and goes on, or raises when `strict`.
ProblemReporter = Callable[[str], None]


def read_file(path: str, turn_fields: tuple, report_problem: ProblemReporter) -> Iterator[Any]:
    if path.lower().endswith(".jsonl"):
        with open(path, "rb") as lines:
            yield from decode_json_lines(lines, path, report_problem)
    elif path.lower().endswith(".json"):
        yield from read_json_file(path, turn_fields, report_problem)
    else:
        yield from read_parquet_file(path)


def read_parquet_file(path: str) -> Iterator[dict]:
    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors do not say which file
        raise ValueError(f"{path}: cannot read Parquet file: {err}") from err
    for batch in parquet.iter_batches(batch_size=1024):
        yield from batch.to_pylist()


def decode_json_lines(lines: Iterable[bytes], path: str, report_problem: ProblemReporter) -> Iterator[Any]:
    """One JSON value per line; a corrupt line is reported and the others are still used."""
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)  # bytes in: json detects UTF-8 and a leading BOM itself
        except json.JSONDecodeError as err:
            # json's messages may end in "at" ("Unterminated string starting at"): the column goes first
            report_problem(f"{path}: line {line_number}, column {err.colno}: {err.msg.removesuffix(' at')}")
        except UnicodeDecodeError as err:
            report_problem(f"{path}: line {line_number}: invalid UTF-8 ({err.reason})")


def read_json_file(path: str, turn_fields: tuple, report_problem: ProblemReporter) -> Iterator[Any]:
    """A top-level array of records (decoded one by one), `{"data": [...]}`, one record, or JSON Lines."""
    data = Path(path).read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    text = decode_utf8_prefix(data[bom:])

    def byte_offset(char_index: int) -> int:
        return bom + len(text[:char_index].encode("utf-8"))

    start = JSON_WHITESPACE.match(text).end()
    if text.startswith("[", start):
        yield from decode_json_array(text, start, path, byte_offset, report_problem)
        return
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several top-level values: JSON Lines saved under a .json name
            yield from decode_json_lines(data.splitlines(), path, report_problem)
        else:
            report_problem(
                f"{path}: truncated/corrupt JSON at byte {byte_offset(err.pos)} after 0 complete records: "
                f"{err.msg}"
            )
        return
    yield from records_in_json_document(document, turn_fields)


def decode_utf8_prefix(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        # A file cut inside a multi-byte character keeps what comes before; the JSON decoder then
        # reports the truncation at that byte.
        return data[: err.start].decode("utf-8")


def decode_json_array(
    text: str, start: int, path: str, byte_offset: Callable[[int], int], report_problem: ProblemReporter
) -> Iterator[Any]:
    """Decode `text[start:]`, a JSON array, one element at a time so a cut-off file keeps its prefix.

    raw_decode on the whole string at a moving index is linear in the file size: nothing is re-parsed
    and no substrings are built, which matters for 100+ MB ShareGPT dumps.
    """
    decoder = json.JSONDecoder()
    num_records = 0

    def report_stop(char_index: int, why: str) -> None:
        report_problem(
            f"{path}: truncated/corrupt JSON at byte {byte_offset(char_index)} after {num_records} "
            f"complete records: {why}"
        )

    pos = JSON_WHITESPACE.match(text, start + 1).end()
    if text.startswith("]", pos):
        return
    while True:
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            report_stop(err.pos, err.msg)
            return
        yield record
        num_records += 1
        pos = JSON_WHITESPACE.match(text, pos).end()
        if text.startswith("]", pos):
            break
        if not text.startswith(",", pos):
            report_stop(pos, "expected ',' or ']' after a record")
            return
        pos = JSON_WHITESPACE.match(text, pos + 1).end()
    end = JSON_WHITESPACE.match(text, pos + 1).end()
    if end != len(text):
        report_stop(end, "extra data after the closing ']'")


def records_in_json_document(document: Any, turn_fields: tuple) -> Iterator[Any]:
    if isinstance(document, list):
        yield from document
        return
    if isinstance(document, dict) and not any(name in document for name in turn_fields if name):
        # A wrapper such as {"version": 2, "data": [...]}: the records are its only list.
        lists = [value for value in document.values() if isinstance(value, list)]
        if len(lists) == 1:
            yield from lists[0]
            return
    yield document  # one record, or something unusable that the normalizer counts as malformed


# Records: from one raw record to normalized messages, or a reason to skip it.
