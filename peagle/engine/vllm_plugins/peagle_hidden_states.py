"""vLLM KV connector writing a request's hidden states to disk, on CPU as on CUDA (runs INSIDE vLLM).

Loaded by vLLM through its connector plug-in point, never imported by `peagle`:
``--kv-transfer-config '{"kv_connector": "PeagleHiddenStatesConnector",
"kv_connector_module_path": "peagle_hidden_states", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}}'`` with this folder on ``PYTHONPATH``, next to
``--speculative-config '{"method": "extract_hidden_states", ...}'``.

vLLM's own `ExampleHiddenStatesConnector` copies the states out of the KV cache on a CUDA stream into
pinned host memory, which fails on the CPU build ("pin_memory=True requires a CUDA or other accelerator
backend"). This subclass keeps everything else of it (scheduler side, lock files, file layout:
``hidden_states [T, n_ids, H]``, ``token_ids [T]``; the path comes back in the response's
``kv_transfer_params["hidden_states_path"]``) and, when the KV cache lives on the CPU, copies
synchronously and hands only the disk write to its thread pool. On CUDA the parent's asynchronous path
runs unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["PeagleHiddenStatesConnector"]


class _Done:
    """Stands in for the CUDA event of a copy that already happened (`get_finished` polls `query()`)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class PeagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous copy when the KV cache is on the CPU."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        cache = self._kv_cache
        if cache is None or cache.device.type != "cpu":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(cache, slots, num_tokens).clone()  # [T, n_ids, H], a copy
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "two saves for one request id"
        Path(pending.filename).parent.mkdir(parents=True, exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done: Any = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        from functools import partial

        future.add_done_callback(partial(self._on_write_done, pending.req_id))
