"""Stage 05 for an MLA draft ([train] draft_arch = "mla"): config.json, tensor shapes and the contract
items vLLM 0.32 reads from an `Eagle3DeepseekV2ForCausalLM` draft (deepseek_eagle3.py). export.py calls
these for an MLA spec; everything shared with the llama draft (aux ids, d2t, norm flags, dtypes, the
read-back) stays there. The items, each refused by name (docs/reference.md "The export contract, MLA"):

- model_type `deepseek_v2`, architectures [Eagle3DeepseekV2ForCausalLM]. Not `deepseek_v3`: vLLM's
  SpeculativeConfig.hf_config_override rewrites every deepseek_v3 draft config into a DeepSeek MTP draft.
  Not `kimi_k2` (the verifier's): the eagle branch of is_deepseek_mla (model_arch_config_convertor.py)
  lists axk1, deepseek_v2/v3/v32, deepseek_mtp only, so the draft would not be detected as MLA.
- kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim and q_lora_rank (null: a plain q_proj)
  as trained: vLLM reads each with getattr(config, name, 0) and would build other shapes.
- norm_before_fc false: deepseek_eagle3.py has no input_norm (it applies fc_norm only).
- rope_scaling as trained (export_rope.py, shared with llama): yarn changes vLLM's rotation and, for MLA,
  its softmax scale (mscale(factor, mscale_all_dim) ** 2).
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.models.draft import MLA_DIMS, DraftSpec

MLA_MODEL_TYPE = "deepseek_v2"
MLA_ARCHITECTURES = ["Eagle3DeepseekV2ForCausalLM"]


def mla_config_fields(spec: DraftSpec) -> dict[str, Any]:
    """The MLA part of config.json (export.export_config writes the shared part)."""
    return {
        "architectures": MLA_ARCHITECTURES,
        "model_type": MLA_MODEL_TYPE,
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "num_key_value_heads": spec.num_attention_heads,
        "first_k_dense_replace": 1,  # vLLM's Eagle3 layer is always dense; stated for transformers' loader
    }


def mla_attention_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The attention tensors of `midlayer.` from config.json alone (vLLM DeepseekV2MLAAttention with
    input_size 2 x hidden)."""
    H, heads = config["hidden_size"], config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    latent, q_lora = config["kv_lora_rank"], config.get("q_lora_rank")
    a = "midlayer.self_attn."
    shapes = {
        a + "kv_a_proj_with_mqa.weight": (latent + rope, 2 * H),
        a + "kv_a_layernorm.weight": (latent,),
        a + "kv_b_proj.weight": (heads * (nope + v), latent),
        a + "o_proj.weight": (H, heads * v),
    }
    if q_lora:
        shapes[a + "q_a_proj.weight"] = (q_lora, 2 * H)
        shapes[a + "q_a_layernorm.weight"] = (q_lora,)
        shapes[a + "q_b_proj.weight"] = (heads * (nope + rope), q_lora)
    else:
        shapes[a + "q_proj.weight"] = (heads * (nope + rope), 2 * H)
    return shapes


def mla_config_problems(config: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """config.json of an MLA export against the trained spec: what vLLM would misdetect or misread."""
    p: list[str] = []
    if config.get("model_type") != MLA_MODEL_TYPE:
        why = (
            "vLLM rewrites a deepseek_v3 draft into a DeepSeek MTP draft"
            if config.get("model_type") in ("deepseek_v3", "deepseek_v32")
            else "vLLM's is_deepseek_mla (eagle branch) would not detect the draft as MLA"
        )
        p.append(f"model_type {config.get('model_type')!r} must be {MLA_MODEL_TYPE!r}: {why}")
    if config.get("architectures") != MLA_ARCHITECTURES:
        p.append(f"architectures {config.get('architectures')!r} must be {MLA_ARCHITECTURES}")
    for dim in MLA_DIMS:
        want = spec.get(dim, 0) or (None if dim == "q_lora_rank" else 0)
        if dim not in config:
            default = None if dim == "q_lora_rank" else 0
            p.append(f"{dim} missing: vLLM would take {default}; trained {want}")
        elif config[dim] != want:
            p.append(f"{dim} {config[dim]!r} != trained {want!r}")
    if config.get("num_hidden_layers") != 1:
        p.append(f"num_hidden_layers {config.get('num_hidden_layers')!r} must be 1 (one draft layer)")
    if config.get("norm_before_fc"):
        p.append("norm_before_fc true: vLLM's deepseek_eagle3.py has no input_norm and would skip it")
    return p
