"""Resumable outputs written in parts: stage 00's regenerated rows and stage 01's shards.

An output folder holds the settings it was started with (run.json, pinned by core/output.py's
`StageOutput.in_place`: a resume with other settings is refused naming them), one file per finished part
(a killed run resumes at the first missing one), and, once every part is there, the joined output,
rejects.jsonl, meta.json and COMPLETE. Every input row is written or rejected: `check_every_row` refuses
to finish otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import storage

REJECTS_FILE = "rejects.jsonl"  # one {"row", "reason"} per rejected input row

Block = tuple[int, int]  # input rows [start, end) of one part


def blocks(start: int, end: int, rows_per_part: int) -> list[Block]:
    """Rows [start, end) in parts of rows_per_part (the last one shorter)."""
    return [(b, min(b + rows_per_part, end)) for b in range(start, end, rows_per_part)]


def todo(out_dir: Path, parts: list[Block], done_name: Callable[[int], str]) -> list[tuple[int, Block]]:
    """(n, block) of the parts whose file `done_name(n)` is not in out_dir yet."""
    return [(n, b) for n, b in enumerate(parts) if not (out_dir / done_name(n)).exists()]


def check_every_row(out_dir: Path, written: int, rejected: int, num_rows: int) -> None:
    """Every input row is written or rejected; anything else is a bug, never a silent loss."""
    if written + rejected != num_rows:
        raise RuntimeError(f"{out_dir}: {written} written + {rejected} rejected != {num_rows} rows")


def write_rejects(out_dir: Path, rejects: list[dict[str, Any]]) -> None:
    storage.write_bytes_atomic(
        out_dir / REJECTS_FILE, "".join(json.dumps(r) + "\n" for r in rejects).encode()
    )
