"""torchrun plumbing for training: ranks, devices, summed metrics, a stop signal all ranks agree on,
the run folder every node must see, and a lost rank named.

One node or several, the same command: torchrun's own rendezvous (`--rdzv-backend c10d`) makes the
process group; nothing here launches processes. What the nodes share (docs/multi_node.md): the run
folder (`--out-dir`: global rank 0 alone writes meta.json, logs and checkpoints; every rank reads the
checkpoint a rerun resumes from, so it must be the same folder on every node: `check_run_dir` stops a run
whose ranks do not all see rank 0's files there); the shards, vocab mapping, split and verifier must be
at the same paths on every node (shared, or copies), since every rank reads them itself. Local to a node:
DataLoader workers, compile caches, with online states the `--cache-dir`.

A rank that dies (its node lost, SIGKILL) breaks the next collective of every other rank at once (gloo:
the peer's connection closes); a rank that hangs is given up after `dist_timeout_s`. Either way every
other rank stops with one line naming the rank(s) lost (`lost_rank_error`), and the same command rerun
on every node resumes from the last complete checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.core.errors import UserError

log = logging.getLogger("eagle3.train")
T = TypeVar("T")


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_s: float = 0.0
    hosts: list[tuple[str, list[str]]] = field(default_factory=list)  # per rank: (host name, its IPs)
    sp: int = 1  # ranks per packed row (sequence_parallel.py): groups of consecutive ranks share a row
    seq: Any = None  # with sp > 1, this rank's sequence_parallel.SeqGroup

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def dp_rank(self) -> int:
        """Which rows this rank trains: its sequence-parallel group's index (its rank without it)."""
        return self.rank // self.sp

    @property
    def dp_world(self) -> int:
        return self.world // self.sp


DEFAULT_TIMEOUT_S = 1800.0  # torch's own default for gloo; a checkpoint save on rank 0 must fit in it


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK (one node or many: its rendezvous made the group): NCCL
    on GPUs, gloo on CPU; a collective waits at most `timeout_s` for the other ranks."""
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
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    if d.enabled:
        d.timeout_s = timeout_s
        d.hosts = [None] * d.world  # type: ignore[list-item]
        torch.distributed.all_gather_object(d.hosts, _this_host())
    return d, device


def _this_host() -> tuple[str, list[str]]:
    name = socket.gethostname()
    try:
        ips = sorted({a[4][0] for a in socket.getaddrinfo(name, None)})
    except OSError:
        ips = []
    return name, ips


@contextlib.contextmanager
def rank0_output_lock(out: StageOutput, dist: Dist) -> Iterator[None]:
    """Rank 0 the one writer of the run folder for the block (StageOutput.lock); its refusal is every
    rank's, so none waits at a collective for a rank 0 that has stopped."""
    with contextlib.ExitStack() as held:
        refused: str | None = None
        if dist.rank == 0:
            try:
                held.enter_context(out.lock())
            except UserError as e:
                refused = str(e)
        if dist.enabled:
            said = [refused]
            torch.distributed.broadcast_object_list(said, src=0)
            refused = said[0]
        if refused is not None:
            raise UserError(refused)
        yield


def check_run_dir(out_dir: Path, resume_from: Path | None, dist: Dist) -> Path | None:
    """Every rank resumes from rank 0's choice of checkpoint; a rank that does not see rank 0's files in
    `out_dir` (a folder local to each node) stops every rank with one line naming its node."""
    if not dist.enabled:
        return resume_from
    probe = [f".rank0-{uuid.uuid4().hex}" if dist.rank == 0 else None, resume_from]
    if dist.rank == 0:
        (out_dir / probe[0]).write_text("written by rank 0 to check that every rank sees this folder\n")
    torch.distributed.broadcast_object_list(probe, src=0)
    name, chosen = probe
    wanted = [out_dir / name] + ([Path(chosen) / "COMPLETE"] if chosen is not None else [])
    deadline = time.monotonic() + 10.0  # a shared filesystem's new entries may take a moment elsewhere
    while not all(p.exists() for p in wanted) and time.monotonic() < deadline:
        time.sleep(0.2)
    seen = [None] * dist.world
    torch.distributed.all_gather_object(seen, all(p.exists() for p in wanted))
    if dist.rank == 0:
        (out_dir / name).unlink()
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        where = ", ".join(f"rank {r} ({dist.hosts[r][0]})" for r in blind)
        raise UserError(
            f"--out-dir {out_dir}: {where} {'does' if len(blind) == 1 else 'do'} not see the files rank 0 "
            "writes there; the run folder must be the same folder on every node (a shared filesystem, same "
            "path): see docs/multi_node.md"
        )
    return chosen


# gloo names the peer whose connection broke: "Read error [10.0.0.2]:41523: Connection reset by peer"
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_rank_error(error: BaseException, dist: Dist, last_checkpoint: Path | None) -> UserError | None:
    """A collective that failed because another rank is gone (or silent past dist_timeout_s), as one
    line naming the rank(s) lost; None for any other error."""
    text = str(error)
    gloo = "gloo" in text or "pair closure" in text
    if not dist.enabled or not (isinstance(error, torch.distributed.DistError) or gloo):
        return None
    peer = _PEER.search(text)
    lost = _ranks_at(peer.group(1) if peer else "", dist)
    who = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}" if lost else "another rank"
    host = f" on {dist.hosts[lost[0]][0]}" if lost else ""
    # gloo's own timeout reads "Timed out waiting ..." where it expires and "Application timeout caused pair
    # closure" on every other pair it closes (either can surface first)
    timed_out = any(w in text.lower() for w in ("timed out", "application timeout"))
    why = "timed out" if timed_out else "connection lost"
    return UserError(
        f"rank {dist.rank} lost {who}{host} ({why}: its process or node is gone, or it did not answer "
        f"within dist_timeout_s {dist.timeout_s:.0f}s); every rank stops; the last complete checkpoint is "
        f"{last_checkpoint or 'none yet'}: rerun the same torchrun command on every node to resume from it"
    )


def _ranks_at(ip: str, dist: Dist) -> list[int]:
    """The other ranks whose host has this address (a loopback address: this rank's host)."""
    me = dist.hosts[dist.rank][0]
    try:
        local = ipaddress.ip_address(ip).is_loopback
    except ValueError:
        local = False
    others = [r for r in range(dist.world) if r != dist.rank]
    at = [r for r in others if ip in dist.hosts[r][1] or (local and dist.hosts[r][0] == me)]
    return at or (others if len(others) == 1 else [])


def rank_slice(items: list[T], dist: Dist) -> list[T]:
    """This rank's share (every world-th item, by data rank: a sequence-parallel group shares its rows); a
    rank left empty repeats the first so none hangs."""
    return items[dist.dp_rank :: dist.dp_world] or items[:1]


def all_reduce_sums(sums: dict[str, float], dist: Dist, device: torch.device) -> dict[str, float]:
    """The sums over the ranks, each sequence-parallel group's counted once (its first rank's: every rank
    of a group holds the row's sums)."""
    if not dist.enabled:
        return sums
    keys = sorted(sums)
    counted = 1.0 if dist.rank % dist.sp == 0 else 0.0
    t = torch.tensor([sums[k] * counted for k in keys], dtype=torch.float64, device=device)
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
