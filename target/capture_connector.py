"""The KV connector that writes captured hidden states on vLLM's CPU build (loaded by the engine core
through `kv_transfer_config["kv_connector_module_path"] = "target.capture_connector"`).

vLLM's `ExampleHiddenStatesConnector` copies each finished request's states to pinned host memory on a CUDA
stream and writes the file from a thread pool. Without an accelerator both fail: `pin_memory=True` raises,
and the CPU worker's `torch.cuda.Event` stand-in has no `query()` (docs/design.md#capture). This subclass
changes only the write: the states are gathered from the hidden-state cache and saved at once, in the
engine's step, and the request is reported finished right after. The file format, its path and the lock
file protocol (readers block on a shared lock until the writer closes its exclusive one) are vLLM's.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class Written:
    """What `get_finished` polls for a request whose copy is done: the file is already written."""

    @staticmethod
    def query() -> bool:
        return True


class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:  # the other tensor-parallel ranks hold no more than rank 0
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size) + block_ids[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(
            self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0]
        )
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file(
                {"hidden_states": states.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()},
                pending.filename,
            )
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the writer's lock: readers waiting on it go on
        self._req_copy_events[pending.req_id] = Written()
