"""The trainer beside a vLLM server of the verifier on the same GPUs (co-location), for `--plan`.

Online hidden states (a `vllm serve` of the verifier producing the states while 04_train.py trains) can
share one node: Kimi-K2.5's INT4 routed experts leave most of each GPU free under tensor parallelism.
Per GPU, what the server needs is its weights (the checkpoint's bytes, `verifier.weight_bytes`, over the
tensor-parallel size: experts, attention and vocabulary are sharded; the few replicated tensors are
small), a reserve for its activations and CUDA graphs, and KV cache for the tokens it prefills at
once (`kv_cache.verifier_kv`: the MLA latent is on every rank); the trainer needs
`plan.memory_per_gpu`. The server is then started with `--gpu-memory-utilization` leaving the trainer
its share. The producers must deliver the trainer's tokens/s of states, which at Kimi's 4 x 7168 values
per token is a bandwidth as well as a compute budget.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.sizing.gpus import GPUS
# vLLM's own non-KV, non-weight memory per GPU: prefill activations, CUDA graphs, NCCL buffers. An
# assumption (not measured on these GPUs yet): scripts/gpu_check.sh is where to measure it.
SERVER_RESERVE_BYTES = 8 * 2**30
MARGIN_BYTES = 2 * 2**30  # left unused between the two processes (allocator fragmentation)


def report(
    weights_bytes: int | None,
    tensor_parallel_size: int,
    trainer_bytes: int,
    kv_bytes_per_token: int,
    prefill_tokens: int,
    state_bytes_per_token: int,
    tokens_per_second: float | None,
) -> dict[str, Any]:
    """Per GPU kind: the server's weights, what is left for its KV cache beside the trainer, the tokens
    that holds, whether it holds one prefill of `prefill_tokens`, and the --gpu-memory-utilization that
    leaves the trainer its bytes; and the producers' rate (the trainer's tokens/s) in bytes/s."""
    per_gpu_weights = None if weights_bytes is None else weights_bytes // tensor_parallel_size
    gpus: dict[str, Any] = {}
    for name, gpu in GPUS.items():
        total = gpu.memory_bytes
        if per_gpu_weights is None:
            gpus[name] = {"memory": total}
            continue
        kv_room = total - per_gpu_weights - SERVER_RESERVE_BYTES - trainer_bytes - MARGIN_BYTES
        gpus[name] = {
            "memory": total,
            "kv_room": kv_room,
            "kv_tokens": max(0, kv_room) // kv_bytes_per_token,
            "fits": kv_room >= prefill_tokens * kv_bytes_per_token,
            "gpu_memory_utilization": (total - trainer_bytes - MARGIN_BYTES) / total,
        }
    return {
        "checkpoint_bytes": weights_bytes,
        "tensor_parallel_size": tensor_parallel_size,
        "server_weights_per_gpu": per_gpu_weights,
        "server_reserve": SERVER_RESERVE_BYTES,
        "margin": MARGIN_BYTES,
        "trainer_per_gpu": trainer_bytes,
        "prefill_tokens": prefill_tokens,
        "gpus": gpus,
        "producer_tokens_per_second": tokens_per_second,
        "producer_bytes_per_second": (
            None if tokens_per_second is None else tokens_per_second * state_bytes_per_token
        ),
    }


def render_lines(c: dict[str, Any]) -> list[str]:
    """The plan's co-location lines."""
    gb = storage.format_bytes
    if c["server_weights_per_gpu"] is None:
        lines = ["co-location   ? (the verifier folder has no safetensors: its weights per GPU are unknown)"]
    else:
        lines = [
            f"co-location   vLLM server TP{c['tensor_parallel_size']}: weights {gb(c['checkpoint_bytes'])} / "
            f"{c['tensor_parallel_size']} = {gb(c['server_weights_per_gpu'])}/GPU + reserve "
            f"{gb(c['server_reserve'])} (assumed) | trainer {gb(c['trainer_per_gpu'])}/GPU | margin "
            f"{gb(c['margin'])}"
        ]
        for name, g in c["gpus"].items():
            verdict = "fits" if g["fits"] else f"DOES NOT FIT a {c['prefill_tokens']:,}-token prefill"
            lines.append(
                f"              {name} {gb(g['memory'])}: KV cache {gb(max(0, g['kv_room']))} = "
                f"{g['kv_tokens']:,} tokens: {verdict} (vllm serve --gpu-memory-utilization "
                f"{g['gpu_memory_utilization']:.2f})"
            )
    if c["producer_tokens_per_second"] is None:
        lines.append("producers     ? tokens/s of states (give --plan-tokens-per-second: the trainer's rate)")
    else:
        lines.append(
            f"producers     {c['producer_tokens_per_second']:,.0f} tokens/s of states keep the trainer busy: "
            f"{gb(c['producer_bytes_per_second'])}/s over the connector"
        )
    return lines
