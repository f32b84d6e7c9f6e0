"""Stage 05's read-back: the export read as vLLM reads it (reference_mla.read_export: the MLA or the llama
layer) must reproduce the trained draft's logits on stored samples, a scaled draft's also at positions
past its original length (export_rope.long_positions). Called by export.gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import rope_scaling
from eagle3_pipeline.data.packing import pack
from eagle3_pipeline.data.vocab import draft_to_target
from eagle3_pipeline.export_eval import export_window as window
from eagle3_pipeline.export_eval.export_rope import long_positions
from eagle3_pipeline.models.draft import rope_parameters_of
from eagle3_pipeline.models.reference_draft import ReferenceDraft
from eagle3_pipeline.models.reference_mla import read_export
from eagle3_pipeline.training import parallel

# Read-back tolerance. The export is bf16 (contract section 2) and training keeps fp32 weights, so logits
# differ by bf16 rounding (relative 2^-8 per weight). Measured on the tiny smoke draft: top-1 agreement
# 1.0 and normalised mean error ~0.003; a missing head_dim, missing d2t or wrong layer gives agreement
# far below. Thresholds leave room for near-ties flipping under rounding.
MIN_TOP1_AGREEMENT = 0.98
MAX_NORMALISED_ERROR = 0.05


def _sequential_pairs(
    ref: ReferenceDraft, model: Any, b: dict[str, torch.Tensor], ttt_steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(trained, read back) logits of one packed sample: TTT step 0 at every slot, step 1 at a few."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    try:
        with torch.no_grad():
            if not window.run_windowed(model, b, min(2, ttt_steps)):  # a windowed draft: export_window.py
                model(hidden_states=b["hidden_states"], input_ids=b["input_ids"], ttt_steps=min(2, ttt_steps),
                      document_ids=b["document_ids"], position_ids=b["position_ids"])
    finally:
        hook.remove()
    T = b["input_ids"].shape[1]
    out0, logits0, cache = ref.first_pass(b["hidden_states"][0], b["input_ids"][0], b["position_ids"][0])
    pairs = [(captured[0][0], logits0)]
    if len(captured) > 1 and T > 2:  # step 1 at a few slots: chain on top of the first pass
        slots = torch.linspace(0, T - 2, steps=min(8, T - 1)).long().unique()
        got = []
        for t in slots.tolist():
            _, lg, _ = ref.step(
                out0[t : t + 1],
                b["input_ids"][0, t + 1 : t + 2],
                b["position_ids"][0, t : t + 1] + 1,
                cache.truncate(t + 1),
            )
            got.append(lg[0])
        pairs.append((captured[1][0][slots], torch.stack(got)))
    return pairs


def _parallel_pairs(
    ref: ReferenceDraft, model: Any, b: dict[str, torch.Tensor], k: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(trained, read back) logits of one packed sample for a parallel draft: every slot's first draft,
    and the masked slots' drafts 2..k after a few slots (the training forward's rollouts)."""
    T = b["input_ids"].shape[1]
    _, logits0, cache = ref.first_pass(b["hidden_states"][0], b["input_ids"][0], b["position_ids"][0])
    slots = torch.linspace(0, max(T - k, 0), steps=min(8, T)).long().unique()
    anchor = torch.cat([torch.arange(T)] + [slots] * (k - 1))
    depth = torch.cat([torch.zeros(T, dtype=torch.long)] + [torch.full_like(slots, d) for d in range(1, k)])
    with torch.no_grad():
        trained = parallel.draft_logits(model, b, anchor, depth)[0]
    pairs = [(trained[:T], logits0)]
    if k > 1:
        got = [ref.masked_logits(cache.truncate(t + 1), int(b["position_ids"][0, t]), k)
               for t in slots.tolist()]  # fmt: skip
        pairs.append((trained[T:], torch.stack(got, dim=1).reshape(-1, trained.shape[-1])))
    return pairs


def readback_problems(
    export_dir: Path, model: Any, embed: torch.Tensor, samples: list[dict[str, torch.Tensor]], ttt_steps: int
) -> tuple[list[str], dict[str, float]]:
    """Logits of the export read as vLLM reads it (reference_mla.read_export: the MLA or the llama layer)
    vs the trained model's: TTT steps 0 and 1, or for a parallel draft (an export with mask_hidden) the
    first draft and up to 3 masked slots; with a RoPE scaling (trained or exported) each sample also at
    positions spread past its original length (export_rope.long_positions)."""
    ref = read_export(export_dir, embed)
    agree = total = 0
    err_sum = scale_sum = 0.0
    non_finite = {"trained draft's": 0, "read-back": 0}  # NaN logits argmax alike on both sides: counted
    scalings = [ref.rope_scaling, rope_scaling.of_verifier({"rope_parameters": rope_parameters_of(model)})]
    packed = [pack([s], max_seq_len=10**9) for s in samples]
    for b in packed + [far for b in packed for far in long_positions(b, scalings)]:
        if ref.parallel:
            pairs = _parallel_pairs(ref, model, b, min(4, b["input_ids"].shape[1]))
        else:
            pairs = _sequential_pairs(ref, model, b, ttt_steps)
        for want, have in pairs:
            non_finite["trained draft's"] += int((~torch.isfinite(want)).sum())
            non_finite["read-back"] += int((~torch.isfinite(have)).sum())
            want_t = draft_to_target(want.argmax(-1), model.d2t)
            have_t = ref.to_target(have.argmax(-1))
            agree += int((want_t == have_t).sum())
            total += want_t.numel()
            err_sum += float((want.float() - have).abs().mean()) * want_t.numel()
            scale_sum += float(want.float().std()) * want_t.numel()
    stats = {
        "top1_agreement": agree / max(total, 1),
        "normalised_error": err_sum / max(scale_sum, 1e-12),
        "positions": total,
    }
    p = []
    if any(non_finite.values()):
        p.append(
            f"logits not finite on the gate's {len(samples)} samples ({total} positions): "
            + ", ".join(f"{n} NaN/Inf values in the {side} logits" for side, n in non_finite.items())
        )
    # written so that a NaN statistic fails them (NaN compares false)
    if not stats["top1_agreement"] >= MIN_TOP1_AGREEMENT:
        p.append(
            f"read back under vLLM's rules, the export agrees with the trained draft on "
            f"{stats['top1_agreement']:.3f} of target tokens (< {MIN_TOP1_AGREEMENT})"
        )
    if not stats["normalised_error"] <= MAX_NORMALISED_ERROR:
        p.append(
            f"read-back logits differ by {stats['normalised_error']:.3f} of their spread "
            f"(> {MAX_NORMALISED_ERROR})"
        )
    return p, stats
