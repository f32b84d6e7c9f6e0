"""Training checkpoints that count only when complete, with retention of the last few and the best.

`<run>/checkpoints/step_000400/` holds model.safetensors (trainable weights only: the verifier's
tensors are reloaded from the verifier), state.pt (optimizer, scheduler, RNG states) and checkpoint.json
(step, validation metrics, and the sha256 and size of the two others under "files"); it is built as
`step_000400.tmp` and renamed after COMPLETE is written. `load` checks the files against those digests: a
corrupt, truncated or unreadable file is a UserError naming it and the previous complete checkpoint.
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
from eagle3_pipeline.core.output import StageOutput

log = logging.getLogger("eagle3.checkpoint")

BEST_FILE = "best.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.pt"
INFO_FILE = "checkpoint.json"  # written last: it records the digests of the others (FILES_KEY)
FILES_KEY = "files"
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
    final = StageOutput(step_dir(root, step), overwrite=True)
    with final.building() as tmp:  # a full disk drops the unfinished checkpoint (it never counted)
        digests = {
            WEIGHTS_FILE: storage.save_safetensors_atomic(
                {k: v.detach().cpu().contiguous() for k, v in weights.items()}, tmp / WEIGHTS_FILE
            )
        }
        storage.torch_save_atomic(train_state, tmp / STATE_FILE)
        digests[STATE_FILE] = storage.sha256_file(tmp / STATE_FILE)
        files = {n: {"sha256": d, "bytes": (tmp / n).stat().st_size} for n, d in digests.items()}
        storage.write_json_atomic(tmp / INFO_FILE, {"step": step, **info, FILES_KEY: files})
    final.publish(tmp)
    _update_best(root, final.out_dir, info)
    _prune(root, keep_last)
    return final.out_dir


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


def _previous(ckpt: Path) -> Path | None:
    """The complete checkpoint saved before `ckpt`, if any."""
    before = [c for c in complete_checkpoints(ckpt.parent) if c.name < ckpt.name]
    return before[-1] if before else None


def _refuse(path: Path, problem: str) -> UserError:
    """A checkpoint file that cannot be used: named, with what is wrong and the way back."""
    ckpt = path.parent
    prev = _previous(ckpt)
    if prev is None:
        way = (f"no earlier complete checkpoint; delete it (rm -rf {ckpt}) and rerun to train from the start "
               "(or rerun 04_train.py with --overwrite)")  # fmt: skip
    else:
        way = (f"the previous complete checkpoint is {prev}: delete this one (rm -rf {ckpt}) and rerun the "
               f"same command to resume from it, or export it with 05_export.py --checkpoint {prev.name}")
    return UserError(f"{path}: {problem}; {way}")


def verify(ckpt: Path, names: tuple[str, ...] = (WEIGHTS_FILE, STATE_FILE)) -> dict[str, Any]:
    """checkpoint.json, after checking `names` against the size and sha256 it records (a file changed,
    truncated or missing since the save is refused). A checkpoint saved before the digests were recorded
    is used as it is, with a warning: refusing it would strand every run in progress, and loading it still
    catches a truncated or unreadable file (`load`)."""
    info_file = ckpt / INFO_FILE
    try:
        info = storage.read_json(info_file)
    except UserError as e:
        raise _refuse(info_file, str(e).removeprefix(f"{info_file}: ")) from None
    recorded = info.get(FILES_KEY)
    if recorded is None:
        log.warning("%s: saved without file digests (an older version): its bytes cannot be checked", ckpt)
        return info
    for name in names:
        path, want = ckpt / name, recorded.get(name)
        if want is None:
            raise _refuse(info_file, f"records no digest of {name}")
        if not path.is_file():
            raise _refuse(path, "missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise _refuse(path, f"{size:,} bytes, {want['bytes']:,} when saved (truncated or overwritten)")
        digest = storage.sha256_file(path)
        if digest != want["sha256"]:
            raise _refuse(path, f"sha256 {digest[:16]}... differs from the {want['sha256'][:16]}... "
                                f"recorded in {INFO_FILE} at the save: the file is corrupt")  # fmt: skip
    return info


def load(
    ckpt: Path, with_state: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None, dict[str, Any]]:
    """(weights, train state or None, checkpoint.json) of a checkpoint, verified first (`verify`)."""
    from safetensors.torch import load_file

    info = verify(ckpt, (WEIGHTS_FILE, STATE_FILE) if with_state else (WEIGHTS_FILE,))
    try:
        weights = load_file(str(ckpt / WEIGHTS_FILE))
    except Exception as e:  # noqa: BLE001 - any reader failure: the file, not the code
        raise _refuse(ckpt / WEIGHTS_FILE, f"unreadable ({type(e).__name__}: {e})") from None
    state = None
    if with_state:
        # to CPU: the tensors name the device they were saved from (rank 0's GPU); a resume elsewhere, or
        # every rank of a torchrun loading onto cuda:0, would fail or crowd one GPU (load_state_dict moves
        # them after)
        try:
            state = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
        except Exception as e:  # noqa: BLE001 - any reader failure: the file, not the code
            raise _refuse(ckpt / STATE_FILE, f"unreadable ({type(e).__name__}: {e})") from None
    return weights, state, info


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
