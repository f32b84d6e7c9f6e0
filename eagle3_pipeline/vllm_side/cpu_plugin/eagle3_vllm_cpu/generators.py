"""CPU build only: seeded requests survive a chunked prefill.

vLLM 0.32 samples a token for a request whose prompt is only partly prefilled in a step, discards it,
and rewinds the request's generator by the draw it used: `gen.set_offset(gen.get_offset() - 4)`
(`vllm/v1/worker/gpu_model_runner.py`, the discard loop after sampling). That is Philox's counter on
CUDA; a CPU generator (mt19937) has no offset, so the first seeded request whose prompt is chunked kills
the engine: "RuntimeError: CPU Generator does not use offset" (measured: stage 00 at temperature 1.0
with a seed, 400 multi-turn rows of up to 1,024 tokens). Here a request's CPU generator is one whose
offset is always 0 and whose rewind does nothing: the discarded draw is consumed instead of rewound, so
a seeded request is still reproducible for the same schedule, but its draws after a chunked prefill
are not the ones an unchunked (or GPU) run makes.
"""

from __future__ import annotations

import torch


class CpuSeededGenerator(torch.Generator):
    """A CPU generator whose offset is 0 and cannot be moved (mt19937 has none)."""

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> CpuSeededGenerator:
        return self


def register() -> None:
    """Every request state the CPU runner builds gets its seeded CPU generator as a CpuSeededGenerator
    (same seed, same state) before any draw."""
    from vllm.v1.worker import gpu_input_batch

    cls = gpu_input_batch.CachedRequestState
    original = cls.__post_init__

    def __post_init__(self) -> None:
        original(self)
        gen = self.generator
        if gen is not None and gen.device.type == "cpu" and not isinstance(gen, CpuSeededGenerator):
            wrapped = CpuSeededGenerator(device="cpu")
            wrapped.set_state(gen.get_state())
            self.generator = wrapped

    cls.__post_init__ = __post_init__
