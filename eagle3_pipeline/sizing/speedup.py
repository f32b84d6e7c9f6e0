"""Expected decode speed of the verifier served with a draft on one node: the cost model of `--plan`.

What a user buys is tokens per second, and a draft's acceptance length (AL) alone does not decide it:
verifying k + 1 tokens per request reads more of a mixture-of-experts verifier than decoding one, and the
draft's own forwards take time. Per decode step of B requests, each with L tokens of context, on G GPUs
under tensor parallelism (how vLLM serves Kimi-K2.5 on one node):

  a forward     its time is max(bytes read from HBM / (G x bandwidth x HBM_EFFICIENCY),
                FLOPs / (G x bf16 FLOP/s x FLOPS_EFFICIENCY)) + layers x LAYER_SECONDS (kernel launches
                and the two all-reduces of each layer, which no byte count sees)
  verifier      a forward over N tokens: N = B decoding alone, B x (k + 1) verifying a draft's k. Bytes:
                its dense weights (attention, dense MLPs, shared experts, routers, lm_head; not the
                embedding, a lookup) + the routed experts the N tokens touch, E x (1 - (1 - topk / E)^N)
                of each MoE layer's E (tokens routed independently and uniformly: an assumption; real
                routing is skewed, which touches fewer) + the KV cache, B x L x its bytes per token on
                each rank (the MLA latent is on every rank: kv_cache.py). FLOPs: 2 x active parameters
                x N + attention 2 x N x L x heads x (2 x kv_lora_rank + qk_rope_head_dim) per layer (MLA
                absorbed; plain attention 4 x N x L x heads x head_dim).
  draft         sequential EAGLE-3: k forwards, the first over B x (k + 1) tokens (the verified ones),
                then B each; parallel drafting: one forward over B x 2k tokens. Each reads the draft's
                serving weights (not the embedding) and its KV cache (kv_cache.draft_kv per rank).
  speedup       AL x t(verifier, N = B) / (t(verifier, N = B(k + 1)) + t(draft)); output tokens/s =
                B x AL / (t(verifier) + t(draft)); break-even AL: the AL whose speedup is 1.

Weights are bf16 except routed experts stored quantized (`quantization_config` with config_groups:
num_bits / 8 bytes per parameter plus one bf16 scale per group_size; Kimi-K2.5: INT4, group 32,
0.5625 B). LAYER_SECONDS is a calibration, not a measurement: with it the model gives +45% output
tokens/s for Kimi-K2.5 at concurrency 16 on 8 x H200 with a k = 3 draft of AL 2.88 (the public MLA
draft's thinking-mode AL at k = 3), where a public benchmark measured +43% (vLLM 0.21, 1,024 in / 2,048
out; docs/results.md has both sources and the figures of this model). The GPUs' figures: gpus.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.sizing.gpus import GPUS, Gpu

BF16_BYTES = 2
HBM_EFFICIENCY = 0.8  # the share of the datasheet bandwidth decode kernels reach (an assumption)
FLOPS_EFFICIENCY = 0.5  # the share of dense bf16 FLOP/s small-batch GEMMs reach (an assumption)
LAYER_SECONDS = 40e-6  # per decoder layer per forward: launches + 2 all-reduces (calibrated, docstring)
BATCH_SIZES = (1, 16, 64)
DEFAULT_CONTEXT = 2048  # tokens of context per request (1,024 in + 2,048 out averages about this)


@dataclass(frozen=True)
class Model:
    """What one forward reads and computes, from a config.json (verifier) or a draft's shapes."""

    layers: int
    dense_bytes: float  # read by every forward whatever its tokens
    dense_params: float  # multiplied by every token
    moe_layers: int
    experts: int
    experts_per_token: int
    expert_bytes: float  # one routed expert of one layer
    expert_params: float
    kv_bytes_per_token: float  # per rank
    attention_flops_per_token_context: float  # per query token per context token, all layers


def _routed_bytes_per_param(text: dict[str, Any]) -> float:
    groups = (text.get("quantization_config") or {}).get("config_groups") or {}
    for group in groups.values():
        w = group.get("weights") or {}
        if w.get("num_bits"):
            scale = BF16_BYTES / w["group_size"] if w.get("group_size") else 0.0
            return w["num_bits"] / 8 + scale
    return BF16_BYTES


def _attention_params(t: dict[str, Any]) -> tuple[float, float]:
    """Parameters of one attention layer and its FLOPs per query token per context token."""
    H, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    if t.get("kv_lora_rank"):
        q_lora, kv_lora = t.get("q_lora_rank"), int(t["kv_lora_rank"])
        nope, rope, v = int(t["qk_nope_head_dim"]), int(t["qk_rope_head_dim"]), int(t["v_head_dim"])
        q = H * q_lora + q_lora * heads * (nope + rope) if q_lora else H * heads * (nope + rope)
        params = q + H * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * H
        return params, 2 * heads * (2 * kv_lora + rope)
    kv_heads = int(t.get("num_key_value_heads") or heads)
    hd = int(t.get("head_dim") or H // heads)
    return H * hd * (2 * heads + 2 * kv_heads), 4 * heads * hd


def verifier_model(text: dict[str, Any], kv_bytes_per_token: float) -> Model:
    """The verifier from its text config (DeepSeek-V3 / Kimi-K2.5 MoE fields, or a dense model)."""
    H, V, layers = int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    attn, attn_flops = _attention_params(text)
    experts = int(text.get("n_routed_experts") or 0)
    dense_layers = min(layers, int(text.get("first_k_dense_replace") or 0)) if experts else layers
    moe_layers = layers - dense_layers
    moe_inter = int(text["moe_intermediate_size"]) if experts else 0  # KeyError: the plan names it
    shared = int(text.get("n_shared_experts") or 0) * 3 * H * moe_inter + H * experts  # + router
    dense_params = layers * attn + (dense_layers * 3 * H * int(text["intermediate_size"]) if dense_layers else 0)
    dense_params += moe_layers * shared + V * H  # lm_head
    expert_params = 3 * H * moe_inter
    return Model(
        layers=layers, dense_bytes=dense_params * BF16_BYTES, dense_params=dense_params,
        moe_layers=moe_layers, experts=experts, experts_per_token=int(text.get("num_experts_per_tok") or 0),
        expert_bytes=expert_params * _routed_bytes_per_param(text), expert_params=expert_params,
        kv_bytes_per_token=kv_bytes_per_token, attention_flops_per_token_context=layers * attn_flops,
    )  # fmt: skip


def draft_model(shapes: dict[str, list[int]], kv_bytes_per_token: float, heads: int, head_dim: int) -> Model:
    """The draft as vLLM serves it: every tensor of its export (not the embedding, not the training-only
    teacher head and norm), one layer."""
    params = 0
    for name, shape in shapes.items():
        if name == "embed_tokens.weight" or name.startswith("verifier_"):
            continue
        n = 1
        for d in shape:
            n *= d
        params += n
    return Model(
        layers=1, dense_bytes=params * BF16_BYTES, dense_params=params, moe_layers=0, experts=0,
        experts_per_token=0, expert_bytes=0.0, expert_params=0.0, kv_bytes_per_token=kv_bytes_per_token,
        attention_flops_per_token_context=4 * heads * head_dim,
    )  # fmt: skip


def forward_seconds(m: Model, tokens: int, batch: int, context: int, gpu: Gpu, gpus: int) -> float:
    """One forward over `tokens` tokens of `batch` requests with `context` tokens each (docstring)."""
    touched = m.experts * (1 - (1 - m.experts_per_token / m.experts) ** tokens) if m.experts else 0.0
    weights = m.dense_bytes + m.moe_layers * touched * m.expert_bytes
    kv = batch * context * m.kv_bytes_per_token  # on each rank
    active = m.dense_params + m.moe_layers * m.experts_per_token * m.expert_params
    flops = 2 * active * tokens + tokens * context * m.attention_flops_per_token_context
    memory_s = (weights / gpus + kv) / (gpu.hbm_bytes_per_second * HBM_EFFICIENCY)
    compute_s = flops / (gpus * gpu.bf16_flops * FLOPS_EFFICIENCY)
    return max(memory_s, compute_s) + m.layers * LAYER_SECONDS


def draft_forwards(k: int, parallel: bool) -> int:
    """The draft's forwards per decode step: one with parallel drafting, k one after another without."""
    return 1 if parallel else k


def draft_seconds(d: Model, k: int, parallel: bool, batch: int, context: int, gpu: Gpu, gpus: int) -> float:
    """The draft's forwards of one step: one over B x 2k tokens (parallel) or k (sequential: the first
    over the B x (k + 1) verified tokens, the others over B)."""
    if parallel:
        return forward_seconds(d, batch * 2 * k, batch, context, gpu, gpus)
    first = forward_seconds(d, batch * (k + 1), batch, context, gpu, gpus)
    return first + (k - 1) * forward_seconds(d, batch, batch, context, gpu, gpus)


def step(
    verifier: Model, draft: Model, k: int, parallel: bool, batch: int, context: int, gpu: Gpu, gpus: int
) -> dict[str, float]:
    """Seconds of a plain decode step and of a speculative one, and the break-even AL."""
    base = forward_seconds(verifier, batch, batch, context, gpu, gpus)
    verify = forward_seconds(verifier, batch * (k + 1), batch, context, gpu, gpus)
    drafting = draft_seconds(draft, k, parallel, batch, context, gpu, gpus)
    return {"base_s": base, "verify_s": verify, "draft_s": drafting, "break_even_al": (verify + drafting) / base}


def speedup(s: dict[str, float], al: float) -> float:
    return al * s["base_s"] / (s["verify_s"] + s["draft_s"])


def report(
    verifier: Model, draft: Model, k: int, parallel: bool, gpus: int, context: int, al: float | None
) -> dict[str, Any]:
    """Per GPU kind and batch size (BATCH_SIZES): the step times, break-even AL and, given an AL, the
    expected speedup and output tokens/s."""
    out: dict[str, Any] = {"k": k, "parallel": parallel, "gpus": gpus, "context": context, "al": al,
                           "by_gpu": {}}  # fmt: skip
    for name, gpu in GPUS.items():
        rows = {}
        for b in BATCH_SIZES:
            s = step(verifier, draft, k, parallel, b, context, gpu, gpus)
            if al is not None:
                s["speedup"] = speedup(s, al)
                s["tokens_per_second"] = b * al / (s["verify_s"] + s["draft_s"])
            s["base_tokens_per_second"] = b / s["base_s"]
            rows[b] = s
        out["by_gpu"][name] = rows
    return out


def render_lines(r: dict[str, Any]) -> list[str]:
    """The plan's speedup lines: one per GPU kind."""
    how = "parallel drafting, 1 draft forward" if r["parallel"] else f"{r['k']} draft forwards"
    lines = [
        f"speedup       cost model (sizing/speedup.py), {r['gpus']} GPUs TP, k={r['k']} ({how}), context "
        f"{r['context']:,} tokens" + ("" if r["al"] is not None else "; give --plan-al for tokens/s")
    ]
    for name, rows in r["by_gpu"].items():
        cells = []
        for b, s in rows.items():
            cell = f"batch {b}: break-even AL {s['break_even_al']:.2f}"
            if r["al"] is not None:
                cell += (f", at AL {r['al']:.2f} {s['speedup']:.2f}x ({s['base_tokens_per_second']:,.0f} -> "
                         f"{s['tokens_per_second']:,.0f} tok/s)")  # fmt: skip
            cells.append(cell)
        lines.append(f"              {name}: " + " | ".join(cells))
    return lines
