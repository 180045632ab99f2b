"""What an export says about itself, and the check of it before anything serves it.

Export builds and verifies in `<export>.unverified/` (`unproven_dir`) and swaps it in whole - weights,
config, card, `verification.json` and this record together - only when verification passed or was not asked
for (export/main.py); a failed or killed verification leaves the previous export as it was. The record,
`export_record.json`: {"verified": bool, "note": why not, where not, "files": {relative path: {"sha256",
"bytes"}}} for every file an engine reads. eval checks it (`check_export`) before any server starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from artifacts import atomic
from artifacts.cache import file_sha256

RECORD = "export_record.json"
SERVED_FILES = ("config.json", "model.safetensors")  # what an engine reads, per directory


def unproven_dir(out_dir: Path) -> Path:
    """Where export builds and verifies; left in place, named so, when verification fails or is killed."""
    return Path(out_dir).with_name(Path(out_dir).name + ".unverified")


def served_files(export_dir: Path) -> list[Path]:
    """The files engines read in `export_dir` (and in SGLang's directory inside it, if any)."""
    return sorted(p for p in Path(export_dir).rglob("*") if p.name in SERVED_FILES)


def record_export(export_dir: Path, verified: bool, note: str = "", target: str | None = None) -> dict:
    """Write the export's record: verified or not (and why), the target it was exported for (the watch
    checks the served model against it, whatever the format), every served file's size and checksum."""
    files = {
        str(p.relative_to(export_dir)): {"sha256": file_sha256(p), "bytes": p.stat().st_size}
        for p in served_files(export_dir)
    }
    record = {"verified": verified, "note": note, "target": target, "files": files}
    atomic.write_json(Path(export_dir) / RECORD, record)
    return record


def read_record(export_dir: Path) -> dict | None:
    """The export's record, or None where there is none; a record that cannot be read is named."""
    record_file = Path(export_dir) / RECORD
    if not record_file.exists():
        return None
    try:
        return json.loads(record_file.read_text())
    except (ValueError, OSError) as error:
        raise ValueError(f"{record_file}: not a readable export record ({error}); rerun export") from error


def check_export(export_dir: Path) -> dict | None:
    """Refuse, naming the file, an export whose files are missing, changed or unreadable; returns its record
    (None for an export written elsewhere, without one: then its weights are still opened)."""
    export_dir = Path(export_dir)
    unproven = unproven_dir(export_dir)
    if not (export_dir / "config.json").exists():
        hint = f" (an unverified one is at {unproven})" if unproven.exists() else ""
        raise ValueError(f"{export_dir}: no export there{hint}; run export/main.py")
    record_file = export_dir / RECORD
    record = read_record(export_dir)
    for name, expected in (record or {}).get("files", {}).items():
        path = export_dir / name
        if not path.exists():
            raise ValueError(f"{path}: missing from the export ({record_file} lists it); rerun export")
        size = path.stat().st_size
        if size != expected["bytes"] or file_sha256(path) != expected["sha256"]:
            raise ValueError(
                f"{path}: changed since export wrote it ({size} bytes, {expected['bytes']} recorded; sha256 "
                f"differs from {record_file}); rerun export"
            )
    for path in served_files(export_dir):
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), "pt") as f:
                    tensors = ((k, f.get_tensor(k)) for k in f.keys())  # each read once
                    bad = [k for k, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]
            except (SafetensorError, OSError) as error:
                raise ValueError(
                    f"{path}: not a readable safetensors file ({error}); rerun export"
                ) from error
            if bad:  # export's own reader refuses these too; an export written elsewhere is checked here
                raise ValueError(f"{path}: {', '.join(bad[:3])} hold NaN or inf values; rerun export")
    return record
