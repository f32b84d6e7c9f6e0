"""The draft's RoPE scaling (`[train] rope_scaling`): its canonical form and its maths, as vLLM 0.32
computes them (vllm/model_executor/layers/rotary_embedding: get_rope, yarn_scaling_rope.py,
deepseek_scaling_rope.py; deepseek_v2.py's MLA softmax scale); no torch, so parsing a config stays light.

One scaling is supported, yarn (Kimi-K2.5's and DeepSeek-V3's); the table holds `rope_type` "yarn",
`factor`, `original_max_position_embeddings` and optionally `beta_fast` (32), `beta_slow` (1) and
`mscale` with `mscale_all_dim` (both or neither: transformers and vLLM take one alone differently).
Training (transformers' yarn) and the export's read-back (models/reference_*.py, these formulas) must
give the same rotation; tests/test_rope_scaling.py checks that they do.
"""

from __future__ import annotations

import json
import math
from typing import Any

from eagle3_pipeline.core.errors import UserError

NONE, VERIFIER = "none", "verifier"  # the [train] rope_scaling words; anything else is a JSON table
YARN = "yarn"
REQUIRED = ("factor", "original_max_position_embeddings")
OPTIONAL = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# A transformers 5 `rope_parameters` table also carries these; they are not part of the scaling.
NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def canonical(table: Any, where: str) -> dict[str, Any]:
    """A yarn table in one form ("type" read as "rope_type", numbers as floats, the original length an
    int); a UserError naming `where` and the key for anything vLLM and training would not both read."""
    if not isinstance(table, dict):
        raise UserError(f"{where}: a RoPE scaling must be a table such as {example()}, not {table!r}")
    kind = table.get("rope_type", table.get("type"))
    if kind != YARN:
        raise UserError(f"{where}: rope_type {kind!r} is not supported (only {YARN!r}); or use {NONE!r}")
    unknown = sorted(set(table) - {"rope_type", "type", *REQUIRED, *OPTIONAL})
    if unknown:
        known = ", ".join(REQUIRED + OPTIONAL)
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)} (yarn takes {known})")
    out: dict[str, Any] = {"rope_type": YARN}
    for key in REQUIRED + OPTIONAL:
        if key not in table:
            if key in REQUIRED:
                raise UserError(f"{where}: yarn needs `{key}`")
            continue
        value = table[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"{where}: `{key}` must be a number, not {value!r}")
        out[key] = float(value)
    if out["factor"] <= 1:
        raise UserError(f"{where}: `factor` {out['factor']:g} must be > 1")
    orig = out["original_max_position_embeddings"]
    if orig < 1 or orig != int(orig):
        raise UserError(f"{where}: `original_max_position_embeddings` must be an integer >= 1")
    out["original_max_position_embeddings"] = int(orig)
    if ("mscale" in out) != ("mscale_all_dim" in out):
        raise UserError(f"{where}: give both `mscale` and `mscale_all_dim` or neither")
    if any(out.get(k, 1.0) <= 0 for k in OPTIONAL):
        raise UserError(f"{where}: `beta_fast`, `beta_slow`, `mscale` and `mscale_all_dim` must be > 0")
    return out


def example() -> str:
    return '\'{"rope_type": "yarn", "factor": 64, "original_max_position_embeddings": 4096}\''


def setting_problem(value: str) -> str | None:
    """Why `value` is no [train] rope_scaling (None: it is one): none, verifier or a JSON yarn table."""
    if value in (NONE, VERIFIER):
        return None
    try:
        canonical(json.loads(value), "--rope-scaling")
    except json.JSONDecodeError:
        return f"must be {NONE}, {VERIFIER} or a JSON yarn table such as {example()}"
    except UserError as e:
        return f"must be {NONE}, {VERIFIER} or a JSON yarn table: {str(e).removeprefix('--rope-scaling: ')}"
    return None


def of_verifier(
    config: dict[str, Any], where: str = "--rope-scaling verifier (the verifier's config.json)"
) -> dict[str, Any] | None:
    """The verifier's own scaling from its (text) config.json: `rope_scaling`, else the scaling part of
    a transformers 5 `rope_parameters`; None for plain RoPE."""
    table = config.get("rope_scaling") or config.get("rope_parameters")
    if not table:
        return None
    table = {k: v for k, v in table.items() if k not in NOT_SCALING}
    if table.get("rope_type", table.get("type", "default")) == "default":
        return None
    return canonical(table, where)


def resolve(setting: str, verifier: dict[str, Any]) -> dict[str, Any] | None:
    """The scaling a draft trains with: None (plain RoPE), the verifier's, or the table given."""
    if setting == NONE:
        return None
    if setting == VERIFIER:
        return of_verifier(verifier)
    return canonical(json.loads(setting), "--rope-scaling")


def served(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, str]:
    """(theta, scaling, the key it came from) as vLLM 0.32 reads an exported config.json (transformers 5
    `standardize_rope_params`): a non-null `rope_scaling` wins, with the top-level `rope_theta`; else
    `rope_parameters`, whose own rope_theta then wins; neither: plain RoPE (theta default 10000)."""
    theta = float(config.get("rope_theta") or 10000.0)
    if config.get("rope_scaling"):
        return theta, canonical(config["rope_scaling"], "rope_scaling"), "rope_scaling"
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or theta)
    return theta, of_verifier({"rope_parameters": params}, "rope_parameters"), "rope_parameters"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """vLLM's and DeepSeek's yarn_get_mscale."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, length: int) -> float:
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))


def inv_freq(dim: int, theta: float, scaling: dict[str, Any] | None) -> list[float]:
    """The dim // 2 rotation frequencies: theta ** (-2i / dim), under yarn blended per pair between that
    (extrapolation) and it / factor (interpolation) along vLLM's ramp between the beta_fast and beta_slow
    correction dims (floored and ceiled, as vLLM and transformers truncate them)."""
    plain = [1.0 / theta ** (2 * i / dim) for i in range(dim // 2)]
    if scaling is None:
        return plain
    orig, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low = max(math.floor(_correction_dim(scaling.get("beta_fast", 32.0), dim, theta, orig)), 0)
    high = min(math.ceil(_correction_dim(scaling.get("beta_slow", 1.0), dim, theta, orig)), dim - 1)
    if low == high:
        high += 0.001  # vLLM's guard against a zero-width ramp
    out = []
    for i, f in enumerate(plain):
        extrapolate = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * (1 - extrapolate) + f * extrapolate)
    return out


def cos_sin_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: yarn's mscale(factor), or with DeepSeek's keys
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (1 for Kimi-K2.5's equal ones)."""
    if scaling is None:
        return 1.0
    if "mscale" in scaling:
        factor = scaling["factor"]
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(scaling["factor"])


def mla_softmax_factor(scaling: dict[str, Any] | None) -> float:
    """The MLA attention's extra softmax scale: mscale(factor, mscale_all_dim) squared (DeepSeek's and vLLM's
    DeepseekV2MLAAttention), 1 without mscale_all_dim; the llama attention has none."""
    if scaling is None or "mscale_all_dim" not in scaling:
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def describe(scaling: dict[str, Any] | None) -> str:
    if scaling is None:
        return "plain RoPE"
    return f"yarn factor {scaling['factor']:g} over {scaling['original_max_position_embeddings']} positions"
