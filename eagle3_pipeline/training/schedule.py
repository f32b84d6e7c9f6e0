"""The learning-rate schedule and the validation/checkpoint cadence, both sized from the run's length.

A fixed warm-up of N steps is a third of a 300-step run and nothing of a 30k-step one (measured in the
draft-quality issue: 100 warm-up steps of 294 cost most of the acceptance), so warm-up is a fraction
of the run unless given in steps; validations likewise default to a number per run, so that the best
checkpoint is a choice between several.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")
DEFAULT_VALIDATIONS_PER_RUN = 10  # evaluations (and checkpoints) spread over a run unless given in steps


def steps_per_epoch(micro_batches: int, world_size: int, grad_accum: int) -> int:
    """Optimizer steps per epoch on each rank: the epoch's micro-batches shared by the ranks, grad_accum of
    them per step; the last step takes the remainder (its empty slots are padding: epochs.py), so every
    micro-batch is trained once (at least one step)."""
    return max(1, math.ceil(micro_batches / (world_size * grad_accum)))


def total_steps(epoch_steps: list[int], max_steps: int | None) -> int:
    """max_steps when given (beyond what the epochs allow it keeps cycling over the data), else the steps
    of the epochs (each packs its own shuffle, so their step counts may differ by a step or two)."""
    return sum(epoch_steps) if max_steps is None else max_steps


def warmup_steps_for(total_steps: int, warmup_ratio: float, warmup_steps: int | None) -> int:
    """Explicit steps win (>= 0, as TrainConfig holds them); else the ratio of the run (at least one step
    when the ratio is positive)."""
    if warmup_steps is not None:
        return warmup_steps
    return max(1, round(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0


def lr_factor(step: int, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine or linear decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1.0 - frac
    return min_ratio + (1 - min_ratio) * shape


def every_for(total_steps: int, every: int | None, per_run: int = DEFAULT_VALIDATIONS_PER_RUN) -> int:
    """Steps between validations or checkpoints: as given (>= 1, as TrainConfig holds them), else the run
    split into `per_run` intervals."""
    if every is not None:
        return every
    return max(1, math.ceil(total_steps / per_run))
