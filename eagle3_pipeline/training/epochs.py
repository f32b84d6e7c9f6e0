"""Which micro-batches each rank trains at each optimizer step, so that an epoch trains every sample once.

An epoch's micro-batches (packing.micro_batches: its own seeded shuffle, packed) are dealt in order over
the slots (step, micro, rank): slot (s, m, r) holds global micro-batch `(s * grad_accum + m) * world + r`,
so one optimizer step consumes `world x grad_accum` consecutive micro-batches, whatever the split between
ranks and accumulation (2 ranks x grad_accum 1 and 1 rank x grad_accum 2 train the same pairs). The epoch
has ceil(micro-batches / (world x grad_accum)) steps; the slots of the last step past the epoch's last
micro-batch are padding: a short row (PAD_POSITIONS) whose loss is multiplied by 0, so the rank still runs
its forward and backward (DDP's gradient all-reduce needs every rank at every backward) and adds nothing.

The rule that keeps the loss right: a step's gradient is the mean of the gradients of its real
micro-batches' losses (each micro-batch's loss being speculators' mean over its supervised positions),
exactly as a full step; a padding micro-batch neither counts nor weighs. DDP averages over ranks, so a
rank scales each real loss by world / real_in_step (= 1 / grad_accum in every full step, the usual DDP
accumulation). The logged loss is the mean over real micro-batches too.

`EpochCount` counts, on every rank, the samples it trained in the epoch and the packed positions that
reached the model; at the epoch's end the counts are summed over ranks and compared with the epoch's
micro-batches (count, two checksums of the sample ids, positions; a mismatch is a bug and stops the run),
and rank 0 logs one line: `train | epoch N | samples X, each once | positions P | micro-batches B (+k
padding) | ranks R x grad_accum G`.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_pipeline.training import schedule
from eagle3_pipeline.training.distributed import Dist, all_reduce_sums
from eagle3_pipeline.data.length_mix import first_window
from eagle3_pipeline.data.shards import SampleRef

log = logging.getLogger("eagle3.train")

PAD_POSITIONS = 8  # a padding micro-batch's row: a few positions, so that it costs almost nothing


@dataclass
class EpochPlan:
    """One epoch as one rank sees it: all ranks' micro-batches in order, and this rank's slots."""

    epoch: int
    batches: list[list[SampleRef]]  # the epoch's micro-batches, every rank's, in slot order
    world: int
    rank: int
    grad_accum: int

    @property
    def steps(self) -> int:
        return schedule.steps_per_epoch(len(self.batches), self.world, self.grad_accum)

    def global_index(self, step: int, micro: int, rank: int | None = None) -> int:
        """The micro-batch in slot (step of this epoch, micro, rank); past the last one: padding."""
        return (step * self.grad_accum + micro) * self.world + (self.rank if rank is None else rank)

    def is_real(self, step: int, micro: int) -> bool:
        return self.global_index(step, micro) < len(self.batches)

    def real_in_step(self, step: int) -> int:
        """Real micro-batches of a step over all ranks (world x grad_accum but in an epoch's last step)."""
        first = step * self.grad_accum * self.world
        return max(0, min(len(self.batches), first + self.grad_accum * self.world) - first)

    def loss_divisor(self, step: int) -> float:
        """What a real micro-batch's loss is divided by before backward: DDP then averages over the
        ranks, so the step's gradient is the mean over its real micro-batches (grad_accum when full)."""
        return self.real_in_step(step) / self.world

    def rank_batches(self, from_step: int) -> list[list[SampleRef]]:
        """This rank's real micro-batches from a step of the epoch to its end, in the order trained."""
        return [
            self.batches[i]
            for j in range(from_step * self.grad_accum, self.steps * self.grad_accum)
            if (i := j * self.world + self.rank) < len(self.batches)
        ]

    def batches_from(self, step: int) -> list[list[SampleRef]]:
        """Every rank's micro-batches from a step of the epoch on (what the ranks train together)."""
        return self.batches[step * self.grad_accum * self.world :]


def padding_of(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A padding micro-batch made from a real one: its first PAD_POSITIONS positions, every position
    supervised (a loss over no position could be NaN, and 0 x NaN is NaN); trained with weight 0."""
    out = {k: v[:, :PAD_POSITIONS].clone() for k, v in batch.items()}
    out["loss_mask"] = torch.ones_like(out["loss_mask"])
    return out


def _id_hashes(sample_id: str) -> tuple[int, int]:
    """Two independent 26-bit hashes of a sample id: summed over an epoch's samples they stay exact in
    float64 (2^26 x 600k < 2^53), so the sum over ranks can be compared with the epoch's."""
    h = hashlib.sha256(sample_id.encode()).digest()
    return int.from_bytes(h[:4], "little") >> 6, int.from_bytes(h[4:8], "little") >> 6


def positions_of(ref: SampleRef, max_seq_len: int) -> int:
    """Positions a sample adds to a packed row (packing.pack: cut at max_seq_len, shifted by one)."""
    n = min(ref.num_tokens, max_seq_len)
    return n - 1 if n >= 2 else 0


def _counts(batches: list[list[SampleRef]], max_seq_len: int) -> dict[str, float]:
    out = {"samples": 0.0, "windows": 0.0, "id_sum_a": 0.0, "id_sum_b": 0.0, "positions": 0.0}
    for refs in batches:
        for r in refs:
            a, b = _id_hashes(f"{r.sample_id}@{r.start}" if r.start else r.sample_id)
            first = first_window(r)  # a long sample's windows (length_mix.py) count it once
            out["samples"] += first
            out["windows"] += not first
            out["id_sum_a"] += a
            out["id_sum_b"] += b
            out["positions"] += positions_of(r, max_seq_len)
    return out


@dataclass
class EpochCount:
    """What this rank trained of an epoch (from `from_step` on: a resumed run counts from its resume)."""

    plan: EpochPlan
    from_step: int
    max_seq_len: int
    epoch_start: int = 0  # the run's global step at which this epoch began
    trained: list[list[SampleRef]] = field(default_factory=list)
    positions: int = 0  # packed positions of the real micro-batches, as they reached the model
    padding: int = 0

    def add(self, refs: list[SampleRef] | None, batch: dict[str, Any]) -> None:
        if refs is None:
            self.padding += 1
            return
        self.trained.append(refs)
        self.positions += int(batch["input_ids"].shape[1])

    def report(self, dist: Dist, device: torch.device) -> dict[str, float]:
        """Sum over ranks (a collective: every rank calls it at the epoch's end), check, log one line."""
        mine = {**_counts(self.trained, self.max_seq_len), "padding": float(self.padding)}
        mine["positions"] = float(self.positions)
        got = all_reduce_sums(mine, dist, device)
        want = _counts(self.plan.batches_from(self.from_step), self.max_seq_len)
        if any(got[k] != want[k] for k in want):
            raise RuntimeError(
                f"epoch {self.plan.epoch}: trained {got} but its micro-batches hold {want} (a bug: report it)"
            )
        resumed = f" (from step {self.from_step} of it: resumed)" if self.from_step else ""
        log.info(
            "train | epoch %d | samples %d, each once%s | positions %d | micro-batches %d (+%d padding) | "
            "ranks %d x grad_accum %d%s",
            self.plan.epoch, got["samples"], resumed, got["positions"],
            len(self.plan.batches_from(self.from_step)), got["padding"], dist.world, self.plan.grad_accum,
            f" | +{got['windows']:.0f} windows of longer samples" if got["windows"] else "",
        )  # fmt: skip
        return got
