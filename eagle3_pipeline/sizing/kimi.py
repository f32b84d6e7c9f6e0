"""Kimi-K2.5's text config (moonshotai/Kimi-K2.5 config.json `text_config`, contract section 6): what a
config-only verifier folder holds for `--plan` and the serving cost model when the checkpoint is not at
hand. DeepSeek-V3 MLA + MoE; routed experts INT4 with group 32 (compressed-tensors); yarn RoPE."""

from __future__ import annotations

from typing import Any

KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 64, "vocab_size": 163840, "rms_norm_eps": 1e-5,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "rope_theta": 50000, "tie_word_embeddings": False,
    "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}},
    "rope_scaling": {"type": "yarn", "factor": 64, "original_max_position_embeddings": 4096},
}  # fmt: skip
