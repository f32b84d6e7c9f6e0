"""Measurements behind docs/results.md, run from the repository root as modules:
`.venv/bin/python -m benchmarks.draft_quality --quick` (the package imports as in the stage scripts)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The committed JSON reports the docs quote: one folder, beside the pages that cite them.
RESULTS = REPO / "docs" / "results"
