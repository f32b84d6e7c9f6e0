"""Files that count only when complete: temp name, fsync, rename; meta.json; checksums; versions; one
writer per output folder (`output_lock`).

A crash (SIGKILL, full disk, lost ssh) leaves at worst a `*.tmp*` file or folder, which readers ignore
and the next run deletes. `COMPLETE` markers are written last, so a folder without one is unfinished.
A full disk (ENOSPC, or EDQUOT on a quota) at any write here is a UserError naming the file, the bytes
it needed and the space left; the half-written temp file is removed first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import socket
import sys
import time
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
    return (folder / COMPLETE_MARKER).is_file()


def mark_complete(folder: Path) -> None:
    write_bytes_atomic(folder / COMPLETE_MARKER, b"")


def clear_tmp(folder: Path) -> None:
    """Delete leftovers of an interrupted write (`*.tmp` files and folders)."""
    for p in folder.glob(f"*{TMP_SUFFIX}*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


def check_run_settings(run_file: Path, settings: dict[str, Any]) -> None:
    """A resume with other settings than the unfinished output's is refused naming them (its parts would
    not belong together); reads only."""
    if run_file.exists():
        before = read_json(run_file)
        if before != settings:
            changed = sorted(k for k in settings if before.get(k) != settings[k])
            raise UserError(
                f"{run_file.parent}: a run with other settings ({', '.join(changed)}) left it unfinished; "
                "rerun with those settings to resume, or --overwrite to start over"
            )


def pin_run_settings(run_file: Path, settings: dict[str, Any]) -> None:
    """The settings an unfinished resumable output was started with: written the first time, checked
    (check_run_settings) after."""
    check_run_settings(run_file, settings)
    if not run_file.exists():
        write_json_atomic(run_file, settings)


def prepare_output_dir(out_dir: Path, overwrite: bool) -> bool:
    """True when the stage should run; False (logged: a skip) when the output is complete.

    An incomplete folder is removed (single-file stages have nothing worth resuming); a complete one
    stays until `publish_dir` swaps the new output in.
    """
    if out_dir.exists() and is_complete(out_dir):
        if not overwrite:
            log_skip(out_dir)
        return overwrite
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return True


def aside_dir(out_dir: Path) -> Path:
    """Where --overwrite keeps the old output while this process makes the new one: a hidden sibling
    `.<name>.old-<pid>` (stage 00's `overwriting`, stage 04's run folder)."""
    return out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


def check_stale_asides(out_dir: Path, replaced: bool) -> None:
    """The old output an --overwrite killed outright (SIGKILL, a lost node) left in its hidden sibling,
    its process gone: refused while `out_dir` holds no finished replacement, with both ways out (put it
    back, or discard it); named in a warning once the replacement is finished (`replaced`). Reads only."""
    for aside in sorted(out_dir.parent.glob(f".{out_dir.name}.old-*")):
        pid = aside.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _running(int(pid)):
            continue
        if replaced:
            logging.getLogger("eagle3.stage").warning(
                "%s: the output an interrupted --overwrite replaced, no longer needed (%s is finished); "
                "delete it: rm -rf %s", aside, out_dir, aside)  # fmt: skip
            continue
        raise UserError(
            f"{aside}: the output an --overwrite moved aside before it was killed (pid {pid}); {out_dir} "
            f"holds nothing finished to replace it. Put it back: rm -rf {out_dir} && mv {aside} {out_dir}; "
            f"or discard it: rm -rf {aside}"
        )


@contextlib.contextmanager
def overwriting(out_dir: Path, overwrite: bool) -> Iterator[None]:
    """--overwrite of an output built in place (stage 00's parts): the old one moved to a hidden sibling
    `.<name>.old-<pid>` for the block; deleted when the block leaves the new one complete, put back (and
    what the block wrote removed) when it does not: a failed overwrite loses nothing."""
    if not (overwrite and out_dir.exists()):
        yield
        return
    aside = aside_dir(out_dir)
    os.replace(out_dir, aside)
    logging.getLogger("eagle3.stage").info("--overwrite: the old %s is at %s until the new one is complete",
                                           out_dir, aside)  # fmt: skip
    try:
        yield
    finally:
        if is_complete(out_dir):
            shutil.rmtree(aside)
        else:
            if out_dir.exists():
                shutil.rmtree(out_dir)
            os.replace(aside, out_dir)
            log = logging.getLogger("eagle3.stage")
            log.warning("the new output is unfinished: the old one is back in %s", out_dir)


def log_skip(out_dir: Path) -> None:
    """The line every stage logs when its output is complete already."""
    logging.getLogger("eagle3.stage").info("skip: %s is complete (use --overwrite to redo it)", out_dir)


def fresh_tmp_dir(out_dir: Path) -> Path:
    """An empty `<out_dir>.tmp` to build an output in before `publish_dir`."""
    tmp = out_dir.with_name(out_dir.name + TMP_SUFFIX)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_dir(tmp_dir: Path, out_dir: Path, meta: dict[str, Any] | None = None) -> None:
    """Write `meta` (if given) as its meta.json, mark `tmp_dir` complete and move it to `out_dir`,
    replacing an older complete copy only now."""
    if meta is not None:
        write_json_atomic(tmp_dir / META_NAME, meta)
    try:
        mark_complete(tmp_dir)
    except DiskFull:  # the unfinished folder must not linger as if it were in progress
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    old = out_dir.with_name(out_dir.name + ".old" + TMP_SUFFIX)
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp_dir, out_dir)
    fsync_dir(out_dir.parent)
    if old.exists():
        shutil.rmtree(old)


_HELD_LOCKS: set[int] = set()  # the descriptors of the output locks this process holds


def _close_held_in_child() -> None:
    """A forked child (stage 01's renderer, DataLoader workers) closes its copies of the lock descriptors:
    the flock is the parent's, and must go when the parent dies even if a child lingers."""
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def lock_path(out_dir: Path) -> Path:
    """The lock of an output folder: a hidden sibling, since publish_dir and --overwrite swap the folder."""
    out_dir = Path(os.path.abspath(out_dir))
    return out_dir.with_name(f".{out_dir.name}.lock")


def _holder_text(raw: bytes) -> str:
    """'pid 1234 on host h since <time> (command ...)' from a lock file's content."""
    try:
        h = json.loads(raw)
        return f"pid {h['pid']} on host {h['host']} since {h['since']} (command {h['command']})"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not recorded itself yet)"


def _read_fd(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


@contextlib.contextmanager
def output_lock(out_dir: Path) -> Iterator[None]:
    """This process is the one writer of `out_dir` for the block; another holder is a UserError naming it.

    Taken by every stage before it does any work on its output (read-only paths, --plan and a logged
    skip of a complete output, take none). An flock on `.<name>.lock` beside the folder: the kernel
    releases it when the holder dies, however it dies, so a lock file whose flock is free is stale and is
    taken over (logged, naming the dead holder recorded in it: pid, host, start, command). A clean release
    removes the file, and the folders made for it when they are still empty: a refused run leaves nothing.
    A filesystem without flock support is logged and the block runs unlocked.
    """
    path = lock_path(out_dir)
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    fd = _open_locked(path, out_dir)
    try:
        if fd is not None:
            _record_holder(fd, out_dir)
            _HELD_LOCKS.add(fd)
        yield
    finally:
        if fd is not None:
            _HELD_LOCKS.discard(fd)
            with contextlib.suppress(OSError):
                path.unlink()  # while still held: a writer that opened it meanwhile retries (_open_locked)
            os.close(fd)
        for folder in made:  # deepest first
            with contextlib.suppress(OSError):
                folder.rmdir()


def _open_locked(path: Path, out_dir: Path) -> int | None:
    """A descriptor of `path` holding its flock; None on a filesystem without locks. A file its holder
    removed between this open and the flock is not the lock any more: opened again."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)  # (again: a refused writer may have removed it)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if not _flock(fd, out_dir, path):
                os.close(fd)
                return None
            held = os.fstat(fd)
            with contextlib.suppress(FileNotFoundError):
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _flock(fd: int, out_dir: Path, path: Path) -> bool:
    """True once this process holds the lock; False on a filesystem without locks (logged)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_text(_read_fd(fd))
        raise UserError(f"{out_dir}: in use by {holder}; wait for it or stop it") from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP: a filesystem mounted without locks
        logging.getLogger("eagle3.stage").warning(
            "%s: cannot lock (%s): one writer per folder is not enforced here", path, e.strerror)  # fmt: skip
        return False
    return True


def _record_holder(fd: int, out_dir: Path) -> None:
    """Name this process in the lock file (what a refused writer prints); a previous holder's name still
    there means it died holding the lock."""
    before = _read_fd(fd)
    if before.strip():
        logging.getLogger("eagle3.stage").warning(
            "%s: taking over a stale lock: its holder, %s, is gone", out_dir, _holder_text(before)
        )
    me = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join(sys.argv)[:500],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)


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
