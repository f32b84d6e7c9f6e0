"""Files that count only when complete: temp name, fsync, rename; meta.json; checksums; versions. The
life of an output folder (lock, skip, resume, publish) is core/output.py's.

A crash (SIGKILL, full disk, lost ssh) leaves at worst a `*.tmp*` file or folder, which readers ignore
and the next run deletes. `COMPLETE` markers are written last, so a folder without one is unfinished.
A full disk (ENOSPC, or EDQUOT on a quota) at any write here is a UserError naming the file, the bytes
it needed and the space left; the half-written temp file is removed first.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import platform
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import DiskFull, UserError

COMPLETE_MARKER = "COMPLETE"
META_NAME = "meta.json"
TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# How the libraries report it: safetensors (Rust) "I/O error: No space left on device (os error 28)";
# torch.save a RuntimeError "unexpected pos" whose __context__ is the OSError (measured on a full tmpfs).
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def _is_disk_full(e: BaseException, folder: Path) -> bool:
    seen: BaseException | None = e
    while seen is not None:  # the exception and what it was raised from or during
        if isinstance(seen, OSError) and seen.errno in DISK_FULL_ERRNOS:
            return True
        if any(t in str(seen) for t in DISK_FULL_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return free_bytes(folder) == 0  # a writer that reports it some other way
    except OSError:
        return False


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def describe_bytes(n: int) -> str:
    """'8.21 MB (8,212,480 bytes)': readable and exact."""
    return f"{format_bytes(n)} ({n:,} bytes)"


@contextlib.contextmanager
def disk_full_is_user_error(path: Path, tmp: Path | None, bytes_needed: int) -> Iterator[None]:
    """A full disk while writing `tmp` (to become `path`): remove `tmp`, raise a UserError saying so."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unless it is a full disk
        if not _is_disk_full(e, path.parent):
            raise
        errno_ = next((x.errno for x in (e, e.__context__) if isinstance(x, OSError)), errno.ENOSPC)
        with contextlib.suppress(OSError):
            if tmp is not None:
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        raise DiskFull(
            f"{path}: disk full ({os.strerror(errno_)}) writing {describe_bytes(bytes_needed)}; "
            f"{describe_bytes(free_bytes(path.parent))} free on that filesystem. "
            "Free space and rerun the same command: it resumes, and nothing half-written counts"
        ) from None


def _write_tmp(tmp: Path, writer: Callable[[Path], None]) -> None:
    """Every file this module writes is written here (`writer(tmp)`), then fsynced: one place to fail."""
    writer(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())


def _replace(tmp: Path, path: Path, bytes_needed: int) -> None:
    with disk_full_is_user_error(path, tmp, bytes_needed):  # a directory fsync can also hit a full disk
        os.replace(tmp, path)
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with disk_full_is_user_error(path, tmp, len(data)):
        _write_tmp(tmp, lambda t: t.write_bytes(data))
    _replace(tmp, path, len(data))


def append_text(path: Path, text: str) -> None:
    """Append to a log (train_log.jsonl); a full disk is the same UserError as for any other write."""
    with disk_full_is_user_error(path, None, len(text.encode())):
        with open(path, "a") as f:
            f.write(text)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside a nested dict/list (what torch.save will write, give or take headers)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def _torch_save_to(obj: Any, path: Path) -> None:
    """torch.save through a Python file, so a full disk surfaces as the OSError behind its RuntimeError."""
    import torch

    with open(path, "wb") as f:
        torch.save(obj, f)


def torch_save_atomic(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    need = tensor_bytes(obj)
    with disk_full_is_user_error(path, tmp, need):
        _write_tmp(tmp, lambda t: _torch_save_to(obj, t))
    _replace(tmp, path, need)


def write_json_atomic(path: Path, obj: Any) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{path}: not valid JSON ({e}); the folder is corrupt, rerun the stage that wrote it"
        ) from None


def sha256_file(path: Path, chunk_bytes: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def save_safetensors_atomic(
    tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None
) -> str:
    """Write a safetensors file under a temp name, rename it, and return its sha256."""
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + TMP_SUFFIX)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    need = tensor_bytes(tensors)
    with disk_full_is_user_error(path, tmp, need):
        _write_tmp(tmp, lambda t: save_file(tensors, str(t), metadata=metadata))
    digest = sha256_file(tmp)
    _replace(tmp, path, need)
    return digest


def sha256_tensors(tensors: dict[str, Any]) -> str:
    """sha256 over the raw bytes of tensors (name order), as they lie in a safetensors file."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode() + b"\0")
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def is_complete(folder: Path) -> bool:
    """Whether `folder` is a finished output (its COMPLETE marker, written last, is there)."""
    return (folder / COMPLETE_MARKER).is_file()


def clear_tmp(folder: Path) -> None:
    """Delete leftovers of an interrupted write (`*.tmp` files and folders)."""
    for p in folder.glob(f"*{TMP_SUFFIX}*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def versions() -> dict[str, str]:
    """Library versions recorded in every meta.json."""
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in ("torch", "transformers", "safetensors", "speculators", "datasets"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing optional package is recorded as absent
            out[name] = "absent"
    import eagle3_pipeline

    out["eagle3_pipeline"] = eagle3_pipeline.__version__
    return out


def record_path(target: Path | str, folder: Path) -> str:
    """How a meta.json in `folder` records a path: relative to `folder`, so a run copied or moved whole
    (cp -r) reads its own copy's verifier, shards and mapping, never the original's."""
    return os.path.relpath(os.path.abspath(target), os.path.abspath(folder))


def recorded_path(value: str, folder: Path, written_in: str | None = None) -> Path:
    """A path that a meta.json in `folder` recorded (record_path), as a path to open: joined with `folder`;
    an absolute one (older meta.json files, written before paths were relative) stays as it is. Where the
    file also records the folder it was `written_in` (WRITTEN_IN) and the path is not there beside it (the
    folder was copied alone: an export to a serving host), it is joined with that folder instead."""
    here = os.path.normpath(os.path.join(os.path.abspath(folder), value))
    if written_in and not os.path.exists(here):
        there = os.path.normpath(os.path.join(written_in, value))
        if os.path.exists(there):
            return Path(there)
    return Path(here)


WRITTEN_IN = "written_in"  # the folder a training run's or an export's meta was written in (recorded_path)
