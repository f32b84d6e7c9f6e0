#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run calls this script): extra arguments go to pytest.
#   bash scripts/test.sh                  # everything, the vLLM tier included (bash scripts/setup_vllm_cpu.sh first)
#   bash scripts/test.sh -k resume       # a subset
# Two pytest-xdist workers, by the work units tests/conftest.py names (pytest_xdist_make_scheduler): a file per
# unit (a file's module fixtures, some of them whole tiny runs, are built once), and the vLLM tier's files in
# two units, scheduled first (the longest), then the slowest files. Each worker's torch (its own and its stage
# subprocesses') and vLLM engines keep to their share of the cores (tests/conftest.py: xdist_worker_env), so
# the tier runs beside the other files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m pytest -q -rfEs -n 2 --dist loadscope --no-loadscope-reorder "$@" tests
