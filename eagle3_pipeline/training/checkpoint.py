"""Training checkpoints that count only when complete, with retention of the last few and the best.

`<run>/checkpoints/step_000400/` holds model.safetensors (trainable weights only: the verifier's
tensors are reloaded from the verifier), state.pt (optimizer, scheduler, RNG states) and checkpoint.json
(step, validation metrics); it is built as `step_000400.tmp` and renamed after COMPLETE is written.
A full disk while saving is a UserError naming the file and the bytes; the unfinished `.tmp` folder is
deleted, so the latest complete checkpoint is still the one a rerun resumes from.
"""

from __future__ import annotations

import logging
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import DiskFull, UserError

log = logging.getLogger("eagle3.checkpoint")

BEST_FILE = "best.json"
DIR_NAME = "checkpoints"  # inside a training run's --out-dir


def root_of(run_dir: Path) -> Path:
    """Where a training run keeps its checkpoints."""
    return run_dir / DIR_NAME


def checkpoint_bytes(trainable: int) -> int:
    """One training checkpoint: fp32 trainable weights + AdamW's two fp32 states (state.pt)."""
    return trainable * 4 + 2 * trainable * 4


def checkpoints_disk(trainable: int, keep_last: int) -> int:
    """keep_last + the best one + the one being written."""
    return checkpoint_bytes(trainable) * (keep_last + 2)


def check_space(root: Path, keep_last: int, trainable: int) -> None:
    """Refuse to start when the checkpoints the run keeps would not fit on the run folder's disk."""
    have = sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0
    need = max(0, checkpoints_disk(trainable, keep_last) - have)  # what is kept already counts
    free = storage.free_bytes(root.parent)
    if need > free:
        raise UserError(
            f"{root}: {keep_last} + 2 checkpoints x "
            f"{storage.format_bytes(checkpoint_bytes(trainable))} (fp32 weights + AdamW states of "
            f"{trainable:,} parameters) = {storage.describe_bytes(need)} needed, "
            f"{storage.describe_bytes(free)} free; free space, lower --keep-last, or use another --out-dir"
        )


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(
        p
        for p in root.iterdir()
        if p.is_dir()
        and p.name.startswith("step_")
        and not p.name.endswith(storage.TMP_SUFFIX)
        and storage.is_complete(p)
    )


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    root: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    train_state: dict[str, Any],
    info: dict[str, Any],
    keep_last: int,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + storage.TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        storage.save_safetensors_atomic(
            {k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / "model.safetensors"
        )
        storage.torch_save_atomic(train_state, tmp / "state.pt")
        storage.write_json_atomic(tmp / "checkpoint.json", {"step": step, **info})
    except DiskFull:  # drop the unfinished checkpoint (it never counted) to free its space
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    storage.publish_dir(tmp, final)
    _update_best(root, final, info)
    _prune(root, keep_last)
    return final


def _update_best(root: Path, ckpt: Path, info: dict[str, Any]) -> None:
    score = info.get("val", {}).get("acceptance_length")
    if score is None:
        return
    best_file = root / BEST_FILE
    best = storage.read_json(best_file) if best_file.exists() else None
    if best is None or score > best["acceptance_length"] or not (root / best["checkpoint"]).exists():
        storage.write_json_atomic(best_file, {"checkpoint": ckpt.name, "acceptance_length": score})


def _prune(root: Path, keep_last: int) -> None:
    best_file = root / BEST_FILE
    best = storage.read_json(best_file)["checkpoint"] if best_file.exists() else None
    ckpts = complete_checkpoints(root)
    for p in ckpts[: max(0, len(ckpts) - keep_last)]:
        if p.name != best:
            shutil.rmtree(p)
    for p in root.glob(f"*{storage.TMP_SUFFIX}"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def latest(root: Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def resolve(root: Path, which: str) -> Path:
    """`best`, `latest` or a checkpoint folder name."""
    if which == "latest":
        p = latest(root)
    elif which == "best":
        best_file = root / BEST_FILE
        p = root / storage.read_json(best_file)["checkpoint"] if best_file.exists() else latest(root)
    else:
        p = root / which
    if p is None or not storage.is_complete(p):
        raise UserError(
            f"{root}: no complete checkpoint {which!r} (have: {[c.name for c in complete_checkpoints(root)]})"
        )
    return p


def load(
    ckpt: Path, with_state: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]]:
    from safetensors.torch import load_file

    weights = load_file(str(ckpt / "model.safetensors"))
    # to CPU: the tensors name the device they were saved from (rank 0's GPU); a resume elsewhere, or every
    # rank of a torchrun loading onto cuda:0, would fail or crowd one GPU (load_state_dict moves them after)
    state = torch.load(ckpt / "state.pt", map_location="cpu", weights_only=False) if with_state else None
    return weights, state, storage.read_json(ckpt / "checkpoint.json")


@dataclass
class Checkpointer:
    """A training run's checkpoints: when one is due, rank 0 writing it (trainable weights, optimizer,
    scheduler, RNG), keep_last and the best kept (`save`), and a full disk on rank 0 stopping every rank
    with the reason rather than leaving the others waiting."""

    root: Path
    keep_last: int
    save_every: int
    total_steps: int
    model: Any
    names: list[str]
    optimizer: Any
    scheduler: Any
    dist: Any  # distributed.Dist
    device: torch.device
    on_saved: Callable[[], None] | None = None  # rank 0, after each complete checkpoint
    facts: dict[str, Any] = field(default_factory=dict)  # recorded in each checkpoint.json (a resume checks)

    def due(self, step: int, validated: bool, stopping: bool) -> bool:
        """On the cadence, at the last step, after a validation (the best is chosen among those) and
        when the run stops on a signal."""
        return step % self.save_every == 0 or step == self.total_steps or validated or stopping

    def save(self, step: int, history: dict[str, Any], val: dict[str, float] | None) -> None:
        failure: DiskFull | None = None
        if self.dist.rank == 0:
            params = dict(self.model.named_parameters())
            train_state = {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng_state(),
            }
            info: dict[str, Any] = {**self.facts, "history": history}
            if val is not None:
                info["val"] = val
            try:
                weights = {n: params[n] for n in self.names}
                log.info("checkpoint %s", save(self.root, step, weights, train_state, info, self.keep_last))
                if self.on_saved is not None:
                    self.on_saved()
            except DiskFull as e:
                failure = e
        if self.dist.enabled:  # doubles as the barrier after the save
            failed = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
            torch.distributed.all_reduce(failed)
            if failed.item() and failure is None:
                raise UserError(f"rank 0 could not save checkpoint step {step} (disk full; see rank 0)")
        if failure is not None:
            raise failure
