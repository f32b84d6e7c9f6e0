"""The MLA EAGLE-3 draft layer ([train] draft_arch = "mla"): the layer vLLM 0.32 serves as
`Eagle3DeepseekV3ForCausalLM` (vllm/model_executor/models/deepseek_eagle3.py), trained by speculators'
unchanged `Eagle3DraftModel` (its TTT loop, DynamicCache and masks).

speculators 0.9.0 picks the draft's decoder layer from `model_definitions.model_classes`, keyed by the
decoder config's model_type; it knows llama and qwen3. `register()` adds "deepseek_v3": transformers'
DeepseekV3DecoderLayer (MLA attention, dense MLP for layer 0) with the EAGLE-3 first-layer changes vLLM's
`DeepseekV2Eagle3DecoderLayer` makes:
- attention reads cat(input_layernorm(embeds), hidden_norm(g)), 2 x hidden wide: q_a_proj (or q_proj when
  q_lora_rank is None) and kv_a_proj_with_mqa take 2 x hidden inputs (vLLM's `input_size`);
- the residual is g, or hidden_norm(g) with norm_before_residual (speculators' Eagle3FirstLayerMixin
  computes exactly this split, so its forward is reused);
- q_a_layernorm and kv_a_layernorm use the config's rms_norm_eps (vLLM: RMSNorm(..., eps=rms_norm_eps);
  transformers builds them with its 1e-6 default).
What transformers computes equals vLLM's MLA (checked in tests/test_mla_draft.py against our own plain
reading of the export, models/reference_mla.py): RoPE on the last qk_rope_head_dim of each head with
interleaved pairs (transformers `rope_interleave=True` == vLLM `is_neox_style=False`), the shared k_pe,
softmax scale qk_head_dim ** -0.5 (under a yarn [train] rope_scaling the rotation is yarn's and the scale
times mscale(factor, mscale_all_dim) ** 2, transformers' yarn_apply_mscale == vLLM's deepseek_yarn), key
width nope + rope (192 for Kimi) and value width v_head_dim (128): sdpa and flex take different key and
value widths.
"""

from __future__ import annotations

from typing import Any

import torch

MODEL_TYPE = "deepseek_v3"  # the decoder config's model_type; vLLM detects it as MLA (is_deepseek_mla)


def _first_layer_class() -> type:
    from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):  # type: ignore
        """DeepseekV3DecoderLayer whose attention reads 2 x hidden (cat of embeds and g)."""

        def __init__(self, config: Any, layer_idx: int, norm_before_residual: bool = False):
            super().__init__(config, layer_idx)
            H, attn = config.hidden_size, self.self_attn
            self.norm_before_residual = norm_before_residual
            self.hidden_norm = DeepseekV3RMSNorm(H, eps=config.rms_norm_eps)
            if config.q_lora_rank is None:
                attn.q_proj = torch.nn.Linear(2 * H, attn.num_heads * attn.qk_head_dim, bias=False)
            else:
                attn.q_a_proj = torch.nn.Linear(2 * H, config.q_lora_rank, bias=False)
                attn.q_a_layernorm.variance_epsilon = config.rms_norm_eps
            attn.kv_a_proj_with_mqa = torch.nn.Linear(
                2 * H, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
            )
            attn.kv_a_layernorm.variance_epsilon = config.rms_norm_eps

    return DeepseekV3DecoderEagle3FirstLayer


def register() -> None:
    """Make speculators' Eagle3DraftModel build the MLA layer for a deepseek_v3 decoder config (once)."""
    from speculators.models.base_components import ModelComponents
    from speculators.models.eagle3.model_definitions import model_classes
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
        DeepseekV3RotaryEmbedding,
    )

    if MODEL_TYPE not in model_classes:
        model_classes[MODEL_TYPE] = ModelComponents(
            _first_layer_class(), DeepseekV3DecoderLayer, DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding
        )


def mla_decoder_config(spec: Any, attn_impl: str, shared: dict[str, Any]) -> Any:
    """A one-layer DeepseekV3Config of the draft spec's MLA dims; layer 0 dense (first_k_dense_replace).
    `shared`: the fields every draft layer takes (draft.layer_fields)."""
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(
        **shared,
        num_key_value_heads=spec.num_attention_heads,
        q_lora_rank=spec.q_lora_rank or None,
        kv_lora_rank=spec.kv_lora_rank,
        qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        v_head_dim=spec.v_head_dim,
        first_k_dense_replace=1,  # layer 0 keeps the dense MLP (vLLM: "Always use MLP (not MoE)")
        rope_interleave=True,  # vLLM's deepseek_v2 MLA: get_rope(..., is_neox_style=False)
    )
    cfg._attn_implementation = attn_impl
    return cfg


def kv_bytes_per_token(kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """One MLA layer's cache per token: the latent and the shared RoPE key (vLLM's MLAAttentionSpec);
    1,152 B in bf16 for Kimi-K2.5's 512 + 64."""
    return (kv_lora_rank + qk_rope_head_dim) * dtype_bytes
