"""Files that count only when complete: temp name, fsync, rename; meta.json; checksums; versions.

A crash (SIGKILL, full disk, lost ssh) leaves at worst a `*.tmp*` file or folder, which readers ignore
and the next run deletes. `COMPLETE` markers are written last, so a folder without one is unfinished.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UserError

COMPLETE_MARKER = "COMPLETE"
META_NAME = "meta.json"
TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


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
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = sha256_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


def mark_complete(folder: Path) -> None:
    write_bytes_atomic(folder / COMPLETE_MARKER, b"")


def clear_tmp(folder: Path) -> None:
    """Delete leftovers of an interrupted write (`*.tmp` files and folders)."""
    for p in folder.glob(f"*{TMP_SUFFIX}*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def prepare_output_dir(out_dir: Path, overwrite: bool) -> bool:
    """True when the stage should run; False (a logged skip upstream) when the output is complete.

    An incomplete folder is removed (single-file stages have nothing worth resuming); a complete one
    stays until `publish_dir` swaps the new output in.
    """
    if out_dir.exists() and is_complete(out_dir):
        return overwrite
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return True


def fresh_tmp_dir(out_dir: Path) -> Path:
    """An empty `<out_dir>.tmp` to build an output in before `publish_dir`."""
    tmp = out_dir.with_name(out_dir.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Mark `tmp_dir` complete and move it to `out_dir`, replacing an older complete copy only now."""
    mark_complete(tmp_dir)
    old = out_dir.with_name(out_dir.name + ".old" + TMP_SUFFIX)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp_dir, out_dir)
    fsync_dir(out_dir.parent)
    if old.exists():
        shutil.rmtree(old)


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
