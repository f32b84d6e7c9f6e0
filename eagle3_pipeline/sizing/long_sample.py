"""Peak memory of one training step on one long sample, per GPU, with sequence parallelism (`--plan`).

The trainer's linear-memory path ([train] attn_impl = "blockwise", loss_impl = "chunked",
models/linear_memory.py) keeps memory linear in the sample's length L. With `sp` sequence-parallel ranks
per sample each rank holds a contiguous slice of P = ceil(L / sp) positions and, per rank:
  states       weights, gradients, DDP buckets, AdamW and autocast copies, replicated (state_bytes)
  inputs       the packed row's slice: aux and last states as fp32 (packing's .float()), ids, mask
  activations  per TTT step and position what autograd saves in the draft layer, final norm and loss
               (layer_values: counted per tensor from autograd's saved tensors on CPU, fp32 and bf16
               autocast, at distinct widths); the fc's input copy and output once
  keys         the keys and values attention keeps for backward: per TTT step s the TTT cache's
               concatenation of the rank's own P keys of steps 0..s ((s + 1) P: an upper bound, kept whole
               where the heads are not repeated); with sp > 1 also step 0's of all L positions,
               all-gathered once per forward and shared by every step (sequence_parallel._Step0Gather);
               sp = 1 reads step 0's from its own cache: (s + 1) L per step
  transient    the larger of the chunked loss's [LOSS_CHUNK, draft vocab] tensors (LOSS_*_TENSORS
               alive at once) and the last step's attention backward: its q/k/v gradients and, where
               sdpa falls back to its math path, SCORE_TENSORS [heads, ATTN_CHUNK, keys] score tensors of
               one query chunk. On CPU that is MLA (key width nope + rope != value width: no fused kernel;
               llama's equal widths run a fused kernel that takes the boolean mask, measured: no scores).
               CUDA's memory-efficient kernel takes unequal widths too; counted anyway (an upper bound)
The sum is checked against the peak RSS of real CPU steps at small shapes (fp32, tests/test_plan_long.py);
the bf16 dtypes per tensor come from the same census under CPU autocast; not yet measured on a GPU.
"""

from __future__ import annotations

import math
from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.models.draft import DraftSpec
from eagle3_pipeline.models.linear_memory import ATTN_CHUNK, LOSS_CHUNK
from eagle3_pipeline.sizing.gpus import GPUS

LENGTHS = (32_768, 131_072, 262_144)  # the sample lengths --plan sizes
MAX_SP = 64  # sequence-parallel ranks searched: eight 8-GPU nodes per sample
RESERVE_BYTES = 8 * 10**9  # kept free per GPU: CUDA context, NCCL buffers, allocator fragmentation
# [chunk, draft vocab] tensors alive at the eager kl_div's last op (logits and teacher logits in the
# compute dtype; log-softmax, softmax, and kl_div's two products in fp32)
LOSS_COMPUTE_TENSORS, LOSS_FP32_TENSORS = 2, 5
SCORE_TENSORS = 3  # attention backward's recompute: softmax output, its gradient, the scores' gradient
ID_BYTES = 3 * 8 + 1  # input_ids, position_ids, document_ids int64 and the loss mask, per position
STATE_PARTS = ("weights", "gradients", "ddp_buckets", "adamw_states", "autocast_weight_copies")


def state_bytes(draft: dict[str, Any], gpus: int, compute_bytes: int) -> dict[str, int]:
    """What every rank keeps whatever the sample: fp32 weights (trainable and frozen) and buffers, fp32
    gradients (DDP keeps a bucket copy with more than one GPU), AdamW's two fp32 moments, and the bf16
    copies autocast caches of each matmul weight."""
    trainable = draft["trainable_parameters"]
    return {
        "weights": draft["total_parameters"] * 4 + draft["buffer_bytes"],
        "gradients": trainable * 4,
        "ddp_buckets": trainable * 4 if gpus > 1 else 0,
        "adamw_states": 2 * trainable * 4,
        "autocast_weight_copies": draft["matmul_parameters"] * 2 if compute_bytes == 2 else 0,
    }


def layer_values(spec: DraftSpec, autocast: bool) -> tuple[int, int]:
    """(fp32 values, compute-dtype values) autograd keeps per position and TTT step: the residual stream
    and norms (fp32 under autocast: the RMSNorms upcast), the RoPE'd queries and cos/sin (fp32), the MLP
    (gate, up, act, product), the attention output, and each Linear's input (autocast casts it once per
    Linear that reads it: the 2H attention input per projection, the MLP input for gate and up)."""
    H, inter = spec.hidden_size, spec.intermediate_size
    if spec.draft_arch == "mla":
        heads = spec.num_attention_heads
        rope, q_rank, kv_rank = spec.qk_rope_head_dim, spec.q_lora_rank, spec.kv_lora_rank
        fp32 = 8 * H + heads * (spec.qk_nope_head_dim + rope) + rope
        lora = 3 * q_rank + 2 * kv_rank + rope  # q_a out, its norm's in/out; kv_a's latent and k_pe
        readers = 2  # q_a_proj (or q_proj) and kv_a_proj_with_mqa
        compute = 4 * inter + heads * spec.v_head_dim + lora
    else:
        q = spec.num_attention_heads * spec.head_dim
        fp32 = 8 * H + q + 2 * spec.head_dim
        readers = 3  # q_proj, k_proj, v_proj
        compute = 4 * inter + q
    copies = (readers * 2 * H + 2 * H) if autocast else (2 * H + H)
    return fp32, compute + copies


def key_bytes(spec: DraftSpec, compute_bytes: int) -> int:
    """Bytes per key and TTT step the attention keeps: llama's RoPE'd keys and values, fp32, repeated to
    every head (repeat_kv); MLA's keys (nope + rope), values and kv_b's latent input, compute dtype."""
    heads = spec.num_attention_heads
    if spec.draft_arch == "mla":
        width = heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) + spec.kv_lora_rank
        return width * compute_bytes
    return 2 * heads * spec.head_dim * 4


def sample_bytes(spec: DraftSpec, length: int, ttt_steps: int, compute_bytes: int, sp: int = 1
                 ) -> dict[str, int]:  # fmt: skip
    """Bytes one rank holds for its slice of one sample of `length` positions (module docstring), the
    states excluded."""
    P, S, H, b = math.ceil(length / sp), ttt_steps, spec.hidden_size, compute_bytes
    n_aux, Vd = len(spec.aux_layer_ids), spec.draft_vocab_size
    fp32, compute = layer_values(spec, b == 2)
    # each step's cache of the rank's own keys; with sp > 1 step 0's of the whole row, gathered once
    keys = (length if sp > 1 else 0) + sum((s + 1) * P for s in range(S))
    heads_q = spec.num_attention_heads * (
        spec.qk_nope_head_dim + spec.qk_rope_head_dim if spec.draft_arch == "mla" else spec.head_dim
    )
    scores = 0
    if spec.draft_arch == "mla":  # the math path: unequal key and value widths (module docstring)
        chunk_keys = length + (S - 1) * ATTN_CHUNK
        scores = SCORE_TENSORS * spec.num_attention_heads * min(ATTN_CHUNK, P) * chunk_keys * b
    attention = scores + P * heads_q * 4 + (length + (S - 1) * P) * key_bytes(spec, b)  # + dq, dk, dv
    loss = min(LOSS_CHUNK, P) * Vd * (LOSS_COMPUTE_TENSORS * b + LOSS_FP32_TENSORS * 4)
    return {
        "inputs": P * ((n_aux + 1) * H * 4 + ID_BYTES),
        "activations": P * (n_aux * H * b + H * 4)  # the fc's input (cast or normed copy) and output
        + S * P * (4 * fp32 + b * compute)
        + P * H * 4 * S * (S - 1) // 2,  # the loss's shifted views of later steps
        "keys": keys * key_bytes(spec, b),
        "transient": max(loss, attention),
    }


def step_peak(spec: DraftSpec, draft: dict[str, Any], length: int, ttt_steps: int, compute_bytes: int,
              sp: int = 1, gpus: int = 1) -> dict[str, int]:  # fmt: skip
    """The peak bytes per GPU of one training step on one sample of `length` over `sp` ranks: every part
    and their "total". The one formula the plan's long-sample lines print."""
    sample = sample_bytes(spec, length, ttt_steps, compute_bytes, sp)
    parts = {**state_bytes(draft, gpus, compute_bytes), **sample}
    return {**parts, "total": sum(parts.values())}


def sequence_parallel(spec: DraftSpec, draft: dict[str, Any], length: int, ttt_steps: int,
                      compute_bytes: int, memory_bytes: int, gpus: int = 8, reserve: int = RESERVE_BYTES
                      ) -> int | None:  # fmt: skip
    """The fewest sequence-parallel ranks (1 .. MAX_SP) whose per-rank peak fits `memory_bytes` minus
    `reserve`; None when MAX_SP do not (what does not shrink with sp: the states, step 0's keys of all
    L positions and the attention's scores over them). `gpus`: GPUs per node (DDP buckets)."""
    for sp in range(1, MAX_SP + 1):
        peak = step_peak(spec, draft, length, ttt_steps, compute_bytes, sp, gpus)["total"]
        if peak <= memory_bytes - reserve:
            return sp
    return None


def largest_length(spec: DraftSpec, draft: dict[str, Any], ttt_steps: int, compute_bytes: int,
                   memory_bytes: int, gpus: int = 8, reserve: int = RESERVE_BYTES) -> int:  # fmt: skip
    """The longest sample one GPU (sp = 1) holds within `memory_bytes` minus `reserve` (0: none)."""
    def fits(n: int) -> bool:
        return step_peak(spec, draft, n, ttt_steps, compute_bytes, 1, gpus)["total"] <= memory_bytes - reserve

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def states_held(length: int, bytes_per_token: int, prefetch_batches: int, n_states: int, hidden: int
                ) -> dict[str, int]:  # fmt: skip
    """A sample's hidden states: `offline`, what its shard stores (aux + last, storage dtype); `online`,
    what one trainer holds at once streaming them (the micro-batch in training and `prefetch_batches`
    fetched ahead, each packed to fp32)."""
    online = (prefetch_batches + 1) * length * n_states * hidden * 4
    return {"offline": length * bytes_per_token, "online": online}


def report(drafts: dict[str, tuple[DraftSpec, dict[str, Any]]], ttt_steps: int, compute_bytes: int,
           gpus: int, bytes_per_token: int, prefetch_batches: int) -> dict[str, Any]:  # fmt: skip
    """Per draft (name -> spec and draft_report) and sample length in LENGTHS: the peak on one GPU and
    its parts, the sequence-parallel ranks each GPU kind needs (up to MAX_SP), the longest sample one
    GPU of each kind holds; per length the states offline and online."""
    memory = {k: g.memory_bytes for k, g in GPUS.items()}
    out: dict[str, Any] = {"lengths": list(LENGTHS), "ttt_steps": ttt_steps, "gpus": gpus, "drafts": {},
                           "compute_bytes": compute_bytes, "reserve_bytes": RESERVE_BYTES,
                           "gpu_memory": memory}
    for name, (spec, draft) in drafts.items():
        at = {
            str(n): {
                "one_gpu": step_peak(spec, draft, n, ttt_steps, compute_bytes, 1, gpus),
                "sp": {k: sequence_parallel(spec, draft, n, ttt_steps, compute_bytes, g.memory_bytes, gpus)
                       for k, g in GPUS.items()},  # fmt: skip
            }
            for n in LENGTHS
        }
        largest = {k: largest_length(spec, draft, ttt_steps, compute_bytes, g.memory_bytes, gpus)
                   for k, g in GPUS.items()}  # fmt: skip
        out["drafts"][name] = {"lengths": at, "largest_length": largest}
    spec = next(iter(drafts.values()))[0]
    n_states = len(spec.aux_layer_ids) + 1
    out["states"] = {str(n): states_held(n, bytes_per_token, prefetch_batches, n_states, spec.hidden_size)
                     for n in LENGTHS}  # fmt: skip
    out["bytes_per_token"] = bytes_per_token
    return out


def _sp(n: int | None) -> str:
    return f"> {MAX_SP}" if n is None else str(n)


def render_lines(r: dict[str, Any]) -> list[str]:
    """The plan's long-sample lines (docs/reference.md "Long samples" says how to read them)."""
    gb = storage.format_bytes
    kinds = list(r["gpu_memory"])
    memory = ", ".join(f"{k} {gb(r['gpu_memory'][k])}" for k in kinds)
    lines = [
        f"long sample   one sample per step, linear-memory path (attn blockwise, loss chunked), "
        f"{r['ttt_steps']} TTT steps, {'bf16' if r['compute_bytes'] == 2 else 'fp32'}: peak per GPU, and "
        f"the sequence-parallel ranks a GPU needs within its memory - {gb(r['reserve_bytes'])} "
        f"({memory})"
    ]
    for name, d in r["drafts"].items():
        for n, at in d["lengths"].items():
            p = at["one_gpu"]
            sp = ", ".join(f"{k} {_sp(at['sp'][k])}" for k in kinds)
            lines.append(
                f"  {name:<6}{int(n):>8,} tokens: {gb(p['total'])} on one GPU (states "
                f"{gb(sum(p[k] for k in STATE_PARTS))}, inputs {gb(p['inputs'])}, activations "
                f"{gb(p['activations'])}, keys "
                f"{gb(p['keys'])}, transient {gb(p['transient'])}) | sp ranks: {sp}"
            )
        longest = ", ".join(f"{k} {v:,}" for k, v in d["largest_length"].items())
        lines.append(f"  {name:<6}longest sample on one GPU: {longest} tokens")
    states = " | ".join(
        f"{int(n):,}: offline {gb(s['offline'])}, online {gb(s['online'])} held"
        for n, s in r["states"].items()
    )
    lines.append(f"  states per sample ({r['bytes_per_token']:,} B/token stored; online: host memory of "
                 f"the micro-batches held at once, fp32): {states}")  # fmt: skip
    return lines
