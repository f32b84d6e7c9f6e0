#!/usr/bin/env bash
# Create (or update) the project's environment in .venv: torch, transformers, safetensors, datasets,
# tqdm, speculators and pytest, pinned to versions that install and import together (requirements.txt,
# requirements-nodeps.txt). Idempotent.
#   bash scripts/setup.sh                  # CPU here: torch 2.13.0 (+cpu from the local wheel mirror)
#   TORCH_SPEC="torch==2.14.1" bash scripts/setup.sh   # a CUDA box (speculators 0.9.0 caps torch<=2.14.1)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ -n "${TORCH_SPEC:-}" ]; then
  "${PIP[@]}" "$TORCH_SPEC"
  "${PIP[@]}" -r <(grep -v '^torch==' requirements.txt)
else
  "${PIP[@]}" -r requirements.txt
fi
"${PIP[@]}" --no-deps -r requirements-nodeps.txt
"$VENV/bin/python" - <<'PY'
import torch, transformers, safetensors, datasets, tqdm, speculators  # noqa: F401
from speculators.models.eagle3 import Eagle3DraftModel  # noqa: F401
print(f"environment ready: torch {torch.__version__}, transformers {transformers.__version__}, "
      f"cuda {torch.cuda.is_available()}")
PY
