"""Yield the raw records of one source: local files, a `datasets` `save_to_disk` directory or the hub.

`data.source` (or `data.mix[i].source`) is a .json / .jsonl / .parquet file, a glob of them, a directory
of them (subdirectories included), a directory written by `save_to_disk`, or otherwise a Hugging Face hub
dataset name. Files are read in sorted order so runs repeat; each file is decoded by
`data_prep/record_files.py`, which keeps the complete records of a damaged one. Used by
`data_prep/sources.py`.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterator
from typing import Any

import datasets

from artifacts.config import DataConfig, DataSourceConfig
from artifacts.record_files import ProblemReporter, read_file

logger = logging.getLogger(__name__)

FILE_EXTENSIONS = (".json", ".jsonl", ".parquet")


def read_records(
    cfg: DataConfig | DataSourceConfig, report_problem: ProblemReporter, where: str = "data"
) -> Iterator[Any]:
    """Yield the raw records of `cfg.source` in a fixed order (files sorted by path)."""
    source = str(cfg.source)
    local = os.path.expanduser(source)
    if os.path.isdir(local) and is_saved_dataset(local):
        yield from read_saved_dataset(local, cfg.split, where)
    elif os.path.exists(local) or looks_like_path(source):
        turn_fields = ("conversations", "messages", cfg.messages_field)
        for path in find_data_files(source, where):
            yield from read_file(path, turn_fields, report_problem)
    else:
        yield from read_hub_dataset(source, cfg.split, where)


def looks_like_path(source: str) -> bool:
    # Hub names are `owner/name`, so a slash alone does not make a path; these do.
    return (
        os.path.isabs(source)
        or source.startswith((".", "~"))
        or source.lower().endswith(FILE_EXTENSIONS)
        or any(char in source for char in "*?[")
    )


def is_saved_dataset(directory: str) -> bool:
    # The files `Dataset.save_to_disk` and `DatasetDict.save_to_disk` always write.
    return any(os.path.isfile(os.path.join(directory, name)) for name in ("state.json", "dataset_dict.json"))


def find_data_files(source: str, where: str = "data") -> list[str]:
    """The .json/.jsonl/.parquet files a path, glob or directory names, sorted so runs repeat."""
    local = os.path.expanduser(source)
    if os.path.isdir(local):  # subdirectories too: a dump split into folders is read whole
        matches = sorted(
            path
            for path in glob.glob(os.path.join(glob.escape(local), "**", "*"), recursive=True)
            if os.path.isfile(path)
        )
    elif os.path.isfile(local):
        matches = [local]
    else:
        matches = sorted(path for path in glob.glob(local, recursive=True) if os.path.isfile(path))
    data_files = [path for path in matches if path.lower().endswith(FILE_EXTENSIONS)]
    others = [path for path in matches if path not in data_files]
    if data_files and others:
        logger.info("%s.source=%r: not reading %d files that are not %s, e.g. %s",
                    where, source, len(others), "/".join(FILE_EXTENSIONS), others[:3])  # fmt: skip
    if not data_files:
        found = f"; it matches only {matches[:5]}" if matches else ""
        raise ValueError(
            f"{where}.source={source!r} names no {'/'.join(FILE_EXTENSIONS)} file, glob of them, directory "
            f"of them or `save_to_disk` directory{found}"
        )
    return data_files


def read_saved_dataset(directory: str, split: str, where: str = "data") -> Iterator[dict]:
    loaded = datasets.load_from_disk(directory)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{directory} holds splits {sorted(loaded)}; {where}.split={split!r} is not one")
        loaded = loaded[split]
    yield from loaded


def read_hub_dataset(name: str, split: str, where: str = "data") -> Iterator[dict]:
    try:
        dataset = datasets.load_dataset(name, split=split)
    except Exception as err:  # hub, network and format errors all mean the same thing to the user
        raise ValueError(
            f"{where}.source={name!r} is not a local file or directory, and loading it as a Hugging Face "
            f"hub dataset (split={split!r}) failed: {err}"
        ) from err
    yield from dataset
