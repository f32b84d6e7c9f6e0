"""One training forward of a parallel (P-EAGLE) draft: the k drafts of a step from one forward, as vLLM
0.32 runs `"parallel_drafting": true` (`v1/spec_decode/llm_base_proposer.py`).

What vLLM computes for a step whose last verified slot is a (slot t: the verifier's aux states at t and
the embedding of token t+1, this project's layout, models/reference_draft.py): draft 1 from slot a as in
EAGLE-3; draft d+1 (d = 1..k-1) from an extra slot at position pos(a) + d whose token is the mask token
(`mask_token_id`) and whose hidden input is `combine_hidden_states(mask_hidden)` (fc over the learned
[1, n_aux * H] buffer, after input_norm / fc_norm), attending causally to every verified slot <= a and to
the extra slots before it (`_copy_and_expand_eagle_inputs`, then one causal forward).

Training runs every such rollout of a packed row at once, in speculators' P-EAGLE layout
(speculators/models/peagle): element (anchor a, depth d) sits at position pos(a) + d, depth 0 is the real
slot a, depth d >= 1 a masked slot; it attends to depth-0 elements of its document up to a and to its own
rollout's depths <= d (speculators' `create_peagle_mask_mod`), and it is scored against the verifier's
distribution at slot a + d (what draft d+1 must equal), as Eagle3DraftModel scores TTT step d. Training
sub-samples the rollouts with speculators' COD (`generate_cod_sample_indices`: depth d keeps
max(ratio**d, ratio_min) of the candidates, each a continuation of a depth d-1 rollout, so a rollout's
earlier depths are always there); validation runs every rollout, deterministic.

Where this differs from speculators' PEagleDraftModel.forward (read there, not copied): positions are each
document's own (the batch's position_ids, as vLLM numbers a request), not the packed row's index; a
rollout that runs into the next packed document is not scored; and the metrics are the prefix ones the
trainer selects checkpoints by (full_acc_d: depths 0..d all right, an accepted prefix; cond_acc_d), not
per-depth accuracy alone.
"""

from __future__ import annotations

import types
from typing import Any

import torch


def all_rollouts(
    loss_mask: torch.Tensor, document_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, depth) of every rollout vLLM could run: depth 0 at every slot, depth d >= 1 at anchor a
    when slots a+1..a+d are in a's document and carry loss (COD with ratio 1, no randomness)."""
    n = loss_mask.shape[-1]
    lm, doc = loss_mask.reshape(-1).bool(), document_ids.reshape(-1)
    anchors, depths = [torch.arange(n)], [torch.zeros(n, dtype=torch.long)]
    chain = torch.ones(n, dtype=torch.bool)
    for d in range(1, k):
        a = torch.arange(n - d)
        ok = torch.zeros(n, dtype=torch.bool)
        ok[: n - d] = lm[a + d] & (doc[a + d] == doc[a]) & (doc[a] >= 0)
        chain = chain & ok
        sel = chain.nonzero().flatten()
        if sel.numel() == 0:
            break
        anchors.append(sel)
        depths.append(torch.full_like(sel, d))
    return torch.cat(anchors), torch.cat(depths)


def sampled_rollouts(
    loss_mask: torch.Tensor, k: int, ratio: float, ratio_min: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' COD sub-sampling (training), on the CPU: (anchor, depth). speculators 0.9.0 seeds
    depth 1 at every position with loss, position 0 included, which gives anchor -1 (a rollout from the
    row's last slot, wrapped around); those are dropped here."""
    from speculators.models.peagle.data import generate_cod_sample_indices

    anchor, depth = generate_cod_sample_indices(
        seq_length=loss_mask.shape[-1],
        loss_mask=loss_mask.reshape(1, -1).cpu(),
        num_depths=k,
        down_sample_ratio=ratio,
        down_sample_ratio_min=ratio_min,
    )
    keep = anchor >= 0
    return anchor[keep], depth[keep]


def _inputs(model: Any, b: dict[str, torch.Tensor], anchor: torch.Tensor, depth: torch.Tensor) -> Any:
    """[1, E, 2H] layer input: embedding of the real or mask token, beside fc(aux or mask_hidden)."""
    slot = anchor + depth
    real = depth == 0
    mask_id = torch.tensor(model.mask_token_id, dtype=b["input_ids"].dtype, device=slot.device)
    tokens = torch.where(real, b["input_ids"][0, slot], mask_id)
    h = b["hidden_states"][0, slot]
    h = torch.where(real[:, None], h, model.mask_hidden.reshape(1, -1).to(h.dtype))
    if model.input_norm is not None:
        h = model.input_norm(h)
    if model.fc_norm is not None:
        chunks = h.chunk(len(model.fc_norm), dim=-1)
        h = torch.cat([norm(c) for norm, c in zip(model.fc_norm, chunks)], dim=-1)
    with torch.no_grad():
        emb = model.embed_tokens(tokens)
    return torch.cat([emb.to(h.dtype), model.fc(h)], dim=-1)[None]


def draft_logits(model: Any, b: dict[str, torch.Tensor], anchor: torch.Tensor, depth: torch.Tensor) -> Any:
    """[1, E, draft vocab] logits of the elements (anchor, depth) of packed row b (on the model's device)."""
    from speculators.models.peagle.attention import create_peagle_mask_mod

    x = _inputs(model, b, anchor, depth)
    positions = (b["position_ids"][0, anchor] + depth)[None]
    doc = b["document_ids"].reshape(-1)
    E = anchor.numel()
    mask = model._create_mask_fn(
        create_peagle_mask_mod(anchor_pos=anchor, depth=depth, document_ids=doc),
        B=None, H=None, Q_LEN=E, KV_LEN=E, device=x.device,
    )  # fmt: skip
    rope = model.rotary_emb(x, positions)
    for layer in model.layers:
        x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
    return model.lm_head(model.norm(x))


def prefix_metrics(
    correct: torch.Tensor, scored: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor, n: int, k: int
) -> dict[str, torch.Tensor]:
    """full_acc_d (depths 0..d of a rollout all right) and cond_acc_d (depth d right given 0..d-1), over
    the scored elements of depth d; the keys Eagle3DraftModel reports per TTT step (summarize reads them)."""
    right = torch.zeros(n, k, dtype=torch.bool, device=correct.device)
    counted = torch.zeros(n, k, dtype=torch.bool, device=correct.device)
    right[anchor, depth] = correct
    counted[anchor, depth] = scored
    prefix = right.long().cumprod(dim=1).bool()
    out: dict[str, torch.Tensor] = {}
    for d in range(k):
        before = prefix[:, d - 1] if d else torch.ones_like(prefix[:, 0])
        c = counted[:, d]
        out[f"full_acc_{d}_sum"] = (prefix[:, d] & c).sum()
        out[f"full_acc_{d}_total"] = c.sum()
        out[f"cond_acc_{d}_sum"] = (right[:, d] & before & c).sum()
        out[f"cond_acc_{d}_total"] = (before & c).sum()
    return out


def forward(
    model: Any, b: dict[str, torch.Tensor], k: int, cod: tuple[float, float] | None, loss_config: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and metrics of one packed row (batch of 1, already on the device). cod: (ratio, ratio_min) to
    sub-sample rollouts (training), None for every rollout (validation)."""
    from speculators.losses.utils import compound_loss

    lm = b["loss_mask"]
    if cod is None:
        anchor, depth = all_rollouts(lm.cpu(), b["document_ids"].cpu(), k)
    else:
        anchor, depth = sampled_rollouts(lm, k, *cod)
    anchor, depth = anchor.to(lm.device), depth.to(lm.device)
    slot = anchor + depth
    doc = b["document_ids"].reshape(-1)
    scored = lm[0, slot].bool() & (doc[slot] == doc[anchor]) & (doc[anchor] >= 0)
    logits = getattr(model, "parallel_logits", draft_logits)(model, b, anchor, depth)
    with torch.no_grad():
        targets = model.verifier_lm_head(model.verifier_norm(b["verifier_last"][:, slot]))
    loss, terms = compound_loss(logits, targets, scored[None], depth[None], loss_config=loss_config)
    with torch.no_grad():
        correct = logits[0].argmax(-1) == targets[0].argmax(-1)
        metrics = prefix_metrics(correct, scored, anchor, depth, lm.shape[-1], k)
    metrics.update({name + "_sum": v for name, v in terms.items()})
    metrics.update({name + "_total": torch.ones((), device=lm.device) for name in terms})
    metrics["loss_sum"] = loss.detach()
    metrics["loss_total"] = torch.ones((), device=lm.device)
    return loss, metrics


def _module_forward(
    self: Any, b: dict[str, torch.Tensor], k: int, cod: tuple[float, float] | None, loss_config: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return forward(self, b, k, cod, loss_config)


def bind(model: Any, compiled: bool = False) -> None:
    """Make this instance's forward the parallel one, so calling the model (or DDP around it, whose
    gradient hooks need the call to go through it) runs `forward`. `compiled` (the resolved kernels' compile:
    on CUDA by default) torch.compiles its `draft_logits` with dynamic shapes, the element count E changing
    every step, as speculators compiles PEagleDraftModel.forward: uncompiled, flex_attention runs torch's
    reference path, which materialises the [heads, E, E] scores (kernel_policy.resolve refuses that for
    sequential drafts)."""
    model.forward = types.MethodType(_module_forward, model)
    model.parallel_logits = torch.compile(draft_logits, dynamic=True) if compiled else draft_logits
