"""Run the target over rendered samples and write its hidden states to cache shards (or, with
`cache.hidden_states=false`, the tokens and loss masks alone). The states come from a transformers target
(`capture.engine=hf`, `hf_states`) or from the vLLM engine (`capture.engine=vllm`, `vllm_states`).

Shards are planned from the samples alone (never from the number of processes), and shard s is computed
by rank s % world_size: any number of processes writes the same files, and a rerun skips every shard
whose checksum verifies.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from artifacts import atomic
from artifacts.cache import read_complete_shard_info, shard_path, write_shard
from target.model import target_hidden_states

log = logging.getLogger(__name__)


def bytes_per_token(num_aux: int, hidden_size: int, hidden_states: bool = True) -> int:
    """Disk per cached token, at most: bf16 aux and final states (ids and mask fit in the aux rows a shard
    leaves out, see artifacts/cache.py); without hidden states (`cache.hidden_states=false`), the token id and
    its mask bit (4 bytes: ids above 65,535 take int32)."""
    return 2 * (num_aux + 1) * hidden_size if hidden_states else 4


def plan_shards(lengths: list[int], token_bytes: int, max_shard_bytes: int) -> list[list[int]]:
    """Consecutive runs of sample indices, each under `max_shard_bytes` (a longer sample gets its own)."""
    shards, current, current_bytes = [], [], 0
    for index, length in enumerate(lengths):
        size = length * token_bytes
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def plan_batches(indices: list[int], lengths: list[int], max_tokens_per_batch: int) -> list[list[int]]:
    """Group samples of similar length (longest first) so padded tokens stay under the budget."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches, current = [], []
    for index in order:
        padded = (len(current) + 1) * lengths[current[0] if current else index]
        if current and padded > max_tokens_per_batch:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def pad_batch(samples, indices, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask: right padding leaves every real position's states unchanged."""
    max_len = max(len(samples[i].input_ids) for i in indices)
    input_ids = torch.full((len(indices), max_len), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), max_len), dtype=torch.long)
    for row, i in enumerate(indices):
        ids = samples[i].input_ids
        input_ids[row, : len(ids)] = torch.as_tensor(ids)
        attention_mask[row, : len(ids)] = 1
    return input_ids.to(device), attention_mask.to(device)


def hf_states(model, aux_layer_ids, max_tokens_per_batch: int, pad_id: int, device):
    """States from a transformers target: padded batches of similar length through one decoder forward."""

    def states_of(samples, indices):
        lengths = [len(s.input_ids) for s in samples]
        for batch in plan_batches(indices, lengths, max_tokens_per_batch):
            input_ids, attention_mask = pad_batch(samples, batch, pad_id, device)
            aux_BTNH, final_BTH = target_hidden_states(model, input_ids, attention_mask, aux_layer_ids)
            aux_BTNH, final_BTH = aux_BTNH.to("cpu", torch.bfloat16), final_BTH.to("cpu", torch.bfloat16)
            # views: write_shard concatenates them into one copy
            yield (
                batch,
                [(aux_BTNH[row, : lengths[i]], final_BTH[row, : lengths[i]]) for row, i in enumerate(batch)],
            )

    return states_of


def vllm_states(engine, batch_size: int):
    """States from a vLLM engine (target/capture.py): a prompt-only pass (one token sampled, then
    dropped), `batch_size` samples per call, each file checked against the sample's token ids."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1)

    def states_of(samples, indices):
        for first in range(0, len(indices), batch_size):
            batch = indices[first : first + batch_size]
            outputs = engine.generate([samples[i].input_ids for i in batch], params)
            states = [
                engine.states(output, samples[i].input_ids, f"sample {samples[i].id!r}")
                for i, output in zip(batch, outputs)
            ]
            yield batch, [(aux.to(torch.bfloat16), final.to(torch.bfloat16)) for aux, final in states]

    return states_of


def compute_shard(states_of, samples, indices, on_tokens):
    """The samples `indices`, in that order, with the target's hidden states from `states_of` (hf_states or
    vllm_states), ready for `write_shard`; `states_of` None: tokens and loss masks only (a cache for online
    training)."""
    lengths = [len(s.input_ids) for s in samples]
    results = {
        i: {"id": samples[i].id, "input_ids": samples[i].input_ids, "loss_mask": samples[i].loss_mask}
        for i in indices
    }
    if states_of is None:
        on_tokens(sum(lengths[i] for i in indices))
        return [results[i] for i in indices]
    for batch, states in states_of(samples, indices):
        for i, (aux, final) in zip(batch, states):
            results[i]["aux_hidden"], results[i]["final_hidden"] = aux, final
        on_tokens(sum(lengths[i] for i in batch))
    return [results[i] for i in indices]


def cache_split(states_of, samples, split_dir: Path, shard_plan, accelerator, desc) -> dict:
    """Compute and write this rank's shards of one split; finished shards are verified and kept."""
    split_dir.mkdir(parents=True, exist_ok=True)
    mine = [s for s in range(len(shard_plan)) if s % accelerator.num_processes == accelerator.process_index]
    todo = []
    for s in mine:
        atomic.remove_tmp_files(shard_path(split_dir, s))  # left by a killed run (each shard has one writer)
        if read_complete_shard_info(shard_path(split_dir, s)) is None:
            if shard_path(split_dir, s).exists():
                log.warning("%s: incomplete or corrupt, recomputing it", shard_path(split_dir, s))
            todo.append(s)
    num_tokens = sum(len(samples[i].input_ids) for s in todo for i in shard_plan[s])
    stats = {
        "num_shards_reused": len(mine) - len(todo),
        "num_shards_written": len(todo),
        "num_tokens": num_tokens,
    }
    if not todo:
        return stats
    bar = tqdm(
        total=num_tokens,
        desc=desc,
        unit="tok",
        unit_scale=True,
        disable=not accelerator.is_local_main_process,
    )
    start = time.perf_counter()
    for s in todo:
        shard = compute_shard(states_of, samples, shard_plan[s], bar.update)
        write_shard(shard_path(split_dir, s), shard)
    bar.close()
    stats["seconds"] = time.perf_counter() - start
    return stats
