"""The life of a stage's output folder, one owner for every stage (00-06): `StageOutput`.

open: the output lock (one writer), a stale --overwrite aside refused, a complete output skipped with
one log line; then skip, resume or fresh; then publish (meta.json, the COMPLETE marker, an atomic swap).
Two flavours:
- built in `<out>.tmp`, then published by one rename (stages 02, 03, 05, checkpoints): `start_fresh`,
  `building`, `publish`; the old output is replaced only by a complete new one;
- built in place, in resumable parts (stages 00 and 01's shards, stage 04's run folder): `same_run`
  (the settings pinned, a resume with others refused), `in_place` / `open_in_place` with
  `kept` / `close_in_place` (--overwrite keeps the old output in a hidden sibling `.<name>.old-<pid>`
  until the new one is complete or has a checkpoint), `finish`.
A failed --overwrite loses nothing; a refused run writes nothing. core/storage.py keeps the atomic file
primitives this builds on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import DiskFull, UserError
from eagle3_pipeline.core.output_lock import output_lock

log = logging.getLogger("eagle3.stage")

RUN_FILE = "run.json"  # the settings a resumable output was started with; a resume must match them
UNFINISHED = "left it unfinished"  # how `same_run` names a resumable output started with other settings
# what an --overwrite in place logs: (the old one, until when it is kept, why it came back)
REPLACING = {
    "output": ("the old {out}", "the new one is complete", "the new output is unfinished: the old one"),
    "run": ("the old run", "the new run's first checkpoint", "the new run saved no checkpoint: the old run"),
}


def changed_settings(before: dict[str, Any], now: dict[str, Any], keys: Iterable[str] | None = None,
                     flags: str | None = None) -> list[str]:  # fmt: skip
    """The settings (`keys`, else every key of either) that `before` records otherwise than `now`; the
    fields under `flags` (a dict of command-line values) each named as its flag, with both values."""
    keys = sorted(set(now) | set(before)) if keys is None else list(keys)
    changed = [k for k in keys if k != flags and before.get(k) != now.get(k)]
    if flags is not None:
        old = before.get(flags, {})
        changed += [
            f"--{k.replace('_', '-')} (was {old.get(k, 'not recorded')!r}, now {v!r})"
            for k, v in now[flags].items() if k not in old or old[k] != v
        ]  # fmt: skip
    return changed


class StageOutput:
    """One output folder of one stage run, from its lock to its publication (module docstring)."""

    def __init__(self, out_dir: Path | str, overwrite: bool = False):
        self.out_dir, self.overwrite = Path(out_dir), overwrite
        self.aside: Path | None = None
        self.created = self.has_checkpoint = self.discard_partial = False
        self.what = "output"  # how --overwrite in place names the old one (REPLACING)

    # --- open ---
    def complete(self) -> bool:
        return storage.is_complete(self.out_dir)

    def wanted(self) -> bool:
        """This run has work on it: --overwrite, or not complete."""
        return self.overwrite or not self.complete()

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """This process the one writer of the folder for the block (core/output_lock.py)."""
        return output_lock(self.out_dir)

    def skip(self, asides: bool = False, why: str = "is complete", redo: str = "redo it") -> bool:
        """True (logged: the one skip line) when the output is complete and not --overwrite; with
        `asides`, a stale --overwrite aside is checked first (`check_asides`)."""
        if asides:
            self.check_asides(self.complete())
        if self.complete() and not self.overwrite:
            self.log_skip(why, redo)
            return True
        return False

    def log_skip(self, why: str = "is complete", redo: str = "redo it") -> None:
        """The line every stage logs when it has nothing to do."""
        log.info("skip: %s %s (use --overwrite to %s)", self.out_dir, why, redo)

    def check_asides(self, replaced: bool) -> None:
        """A stale --overwrite aside refused, or named once the replacement is finished (`stale_asides`)."""
        stale_asides(self.out_dir, replaced)

    # --- built in <out>.tmp, then published ---
    def start_fresh(self) -> bool:
        """True when the stage should build; False (logged: a skip) when the output is complete (a writer
        just gone finished it). An incomplete folder is removed (nothing in it is worth resuming); a
        complete one stays until `publish` swaps the new output in."""
        if self.complete():
            if not self.overwrite:
                self.log_skip()
            return self.overwrite
        if self.out_dir.exists():
            shutil.rmtree(self.out_dir)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        return True

    @contextlib.contextmanager
    def building(self) -> Iterator[Path]:
        """An empty `<out>.tmp` to build the output in; a full disk removes it (it never counted; a refused
        build stays to read, and the next build starts from an empty one)."""
        tmp = self.out_dir.with_name(self.out_dir.name + storage.TMP_SUFFIX)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        try:
            yield tmp
        except DiskFull:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def publish(self, tmp: Path, meta: dict[str, Any] | None = None) -> None:
        """Write `meta` (if given) as its meta.json, mark `tmp` complete and move it to the output folder,
        replacing an older complete copy only now."""
        if meta is not None:
            storage.write_json_atomic(tmp / storage.META_NAME, meta)
        try:
            _mark_complete(tmp)
        except DiskFull:  # the unfinished folder must not linger as if it were in progress
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = self.out_dir.with_name(self.out_dir.name + ".old" + storage.TMP_SUFFIX)
        if self.out_dir.exists():
            os.replace(self.out_dir, old)
        os.replace(tmp, self.out_dir)
        storage.fsync_dir(self.out_dir.parent)
        if old.exists():
            shutil.rmtree(old)

    # --- built in place, resumable ---
    def same_run(self, settings: dict[str, Any]) -> None:
        """A resume of the output's parts with other settings than its run.json's is refused (`same_run`)."""
        same_run(self.out_dir / RUN_FILE, settings)

    @contextlib.contextmanager
    def in_place(self, settings: dict[str, Any]) -> Iterator[bool]:
        """The output built in place in parts for the block (stages 00, 01): --overwrite moves the old one
        aside until the block leaves the new one complete, and puts it back (what the block wrote
        removed) when it does not; yields False (a logged skip) when a writer just gone finished it,
        else True with the folder ready: leftovers of an interrupted write gone, `settings` pinned."""
        self.open_in_place("output", discard_partial=False)
        try:
            if self.skip():
                yield False
                return
            storage.clear_tmp(self.out_dir)
            self.same_run(settings)
            if not (self.out_dir / RUN_FILE).exists():
                storage.write_json_atomic(self.out_dir / RUN_FILE, settings)
            yield True
        finally:
            self.close_in_place(self.complete())

    def open_in_place(
        self, what: str, meta: dict[str, Any] | None = None, discard_partial: bool = True
    ) -> None:
        """The folder to build in: an old one on --overwrite moved aside (logged), `meta` written as its
        meta.json. `discard_partial`: a folder this run created is removed when it closes unkept (a run
        folder before its first checkpoint; parts of 00 and 01 stay to resume)."""
        self.what, self.discard_partial = what, discard_partial
        if self.overwrite and self.out_dir.exists():
            self.aside = self.out_dir.with_name(f".{self.out_dir.name}.old-{os.getpid()}")
            os.replace(self.out_dir, self.aside)
            old, until, _ = REPLACING[what]
            log.info("--overwrite: %s is at %s until %s", old.format(out=self.out_dir), self.aside, until)
        self.created = not self.out_dir.exists()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if meta is not None:
            storage.write_json_atomic(self.out_dir / storage.META_NAME, meta)

    def kept(self) -> None:
        """The new output has something worth keeping (its first complete checkpoint): the old one goes."""
        self.has_checkpoint = True
        if self.aside is not None:
            shutil.rmtree(self.aside)
            self.aside = None

    def close_in_place(self, kept: bool = False) -> None:
        """Kept (complete, or a checkpoint): the old output goes; else the old one is back (logged) and a
        folder this run made is removed."""
        if kept or self.has_checkpoint:
            self.kept()
            return
        if self.out_dir.exists() and (self.aside is not None or (self.created and self.discard_partial)):
            shutil.rmtree(self.out_dir)
        if self.aside is not None:
            os.replace(self.aside, self.out_dir)
            log.warning("%s is back in %s", REPLACING[self.what][2], self.out_dir)
            self.aside = None

    def finish(self, meta: dict[str, Any]) -> None:
        """An output built in place is complete: its meta.json, then COMPLETE (written last)."""
        storage.write_json_atomic(self.out_dir / storage.META_NAME, meta)
        _mark_complete(self.out_dir)


def same_run(recorded: Path, settings: dict[str, Any], keys: Iterable[str] | None = None,
             flags: str | None = None, state: str = UNFINISHED) -> None:  # fmt: skip
    """"The same run", for every stage that resumes: a resume with other settings (`keys` of them, else
    all; `flags` see changed_settings) than the output recorded in `recorded` (its run.json, stage 04's
    meta.json) is refused naming each; reads only."""
    if not recorded.exists():
        return
    changed = changed_settings(storage.read_json(recorded), settings, keys, flags)
    if changed:
        raise UserError(
            f"{recorded}: a run with other settings ({', '.join(changed)}) {state}; an exact resume needs "
            "the same: rerun with those settings to resume, use another --out-dir, or --overwrite to start "
            "over"
        )


def stale_asides(out_dir: Path, replaced: bool) -> None:
    """The old output an --overwrite killed outright (SIGKILL, a lost node) left in its hidden sibling,
    its process gone: refused while `out_dir` holds no finished replacement, with both ways out (put it
    back, or discard it); named in a warning once the replacement is finished (`replaced`). Reads only."""
    for aside in sorted(out_dir.parent.glob(f".{out_dir.name}.old-*")):
        pid = aside.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or _running(int(pid)):
            continue
        if replaced:
            log.warning("%s: the output an interrupted --overwrite replaced, no longer needed (%s is "
                        "finished); delete it: rm -rf %s", aside, out_dir, aside)  # fmt: skip
            continue
        raise UserError(
            f"{aside}: the output an --overwrite moved aside before it was killed (pid {pid}); {out_dir} "
            f"holds nothing finished to replace it. Put it back: rm -rf {out_dir} && mv {aside} {out_dir}; "
            f"or discard it: rm -rf {aside}"
        )


def _mark_complete(folder: Path) -> None:
    storage.write_bytes_atomic(folder / storage.COMPLETE_MARKER, b"")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True
