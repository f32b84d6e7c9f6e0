#!/usr/bin/env bash
# The test suite, as CI runs it (.ci/run calls this script): extra arguments go to pytest.
#   bash scripts/test.sh                  # everything, the vLLM tier included (bash scripts/setup_vllm_cpu.sh first)
#   bash scripts/test.sh -k resume       # a subset
# Two pytest-xdist workers, `--dist loadgroup` with the groups tests/conftest.py gives (a whole file per work
# unit, so a file's module fixtures, some of them whole tiny runs, are built once; the vLLM tier's files one
# unit, first, one vLLM worker and its tiny runs for the session). One worker keeps about one of these two
# cores busy (stage subprocesses, torch's threads): the vLLM tier runs on one while the other files run on the
# other, its vLLM engines on one core (tests/conftest.py: VLLM_CPU_OMP_THREADS_BIND).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -m pytest -q -rfEs -n 2 --dist loadgroup --no-loadscope-reorder "$@" tests
