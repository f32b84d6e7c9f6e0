#!/usr/bin/env bash
# The real run for Kimi-K2.5, stage by stage, with the extraction shard loop. Edit configs/kimi_k25.toml
# first (verifier and data paths). Every stage is resumable and a finished one is a logged skip, so after
# an interruption just run this again.
#   NUM_ROWS=600000 SHARD_ROWS=2000 bash scripts/run_kimi_k25.sh
#   SESSION_TOKENS=0 ...: no long sessions joined from the rows (default: 131072 tokens at most, each row in
#   SESSION_PASSES=1 of them)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-configs/kimi_k25.toml}
PY=${PYTHON:-.venv/bin/python}
NUM_ROWS=${NUM_ROWS:?set NUM_ROWS to the number of conversations}
SHARD_ROWS=${SHARD_ROWS:-2000}
GPUS=${GPUS:-8}
SESSION_TOKENS=${SESSION_TOKENS:-131072}
SESSION_PASSES=${SESSION_PASSES:-1}

# What the whole run needs (disk per storage dtype, memory per GPU, steps), before any GPU work
"$PY" 01_extract_hidden_states.py --config "$CONFIG" --plan --plan-gpus "$GPUS" --plan-rows "$NUM_ROWS"
"$PY" 00_regenerate.py --config "$CONFIG"          # one vLLM engine over all GPUs, resumable
# vLLM runs Kimi-K2.5 for stage 01 (the config's engine): one server loads it once (tensor parallel over
# the GPUs) and the shard loop's runs are its clients, each shard resumable, the same bytes as a run with
# its own engine. The server stops when its loop ends, however it ends.
OUT_DIR=$("$PY" -m eagle3_pipeline.core.cli out-dir "$CONFIG" extract)
extract_shards() {  # ROWS [stage 01 flags]: the rows of stage 01's input in SHARD_ROWS shards
    local rows=$1; shift
    "$PY" 01_extract_hidden_states.py --config "$CONFIG" "$@" --serve &
    SERVER=$!
    trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
    until [[ -f "$OUT_DIR/vllm-server.json" ]]; do
        kill -0 "$SERVER" 2>/dev/null || { echo "run_kimi_k25: the vLLM server did not start (see $OUT_DIR/vllm-server.log)" >&2; exit 1; }
        sleep 1
    done
    for ((s = 0; s < rows; s += SHARD_ROWS)); do
        "$PY" 01_extract_hidden_states.py --config "$CONFIG" "$@" --start-row "$s" --end-row "$(( s + SHARD_ROWS < rows ? s + SHARD_ROWS : rows ))"
    done
    kill "$SERVER"; wait "$SERVER" || true; trap - EXIT
}
extract_shards "$NUM_ROWS"
# The same answers joined into long sessions up to SESSION_TOKENS (0: none), extracted beside the rows
# (--variant sessions) by a server at that length; each turn stored from [extract] context_tokens before it.
# Measured: +8-21% acceptance past 1k on a Kimi-shaped verifier, +2-5% on SmolLM2, no bucket lower
# (docs/results.md "Long sessions from the same rows"); one pass (each row in one session) bought 0.97-1.03x
# what four did for a quarter of their states. The tool prints stage 01's cost first.
if (( SESSION_TOKENS > 0 )); then
    SESSIONS="$(dirname "$OUT_DIR")/sessions.jsonl"
    [[ -f "$SESSIONS.meta.json" ]] || "$PY" -m eagle3_pipeline.data.sessions --config "$CONFIG" \
        --max-tokens "$SESSION_TOKENS" --passes "$SESSION_PASSES" --out "$SESSIONS"
    extract_shards "$(wc -l < "$SESSIONS")" --data-path "$SESSIONS" --variant sessions \
        --max-seq-len "$SESSION_TOKENS"
fi
"$PY" 02_build_vocab_mapping.py --config "$CONFIG"
"$PY" 03_split_data.py --config "$CONFIG"
"$(dirname "$PY")/torchrun" --nproc-per-node "$GPUS" 04_train.py --config "$CONFIG"
"$PY" 05_export.py --config "$CONFIG"
"$PY" 06_evaluate.py --config "$CONFIG"
