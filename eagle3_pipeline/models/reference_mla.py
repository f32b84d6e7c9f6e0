"""An exported MLA draft read and run the way vLLM 0.32 runs `Eagle3DeepseekV2ForCausalLM`
(vllm/model_executor/models/deepseek_eagle3.py + deepseek_v2.py DeepseekV2MLAAttention), in plain
PyTorch, not from the training classes; `read_export` picks the reading vLLM picks by `architectures`.

Differences from the llama reading (reference_draft.py), as vLLM computes them:
- attention input x = cat(input_layernorm(embeds), hidden_norm(g)) [T, 2H]; queries from q_b_proj(
  q_a_layernorm(q_a_proj x)) (or q_proj x when q_lora_rank is null), split per head into nope | rope;
- kv_a_proj_with_mqa x = latent | k_pe; the latent through kv_a_layernorm then kv_b_proj gives per-head
  k_nope | v; k_pe (one, shared by all heads) and q's rope part rotated with interleaved pairs (x[2i],
  x[2i+1]): get_rope(..., is_neox_style=False), from rope_theta and the yarn scaling if any (frequencies
  and cos/sin factor as the llama reading);
- softmax scale (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, under yarn times mscale(factor,
  mscale_all_dim) ** 2 (deepseek_v2.py's "deepseek_yarn"); o_proj over heads x v_head_dim;
- no input_norm before fc (deepseek_eagle3.py applies fc_norm only), every other norm flag as llama's;
- every RMSNorm with the config's rms_norm_eps, q_a_layernorm and kv_a_layernorm included.
The cache keeps per-head keys and values (what attention sees); vLLM keeps the latent, the same maths.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_pipeline.core import rope_scaling
from eagle3_pipeline.models.reference_draft import KVCache, ReferenceDraft, _rms_norm, cos_sin

# vLLM's registry: both names load deepseek_eagle3.Eagle3DeepseekV2ForCausalLM
MLA_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style rotary embedding on [..., T, d]: pair (x[2i], x[2i+1]) turned by its angle (cos and
    sin [T, d // 2]; plain RoPE: pos x theta^(-2i/d))."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


class MlaReferenceDraft(ReferenceDraft):
    """fc -> one EAGLE-3 MLA decoder layer (dense MLP) -> norm -> lm_head, float32 copies of the export."""

    def __init__(self, export_dir: Path, embed_tokens: torch.Tensor):
        super().__init__(export_dir, embed_tokens)
        self.norm_before_fc = False  # deepseek_eagle3.py builds no input_norm

    def _load_attention(self, w: dict[str, torch.Tensor], layer: str) -> None:
        c, a = self.config, layer + "self_attn."
        self.nope, self.rope_dim = int(c.get("qk_nope_head_dim", 0)), int(c.get("qk_rope_head_dim", 0))
        self.v_dim, self.latent = int(c.get("v_head_dim", 0)), int(c.get("kv_lora_rank", 0))
        if c.get("q_lora_rank"):
            self.wq_a, self.n_q_a = w[a + "q_a_proj.weight"], w[a + "q_a_layernorm.weight"]
            self.wq_b = w[a + "q_b_proj.weight"]
        else:
            self.wq_a = None
            self.wq = w[a + "q_proj.weight"]
        self.wkv_a, self.n_kv_a = w[a + "kv_a_proj_with_mqa.weight"], w[a + "kv_a_layernorm.weight"]
        self.wkv_b, self.wo = w[a + "kv_b_proj.weight"], w[a + "o_proj.weight"]

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.wq_a is None:
            return x @ self.wq.T
        return _rms_norm(x @ self.wq_a.T, self.n_q_a, self.eps) @ self.wq_b.T

    def _attention(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, KVCache]:
        T, H = x.shape[0], self.heads
        q = self._queries(x).view(T, H, self.nope + self.rope_dim).transpose(0, 1)
        cos, sin = cos_sin(positions, self.rope_dim, self.rope_theta, self.rope_scaling)
        q = torch.cat([q[..., : self.nope], rope_interleaved(q[..., self.nope :], cos, sin)], dim=-1)
        past = 0 if cache is None else cache.k.shape[1]
        new = self._keys_values(x, positions)
        new = new if cache is None else cache.then(new)
        k, v = new.k, new.v
        scale = (self.nope + self.rope_dim) ** -0.5 * rope_scaling.mla_softmax_factor(self.rope_scaling)
        scores = (q @ k.transpose(1, 2)) * scale
        allowed = torch.ones(T, past + T, dtype=torch.bool).tril(diagonal=past)
        scores = scores.masked_fill(~allowed, float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, H * self.v_dim) @ self.wo.T
        return a, new

    def _keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> KVCache:
        """Per-head keys (k_nope | the shared rotated k_pe) and values [heads, T, .] of new slots x."""
        T, H = x.shape[0], self.heads
        cos, sin = cos_sin(positions, self.rope_dim, self.rope_theta, self.rope_scaling)
        kv_a = x @ self.wkv_a.T
        latent = _rms_norm(kv_a[:, : self.latent], self.n_kv_a, self.eps)
        k_pe = rope_interleaved(kv_a[:, self.latent :], cos, sin)  # [T, rope], shared by the heads
        kv = (latent @ self.wkv_b.T).view(T, H, self.nope + self.v_dim).transpose(0, 1)
        k = torch.cat([kv[..., : self.nope], k_pe.expand(H, T, self.rope_dim)], dim=-1)
        return KVCache(k, kv[..., self.nope :])


def read_export(export_dir: Path, embed_tokens: torch.Tensor) -> ReferenceDraft:
    """The export as vLLM reads it: the MLA reading for an Eagle3DeepseekV2/V3 architecture, else llama's."""
    import json

    arch = (json.loads((export_dir / "config.json").read_text()).get("architectures") or ["?"])[0]
    cls = MlaReferenceDraft if arch in MLA_DRAFT_ARCHITECTURES else ReferenceDraft
    return cls(export_dir, embed_tokens)
