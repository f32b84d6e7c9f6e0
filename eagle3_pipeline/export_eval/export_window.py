"""Stage 05's window items: the export attends within the window the draft was trained with ([train]
sliding_window, models/draft_window.py).

config.json carries `layer_types` ["sliding_attention"] and `sliding_window` for a windowed draft (neither
for a full-attention one): what vLLM 0.32's llama.py LlamaAttention reads for the EAGLE-3 draft layer
(its index less the target's layer count). The gate reads them back as vLLM does (draft_window.
served_window) and refuses, naming the key, a missing, extra or other window; the read-back then runs
the export with that window (reference_draft.py) against the trained draft under its own mask.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.models.draft_window import FULL, SLIDING, layer_types_of, served_window
from eagle3_pipeline.models.linear_memory import draft_steps, window_of


def window_config_fields(window: int | None) -> dict[str, Any]:
    """config.json's window keys for vLLM (none for a full-attention draft: exports as before)."""
    return {} if window is None else {"layer_types": layer_types_of(window), "sliding_window": window}


def window_config_problems(config: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """config.json's window as vLLM reads it against the trained spec's `sliding_window`."""
    trained, types = spec.get("sliding_window"), config.get("layer_types")
    layers = config.get("num_hidden_layers", 1)
    if types is not None and (not isinstance(types, list) or len(types) != layers
                              or any(t not in (FULL, SLIDING) for t in types)):  # fmt: skip
        return [f"layer_types {types!r} must list {layers} of {FULL!r} / {SLIDING!r} (vLLM indexes it by "
                "the draft layer and fails to load otherwise)"]  # fmt: skip
    served = served_window(config)
    if served == trained:
        if trained is None and config.get("sliding_window") is not None:
            return [f"sliding_window {config['sliding_window']!r} without a sliding layer in layer_types: "
                    "the draft was trained with full attention; remove it"]  # fmt: skip
        return []
    if trained is None:
        return [f"layer_types / sliding_window: vLLM would attend within {served} tokens; the draft was "
                "trained with full attention"]  # fmt: skip
    if served is None:
        return [f"sliding_window missing: the draft was trained with a {trained}-token window; vLLM would "
                f"serve full attention (config.json needs layer_types [{SLIDING!r}] and sliding_window "
                f"{trained})"]  # fmt: skip
    return [f"sliding_window {served!r} != trained {trained}"]


def run_windowed(model: Any, b: dict[str, Any], ttt_steps: int) -> bool:
    """The read-back's trained side for a windowed draft: its TTT steps over the packed sample `b` as it
    trained (linear_memory.draft_steps: vLLM's window per step, where speculators' forward counts it from
    the query). False, nothing run, for a full-attention draft (speculators' forward is its training's)."""
    if window_of(model) is None:
        return False
    draft_steps(model, b, ttt_steps)
    return True
