"""Why stage 04 stopped at a step whose loss or gradient norm is NaN or Inf: the step's samples (every
rank's), which of them hold non-finite states in their shards, the last complete checkpoint, what to do.
`loop` is train.TrainLoop (its cfg, dist, data, online source)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.shards import SampleRef, load_sample
from eagle3_pipeline.training import checkpoint
from eagle3_pipeline.training.epochs import EpochPlan


def step_error(
    loop: Any, step: int, ep: EpochPlan, in_epoch: int, bad_slots: list[int], grad_norm: float
) -> UserError:
    """Why step `step` (0-based) was not applied: its samples (every rank's; those of the micro-batches
    whose loss was not finite, if any), which of them hold non-finite states (read again from the
    shards), the last complete checkpoint, what to do. Stop, not skip: a skipped step would train on
    without its samples unnoticed, and a rerun meets the same NaN at the same step."""
    slots = range(loop.cfg.grad_accum * loop.dist.dp_world)
    refs = {i: slot_refs(loop, ep, in_epoch, i) for i in slots}
    named = [r for i in (bad_slots or slots) for r in refs[i]]
    last = checkpoint.latest(checkpoint.root_of(Path(loop.cfg.out_dir)))
    what = f"the loss of {len(bad_slots)} micro-batch(es)" if bad_slots else "finite loss"
    head = (
        f"step {step + 1}: NaN or Inf ({what}, gradient norm {grad_norm}): the step was not applied and "
        f"the run stops (never skipped); its samples{' of that loss' if bad_slots else ''}: "
        f"{[r.sample_id for r in named]}; the last complete checkpoint is kept: "
        f"{last if last is not None else 'none yet'}. "
    )
    if loop.online is not None:  # states asked of the servers: nothing here to read them again
        return UserError(
            head + "Look for NaN/Inf in those samples' states from the servers; with finite states "
            "the run diverged: rerun with a lower --lr or --grad-clip and --overwrite"
        )
    bad = [f"{r.sample_id!r} ({n} in {r.shard}/{r.file})" for r in named if (n := stored_non_finite(r))]
    if bad:
        return UserError(
            head + f"NaN/Inf states in sample {', '.join(bad)}: re-extract that shard (stage 01 rejects "
            "such rows), then rerun stages 02-04 with --overwrite (the samples change)"
        )
    return UserError(
        head + "Their states are finite: the run diverged; rerun with a lower --lr or --grad-clip and "
        "--overwrite or another --out-dir"
    )


def slot_refs(loop: Any, ep: EpochPlan, in_epoch: int, slot: int) -> list[SampleRef]:
    """The samples a slot (micro x world + rank) of a step of the epoch trained: its micro-batch, or
    past the epoch's last the padding micro-batch's sample (the run's first)."""
    micro, rank = divmod(slot, loop.dist.dp_world)
    i = ep.global_index(in_epoch, micro, rank)
    return ep.batches[i] if i < len(ep.batches) else loop.data.train_refs[:1]


def stored_non_finite(ref: SampleRef) -> int:
    """NaN/Inf values in a sample's stored states (aux and teacher)."""
    sample = load_sample(ref, ("aux_hidden_states", "last_hidden_state"))
    return sum(int((~torch.isfinite(t.float())).sum()) for t in sample.values())
