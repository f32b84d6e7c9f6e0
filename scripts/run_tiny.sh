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

"$PY" -m eagle3_pipeline.tiny --from-config "$CONFIG"
if grep -q '^\[regenerate\]' "$CONFIG"; then   # the verifier rewrites the assistant turns first
  "$PY" 00_regenerate.py --config "$CONFIG"
fi
"$PY" 01_extract_hidden_states.py --config "$CONFIG"
"$PY" 02_build_vocab_mapping.py --config "$CONFIG"
"$PY" 03_split_data.py --config "$CONFIG"
"$PY" 04_train.py --config "$CONFIG"
"$PY" 05_export.py --config "$CONFIG"
"$PY" 06_evaluate.py --config "$CONFIG" --engine sim
# the baseline: the draft as training initialised it, exported beside the trained one, on the same prompts
UNTRAINED=$("$PY" -m eagle3_pipeline.summary --config "$CONFIG" --untrained-dir)
"$PY" 05_export.py --config "$CONFIG" --checkpoint init --out-dir "$UNTRAINED"
"$PY" 06_evaluate.py --config "$CONFIG" --engine sim --draft-dir "$UNTRAINED"
"$PY" -m eagle3_pipeline.summary --config "$CONFIG"   # trained vs untrained per position; where things are
