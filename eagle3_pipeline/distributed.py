"""torchrun plumbing for training: ranks, devices, summed metrics, and a stop signal all ranks agree on."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

log = logging.getLogger("eagle3.train")
T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed() -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: NCCL on GPUs, gloo on CPU."""
    d = Dist(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    else:
        device = torch.device("cpu")
    if d.enabled and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return d, device


def rank_slice(items: list[T], dist: Dist) -> list[T]:
    """This rank's share (every world-th item); a rank left empty repeats the first so none hangs."""
    return items[dist.rank :: dist.world] or items[:1]


def all_reduce_sums(sums: dict[str, float], dist: Dist, device: torch.device) -> dict[str, float]:
    if not dist.enabled:
        return sums
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits.
    A second signal stops at once (the last complete checkpoint still counts)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("signal %d: finishing this step, then saving a checkpoint (again to stop now)", signum)

    def agreed(self, dist: Dist, device: torch.device) -> bool:
        """Whether any rank was signalled: all ranks must stop at the same step or the barrier hangs."""
        if not dist.enabled:
            return self.signum is not None
        flag = torch.tensor([0 if self.signum is None else self.signum], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())
