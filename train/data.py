"""Batches from the cache: a check that the cache suits the target, a deterministic plan of optimizer
steps, padding, and the target's hidden states computed online when the cache holds none
(`train.features=online`).

The plan depends only on the sample lengths, the seed and the epoch, so a resumed run replays exactly
the batches of an uninterrupted one, and a global batch is the same samples whatever the number of
processes: each optimizer step takes batch_size x processes x accumulation random rows - a sample each, or
with `train.pack_length` as many as fit in that many tokens (no padding computed between them: each sees
only itself, train/losses/ `doc_starts`) - sorts them by length (less padding) and deals consecutive runs
of batch_size to (accumulation index, rank).
"""

from __future__ import annotations

import torch

from artifacts.cache import HIDDEN_DTYPE, CacheSplit
from artifacts.manifest import regen_settings
from artifacts.prompts import served_template_kwargs
from target.model import load_model, target_dir, target_hidden_states, weights_bytes, weights_hash

# Online training refuses a target taking more than this share of a GPU's free memory: the rest is the
# head, its optimizer state, the teacher's lm_head and the activations of a micro-batch.
ONLINE_TARGET_SHARE = 0.6


def check_cache_matches_target(cache_manifest: dict, cfg, target_config) -> None:
    """Refuse a cache made for another target or other layers before any training."""
    found = {
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "num_hidden_layers": target_config.num_hidden_layers,
        "target_hash": weights_hash(target_dir(cfg.target)),
    }
    if cfg.cache.aux_layer_ids is not None:
        found["aux_layer_ids"] = list(cfg.cache.aux_layer_ids)
    differing = [k for k, v in found.items() if cache_manifest.get(k) != v]
    if differing:
        lines = [
            f"  {k}: cache has {cache_manifest.get(k)!r}, config/target has {found[k]!r}" for k in differing
        ]
        raise ValueError(
            f"{cfg.run_dir}/cache was made for another target or layers than train is given "
            f"(target.path={cfg.target.path}):\n" + "\n".join(lines)
        )


def check_cache_settings(cache_manifest: dict, cfg) -> None:
    """Refuse, before any training, a cache made with other data settings than train is given: its answers
    regenerated otherwise (temperature, samples, lengths), rendered otherwise, or another draft vocabulary
    or split. Training on it would train, and record, what the settings do not say (a greedy cache trained
    as if sampled at T=1). Only what the config alone decides is compared; the dataset's fingerprint is
    data_prep's to check. A field an older manifest lacks is not compared."""
    expected = {
        "regeneration": regen_settings(cfg.regen) if cfg.regen.enabled else None,
        "max_length": cfg.render.max_length,
        "overlong": cfg.render.overlong,
        "draft_vocab_size": cfg.cache.draft_vocab_size,
        "draft_vocab_fill": cfg.cache.draft_vocab_fill,
        "eval_fraction": cfg.data.eval_fraction,
        "chat_template_kwargs": served_template_kwargs(cfg),
    }
    # a manifest holds the kwargs only where there are some (data_prep's cache_identity)
    found = {**cache_manifest, "chat_template_kwargs": cache_manifest.get("chat_template_kwargs") or {}}
    differing = [k for k, v in expected.items() if k in found and found[k] != v]
    if differing:
        lines = [f"  {k}: cache has {found[k]!r}, config has {expected[k]!r}" for k in differing]
        raise ValueError(
            f"{cfg.run_dir}/cache was made with other settings than train is given:\n"
            + "\n".join(lines)
            + "\n"
            "Make the cache for these settings (data_prep in a new run_dir), or give train the cache's settings"
        )


def train_lengths(cfg, train_split: CacheSplit) -> list[int]:
    """Lengths of the samples this run trains on: the split, or its first `train.num_samples`."""
    if cfg.train.num_samples is not None and not 0 < cfg.train.num_samples <= len(train_split):
        raise ValueError(
            f"train.num_samples={cfg.train.num_samples}: the cache's train split holds {len(train_split)} samples"
        )
    return train_split.lengths[: cfg.train.num_samples]


def count_steps(cfg, train_split: CacheSplit, num_processes: int) -> tuple[int, int]:
    """(optimizer steps of the run, steps per epoch): train.num_epochs epochs, at most train.max_steps."""
    steps_per_epoch = len(
        plan_epoch(
            train_lengths(cfg, train_split), cfg.train.batch_size, num_processes,
            cfg.train.gradient_accumulation_steps, cfg.seed, 0, cfg.train.pack_length,
        )
    )  # fmt: skip
    num_steps = cfg.train.num_epochs * steps_per_epoch
    if cfg.train.max_steps:
        num_steps = min(num_steps, cfg.train.max_steps)
    return num_steps, steps_per_epoch


# Packing fills a row with the first of the last this many open rows that has room (first fit over a window:
# rows fill well whatever the data's size, in time linear in it).
PACK_WINDOW = 64


def pack_rows(order: list[int], lengths: list[int], pack_length: int) -> list[list[int]]:
    """The samples in `order` packed into rows of at most `pack_length` tokens, first fit among the last
    PACK_WINDOW rows opened; each row lists its samples in the order they came."""
    rows: list[list[int]] = []
    used: list[int] = []
    open_rows: list[int] = []
    for i in order:
        n = lengths[i]
        if n > pack_length:
            raise ValueError(
                f"train sample {i} has {n} tokens, more than train.pack_length={pack_length}: raise "
                "train.pack_length to render.max_length at least"
            )
        for r in open_rows:
            if used[r] + n <= pack_length:
                rows[r].append(i)
                used[r] += n
                break
        else:
            rows.append([i])
            used.append(n)
            open_rows = [*open_rows, len(rows) - 1][-PACK_WINDOW:]
    return rows


def plan_epoch(
    lengths: list[int],
    batch_size: int,
    num_processes: int,
    accumulation: int,
    seed: int,
    epoch: int,
    pack_length: int | None = None,
) -> list[list[list[list[list[int]]]]]:
    """steps[s][rank][micro] = the rows of one micro-batch, each row the sample indices it holds: one, or
    with `pack_length` as many as fit in that many tokens (`pack_rows`, over the epoch's random order). An
    optimizer step takes batch_size x processes x accumulation rows; an incomplete last step is dropped."""
    per_step = batch_size * num_processes * accumulation
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    rows = [[i] for i in order] if pack_length is None else pack_rows(order, lengths, pack_length)
    if len(rows) < per_step:
        packed = "" if pack_length is None else f" of up to train.pack_length={pack_length} tokens"
        raise ValueError(
            f"{len(lengths)} training samples in {len(rows)} rows{packed} cannot fill one optimizer step of "
            f"{per_step} rows (train.batch_size={batch_size} x {num_processes} processes x "
            f"train.gradient_accumulation_steps={accumulation}); lower them or cache more data"
        )
    steps = []
    for start in range(0, len(rows) - per_step + 1, per_step):
        chunk = sorted(rows[start : start + per_step], key=lambda row: (sum(lengths[i] for i in row), row[0]))
        micro = [chunk[m * batch_size : (m + 1) * batch_size] for m in range(num_processes * accumulation)]
        steps.append(
            [[micro[a * num_processes + r] for a in range(accumulation)] for r in range(num_processes)]
        )
    return steps


class OnlineStates:
    """The frozen target in the training step (`train.features=online`): for a padded batch, what the cache
    would have given - the aux states at the cache's ids and the final post-norm state, through data_prep's
    own `target_hidden_states`, rounded to the cache's bf16, zero on padding and on each sample's last aux
    row (the cache never stores that row) - as float32."""

    def __init__(self, model, aux_layer_ids: list[int]):
        self.model, self.aux_layer_ids = model, list(aux_layer_ids)

    def __call__(self, input_ids_BT, attention_mask_BT) -> tuple[torch.Tensor, torch.Tensor]:
        aux_BTNH, final_BTH = target_hidden_states(
            self.model, input_ids_BT, attention_mask_BT.long(), self.aux_layer_ids
        )
        real_BT = attention_mask_BT.bool()
        lengths_B = real_BT.sum(1)
        has_next_BT = torch.arange(real_BT.shape[1], device=real_BT.device) < (lengths_B - 1)[:, None]
        aux_BTNH = aux_BTNH.to(HIDDEN_DTYPE).float() * has_next_BT[:, :, None, None]
        final_BTH = final_BTH.to(HIDDEN_DTYPE).float() * real_BT[:, :, None]
        return aux_BTNH, final_BTH


def online_states(cfg, accelerator, train_split: CacheSplit) -> OnlineStates | None:
    """The frozen target for `train.features=online` (None for `cache`), after checking that the cache suits
    the mode: online needs a tokens-only cache, cache mode a cache with hidden states.

    The target is loaded whole on every rank, in `target.dtype`, beside the head: DeepSpeed / DDP wrap only
    the head, so ZeRO-3 does not shard it. A target that does not fit on the device is refused here.
    """
    cache_dir = train_split.cache_dir
    if cfg.train.features == "cache":
        if not train_split.hidden_states:
            raise ValueError(
                f"{cache_dir} holds no hidden states (data_prep ran with cache.hidden_states=false): train "
                "with train.features=online (the target runs in each training step), or rerun data_prep "
                "with cache.hidden_states=true into another run_dir"
            )
        return None
    if train_split.hidden_states:
        raise ValueError(
            f"train.features=online, but {cache_dir} holds the target's hidden states already: train on them "
            "with train.features=cache (the target's forwards are paid for), or make a tokens-only cache "
            "(data_prep with cache.hidden_states=false) in another run_dir"
        )
    if cfg.capture.engine == "vllm":
        raise ValueError(
            "train.features=online with capture.engine=vllm: online training runs the target on each "
            "training batch, on the training ranks' own devices, between optimizer steps; vLLM 0.32 hands "
            "hidden states out only per finished request, through files, from an engine that "
            "holds its devices for itself. Capture the states through vLLM into the cache instead (data_prep "
            "with cache.hidden_states=true capture.engine=vllm, then train.features=cache), or train online "
            "on the transformers target (capture.engine=hf)"
        )
    device = torch.device(accelerator.device)
    if device.type == "cuda":
        needed, free = weights_bytes(cfg.target), torch.cuda.mem_get_info(device)[0]
        if needed > ONLINE_TARGET_SHARE * free:
            raise ValueError(
                f"train.features=online: the target {cfg.target.path} takes {needed / 1e9:.1f} GB in "
                f"target.dtype={cfg.target.dtype}, more than {ONLINE_TARGET_SHARE:.0%} of the "
                f"{free / 1e9:.1f} GB free on {device}, and every rank holds it whole beside the head (it "
                "is not sharded); use GPUs with more memory, or train.features=cache (data_prep caches "
                "the hidden states, rank by rank, with cache.hidden_states=true)"
            )
    return OnlineStates(load_model(cfg.target, device), train_split.manifest["aux_layer_ids"])


def draw_seeds(seed: int, epoch: int, ids: list[int]) -> list[int]:
    """One seed per sample for the loss's random draws (anchors, block lengths:
    train/losses/positions.py `sample_generators`), from the run's seed, the epoch and the sample's index: a
    sample draws the same in any batch, process or micro-batch, so that one process and two train the
    same."""
    return [(((seed * 1_000_003) ^ (epoch * 7_919)) * 1_000_033 + i) % 2**62 for i in ids]


def micro_batch(
    split: CacheSplit,
    rows: list[list[int]],
    device,
    states=None,
    seeds_from: tuple[int, int] | None = None,
    packed: bool = False,
):
    """One micro-batch of `plan_epoch`'s rows from the cache on `device` (`collate`): a row a sample, or
    each row packing its samples when `packed`; with `seeds_from` (seed, epoch) each sample's `draw_seeds`."""
    ids = [i for row in rows for i in row]
    seeds = None if seeds_from is None else draw_seeds(*seeds_from, ids)
    per_row = [len(row) for row in rows] if packed else None
    return collate([split[i] for i in ids], device, states, seeds, per_row)


def collate(
    samples: list[dict[str, torch.Tensor]],
    device,
    states: OnlineStates | None = None,
    seeds: list[int] | None = None,
    per_row: list[int] | None = None,
):
    """Right-pad samples from `CacheSplit` into one batch on `device`, one a row or, with `per_row` (how
    many consecutive samples each row packs), several: then doc_starts [B, T] int64 says where each
    position's sample starts in its row (a padding position: itself). Hidden states as float32, from the
    samples or, for a cache without them, from `states` (the target, online, on the samples unpacked);
    `seeds` (`draw_seeds`, one per sample) go with it as draw_seeds [D] int64 on the CPU."""
    lengths = [len(s["input_ids"]) for s in samples]
    counts = [1] * len(samples) if per_row is None else per_row
    if sum(counts) != len(samples):
        raise ValueError(f"per_row={per_row} packs {sum(counts)} samples; {len(samples)} given")
    # (row, offset in it) of every sample
    places, row_lengths = [], []
    for row, count in enumerate(counts):
        offset = 0
        for n in lengths[len(places) : len(places) + count]:
            places.append((row, offset))
            offset += n
        row_lengths.append(offset)
    b, t = len(counts), max(row_lengths)
    batch = {
        "input_ids": torch.zeros(b, t, dtype=torch.int64),
        "loss_mask": torch.zeros(b, t, dtype=torch.bool),
        "attention_mask": torch.zeros(b, t, dtype=torch.bool),
    }
    if per_row is not None:
        batch["doc_starts"] = torch.arange(t).repeat(b, 1)
    for sample, n, (row, at) in zip(samples, lengths, places):
        batch["input_ids"][row, at : at + n] = sample["input_ids"]
        batch["loss_mask"][row, at : at + n] = sample["loss_mask"]
        batch["attention_mask"][row, at : at + n] = True
        if per_row is not None:
            batch["doc_starts"][row, at : at + n] = at
    batch = {k: v.to(device) for k, v in batch.items()}
    if seeds is not None:
        batch["draw_seeds"] = torch.tensor(seeds, dtype=torch.int64)
    if "final_hidden" in samples[0]:  # the cache's states, each sample's own
        aux_states = [sample["aux_hidden"] for sample in samples]
        final_states = [sample["final_hidden"] for sample in samples]
    elif states is None:
        raise ValueError("these samples hold no hidden states: collate needs the target (OnlineStates)")
    elif per_row is None:
        batch["aux_hidden"], batch["final_hidden"] = states(batch["input_ids"], batch["attention_mask"])
        return batch
    else:  # packed rows: the target runs on the samples one a row (its attention knows no documents)
        alone = collate(samples, device, states)
        aux_states = [alone["aux_hidden"][i, :n] for i, n in enumerate(lengths)]
        final_states = [alone["final_hidden"][i, :n] for i, n in enumerate(lengths)]
    # laid out as the rows hold the samples
    on = aux_states[0].device
    aux = torch.zeros(b, t, *aux_states[0].shape[1:], dtype=torch.float32, device=on)
    final = torch.zeros(b, t, final_states[0].shape[-1], dtype=torch.float32, device=on)
    for sample_aux, sample_final, n, (row, at) in zip(aux_states, final_states, lengths, places):
        aux[row, at : at + n] = sample_aux
        final[row, at : at + n] = sample_final
    batch["aux_hidden"], batch["final_hidden"] = aux.to(device), final.to(device)
    return batch
