"""Which attention, loss and compile the draft trains with, resolved in one place for the device.

speculators 0.9.0 has three attention paths for Eagle3DraftModel (models/eagle3/core.py):
`simple_flex_attention` (its default: a block-sparse BlockMask extended by one diagonal block per TTT
step, models/eagle3/attention.py), `sdpa` (a dense boolean mask from flex's `create_mask`, widened by
a [T, T] diagonal block per TTT step) and `eager` (a dense bf16 additive mask, `create_float_mask`).
Its losses come fused (Triton kernels, losses/fused.py, imported lazily by losses/utils.py) or eager
(losses/eager.py, which materialises [T, V] fp32 softmaxes). Its trainer defaults to flex + fused
(train/config/schema.py) and `conditional_torch_compile` (models/utils.py) compiles
Eagle3DraftModel.forward at import whenever CUDA is available.

`auto` here: flex + fused + compile on CUDA (fused only where Triton imports; flex only becomes a fused
kernel when compiled), sdpa + eager + no compile on CPU, where flex has no backward ("FlexAttention does
not support backward on CPU", torch/nn/attention/flex_attention.py) and the CPU behaviour stays bit for
bit what it was.

Two facts the packed batches of this project need (they vary in length, speculators' own collate pads
every batch to one fixed length, train/data.py CollateFn):
- flex: `extend_mask_for_draft_tokens` appends kv block `kv_blocks + i` for query block i, which is
  the diagonal only when T is a multiple of the 128-token block; otherwise TTT steps >= 1 silently drop
  part of each token's own diagonal (tests/test_kernels.py measures it). Rows are padded to a multiple
  of FLEX_BLOCK with document id -1 (padding attends to itself only, nothing attends to it, loss mask 0).
- compile: every new row length is a new graph (or a dynamic-shape graph that flex's block-mask
  building breaks anyway, `extend_mask_for_draft_tokens` is `torch.compiler.disable`d), so with compile
  on, rows are padded up to the smallest of a few length buckets: at most len(buckets) shapes per run,
  at most a quarter of a batch padded (greedy packing fills most rows close to batch_tokens).
Padding leaves the loss and the metrics' counts unchanged (align_for_step masks by loss_mask; padding's
loss mask is 0), up to float summation order.

Long rows (models/linear_memory.py): attn_impl `blockwise` (no [T, T] mask, scores per query chunk) and
loss_impl `chunked` (no [T, draft vocab] logits kept for backward) run linear_memory.ttt_forward, the same
TTT loop outside speculators' forward, which is therefore never compiled: `auto` turns compile off for
them and `on` is refused. `auto` keeps sdpa + eager on CPU: benchmarks/long_memory.py measures both.
"""

from __future__ import annotations

import importlib.util
import math
import types
from dataclasses import asdict, dataclass
from typing import Any

import torch

from eagle3_pipeline.training.config import ATTN_IMPLS  # the flag's choices, owned there
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.linear_memory import ATTN_CHUNK, BLOCKWISE_ATTN

FLEX_BLOCK = 128  # torch's _DEFAULT_SPARSE_BLOCK_SIZE, the Q and KV block of create_block_mask
NUM_BUCKETS = 4  # compile on: rows padded to batch_tokens * k/4 (k = 1..4), rounded up to FLEX_BLOCK
# speculators' name for flex in the decoder config (ALL_ATTENTION_FUNCTIONS, models/attention.py)
HF_ATTN_NAMES = {
    "flex": "simple_flex_attention", "sdpa": "sdpa", "eager": "eager", "blockwise": BLOCKWISE_ATTN,
}  # fmt: skip


@dataclass(frozen=True)
class Kernels:
    """The resolved choice; `to_json` is what meta.json records under "kernels"."""

    attn_impl: str  # flex | sdpa | eager | blockwise
    loss_impl: str  # fused | eager | chunked
    compile: bool
    pad_multiple: int = 1  # rows padded to a multiple of this (1: never padded)
    length_buckets: tuple[int, ...] = ()  # compile: rows padded up to the smallest bucket that holds them
    # a windowed draft ([train] sliding_window): its per-step window is linear_memory.ttt_forward's mask
    windowed: bool = False

    @property
    def linear_memory(self) -> bool:
        """Whether the forward is linear_memory.ttt_forward (blockwise attention, the chunked loss, or a
        windowed draft, whose window speculators' forward counts from the wrong position)."""
        return self.attn_impl == "blockwise" or self.loss_impl == "chunked" or self.windowed

    @property
    def hf_attn_impl(self) -> str:
        return HF_ATTN_NAMES[self.attn_impl]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["length_buckets"] = list(self.length_buckets)
        if not self.windowed:  # recorded as runs before windows were
            del d["windowed"]
        return d


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def attention_impl(attn_impl: str, cuda: bool) -> str:
    """The attention `attn_impl` trains with: auto is flex on CUDA (compiled, the fused kernel), sdpa
    elsewhere (FlexAttention has no backward on CPU)."""
    return attn_impl if attn_impl != "auto" else ("flex" if cuda else "sdpa")


def resolve(
    attn_impl: str,
    loss_impl: str,
    compile: str,
    device: torch.device,
    max_row_tokens: int,
    needs_backward: bool = True,
    windowed: bool = False,
) -> Kernels:
    """The implementations for `device` of the [train] settings (TrainConfig has checked their names);
    `max_row_tokens` bounds a packed row (buckets for compile). Refuses what this device cannot run."""
    cuda = device.type == "cuda"
    # a windowed draft's auto: blockwise, whose chunks skip the keys out of reach (constant cost per token)
    attn = "blockwise" if windowed and attn_impl == "auto" else attention_impl(attn_impl, cuda)
    if attn == "flex" and not cuda and needs_backward:
        raise UserError(
            "attn_impl flex: torch's FlexAttention has no backward on CPU; use sdpa (or auto) to train here"
        )
    loss = loss_impl if loss_impl != "auto" else ("fused" if cuda and triton_available() else "eager")
    if loss == "fused" and not (cuda and triton_available()):
        raise UserError(
            "loss_impl fused: speculators' fused losses are Triton kernels and need CUDA and Triton"
        )
    if windowed and attn == "flex":
        raise UserError(
            "sliding_window with attn_impl flex: a windowed draft trains through linear_memory.ttt_forward "
            "(vLLM's window per TTT step), which runs flex uncompiled; use attn_impl blockwise or sdpa"
        )
    linear = attn == "blockwise" or loss == "chunked" or windowed
    if linear and compile == "on":
        raise UserError(
            f"compile on: attn_impl {attn} / loss_impl {loss} train through linear_memory.ttt_forward, "
            "which is not compiled; use compile auto or off"
        )
    compiled = compile == "on" or (compile == "auto" and cuda and not linear)
    if attn == "flex" and cuda and not compiled:
        # uncompiled, flex_attention runs torch's reference path, which materialises the [H, T, KV] scores
        # (fp32: 256 GiB at the Kimi row); speculators gets the fused kernel from compiling the forward
        raise UserError("attn_impl flex needs compile on (auto) on CUDA; with compile off use sdpa")
    buckets: tuple[int, ...] = ()
    if compiled:
        top = _round_up(max_row_tokens, FLEX_BLOCK)
        buckets = tuple(
            sorted({_round_up(top * k // NUM_BUCKETS, FLEX_BLOCK) for k in range(1, NUM_BUCKETS + 1)})
        )
    pad = FLEX_BLOCK if attn == "flex" or compiled else 1
    return Kernels(attn, loss, compiled, pad, buckets, windowed)


def loss_config(k: Kernels, spec: str = "kl_div") -> dict[str, Any]:
    """speculators' loss_config (losses/utils.py resolve_loss_config) for the recipe's loss `spec` in this
    device's implementation: a speculators loss name or JSON weights such as '{"kl_div": 0.5, "ce": 0.5}'."""
    from speculators.losses.utils import resolve_loss_config

    # chunked: speculators' eager per-position losses, called per chunk by linear_memory.chunked_step_loss
    impl = "eager" if k.loss_impl == "chunked" else k.loss_impl
    return resolve_loss_config(spec, impl)  # fused kernels are imported on first call


def padded_length(n: int, k: Kernels) -> int:
    """The row length a packed row of n tokens is padded to (n itself when nothing asks for padding)."""
    for b in k.length_buckets:
        if n <= b:
            return b
    return _round_up(n, k.pad_multiple)


def pad_batch(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A packed batch (pack() keys) padded on the right to `length`: document id -1, loss mask 0."""
    n = batch["input_ids"].shape[1]
    if length == n:
        return batch
    if length < n:
        raise ValueError(f"cannot pad a row of {n} tokens to {length}")
    fill = {"document_ids": -1}
    out = {}
    for key, v in batch.items():
        pad = v.new_full((v.shape[0], length - n, *v.shape[2:]), fill.get(key, 0))
        out[key] = torch.cat([v, pad], dim=1)
    return out


def set_eager(model: Any) -> None:
    """Bind the draft's uncompiled forward on this instance (see set_compile): what export's gate runs, on
    CPU tensors even on a CUDA machine, where speculators' import-time compile would build inductor CPU
    graphs for each sample length."""
    cls_forward = type(model).forward
    model.forward = types.MethodType(getattr(cls_forward, "_torchdynamo_orig_callable", cls_forward), model)


def set_compile(model: Any, k: Kernels) -> None:
    """Bind the draft's forward on this instance: torch.compile'd (static shapes, one graph per length
    bucket) or plain. speculators compiles Eagle3DraftModel.forward at import when CUDA is present
    (conditional_torch_compile, dynamic shapes by default); the uncompiled function is kept by dynamo
    as `_torchdynamo_orig_callable`, so `off` really is eager on CUDA too."""
    set_eager(model)
    if not k.compile:
        return
    bound = model.forward
    # two graphs per bucket (grad and no_grad for validation) must fit dynamo's recompile limit
    limit = max(torch._dynamo.config.recompile_limit, 2 * len(k.length_buckets) + 2)
    torch._dynamo.config.recompile_limit = limit
    model.forward = torch.compile(bound, dynamic=False)


def attention_extra_bytes(
    attn_impl: str, batch_tokens: int, ttt_steps: int, num_heads: int, dtype_bytes: int,
    sdpa_math: bool = False,
) -> int:  # fmt: skip
    """Peak bytes one forward+backward of the draft holds for attention beyond q/k/v/output (which
    every implementation keeps), at a packed row of T = batch_tokens tokens and ttt_steps TTT steps:
    the sum of `attention_extra_terms` (which says where each term comes from)."""
    terms = attention_extra_terms(attn_impl, batch_tokens, ttt_steps, num_heads, dtype_bytes, sdpa_math)
    return sum(terms.values())


def attention_extra_terms(
    attn_impl: str, batch_tokens: int, ttt_steps: int, num_heads: int, dtype_bytes: int,
    sdpa_math: bool = False,
) -> dict[str, int]:  # fmt: skip
    """attention_extra_bytes by term. From speculators 0.9.0 models/eagle3/core.py: the mask is built
    over [T, T] and widened by a [T, T] diagonal block after every step (also after the last), so step s
    attends over KV = T * (s + 1); old masks die when the next one replaces them.

    - sdpa, "masks": boolean masks (flex's create_mask, 1 byte); while the last widening runs, the
      [T, T*ttt] and [T, T*(ttt+1)] masks are both alive: T^2 (2 ttt + 1).
      "saved_for_backward": SDPA turns a boolean mask into an additive one in the query dtype before
      its kernel, and the kernel keeps it for backward: sum_s T^2 (s + 1) dtype_bytes. `sdpa_math`: SDPA's
      math fallback, taken on CPU when key and value widths differ (the MLA draft: nope + rope != v_head_dim;
      no fused CPU kernel takes them), keeps the probabilities [H, T, KV] instead: sum_s H T^2 (s + 1)
      dtype_bytes (measured, tests/test_mla_draft.py).
    - eager, "masks": bf16 additive masks (create_float_mask's default dtype, 2 bytes), 2 T^2 (2 ttt + 1).
      "saved_for_backward": per step the fp32 softmax output [H, T, KV] and its compute-dtype copy
      that multiplies V (transformers eager_attention_forward): sum_s H T^2 (s + 1) (4 + dtype_bytes).
    - blockwise (linear_memory.py), "masks": one query chunk's boolean mask over its keys at the last
      step, at most ATTN_CHUNK (T + ttt ATTN_CHUNK), transient; "saved_for_backward": nothing (each chunk
      is recomputed in backward).
    - flex, "masks": create_block_mask builds the dense [T, T] boolean mask and a padded copy before
      reducing them to blocks (2 T^2, transient) and keeps int32 block indices [T/128, KV/128] for
      partial and full blocks. "saved_for_backward": a fp32 logsumexp [H, T] per step.
    """
    _check(attn_impl, ATTN_IMPLS[1:], "attn_impl")
    t = batch_tokens
    steps_kv = ttt_steps * (ttt_steps + 1) // 2  # sum over the steps of KV / T
    if attn_impl == "sdpa":
        kept = (num_heads if sdpa_math else 1) * t * t * steps_kv * dtype_bytes
        return {"masks": t * t * (2 * ttt_steps + 1), "saved_for_backward": kept}
    if attn_impl == "eager":
        return {
            "masks": 2 * t * t * (2 * ttt_steps + 1),
            "saved_for_backward": num_heads * t * t * steps_kv * (4 + dtype_bytes),
        }
    if attn_impl == "blockwise":
        chunk = min(ATTN_CHUNK, t)
        return {"masks": chunk * (t + ttt_steps * chunk), "saved_for_backward": 0}
    q_blocks = math.ceil(t / FLEX_BLOCK)
    index_bytes = 2 * 4 * q_blocks * q_blocks * (ttt_steps + 1)
    return {"masks": 2 * t * t + index_bytes, "saved_for_backward": ttt_steps * num_heads * t * 4}


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _check(value: str, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise UserError(f"{name} {value!r}: use one of {', '.join(allowed)}")
