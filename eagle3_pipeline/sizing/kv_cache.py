"""KV-cache bytes per token of the draft beside the verifier's, as vLLM serves them.

The draft's cache comes out of the same GPU memory as the verifier's, so every byte it takes per token is
a token of batch x context the verifier cannot hold. `kv_cache_report` is the one place that computes it
(plan.build puts it in the plan and its JSON; plan.render prints it):
  draft     1 decoder layer x 2 (k and v) x num_key_value_heads x head_dim x dtype bytes (the draft spec);
            an MLA draft (draft_arch "mla") 1 x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, every rank
  verifier  from its config.json: MLA (kv_lora_rank set: DeepSeek-V3, Kimi-K2.5) caches one latent per
            layer, num_hidden_layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes; plain attention
            caches num_hidden_layers x 2 x num_key_value_heads x head_dim x dtype bytes.
Per GPU under tensor parallelism, plain attention (the draft too: vLLM's llama_eagle3.py builds it from
LlamaAttention) shards its KV heads over the ranks, max(1, kv_heads // tp) each (llama.py LlamaAttention:
heads are replicated when there are fewer than ranks); the MLA latent has no head axis, so every rank
caches all of it (vLLM's MLAAttentionSpec: one head of kv_lora_rank + qk_rope_head_dim). Under
data-parallel attention (--data-parallel-size with expert parallelism, the other way Kimi-K2.5 is served)
each rank runs every head for its own requests: the full bytes of both (for Kimi-K2.5 the draft adds 47%).
"""

from __future__ import annotations

from typing import Any

from eagle3_pipeline.models.draft import DraftSpec
from eagle3_pipeline.models.mla_draft import kv_bytes_per_token

KV_DTYPE_BYTES = 2  # vLLM's --kv-cache-dtype auto: the activation dtype, bf16 for Kimi-K2.5 and its draft
DRAFT_LAYERS = 1  # an EAGLE-3 draft has one decoder layer (draft.py)


def _sharded_heads(kv_heads: int, tp: int) -> int:
    return max(1, kv_heads // tp)


def draft_kv(spec: DraftSpec, tp: int, dtype_bytes: int = KV_DTYPE_BYTES) -> dict[str, Any]:
    """The draft's bytes per token: on one rank holding all heads, and per rank under TP `tp`. An MLA
    draft (deepseek_eagle3.py) caches one latent per token on every rank, as the verifier's MLA layers."""
    if spec.draft_arch == "mla":
        full = DRAFT_LAYERS * kv_bytes_per_token(spec.kv_lora_rank, spec.qk_rope_head_dim, dtype_bytes)
        return {"attention": "mla", "layers": DRAFT_LAYERS, "kv_lora_rank": spec.kv_lora_rank,
                "qk_rope_head_dim": spec.qk_rope_head_dim, "full": full, "per_tp_rank": full}  # fmt: skip
    per_head = DRAFT_LAYERS * 2 * spec.head_dim * dtype_bytes
    return {
        "attention": "mha",
        "layers": DRAFT_LAYERS,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "full": spec.num_key_value_heads * per_head,
        "per_tp_rank": _sharded_heads(spec.num_key_value_heads, tp) * per_head,
    }


def verifier_kv(text: dict[str, Any], tp: int, dtype_bytes: int = KV_DTYPE_BYTES) -> dict[str, Any]:
    """The verifier's bytes per token from its (text) config.json, full and per rank under TP `tp`."""
    layers = int(text["num_hidden_layers"])
    if text.get("kv_lora_rank"):
        latent, rope = int(text["kv_lora_rank"]), int(text["qk_rope_head_dim"])
        full = layers * kv_bytes_per_token(latent, rope, dtype_bytes)
        return {"attention": "mla", "layers": layers, "kv_lora_rank": latent, "qk_rope_head_dim": rope,
                "full": full, "per_tp_rank": full}  # fmt: skip
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    per_head = layers * 2 * head_dim * dtype_bytes
    return {"attention": "mha", "layers": layers, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "full": kv_heads * per_head, "per_tp_rank": _sharded_heads(kv_heads, tp) * per_head}  # fmt: skip


def kv_cache_report(spec: DraftSpec, text: dict[str, Any], tp: int) -> dict[str, Any]:
    """Both caches per token and the draft's share of the verifier's, under TP `tp` (per rank) and under
    data-parallel attention. `tokens_kept`: the tokens a rank's KV memory holds with the draft, per token
    it holds without (what the draft costs the batch size)."""
    draft, verifier = draft_kv(spec, tp), verifier_kv(text, tp)

    def layout(key: str) -> dict[str, Any]:
        share = draft[key] / verifier[key]
        return {"draft": draft[key], "verifier": verifier[key], "share": share,
                "tokens_kept": 1 / (1 + share)}  # fmt: skip

    return {
        "dtype_bytes": KV_DTYPE_BYTES,
        "tensor_parallel_size": tp,
        "draft": draft,
        "verifier": verifier,
        "tp": layout("per_tp_rank"),
        "dp_attention": layout("full"),
    }


def render_lines(kv: dict[str, Any]) -> list[str]:
    """The plan's two lines: the formulas with their numbers, then the two serving layouts."""
    d, v, tp, b = kv["draft"], kv["verifier"], kv["tensor_parallel_size"], kv["dtype_bytes"]
    if v["attention"] == "mla":
        latent = f"({v['kv_lora_rank']} + {v['qk_rope_head_dim']})"
        v_formula = f"{v['layers']} layers x {latent} x {b} B, MLA latent"
        v_tp = "the MLA latent on every rank"
    else:
        heads = f"{v['num_key_value_heads']} kv heads x {v['head_dim']}"
        v_formula = f"{v['layers']} layers x 2 x {heads} x {b} B"
        v_tp = "kv heads sharded"
    if d["attention"] == "mla":
        latent = f"({d['kv_lora_rank']} + {d['qk_rope_head_dim']})"
        d_formula = f"{d['layers']} layer x {latent} x {b} B, MLA latent"
    else:
        d_formula = f"{d['layers']} layer x 2 x {d['num_key_value_heads']} kv heads x {d['head_dim']} x {b} B"
    t, dp = kv["tp"], kv["dp_attention"]
    return [
        f"kv cache      per token: verifier {v['full']:,} B ({v_formula}) | draft {d['full']:,} B "
        f"({d_formula})",
        f"              TP{tp}: draft {t['draft']:,} B/rank vs verifier {t['verifier']:,} B/rank ({v_tp}) "
        f"= +{t['share']:.1%} | DP attention: draft {dp['draft']:,} B vs {dp['verifier']:,} B = "
        f"+{dp['share']:.1%} | tokens a rank's KV memory holds: x{t['tokens_kept']:.2f} (TP{tp}), "
        f"x{dp['tokens_kept']:.2f} (DP attention)",
    ]
