"""Stage 04's interval log: one line per `log_every` steps with fixed keys (step, loss, acc0, lr, gradient
norm, tok/s, eta), the same record appended to train_log.jsonl on rank 0 and sent to the trackers."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.training import trackers
from eagle3_pipeline.training.distributed import all_reduce_sums
from eagle3_pipeline.training.train_metrics import summarize

log = logging.getLogger("eagle3.train")


@dataclass
class Meter:
    """What one logging interval has seen so far: its start, tokens and metric sums."""

    start_step: int
    t0: float = field(default_factory=time.time)
    tokens: int = 0
    sums: dict[str, float] = field(default_factory=dict)


def log_interval(loop: Any, step: int, epoch: int, grad_norm: float, meter: Meter) -> None:
    """One greppable line per interval (and train_log.jsonl on rank 0, the trackers): the interval's
    metrics over all ranks. `loop` is train.TrainLoop (its recipe, plan, dist, scheduler, tracker)."""
    m = summarize(all_reduce_sums(meter.sums, loop.dist, loop.device), loop.recipe.depths)
    elapsed = time.time() - meter.t0
    line = {
        "step": step,
        "epoch": epoch,
        "loss": m["loss"],
        "acc0": m["acc_0"],
        "lr": loop.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "tok_per_s": meter.tokens / max(elapsed, 1e-9),
    }
    log.info(
        "step %d/%d | loss %.4f | acc0 %.3f | lr %.2e | gnorm %.2f | tok/s %.0f | eta %.0fs",
        step,
        loop.plan.total_steps,
        m["loss"],
        m["acc_0"],
        line["lr"],
        grad_norm,
        line["tok_per_s"],
        elapsed / max(1, step - meter.start_step) * (loop.plan.total_steps - step),
    )
    if loop.dist.rank == 0:
        storage.append_text(Path(loop.cfg.out_dir) / "train_log.jsonl", json.dumps(line) + "\n")
    loop.tracker.log(trackers.prefixed("train", {k: v for k, v in line.items() if k != "step"}), step)
    meter.sums = {}
