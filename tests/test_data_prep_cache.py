"""The hidden-state cache: contents equal an HF forward, and the same files from 1 or 2 processes or after a kill."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from artifacts.cache import CacheSplit
from artifacts.manifest import read_manifest
from artifacts.vocab import load_vocab_map
from data_prep.main import run
from data_prep.render import render_samples
from tests.helpers import AUX_IDS, REPO, shard_hashes, smoke_config


def test_smoke_manifest_records_what_the_next_stages_check(smoke_run):
    manifest = read_manifest(smoke_run / "cache")
    assert manifest["complete"] is True
    assert (
        manifest["num_hidden_layers"] == 6
        and manifest["hidden_size"] == 256
        and manifest["vocab_size"] == 1024
    )
    assert manifest["aux_layer_ids"] == AUX_IDS
    assert (
        len(manifest["target_hash"])
        == len(manifest["tokenizer_hash"])
        == len(manifest["dataset_fingerprint"])
        == 64
    )
    assert manifest["num_samples"]["train"] + manifest["num_samples"]["eval"] == 64
    assert manifest["num_samples"]["eval"] > 0
    assert len(manifest["splits"]["train"]["shards"]) > 2  # the smoke experiment forces several shards
    train = CacheSplit(smoke_run / "cache", "train")
    assert len(train) == manifest["num_samples"]["train"]
    assert sum(train.lengths) == manifest["num_tokens"]["train"]
    eval_ids = {json.loads(line)["id"] for line in (smoke_run / "cache" / "eval_conversations.jsonl").open()}
    assert eval_ids == set(CacheSplit(smoke_run / "cache", "eval").ids) and not eval_ids & set(train.ids)


def test_disk_per_token_is_within_the_bf16_states_budget(smoke_run):
    manifest = read_manifest(smoke_run / "cache")
    shards = [s for v in manifest["splits"].values() for s in v["shards"]]
    num_bytes = sum(s["num_bytes"] for s in shards)
    num_tokens = sum(manifest["num_tokens"].values())
    # docs/design.md#data-scale (disk): bf16 aux + final states, nothing more
    budget = 2 * (len(AUX_IDS) + 1) * 256
    assert num_bytes <= budget * num_tokens
    assert num_bytes > 0.95 * budget * num_tokens  # and not by leaving states out


def test_cached_states_equal_an_independent_hf_forward(smoke_run):
    target_dir = smoke_run / "smoke_target"
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    conversations = {
        json.loads(line)["id"]: json.loads(line)["conversations"]
        for line in (REPO / "artifacts/smoke_data/conversations.jsonl").open()
    }
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    cache = CacheSplit(smoke_run / "cache", "train")
    for index in [0, 5, len(cache) - 1]:
        sample = cache[index]
        messages = [
            {"role": roles[t["from"]], "content": t["value"]} for t in conversations[cache.ids[index]]
        ]
        (rendered,) = render_samples(tokenizer, cache.ids[index], messages)
        assert sample["input_ids"].tolist() == rendered.input_ids
        assert sample["loss_mask"].int().tolist() == rendered.loss_mask
        with torch.no_grad():
            out = model(sample["input_ids"][None], output_hidden_states=True)
        for k, layer_id in enumerate(AUX_IDS):
            expected = out.hidden_states[layer_id][0, :-1].to(torch.bfloat16)  # the last row is never stored
            torch.testing.assert_close(sample["aux_hidden"][:-1, k], expected, atol=2e-2, rtol=2e-2)
        assert not sample["aux_hidden"][-1].any()
        torch.testing.assert_close(
            sample["final_hidden"], out.hidden_states[-1][0].to(torch.bfloat16), atol=2e-2, rtol=2e-2
        )
        # The teacher for train: the target's logits are recoverable from the cached final state.
        logits = model.lm_head(sample["final_hidden"].float())
        assert (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean() > 0.97


def test_draft_vocab_covers_the_most_frequent_answer_tokens(smoke_run):
    vocab = load_vocab_map(smoke_run / "cache" / "vocab.safetensors")
    assert vocab.draft_vocab_size == 512 and vocab.d2t.dtype == torch.int64 and vocab.d2t.shape == (512,)
    target_ids = torch.arange(512) + vocab.d2t
    assert torch.equal(target_ids, torch.nonzero(vocab.t2d).squeeze(1))  # d2t holds offsets, sorted by id
    kept, dropped = vocab.token_counts[vocab.t2d], vocab.token_counts[~vocab.t2d]
    assert kept.min() >= dropped.max()
    train = CacheSplit(smoke_run / "cache", "train")
    recount = torch.zeros(1024, dtype=torch.int64)
    for i in range(len(train)):
        recount += torch.bincount(train[i]["input_ids"][train[i]["loss_mask"]], minlength=1024)
    assert torch.equal(recount, vocab.token_counts)


def test_two_processes_write_the_same_cache_as_one(smoke_run, tmp_path, subprocess_env):
    run_dir = tmp_path / "ddp"
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "data_prep/main.py",
           "experiment=smoke", f"run_dir={run_dir}", "cache.num_threads=1"]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = read_manifest(run_dir / "cache")
    assert manifest["last_run"]["num_processes"] == 2
    assert shard_hashes(run_dir / "cache") == shard_hashes(smoke_run / "cache")
    for name in ["vocab.safetensors", "eval_conversations.jsonl"]:
        assert (run_dir / "cache" / name).read_bytes() == (smoke_run / "cache" / name).read_bytes()


def test_killed_then_resumed_run_gives_the_same_cache(smoke_run, tmp_path, subprocess_env):
    run_dir = tmp_path / "killed"
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    overrides = ["experiment=smoke", f"run_dir={run_dir}", "cache.num_threads=1", "cache.max_shard_mb=1"]
    proc = subprocess.Popen(
        [sys.executable, "data_prep/main.py", *overrides], cwd=REPO, env=subprocess_env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    first_sidecar = run_dir / "cache" / "train" / "shard-00001.json"
    deadline = time.time() + 120
    while not first_sidecar.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "cache" / "train" / "shard-00010.json").exists(), "the run finished before the kill"
    assert read_manifest(run_dir / "cache")["complete"] is False

    manifest = run(smoke_config(run_dir, "cache.max_shard_mb=1"))
    assert manifest["last_run"]["train"]["num_shards_reused"] >= 2
    uninterrupted = tmp_path / "uninterrupted"
    shutil.copytree(smoke_run / "smoke_target", uninterrupted / "smoke_target")
    run(smoke_config(uninterrupted, "cache.max_shard_mb=1"))
    assert shard_hashes(run_dir / "cache") == shard_hashes(uninterrupted / "cache")
    assert not list((run_dir / "cache").rglob(".*.tmp-*")), "temporary files of the killed run are left"


def test_rerun_reuses_every_shard(smoke_run, tmp_path):
    run_dir = tmp_path / "again"
    shutil.copytree(smoke_run, run_dir)
    manifest = run(smoke_config(run_dir))
    assert manifest["last_run"]["train"]["num_shards_written"] == 0
    assert shard_hashes(run_dir / "cache") == shard_hashes(smoke_run / "cache")


def test_a_finished_cache_reruns_without_writing_so_it_may_be_read_only(smoke_run, tmp_path):
    # Not by chmod: root (CI containers) writes through it. Every file keeps its inode and mtime instead.
    run_dir = tmp_path / "read_only"
    shutil.copytree(smoke_run, run_dir)
    cache = run_dir / "cache"

    def stamps():
        return {path: (path.stat().st_ino, path.stat().st_mtime_ns) for path in cache.rglob("*")}

    before = stamps()
    manifest = run(smoke_config(run_dir))
    assert stamps() == before
    assert manifest["complete"] and manifest["last_run"]["train"]["num_shards_written"] == 0


def test_caching_onto_a_full_disk_is_refused_before_writing_naming_the_directory(
    smoke_run, tmp_path, monkeypatch
):
    import data_prep.main

    run_dir = tmp_path / "full"
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(data_prep.main.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(OSError, match=rf"{run_dir / 'cache'}: caching needs about 0.0\d GB more and its disk has "
                       r"0.00 GB free"):  # fmt: skip
        run(smoke_config(run_dir))
    assert not list((run_dir / "cache").rglob("shard-*"))


@pytest.mark.parametrize(
    "override, field",
    [
        ("cache.aux_layer_ids=[1,2,4]", "aux_layer_ids"),
        (
            "target.chat_template='{% for m in messages %}{{ m.content }}<|im_end|>{% endfor %}'",
            "tokenizer_hash",
        ),
        ("render.max_length=256", "max_length"),
        ("data.system_prompt=Be brief.", "dataset_fingerprint"),
    ],
)
def test_reusing_a_cache_for_other_settings_is_refused_naming_the_field(smoke_run, tmp_path, override, field):
    run_dir = tmp_path / "reuse"
    shutil.copytree(smoke_run, run_dir)
    with pytest.raises(ValueError, match=rf"(?s)differ.*{field}: found"):
        run(smoke_config(run_dir, override))


def test_reusing_a_cache_for_another_target_is_refused(smoke_run, tmp_path):
    run_dir = tmp_path / "other_target"
    shutil.copytree(smoke_run, run_dir)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "smoke_target")
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.01)  # a fine-tuned checkpoint of the same shape
    model.save_pretrained(run_dir / "smoke_target")
    with pytest.raises(ValueError, match=r"target_hash: found"):
        run(smoke_config(run_dir))


def test_corrupt_shard_is_named_on_read_and_rebuilt_on_rerun(smoke_run, tmp_path):
    run_dir = tmp_path / "corrupt"
    shutil.copytree(smoke_run, run_dir)
    shard = run_dir / "cache" / "train" / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"shard-00001.safetensors: checksum mismatch"):
        CacheSplit(run_dir / "cache", "train")
    manifest = run(smoke_config(run_dir))
    assert manifest["last_run"]["train"]["num_shards_written"] == 1
    assert shard_hashes(run_dir / "cache") == shard_hashes(smoke_run / "cache")


def test_tokenizer_without_chat_template_is_a_clear_error(smoke_run, tmp_path):
    run_dir = tmp_path / "no_template"
    shutil.copytree(smoke_run / "smoke_target", run_dir / "smoke_target")
    (run_dir / "smoke_target" / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match=r"no chat template.*target\.chat_template="):
        run(smoke_config(run_dir))


def test_a_full_disk_names_the_shard_and_says_how_to_resume(tmp_path, monkeypatch):
    import errno

    from artifacts import atomic
    from artifacts.cache import write_shard

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic, "write_bytes", full)
    path = tmp_path / "train" / "shard-00000.safetensors"
    path.parent.mkdir()
    sample = {"id": "a", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
    with pytest.raises(
        OSError, match=re.escape(str(path)) + ": the disk is full.*rerun the same command"
    ) as caught:
        write_shard(path, [sample])
    assert caught.value.errno == errno.ENOSPC


def test_a_shard_larger_than_the_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    import errno

    from artifacts.cache import write_shard

    path = tmp_path / "train" / "shard-00000-000.safetensors"
    path.parent.mkdir()
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
    sample = {"id": "a", "input_ids": list(range(64)), "loss_mask": [1] * 64}
    with pytest.raises(OSError, match=re.escape(str(path)) + r": this .* MB shard does not fit") as caught:
        write_shard(path, [sample])
    assert caught.value.errno == errno.ENOSPC and not list(path.parent.iterdir())


def test_one_pass_capture_writes_shards_of_max_shard_mb_as_samples_arrive(tmp_path):
    """A regeneration chunk's samples go to disk as each shard fills: never more than one shard's worth of
    states per split waits in memory, and the shards together hold every sample in order."""
    from artifacts.conversation import Conversation
    from data_prep.capture import ChunkShards

    cfg = smoke_config(tmp_path, "cache.max_shard_mb=1", "data.eval_fraction=0.0")
    writer = ChunkShards(cfg, tmp_path / "cache", chunk=7)
    hidden, n = 256, 100
    peak_pending = 0
    for i in range(30):  # 30 samples of ~150 KB of states: ~4.5 MB in all
        writer.add({"id": f"s{i}", "input_ids": list(range(n)), "loss_mask": [0] * 10 + [1] * (n - 10),
                    "aux_hidden": torch.randn(n, 2, hidden).bfloat16(), "final_hidden": torch.randn(n, hidden).bfloat16(),
                    "conversation": Conversation(id=f"s{i}", messages=[{"role": "user", "content": str(i)}])})  # fmt: skip
        peak_pending = max(peak_pending, writer.pending_bytes["train"])
    shards = writer.close()
    assert peak_pending < 2**20  # written once it reached 1 MB
    assert shards["train"][:2] == ["shard-00007-000.safetensors", "shard-00007-001.safetensors"]
    assert len(shards["train"]) >= 4 and "eval" not in shards
    sizes = [(tmp_path / "cache" / "train" / name).stat().st_size for name in shards["train"]]
    assert max(sizes) < 1.2 * 2**20
