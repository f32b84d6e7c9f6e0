"""A TTT training forward whose memory grows linearly with the packed row's length L.

speculators' Eagle3DraftModel.forward (models/eagle3/core.py) holds, besides the activations every
implementation keeps, a dense [L, L * (s + 1)] attention mask per TTT step s (sdpa / eager; flex's
create_block_mask builds the dense [L, L] one transiently), the verifier's [L, draft vocab] fp32 logits
for the whole forward, and per step the [L, draft vocab] fp32 tensors its loss saves for backward.
`ttt_forward` is that forward, step for step, with two pieces swapped in (each optional, so tests can
swap one at a time; kernel_policy.py picks them):

- blockwise attention (`DocumentMask` + `blockwise_attention`, the decoder config's attention
  implementation BLOCKWISE_ATTN): query chunks of ATTN_CHUNK tokens attend to the keys the TTT mask lets
  them see, built per chunk from the document ids: in step 0's keys those of the chunk's documents up to
  the chunk's end (causal, same document, padding id -1 sees only itself), in each later step's keys
  only the query's own position; a windowed draft's only the keys within its window (draft_window.py),
  so its chunks skip the rest and cost the same per query at any length. A custom autograd function
  keeps q, k, v and recomputes each chunk in backward, so neither scores nor masks outlive a chunk.
- a chunked head and loss (`chunked_step_loss`): per LOSS_CHUNK positions, the draft's logits, the
  verifier's logits and the recipe's per-position losses under torch.utils.checkpoint, so backward
  recomputes one chunk's [chunk, draft vocab] logits at a time instead of keeping them for every
  position. The losses are speculators' eager ones (any loss_config of per-position functions, the
  served-distribution wrappers of train_metrics.Recipe included), reduced as its loss_function does.
Both take one rank's slice of a row too (`RowShard`: sequence parallelism, training/sequence_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from eagle3_pipeline.models import draft_window

BLOCKWISE_ATTN = "eagle3_blockwise"  # the name registered in transformers' AttentionInterface
# Query positions per attention chunk: its transient scores are [heads, chunk, keys of its documents].
ATTN_CHUNK = 512
# Positions per loss chunk: a few [chunk, draft vocab] fp32 tensors live at a time (256 MB at 32k vocab).
LOSS_CHUNK = 2048
LOSS_REDUCTION_EPS = 1e-5  # speculators' _LOSS_REDUCTION_EPS (losses/utils.py loss_function)


@dataclass(frozen=True)
class DocumentMask:
    """The TTT attention mask of a packed row, kept as its document ids [L] (no [L, L] tensor):
    `first[i]` is the first position of position i's document (-1 padding counts as one document).
    The queries are the row's positions start..stop-1 (the whole row, or one rank's slice under sequence
    parallelism); `step0_keys` turns the queries' own step-0 keys into the row's (the identity, or an
    all-gather over the ranks: training/sequence_parallel.py)."""

    doc: torch.Tensor
    first: torch.Tensor
    start: int = 0
    stop: int | None = None
    step0_keys: Callable[[Any, torch.Tensor, torch.Tensor, int], tuple] | None = None
    window: int | None = None  # a windowed draft's (draft_window.py): keys out of reach are skipped

    @classmethod
    def of(cls, document_ids: torch.Tensor, start: int = 0, stop: int | None = None,
           step0_keys: Callable | None = None, window: int | None = None) -> DocumentMask:  # fmt: skip
        doc = document_ids.reshape(-1)
        _, inverse = torch.unique(doc, return_inverse=True)
        idx = torch.arange(doc.numel(), device=doc.device)
        first = torch.full((int(inverse.max()) + 1,), doc.numel(), dtype=idx.dtype, device=doc.device)
        first = first.scatter_reduce(0, inverse, idx, "amin")
        return cls(doc, first[inverse], start, stop, step0_keys, window)

    def chunks(self, chunk: int, steps: int = 1) -> list[tuple[int, int, int]]:
        """(start, end, first key) per query chunk at TTT step steps - 1: no key before `first key` shares
        a document with it and is within its window, so a window bounds the keys read per query."""
        n = self.doc.numel() if self.stop is None else self.stop
        starts = list(range(self.start, n, chunk))
        reach = [draft_window.first_step0_key(a, steps - 1, self.window) for a in starts]
        lows = [max(int(self.first[a : a + chunk].min()), r) for a, r in zip(starts, reach)]
        return [(a, min(a + chunk, n), min(lo, min(a + chunk, n))) for a, lo in zip(starts, lows)]

    def chunk_mask(self, a: int, b: int, lo: int, steps: int) -> torch.Tensor:
        """The boolean mask [b - a, (b - lo) + (steps - 1) * (b - a)] of queries a..b-1 over the keys
        `_chunk_keys` gathers: step 0's keys lo..b-1, then each later step's own positions a..b-1; the TTT
        mask of draft_window.ttt_mask_mod at step steps - 1."""
        n, dev = self.doc.numel(), self.doc.device
        mod = draft_window.ttt_mask_mod(self.doc, n, steps - 1, self.window)
        q = torch.arange(a, b, device=dev)
        keys = [torch.arange(lo, b, device=dev)] + [t * n + q for t in range(1, steps)]
        return torch.cat([mod(None, None, q[:, None], k[None]) for k in keys], dim=1)


def _chunk_keys(x0: torch.Tensor, rest: torch.Tensor, a: int, b: int, lo: int, start: int,
                n: int) -> list[torch.Tensor]:  # fmt: skip
    """The [.., keys, ..] slices a chunk of queries a..b-1 reads: step 0's keys lo..b-1 of the row (x0),
    then queries a..b-1 in each later step's n keys (rest, whose position 0 is the row's `start`)."""
    i, j = a - start, b - start
    return [x0[:, :, lo:b]] + [rest[:, :, s * n + i : s * n + j] for s in range(rest.shape[2] // n)]


def _chunk_attention(q: torch.Tensor, ks: list, vs: list, mask: torch.Tensor, scale: Any) -> torch.Tensor:
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _BlockwiseTTTAttention(torch.autograd.Function):
    """softmax(q k^T * scale + TTT mask) v, one query chunk at a time; backward recomputes each chunk.
    k0 / v0: step 0's keys and values of the whole row; kr / vr: the later steps' of the queries."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, kr: torch.Tensor, v0: torch.Tensor,
                vr: torch.Tensor, mask: DocumentMask, scale: Any, chunk: int) -> torch.Tensor:  # fmt: skip
        n, start = q.shape[2], mask.start
        steps = 1 + kr.shape[2] // n
        out = q.new_empty(*q.shape[:-1], v0.shape[-1])
        for a, b, lo in mask.chunks(chunk, steps):
            ks, vs = _chunk_keys(k0, kr, a, b, lo, start, n), _chunk_keys(v0, vr, a, b, lo, start, n)
            out[:, :, a - start : b - start] = _chunk_attention(
                q[:, :, a - start : b - start], ks, vs, mask.chunk_mask(a, b, lo, steps), scale
            )
        ctx.save_for_backward(q, k0, kr, v0, vr)
        ctx.mask, ctx.scale, ctx.chunk = mask, scale, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        q, k0, kr, v0, vr = ctx.saved_tensors
        n, start = q.shape[2], ctx.mask.start
        steps = 1 + kr.shape[2] // n
        grads_in = [torch.zeros_like(t) for t in (q, k0, kr, v0, vr)]
        dq, dk0, dkr, dv0, dvr = grads_in
        for a, b, lo in ctx.mask.chunks(ctx.chunk, steps):
            i, j = a - start, b - start
            with torch.enable_grad():
                qc = q[:, :, i:j].detach().requires_grad_()
                ks = [t.detach().requires_grad_() for t in _chunk_keys(k0, kr, a, b, lo, start, n)]
                vs = [t.detach().requires_grad_() for t in _chunk_keys(v0, vr, a, b, lo, start, n)]
                out = _chunk_attention(qc, ks, vs, ctx.mask.chunk_mask(a, b, lo, steps), ctx.scale)
                grads = torch.autograd.grad(out, [qc, *ks, *vs], grad_out[:, :, i:j])
            dq[:, :, i:j] = grads[0]
            for (t0, tr), parts in (((dk0, dkr), grads[1 : 1 + steps]), ((dv0, dvr), grads[1 + steps :])):
                for dst, g in zip(_chunk_keys(t0, tr, a, b, lo, start, n), parts):
                    dst += g
        return dq, dk0, dkr, dv0, dvr, None, None, None


def blockwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface (query [B, H, L, D], keys of every TTT step so far): blockwise
    under a DocumentMask; any other mask (speculators' own forward, e.g. export's gate) goes to sdpa."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if not isinstance(attention_mask, DocumentMask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if dropout:
        raise ValueError("blockwise attention has no dropout (the draft's attention_dropout is 0)")
    if query.shape[0] != 1 or key.shape[2] % query.shape[2]:
        raise ValueError(f"blockwise attention takes one packed row, got q {query.shape}, k {key.shape}")
    groups = getattr(module, "num_key_value_groups", 1)
    n = query.shape[2]
    if attention_mask.step0_keys is None:
        k0, v0 = repeat_kv(key[:, :, :n], groups), repeat_kv(value[:, :, :n], groups)
    else:
        k0, v0 = attention_mask.step0_keys(module, key[:, :, :n], value[:, :, :n], groups)
    # as sdpa does under a mask on CPU: the key/value heads repeated for the query heads
    kr, vr = repeat_kv(key[:, :, n:], groups), repeat_kv(value[:, :, n:], groups)
    out = _BlockwiseTTTAttention.apply(query, k0, kr, v0, vr, attention_mask, scaling, ATTN_CHUNK)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make BLOCKWISE_ATTN a decoder config's attention implementation (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(BLOCKWISE_ATTN, blockwise_attention)


def _chunk_losses(
    model: Any, loss_config: dict[str, Any], gamma: float, step: int,
    x: torch.Tensor, verifier_last: torch.Tensor, mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Per loss term the chunk's sum of loss * mask * decay, the draft's and the verifier's argmax."""
    logits = model.lm_head(x)
    with torch.no_grad():
        targets = model.verifier_lm_head(model.verifier_norm(verifier_last))
    sums = []
    for fn, _ in loss_config.values():
        elementwise = fn(logits, targets)
        elementwise = elementwise * mask.to(elementwise.dtype)
        decay = gamma ** torch.full(mask.shape, step, device=x.device, dtype=torch.long).to(elementwise.dtype)
        sums.append(torch.sum(elementwise * decay, dim=1))
    return torch.stack(sums), logits.detach().argmax(-1), targets.argmax(-1)


def chunked_step_loss(
    model: Any,
    head_in: torch.Tensor,
    verifier_last: torch.Tensor,
    loss_mask: torch.Tensor,
    prev_correct: torch.Tensor,
    step: int,
    gamma: float,
    loss_config: dict[str, Any],
    chunk: int = LOSS_CHUNK,
    total: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """speculators' compute_metrics for TTT step `step` (loss and metrics, prev_correct updated in place)
    from the head's input [1, n, H] and the verifier's last states, never holding [L, draft vocab].
    verifier_last and loss_mask run `step` positions ahead of head_in (align_for_step: logits i against
    targets i + step) and end where the row does; `total` sums the mask's count over the ranks that share
    the row (sequence parallelism), so each rank's loss is its share of the row's."""
    from speculators.models.metrics import compute_accuracy_single_step

    n = max(0, min(head_in.shape[1], verifier_last.shape[1] - step))
    x, last, mask = head_in[:, :n], verifier_last[:, step : step + n], loss_mask[:, step : step + n]
    correct = prev_correct[:, :n]
    run = partial(_chunk_losses, model, loss_config, gamma, step)
    parts, preds, target_ids = [], [], []
    for a in range(0, max(n, 1), chunk):  # no position left: one empty chunk, the head still in the graph
        sums, pred, tid = checkpoint(run, x[:, a : a + chunk], last[:, a : a + chunk], mask[:, a : a + chunk],
                                     use_reentrant=False)  # fmt: skip
        parts.append(sums)
        preds.append(pred)
        target_ids.append(tid)
    term_sums = torch.stack(parts).sum(0)  # [terms, 1]
    count = mask.to(term_sums.dtype).sum(dim=1)
    denominator = (count if total is None else total(count)) + LOSS_REDUCTION_EPS
    loss = torch.tensor(0.0, device=head_in.device, dtype=torch.float32)
    metrics: dict[str, torch.Tensor] = {}
    for i, (name, (_, weight)) in enumerate(loss_config.items()):
        term = (term_sums[i] / denominator).mean()
        if len(loss_config) > 1:
            metrics[f"{name}_loss_{step}_sum"] = term.detach()
            metrics[f"{name}_loss_{step}_total"] = torch.tensor(1.0, device=head_in.device)
        loss = loss + weight * term
    full, full_total, cond, cond_total = compute_accuracy_single_step(
        torch.cat(preds, dim=1), torch.cat(target_ids, dim=1), mask, correct
    )
    metrics[f"loss_{step}_sum"] = loss.detach().clone()
    metrics[f"loss_{step}_total"] = torch.tensor(1.0, device=loss.device)
    metrics[f"full_acc_{step}_sum"], metrics[f"full_acc_{step}_total"] = full, full_total
    metrics[f"cond_acc_{step}_sum"], metrics[f"cond_acc_{step}_total"] = cond, cond_total
    return loss, metrics


def _fc(model: Any, aux: torch.Tensor) -> torch.Tensor:
    """The aux states through input_norm / fc_norm and fc, as Eagle3DraftModel.forward does first."""
    if model.input_norm is not None:
        aux = model.input_norm(aux)
    if model.fc_norm is not None:
        chunks = aux.chunk(len(model.fc_norm), dim=-1)
        aux = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks, strict=True)], dim=-1)
    return model.fc(aux)


@dataclass(frozen=True)
class RowShard:
    """The slice of a packed row one rank computes under sequence parallelism (the batch ttt_forward gets
    is that slice: training/sequence_parallel.py): its first position in the row, the all-gather of the
    step-0 keys (DocumentMask.step0_keys) and the sum over the ranks of the loss's mask counts."""

    start: int
    step0_keys: Callable[[Any, torch.Tensor, torch.Tensor, int], tuple]
    total: Callable[[torch.Tensor], torch.Tensor]


def window_of(model: Any) -> int | None:
    """The draft's attention window (speculators reads it from the layer config); None: full attention."""
    return model.sliding_window if model.uses_sliding_window_attn else None


def _first_mask(model: Any, doc_ids: torch.Tensor, n: int, blockwise: bool, shard: RowShard | None) -> Any:
    """Step 0's attention mask: a DocumentMask over this rank's queries, or a dense one (speculators')."""
    if not blockwise:
        return _dense_mask(model, doc_ids, n, 0)
    start = 0 if shard is None else shard.start
    return DocumentMask.of(doc_ids, start, start + n, shard and shard.step0_keys, window_of(model))


def _dense_mask(model: Any, doc_ids: torch.Tensor, n: int, step: int, mask: Any = None) -> Any:
    """Step `step`'s mask for the draft's own kernel (flex block mask, sdpa boolean, eager float): a full
    draft's is speculators' (the last one extended); a windowed draft's is built per step, its window
    counted from each step's serving index (draft_window.py), which no extension of step 0's can say."""
    from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens

    window = window_of(model)
    if window is None:
        if step == 0:
            return model._build_attn_mask(doc_ids, n, doc_ids.device)
        return extend_dense_mask_for_draft_tokens(mask, n)
    mod = draft_window.ttt_mask_mod(doc_ids, n, step, window)
    return model._create_mask_fn(mod, B=None, H=None, Q_LEN=n, KV_LEN=n * (step + 1), device=doc_ids.device)


def _draft_step(
    model: Any, hidden_states: torch.Tensor, input_ids: torch.Tensor, mask: Any,
    position_ids: torch.Tensor, past_key_values: Any, step: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One TTT step through the decoder layers, as Eagle3DraftModel.forward: (hidden states, head input)."""
    n = hidden_states.shape[1]
    with torch.no_grad():
        input_embeds = model.embed_tokens(input_ids)
    cache_position = torch.arange(step * n, (step + 1) * n, device=hidden_states.device)
    hidden_states = torch.cat([input_embeds, hidden_states], dim=-1)
    position_embeddings = model.rotary_emb(hidden_states, position_ids)
    for layer in model.layers:
        hidden_states = layer(
            hidden_states,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            cache_position=cache_position,
            position_embeddings=position_embeddings,
        )
    if model.config.norm_output:
        hidden_states = model.norm(hidden_states)
        return hidden_states, hidden_states
    return hidden_states, model.norm(hidden_states)


def ttt_forward(
    model: Any,
    batch: dict[str, torch.Tensor],
    ttt_steps: int,
    ttt_step_loss_decay: float,
    loss_config: dict[str, Any],
    blockwise: bool,
    chunked_loss: bool,
    shard: RowShard | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Eagle3DraftModel.forward's loss and metrics over a packed batch (pack() keys), its TTT loop
    unchanged: blockwise attention where `blockwise` (the draft built with BLOCKWISE_ATTN), the chunked
    head and loss where `chunked_loss`, else speculators' dense mask and compute_metrics. With a `shard`
    (blockwise and chunked) the batch is one rank's slice of the row: hidden states and positions of its
    n positions, input ids, verifier states and loss mask running ttt_steps - 1 positions past them (to the
    row's end), the whole row's document ids."""
    from speculators.models.eagle3.metrics import compute_metrics
    from transformers import DynamicCache

    if blockwise and model._attn_impl != BLOCKWISE_ATTN:
        raise ValueError(f"blockwise attention needs a draft built with attn_impl {BLOCKWISE_ATTN!r}")
    hidden_states, input_ids = batch["hidden_states"], batch["input_ids"]
    loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    verifier_last = batch["verifier_last"]
    device, total_seq_len = hidden_states.device, hidden_states.shape[1]
    if shard is not None and not (blockwise and chunked_loss):
        raise ValueError("a row shard needs blockwise attention and the chunked loss")
    mask = _first_mask(model, batch["document_ids"].squeeze(0), total_seq_len, blockwise, shard)
    hidden_states = _fc(model, hidden_states)
    # step s reads the ids s positions ahead, 0 past the row's end
    ahead = torch.cat([input_ids.detach(), input_ids.new_zeros(1, ttt_steps)], dim=-1)
    input_ids = ahead[:, :total_seq_len]
    targets = None
    if not chunked_loss:
        with torch.no_grad():
            targets = model.verifier_lm_head(model.verifier_norm(verifier_last))
    past_key_values = DynamicCache()
    loss = torch.tensor(0.0, device=device)
    prev_correct = loss_mask.clone()
    metrics: dict[str, torch.Tensor] = {}
    for step in range(ttt_steps):
        hidden_states, head_in = _draft_step(
            model, hidden_states, input_ids, mask, position_ids, past_key_values, step
        )
        if chunked_loss:
            s_loss, s_metrics = chunked_step_loss(
                model, head_in, verifier_last, loss_mask, prev_correct, step, ttt_step_loss_decay,
                loss_config, LOSS_CHUNK, shard and shard.total,
            )
        else:
            s_loss, s_metrics = compute_metrics(
                model.lm_head(head_in), targets, loss_mask, prev_correct, step, ttt_step_loss_decay,
                loss_config=loss_config,
            )  # fmt: skip
        loss += s_loss
        metrics.update(s_metrics)
        input_ids = ahead[:, 1 + step : 1 + step + total_seq_len]
        if not blockwise:
            mask = _dense_mask(model, batch["document_ids"].squeeze(0), total_seq_len, step + 1, mask)
        position_ids = position_ids + 1
    metrics["loss_sum"] = loss.detach().clone()
    metrics["loss_total"] = torch.tensor(1.0, device=device)
    return loss, metrics


def draft_steps(model: Any, batch: dict[str, torch.Tensor], ttt_steps: int) -> list[torch.Tensor]:
    """The draft's logits [1, L, draft vocab] at each TTT step over a packed row (pack() keys: hidden
    states, input ids, document ids, positions), teacher-forced as ttt_forward trains, under its dense
    masks (a windowed draft's window per step): what the export's read-back compares against."""
    from transformers import DynamicCache

    n, doc = batch["hidden_states"].shape[1], batch["document_ids"].squeeze(0)
    ahead = torch.cat([batch["input_ids"], batch["input_ids"].new_zeros(1, ttt_steps)], dim=-1)
    hidden_states, position_ids = _fc(model, batch["hidden_states"]), batch["position_ids"]
    mask, cache, out = _dense_mask(model, doc, n, 0), DynamicCache(), []
    for step in range(ttt_steps):
        hidden_states, head_in = _draft_step(
            model, hidden_states, ahead[:, step : step + n], mask, position_ids, cache, step
        )
        out.append(model.lm_head(head_in))
        mask, position_ids = _dense_mask(model, doc, n, step + 1, mask), position_ids + 1
    return out
