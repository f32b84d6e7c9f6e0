"""Stage 05's RoPE items: the export rotates positions as the draft was trained to ([train] rope_scaling,
core/rope_scaling.py).

config.json carries `rope_theta` and `rope_scaling` (null, or the yarn table trained with) at top level,
the keys vLLM 0.32 reads for both drafts (transformers 5 turns them into the `rope_parameters` that
llama.py's and deepseek_v2.py's get_rope take). The gate refuses, naming the key, an export vLLM would
rotate otherwise: a missing or extra scaling, another factor or length, a `rope_parameters` table that
vLLM would read instead. The read-back then also runs each sample at positions spread past
original_max_position_embeddings: RoPE is relative, so only long distances show a wrong scaling there.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from eagle3_pipeline.core import rope_scaling
from eagle3_pipeline.core.errors import UserError


def rope_config_problems(config: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """config.json's RoPE as vLLM reads it against the trained spec's (rope_theta, rope_scaling)."""
    trained = spec.get("rope_scaling")
    if trained is None and (config.get("rope_scaling") or rope_scaling.NONE) != rope_scaling.NONE:
        return [f"rope_scaling must be null: the draft was trained with plain RoPE, not "
                f"{config['rope_scaling']!r}"]  # fmt: skip
    try:
        theta, served, key = rope_scaling.served(config)
    except UserError as e:
        return [f"{e} (vLLM would read it; the draft was trained with {rope_scaling.describe(trained)})"]
    p = []
    if theta != spec["rope_theta"] and config.get("rope_theta") == spec["rope_theta"]:
        p.append(f"rope_parameters.rope_theta {theta!r} != trained {spec['rope_theta']!r} (vLLM reads it)")
    if served == trained:
        return p
    if trained is None:
        p.append(f"{key} must be null: the draft was trained with plain RoPE, vLLM would rotate with "
                 f"{rope_scaling.describe(served)}")  # fmt: skip
    elif served is None:
        p.append(f"rope_scaling missing: the draft was trained with {rope_scaling.describe(trained)}; "
                 "vLLM would rotate with plain RoPE")  # fmt: skip
    else:
        for k in sorted(set(trained) | set(served)):
            if served.get(k) != trained.get(k):
                p.append(f"{key}.{k} {served.get(k)!r} != trained {trained.get(k)!r}")
    return p


def long_positions(b: dict[str, torch.Tensor], scalings: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """The packed sample `b` again with its positions spread so that its span reaches twice the longest
    original_max_position_embeddings of `scalings` (the trained and the exported one): none without a
    scaling. Every slot keeps its order, so the draft's causal maths is unchanged but its distances."""
    lengths = [s["original_max_position_embeddings"] for s in scalings if s is not None]
    T = b["input_ids"].shape[1]
    if not lengths or T < 2:
        return []
    stride = math.ceil(2 * max(lengths) / (T - 1))
    if stride == 1:  # the sample already spans that far
        return []
    return [{**b, "position_ids": b["position_ids"] * stride}]


def check_checkpoint_rope(recorded: dict[str, Any] | None, built: dict[str, Any], where: str) -> None:
    """A checkpoint's recorded RoPE (checkpoint.json `rope_parameters`; absent before it was recorded)
    against the draft rebuilt from the run's meta.json."""
    if recorded is not None and recorded != built:
        raise UserError(
            f"{where}: trained with RoPE {recorded}, the run's meta.json builds {built}: export the run "
            "this checkpoint belongs to"
        )
