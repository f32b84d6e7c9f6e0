#!/usr/bin/env bash
# The whole pipeline on a tiny verifier made locally, on CPU, in a few minutes: the executable spec of
# a run. Every stage is resumable, so rerunning this after an interruption finishes the work.
#   bash scripts/run_tiny.sh                        # tiny DeepSeek-V3 (MLA + MoE) verifier, configs/tiny.toml
#   bash scripts/run_tiny.sh configs/tiny_llama.toml  # tiny Llama verifier for the vLLM tier
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/tiny.toml}
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PY" -m eagle3_pipeline.models.tiny --from-config "$CONFIG"
for stage in $("$PY" -m eagle3_pipeline.core.cli stages); do   # 00_regenerate.py ... 06_evaluate.py (cli.STAGES)
  case "$stage" in
    00_regenerate.py) grep -q '^\[regenerate\]' "$CONFIG" || continue ;;  # the verifier rewrites the answers
    06_evaluate.py) "$PY" "$stage" --config "$CONFIG" --engine sim; continue ;;  # no vLLM environment
  esac
  "$PY" "$stage" --config "$CONFIG"
done
# the baseline: the draft as training initialised it, exported beside the trained one, on the same prompts
UNTRAINED=$("$PY" -m eagle3_pipeline.export_eval.summary --config "$CONFIG" --untrained-dir)
"$PY" 05_export.py --config "$CONFIG" --checkpoint init --out-dir "$UNTRAINED"
"$PY" 06_evaluate.py --config "$CONFIG" --engine sim --draft-dir "$UNTRAINED"
"$PY" -m eagle3_pipeline.export_eval.summary --config "$CONFIG"   # trained vs untrained per position; where things are
