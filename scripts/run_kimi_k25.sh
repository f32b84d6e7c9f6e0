#!/usr/bin/env bash
# The real run for Kimi-K2.5, stage by stage, with the extraction shard loop. Edit configs/kimi_k25.toml
# first (verifier and data paths). Every stage is resumable and a finished one is a logged skip, so after
# an interruption just run this again.
#   NUM_ROWS=600000 SHARD_ROWS=2000 bash scripts/run_kimi_k25.sh
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/kimi_k25.toml}
PY=${PYTHON:-.venv/bin/python}
NUM_ROWS=${NUM_ROWS:?set NUM_ROWS to the number of conversations}
SHARD_ROWS=${SHARD_ROWS:-2000}
GPUS=${GPUS:-8}

# What the whole run needs (disk per storage dtype, memory per GPU, steps), before any GPU work
"$PY" 01_extract_hidden_states.py --config "$CONFIG" --plan --plan-gpus "$GPUS" --plan-rows "$NUM_ROWS"
"$PY" 00_regenerate.py --config "$CONFIG"          # one vLLM engine over all GPUs, resumable
# one process writes every shard of SHARD_ROWS rows (the verifier loads once); each shard is the same as
# its own `--start-row a --end-row b` run would write, so the README's shell loop is interchangeable
"$PY" 01_extract_hidden_states.py --config "$CONFIG" --start-row 0 --end-row "$NUM_ROWS" --shard-rows "$SHARD_ROWS"
"$PY" 02_build_vocab_mapping.py --config "$CONFIG"
"$PY" 03_split_data.py --config "$CONFIG"
"$(dirname "$PY")/torchrun" --nproc-per-node "$GPUS" 04_train.py --config "$CONFIG"
"$PY" 05_export.py --config "$CONFIG"
"$PY" 06_evaluate.py --config "$CONFIG"
