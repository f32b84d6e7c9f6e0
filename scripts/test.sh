#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run calls this script): extra arguments go to pytest.
#   bash scripts/test.sh                  # everything, the vLLM tier included (bash scripts/setup_vllm_cpu.sh first)
#   bash scripts/test.sh -k resume       # a subset
# Two pytest-xdist workers, by the work units tests/conftest.py names (pytest_xdist_make_scheduler): a file per
# unit (a file's module fixtures, some of them whole tiny runs, are built once), and the vLLM tier's files in
# two units, scheduled first (the longest), each with one vLLM worker. One worker keeps about one of these two
# cores busy (stage subprocesses, torch's threads); each worker's vLLM engines keep to one core of their own
# (tests/conftest.py: VLLM_CPU_OMP_THREADS_BIND), so the tier runs beside the other files.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m pytest -q -rfEs -n 2 --dist loadscope --no-loadscope-reorder "$@" tests
