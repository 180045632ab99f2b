"""Every file and directory the pipeline publishes is written here, so that a kill at any moment leaves the
old version or the new one whole, never a mix of the two or a half-written file.

A file is written beside its destination (`.<name>.tmp-<pid>`), flushed to disk and renamed over it.
A directory (a checkpoint, the final head, an export) is built in a staging directory beside it
(`.<name>.tmp`), flushed, then swapped in by two renames: the old directory to `.<name>.old`, the staging
one to `<name>`; the old one is removed last. A kill between the two renames leaves no `<name>` but the
old one whole in `.<name>.old`: `recover_dir` (run by the next publication and by readers) puts it back.
A kill after them leaves `.<name>.old` as litter, which it removes.

Only what the pipeline published is ever replaced or removed: every directory swapped in carries a marker
(`.eagle-pipeline.json`, naming its kind: export, head, checkpoint), and a destination that exists without
the marker of the same kind - a user's folder, the run directory, a head where an export should go - is
refused by name before anything is built (`NotOurs`). Directories published before markers existed are
recognised by a file only that kind writes (`legacy`), and an empty directory holds nothing to lose.

    from artifacts import atomic
    atomic.write_json(run_dir / "results.json", results)
    with atomic.publish_dir(run_dir / "export", kind="export") as staging:
        atomic.save_tensors(weights, staging / "model.safetensors")
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MARKER = ".eagle-pipeline.json"


class NotOurs(ValueError):
    """A destination this pipeline did not publish (or published as another kind): never renamed or removed."""


def fsync_path(path: Path) -> None:
    """Flush a file's (or a directory's entries) to disk: a rename is only as durable as what it names."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(path: Path, write: Callable[[Path], Any]) -> Path:
    """Publish the file `write(tmp)` writes, through a temporary file beside `path` and a rename.

    The temporary name carries the process id: ranks writing the same file do not write into each other's.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as error:
        if error.filename is not None or error.errno is None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error  # a write's error names no file
    finally:
        tmp.unlink(missing_ok=True)  # only when `write` failed: a replaced file is gone already
    fsync_path(path.parent)
    return path


def save_tensors(tensors: dict, path: Path, metadata: dict | None = None) -> Path:
    """safetensors' save_file, whose OS errors (a full or read-only disk) become the OSError they are, with
    the path: the stages say those in one line (artifacts/errors.py); SafetensorError is not an OSError."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as error:
        code = re.search(r"\(os error (\d+)\)", str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from error
    return Path(path)


def remove_tmp_files(path: Path) -> None:
    """Remove what killed writers of `path` left beside it (only where no other process writes it now)."""
    for stale in Path(path).parent.glob(f".{Path(path).name}.tmp-*"):
        stale.unlink(missing_ok=True)


def write_bytes(path: Path, data: bytes) -> Path:
    return save(path, lambda tmp: tmp.write_bytes(data))


def write_text(path: Path, text: str) -> Path:
    return save(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json(path: Path, data: Any) -> Path:
    return write_text(path, json.dumps(data, indent=2) + "\n")


def write_bytes_if_changed(path: Path, data: bytes) -> Path:
    """`write_bytes` unless the file already holds `data` (a read-only finished artifact stays usable)."""
    path = Path(path)
    if path.exists() and path.read_bytes() == data:
        return path
    return write_bytes(path, data)


def staging_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.tmp")


def old_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.old")


def trash_path(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.trash")


def recover_dir(dest: Path) -> None:
    """Finish what a killed publication of `dest` left: the old directory back in place when the kill came
    between the two renames (no `dest`), the leftover old one removed when it came after (and what a
    killed `remove_dir` left). Cheap when there is nothing to do: readers call it before they read."""
    dest = Path(dest)
    old, trash = old_path(dest), trash_path(dest)
    if trash.exists():
        shutil.rmtree(trash, ignore_errors=True)  # ignore: another rank of the same run may remove it too
    if not old.exists():
        return
    if dest.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):  # another rank put it back first
            os.rename(old, dest)


def recover_dirs(parent: Path, pattern: str) -> None:
    """`recover_dir` for every directory named `pattern` in `parent` that a killed publication or removal
    left litter for, and its partial staging directory removed: only while nothing publishes into `parent`
    (the checkpoints, at a resume and by the one rank that saves)."""
    for litter in Path(parent).glob(f".{pattern}.*"):
        name, _, suffix = litter.name[1:].rpartition(".")
        if suffix == "tmp":
            shutil.rmtree(litter, ignore_errors=True)
        elif suffix in ("old", "trash"):
            recover_dir(litter.with_name(name))


def published_kind(path: Path) -> str | None:
    """The kind the pipeline's marker in `path` names, or None (no marker, or one it cannot read)."""
    try:
        return json.loads((Path(path) / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def file_above(path: Path) -> Path | None:
    """The first of `path`'s parents that exists and is not a directory (nothing can be made under it)."""
    return next((parent for parent in Path(path).parents if parent.exists() and not parent.is_dir()), None)


def check_replaceable(dest: Path, kind: str, legacy: tuple[str, ...] = ()) -> None:
    """Raise NotOurs unless `dest` is absent, empty, or a directory the pipeline published as `kind` (its
    marker; before markers, one of the `legacy` files only that kind writes)."""
    dest = Path(dest)
    if (under := file_above(dest)) is not None:
        raise NotOurs(
            f"{dest} lies under {under}, which is a file, not a directory: refused before anything was built. "
            "Name a directory whose parents are directories (or absent)"
        )
    recover_dir(dest)
    if not dest.exists() and not dest.is_symlink():
        return
    a_kind = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
    if dest.is_dir() and not dest.is_symlink():
        found = published_kind(dest)
        if found == kind:
            return
        if found is None and (not any(dest.iterdir()) or any((dest / name).is_file() for name in legacy)):
            return
        what = f"is the pipeline's {found}, not {a_kind}" if found else f"was not published as {a_kind} here"
    else:
        what = "exists and is not a directory"
    raise NotOurs(
        f"{dest} {what}: refused, nothing was moved or removed. Name a new or empty directory (or {a_kind} "
        f"this pipeline published), or move {dest} away yourself"
    )


def begin_publish(dest: Path, kind: str, legacy: tuple[str, ...] = ()) -> Path:
    """A fresh, empty staging directory for `dest` (a killed publication's leftovers recovered first);
    NotOurs, before anything is built, when `dest` is not the pipeline's `kind`."""
    dest = Path(dest)
    check_replaceable(dest, kind, legacy)
    staging = staging_path(dest)
    shutil.rmtree(staging, ignore_errors=True)  # a killed publication's partial build
    staging.mkdir(parents=True)
    return staging


def finish_publish(staging: Path, dest: Path, kind: str, legacy: tuple[str, ...] = ()) -> Path:
    """Swap the complete `staging` directory in as `dest`, marked as `kind`; the old `dest` stays whole until
    it is replaced, and is replaced only when it is the pipeline's `kind` (checked again: it may have
    changed while staging was built)."""
    dest = Path(dest)
    check_replaceable(dest, kind, legacy)
    (staging / MARKER).write_text(json.dumps({"kind": kind, "by": "eagle-pipeline"}) + "\n")
    for root, _, files in os.walk(staging):
        for name in files:
            fsync_path(Path(root) / name)
        fsync_path(Path(root))
    if dest.exists():
        os.rename(dest, old_path(dest))
    os.rename(staging, dest)
    fsync_path(dest.parent)
    shutil.rmtree(old_path(dest), ignore_errors=True)
    return dest


@contextlib.contextmanager
def publish_dir(
    dest: Path, kind: str = "", legacy: tuple[str, ...] = (), once: bool = False
) -> Iterator[Path]:
    """Yield a staging directory beside `dest`; when the block ends without an error, swap it in as `dest`
    (only over a directory the pipeline published as `kind`: `check_replaceable`).

    `once`: for directories every rank of a job may build at the same time, with the same bytes (the smoke
    target, a converted model): the staging directory is this process's own, and a `dest` that another
    process published first is kept (its copy is as good as ours) instead of replaced - nothing is ever
    replaced, so no kind is needed.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if once:
        staging = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    else:
        assert kind, "a directory published by swap names its kind"
        staging = begin_publish(dest, kind, legacy)
    try:
        yield staging
        if not once:
            finish_publish(staging, dest, kind, legacy)
        else:
            with contextlib.suppress(OSError):  # a non-empty `dest`: another process published first
                os.rename(staging, dest)
            fsync_path(dest.parent)
    except OSError as error:
        if error.errno == errno.ENOSPC and staging.exists():  # its space given back below, and said so
            error.add_note(f"the unfinished {staging} was removed")
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # what a failed block (or a lost race) built


def remove_dir(path: Path, kind: str, legacy: tuple[str, ...] = ()) -> None:
    """Remove a directory the pipeline published as `kind` (NotOurs otherwise), so that a kill midway never
    leaves a part of it under its name: renamed first."""
    path = Path(path)
    check_replaceable(path, kind, legacy)
    trash = trash_path(path)
    shutil.rmtree(trash, ignore_errors=True)
    os.rename(path, trash)
    shutil.rmtree(trash)
