"""CPU build only: vLLM's kernel-override scan, past modules it cannot read.

When the CPU platform registers its Triton stand-ins (`vllm/triton_utils/dispatcher.py`
`register_kernels`, at every worker start), `_rebind_kernels` walks every module in `sys.modules` and
reads `vars(value).get("kernel")` of each attribute with a `__dict__`. llvmlite's `_lib_fn_wrapper`
(imported with numba by Kimi-K2.5's fused image processor,
`vllm/transformers_utils/processors/kimi_k25_vision_fused.py`) answers `hasattr(value, "__dict__")`, but
what `vars` gives has no `get`: the scan raises "AttributeError: '_lib_fn_wrapper' object has no attribute
'get'" and the engine does not start. In vLLM's own worker process numba is not loaded yet when the scan
runs; in the worker's one process (vllm_side/cpu.py `in_process`) it is, once a Kimi-K2.5 engine has
been built there. The modules holding such values (none holds a vLLM kernel) are left out of the scan.
"""

from __future__ import annotations

import sys
from types import ModuleType


def unreadable(module: ModuleType) -> bool:
    """Whether the scan would raise on one of the module's attributes."""
    namespace = getattr(module, "__dict__", None)
    if not namespace:
        return False
    for value in list(namespace.values()):
        try:
            if hasattr(value, "__dict__"):
                vars(value).get
        except Exception:
            return True
    return False


def register() -> None:
    """Wrap the scan once: the unreadable modules are out of `sys.modules` while it runs, then back."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels
    if getattr(scan, "skips_unreadable_modules", False):
        return

    def rebind(overrides):
        hidden = {name: m for name, m in list(sys.modules.items()) if unreadable(m)}
        for name in hidden:
            del sys.modules[name]
        try:
            return scan(overrides)
        finally:
            sys.modules.update(hidden)

    rebind.skips_unreadable_modules = True
    dispatcher._rebind_kernels = rebind
