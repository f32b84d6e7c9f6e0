"""The rules of a draft's shape: which decoder layers it may have and which head settings go together.

Owned by the model package (without importing torch) so that [train] (training/config.py) and a draft read
back from a checkpoint (models/draft.py) are held to the same rules, with the same messages.
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.core.config import check_value
from eagle3_pipeline.core.errors import UserError

# [train] draft_arch: the draft's decoder layer. llama: speculators' Eagle3 Llama layer (vLLM
# llama_eagle3.py); mla: a DeepSeek-V3 MLA layer with a dense MLP (vLLM deepseek_eagle3.py,
# models/mla_draft.py)
DRAFT_ARCHS = ("llama", "mla")


def _even_problem(n: int) -> str | None:
    return "must be even (RoPE rotates pairs)" if n % 2 else None


# What each head setting accepts: [train]'s fields declare these, check_draft_shape applies them
HEAD_BOUNDS: dict[str, dict[str, Any]] = {
    "num_attention_heads": {"ge": 1},
    "num_key_value_heads": {"ge": 1},
    "head_dim": {"ge": 2, "check": _even_problem},
}


def draft_shape_problem(d: Any) -> str | None:
    """Why the draft's shape settings do not go together (None: they do), naming the [train] flags and the
    fix; `d`, a TrainConfig or a DraftSpec (models/draft.py), which share the names."""
    mla = d.draft_arch == "mla"
    if mla and d.norm_before_fc:
        return (
            "--draft-arch mla: vLLM's deepseek_eagle3.py has no norm_before_fc (input_norm) and would skip "
            "it; add --no-norm-before-fc (--fc-norm normalises each aux state instead)"
        )
    if mla and (d.parallel if hasattr(d, "parallel") else d.parallel_drafting):
        return (
            "--draft-arch mla with --parallel-drafting: vLLM 0.32's deepseek_eagle3.py has no mask_hidden, "
            "so it cannot serve an MLA draft in parallel; drop either"
        )
    if getattr(d, "sliding_window", None) is not None and mla:
        return (
            "--sliding-window with --draft-arch mla: vLLM 0.32's deepseek_eagle3.py reads no layer_types / "
            "sliding_window and would serve the draft with full attention; drop either"
        )
    if getattr(d, "sliding_window", None) is not None and (
            d.parallel if hasattr(d, "parallel") else d.parallel_drafting):  # fmt: skip
        return (
            "--sliding-window with --parallel-drafting: the parallel draft's training forward "
            "(training/parallel.py) has no window; drop either"
        )
    if not mla and d.num_attention_heads % d.num_key_value_heads:
        return (
            f"--num-attention-heads {d.num_attention_heads} must be a multiple of --num-key-value-heads "
            f"{d.num_key_value_heads} (grouped-query attention shares each key/value head among whole "
            "groups); change either"
        )
    if d.norm_before_fc and d.fc_norm:
        return (
            "--norm-before-fc and --fc-norm are mutually exclusive (speculators and vLLM); add "
            "--no-norm-before-fc to use --fc-norm"
        )
    return None


def check_draft_shape(d: Any) -> None:
    """The [train] rules of a draft's shape for a DraftSpec not built from a checked TrainConfig (read back
    from a checkpoint, built in code): its shape fields as TrainConfig declares them, then the rules between
    them; the messages a TrainConfig gives."""
    for name, bounds in HEAD_BOUNDS.items():
        check_value(name, getattr(d, name), bounds)
    problem = draft_shape_problem(d)
    if problem is not None:
        raise UserError(problem)
