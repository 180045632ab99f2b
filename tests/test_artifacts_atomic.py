"""artifacts/atomic.py: a checkpoint save, an export and a file write killed at every step of their
publication leave the old version or the new one whole, never a mix, and the next save succeeds.

A "step" is every change to the file system Python makes (its audit events: a file opened for writing, a
directory made, a rename, a removal). The save runs in a forked child that dies with os._exit just before
its n-th step, as under SIGKILL (no `finally`, no cleanup), for n = 1, 2, ... until it completes.
"""

import hashlib
import json
import os
import random
import shutil
import sys
import traceback
from pathlib import Path

import pytest
import torch

from artifacts import atomic

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")

KILLED = 77
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CHANGES = {
    "os.mkdir",
    "os.rename",
    "os.remove",
    "os.rmdir",
    "shutil.rmtree",
    "shutil.copyfile",
    "os.truncate",
}


def is_change(event: str, args) -> bool:
    if event == "open":
        mode, flags = args[1], args[2]
        return bool(mode and any(c in mode for c in "wax+")) or bool(flags & WRITE_FLAGS)
    return event in CHANGES


def run_killed_at(step: int, save) -> int:
    """`save()` in a forked child killed just before its `step`-th change to the file system; returns the
    child's exit code: KILLED, or 0 when it finished before that step."""
    python_rng = random.getstate()
    pid = os.fork()
    if pid == 0:
        try:
            random.setstate(python_rng)  # fork reseeds it: the checkpoint's RNG file would differ
            count = 0

            def hook(event, args):
                nonlocal count
                if is_change(event, args):
                    count += 1
                    if count == step:
                        os._exit(KILLED)

            sys.addaudithook(hook)  # in the child only: an audit hook cannot be removed
            save()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def snapshot(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def kill_at_every_step(pristine: Path, work: Path, save, seen, allowed: list, next_save) -> int:
    """For each step of `save`: `work` reset to `pristine`, the save killed there, what a reader `seen`
    checked to be one of `allowed`, then `next_save` run to the end. Returns the number of steps."""
    for step in range(1, 500):
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work)
        code = run_killed_at(step, save)
        assert code in (KILLED, 0), f"the save failed at step {step} (exit code {code}; traceback above)"
        assert seen() in allowed, f"killed before step {step}: neither the old nor the new, whole"
        next_save()
        assert seen() == allowed[-1], f"the save after a kill before step {step} did not publish the new"
        if code == 0:
            return step - 1
    raise AssertionError("the save never finished")


@pytest.fixture(scope="module")
def accelerator():
    from target.launch import make_accelerator

    return make_accelerator(60.0)


@pytest.mark.parametrize("same_step", [False, True], ids=["next_step", "same_step_again"])
def test_a_checkpoint_save_killed_at_any_step_leaves_the_old_or_the_new(accelerator, tmp_path, same_step):
    from train.checkpoint import checkpoint_dirs, save_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    pristine = tmp_path / "pristine"
    save_checkpoint(accelerator, pristine, 4, 0, keep_last=1)
    old = snapshot(pristine / "step-000004")
    with torch.no_grad():
        model.weight.add_(1.0)  # the new checkpoint's weights differ from the old one's
    new_step = 4 if same_step else 8

    def save_into(ckpt_dir: Path):
        return lambda: save_checkpoint(accelerator, ckpt_dir, new_step, 1, keep_last=1)

    reference = tmp_path / "reference"
    shutil.copytree(pristine, reference)
    save_into(reference)()
    new = snapshot(reference / f"step-{new_step:06d}")
    assert new != old

    work = tmp_path / "ckpt"

    def seen():  # what a resume finds: every checkpoint it lists, whole
        return [(p.name, snapshot(p)) for p in checkpoint_dirs(work)]

    allowed = [[("step-000004", old)], [(f"step-{new_step:06d}", new)]]
    if not same_step:  # published, the old one not yet pruned: both whole, the new one the latest
        allowed.insert(1, [("step-000004", old), ("step-000008", new)])
    num_steps = kill_at_every_step(pristine, work, save_into(work), seen, allowed, save_into(work))
    assert num_steps >= 8  # the hook saw the save's steps: staging, files, the renames, the pruning
    assert sorted(os.listdir(work)) == [f"step-{new_step:06d}"]  # nothing left beside it


def write_tiny_head(head_dir: Path, seed: int, vocab_file: Path) -> None:
    from heads.head_file import HeadRecord, write_head
    from tests.helpers import random_draft, tiny_head_config

    config = tiny_head_config()
    weights = {k: v for k, v in random_draft(config, seed).state_dict().items() if k != "embed_tokens.weight"}
    write_head(head_dir, HeadRecord(kind="eagle3", config=config), weights, vocab_file)


def test_an_export_killed_at_any_step_leaves_the_old_or_the_new(tmp_path):
    from transformers import LlamaConfig

    from artifacts.vocab import build_vocab_map, save_vocab_map
    from export.to_vllm import export_head

    pristine, reference, work = tmp_path / "pristine", tmp_path / "reference", tmp_path / "work"
    pristine.mkdir()
    save_vocab_map(build_vocab_map(torch.arange(40), 24), tmp_path / "vocab.safetensors")
    write_tiny_head(pristine / "old_head", 0, tmp_path / "vocab.safetensors")
    write_tiny_head(pristine / "new_head", 1, tmp_path / "vocab.safetensors")
    target_config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, head_dim=16, vocab_size=40, num_hidden_layers=4,
        max_position_embeddings=128, architectures=["LlamaForCausalLM"],
    )  # fmt: skip

    def export_into(run_dir: Path):  # the new head, in another format: other weights, another config.json
        return lambda: export_head(run_dir / "new_head", run_dir / "export", target_config, fmt="plain")

    export_head(pristine / "old_head", pristine / "export", target_config, fmt="speculators")
    shutil.copytree(pristine, reference)
    export_into(reference)()
    old, new = snapshot(pristine / "export"), snapshot(reference / "export")
    assert old.keys() == new.keys() == {"config.json", "model.safetensors", atomic.MARKER}
    assert all(old[name] != new[name] for name in old if name != atomic.MARKER)

    def seen():  # what eval finds (it recovers an export whose publication was killed, as export does)
        atomic.recover_dir(work / "export")
        return snapshot(work / "export")

    num_steps = kill_at_every_step(pristine, work, export_into(work), seen, [old, new], export_into(work))
    assert num_steps >= 5
    assert sorted(os.listdir(work)) == ["export", "new_head", "old_head"]  # no staging or old one beside it


def test_a_file_write_killed_at_any_step_leaves_the_old_or_the_new(tmp_path):
    pristine, work = tmp_path / "pristine", tmp_path / "work"
    pristine.mkdir()
    atomic.write_json(pristine / "results.json", {"runs": [1, 2]})
    old = (pristine / "results.json").read_text()

    def save():
        atomic.write_json(work / "results.json", {"runs": [1, 2, 3] * 1000})

    def seen():
        return (work / "results.json").read_text()

    new = json.dumps({"runs": [1, 2, 3] * 1000}, indent=2) + "\n"
    num_steps = kill_at_every_step(pristine, work, save, seen, [old, new], save)
    assert num_steps >= 2  # the temporary file, the rename
    assert os.listdir(work) == ["results.json"]


def test_publish_dir_once_keeps_the_first_and_a_failed_build_leaves_nothing(tmp_path):
    dest = tmp_path / "target"
    with atomic.publish_dir(dest, once=True) as staging:
        (staging / "weights").write_text("first")
    with atomic.publish_dir(dest, once=True) as staging:  # another rank, done second: the first stays
        (staging / "weights").write_text("second")
    assert (dest / "weights").read_text() == "first"
    with (
        pytest.raises(RuntimeError, match="disk full"),
        atomic.publish_dir(tmp_path / "export", kind="export") as staging,
    ):
        (staging / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    assert sorted(os.listdir(tmp_path)) == ["target"]


def test_only_a_directory_the_pipeline_published_as_that_kind_is_replaced_or_removed(tmp_path):
    """A user's folder, another kind's directory, a file: refused by name, untouched; an empty folder and a
    directory of the same kind (marked, or written before markers: a legacy file) are replaced."""
    user = tmp_path / "notes"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(atomic.NotOurs, match=f"{user} was not published as an export here: refused"):
        with atomic.publish_dir(user, kind="export") as staging:
            (staging / "config.json").write_text("{}")
    with pytest.raises(atomic.NotOurs, match="refused"):
        atomic.remove_dir(user, kind="checkpoint")
    assert (user / "notes.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["notes"]
    head = tmp_path / "head"
    with atomic.publish_dir(head, kind="head") as staging:
        (staging / "draft_config.json").write_text("{}")
    with pytest.raises(atomic.NotOurs, match="is the pipeline's head, not an export"):
        atomic.check_replaceable(head, "export")
    (tmp_path / "file").write_text("x")
    with pytest.raises(atomic.NotOurs, match="exists and is not a directory"):
        atomic.check_replaceable(tmp_path / "file", "export")
    # a path under a file: refused before anything is built (issue 62: it used to die after the build)
    with pytest.raises(atomic.NotOurs, match=f"lies under {tmp_path / 'file'}, which is a file"):
        atomic.check_replaceable(tmp_path / "file" / "sub" / "export", "export")
    assert sorted(os.listdir(tmp_path)) == ["file", "head", "notes"]
    legacy = tmp_path / "old_export"
    legacy.mkdir()
    (legacy / "export_record.json").write_text("{}")
    for dest in (legacy, tmp_path / "empty"):
        dest.mkdir(exist_ok=True)
        with atomic.publish_dir(dest, kind="export", legacy=("export_record.json",)) as staging:
            (staging / "config.json").write_text("{}")
        assert atomic.published_kind(dest) == "export" and sorted(os.listdir(dest)) == [
            atomic.MARKER,
            "config.json",
        ]
    atomic.remove_dir(legacy, kind="export")
    assert not legacy.exists()
