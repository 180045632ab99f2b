"""What several test modules share (tests import it from here, never from each other): the smoke run's
config and its fast training overrides, tiny head configs with random weights, cache and head file helpers,
and a reader of W&B's offline run file. The fixtures built on these are in tests/conftest.py.

    from tests.helpers import REPO, smoke_config, train_config, step_losses
"""

import json
import math
from pathlib import Path

import torch

from artifacts.config import compose

REPO = Path(__file__).resolve().parent.parent

AUX_IDS = [1, 3, 4]  # the smoke target's aux layers: conf/experiment/smoke.yaml

# Eight steps of the smoke run, with an eval and a checkpoint every four and a log line every two.
FAST = [
    "train.max_steps=8",
    "train.eval_every=4",
    "train.save_every=4",
    "train.log_every=2",
    "train.num_threads=1",
]
# The heads trained for vLLM tests to draft well (their numbers are thresholds, never compared bitwise): both
# cores, 174 s -> 100 s for the DFlash one on a 2-core CPU.
QUALITY_THREADS = "train.num_threads=2"
PEAGLE = ("head.kind=peagle", "head.num_layers=2", "head.cod_ratio=0.5")
DFLASH = (
    "head.kind=dflash",
    "head.num_layers=2",
    "head.block_size=5",
    "head.mask_token_id=5",
    "head.min_block_size=2",
)


def smoke_config(run_dir, *overrides, experiment="smoke"):
    # One CPU thread: bitwise-equal results between in-process runs and torchrun workers (which get 1).
    return compose(
        "config", [f"experiment={experiment}", f"run_dir={run_dir}", "cache.num_threads=1", *overrides]
    )


def train_config(run_dir, *overrides):
    return smoke_config(run_dir, *FAST, *overrides)


def step_losses(run_dir) -> dict[int, float]:
    """step -> loss; a step logged twice (replayed after a resume) keeps its last value."""
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "train_steps.jsonl").open())}


def assert_same_head(expected_run, run_dir, atol: float) -> None:
    """The final heads of two runs hold the same tensors, equal up to float summation order."""
    from safetensors.torch import load_file

    expected = load_file(str(expected_run / "draft_head" / "model.safetensors"))
    found = load_file(str(run_dir / "draft_head" / "model.safetensors"))
    assert found.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], atol=atol, rtol=1e-4, msg=name)


def rewrite_head_weights(head_dir, weights) -> None:
    """Replace a head's weights and record their checksum, as train would have (a deliberate edit)."""
    from safetensors.torch import save_file

    from artifacts.cache import file_sha256

    save_file(weights, str(head_dir / "model.safetensors"))
    config = json.loads((head_dir / "draft_config.json").read_text())
    config["files"]["model.safetensors"] = file_sha256(head_dir / "model.safetensors")
    (head_dir / "draft_config.json").write_text(json.dumps(config))


def shard_hashes(cache_dir: Path) -> dict[str, str]:
    """`split/shard file` -> the sha256 the cache's manifest records for it."""
    from artifacts.manifest import read_manifest

    manifest = read_manifest(cache_dir)
    return {
        f"{split}/{s['file']}": s["sha256"] for split, v in manifest["splits"].items() for s in v["shards"]
    }


def tiny_head_config(config_class=None, **overrides):
    """A head config (EAGLE-3's, or `config_class`) small enough for explicit-matmul references (GQA: 4
    query, 2 kv heads)."""
    from heads.eagle3 import Eagle3Config

    values = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=40,
        draft_vocab_size=24,
        aux_layer_ids=[1, 2, 3],
        rope_theta=1000.0,
        max_position_embeddings=128,
    )
    return (config_class or Eagle3Config)(**{**values, **overrides})


def random_draft(config, seed: int = 0):
    """A head with every weight random, norm weights included (ones would hide a missing norm)."""
    from heads.dflash import DFlashConfig, DFlashDraft
    from heads.eagle3 import Eagle3Draft

    torch.manual_seed(seed)
    model = (DFlashDraft if isinstance(config, DFlashConfig) else Eagle3Draft)(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # the norm weights (input_norm and fc_norm.i included)
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 1 / math.sqrt(param.shape[-1]))
    return model


def wandb_records(run_file: Path) -> list:
    """The protobuf records (`wandb_internal_pb2.Record`) of an offline W&B run file, in order.

    wandb 0.31 ships no Python reader, and the format is small: a 7-byte header (":W&B", magic, version),
    then LevelDB's log format - 32 KiB blocks of chunks, each with a 7-byte header (crc32c, length, type);
    a record longer than a block's space is split into FIRST, MIDDLE.., LAST chunks, and a block's tail too
    short for a chunk header is zero padding. A chunk still being written (wandb's service flushing) ends
    the list.
    """
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    pos, chunks, records = header, [], []
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + header + length > len(data):
            break
        chunks.append(data[pos + header : pos + header + length])
        pos += header + length
        if kind in (1, 4):  # FULL, LAST: the record is complete
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            records.append(record)
            chunks = []
    return records


def wandb_items(items) -> dict:
    """A history / summary / config record's items as {key: value} (nested keys joined by '/')."""
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def head_and_loss(kind: str, seq_len: int = 12, model=None, **loss_kwargs):
    """A tiny random head of `kind` (or `model`, one made so before) and a function of it giving its
    training loss on a fixed batch of two rows of `seq_len` (the same anchors or blocks every call);
    `loss_kwargs` (objective, dpace) go to the kind's loss."""
    from heads.dflash import DFlashConfig
    from train import losses

    extra = {"peagle": dict(mask_token_id=3), "dflash": dict(mask_token_id=3, block_size=4)}.get(kind, {})
    config = tiny_head_config(DFlashConfig if kind == "dflash" else None, aux_layer_ids=[1, 2], **extra)
    model = random_draft(config) if model is None else model
    g = torch.Generator().manual_seed(3)
    b, t = 2, seq_len
    batch = {
        "input_ids": torch.randint(0, config.vocab_size, (b, t), generator=g),
        "loss_mask": torch.arange(t).expand(b, t) >= 3,
        "aux_hidden": torch.randn(b, t, 2, config.hidden_size, generator=g),
        "final_hidden": torch.randn(b, t, config.hidden_size, generator=g),
    }
    lm_head, d2t = torch.randn(config.vocab_size, config.hidden_size, generator=g), torch.arange(24)
    common = (lm_head, d2t, 5)
    if kind == "eagle3":
        return model, lambda: losses.ttt_loss(model, batch, 3, 0.8, *common, **loss_kwargs)
    gens = losses.sample_generators(batch, torch.Generator().manual_seed(0))
    if kind == "peagle":
        anchors = losses.cod_anchors(batch, 3, 0.6, gens)
        return model, lambda: losses.parallel_loss(
            model, batch, 3, 0.8, *common, anchors=anchors, **loss_kwargs
        )
    blocks = losses.sample_blocks(batch, 4, (2, 4), gens)
    return model, lambda: losses.block_loss(
        model, batch, [1.0, 0.7, 0.5], *common, blocks=blocks, **loss_kwargs
    )
