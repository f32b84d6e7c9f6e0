"""One writer per output folder: an flock on a hidden sibling `.<name>.lock` naming its holder. Taken
through core/output.py (`StageOutput.lock`), the owner of an output's life."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from eagle3_pipeline.core.errors import UserError, unwritable

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
    """The lock of an output folder: a hidden sibling, since StageOutput.publish and --overwrite swap the
    folder."""
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
    fd = None
    try:
        fd = _open_locked(path, out_dir)
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
        try:  # (again: a refused writer may have removed it)
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file where a folder goes, a read-only filesystem, no permission
            raise unwritable(out_dir, e) from None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder removed by a refused writer since: made again
            continue
        except OSError as e:
            raise unwritable(out_dir, e) from None
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
