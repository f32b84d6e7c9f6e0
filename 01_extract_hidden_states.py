#!/usr/bin/env python3
"""Stage 01: run the verifier over conversations and store its hidden states at the aux layers.

Inputs:  a verifier checkpoint (Hugging Face layout; Kimi-K2.5's nested `text_config` is fine) and
         conversations (.jsonl/.json rows in OpenAI `messages` or ShareGPT `conversations` form, with
         reasoning, tool calls and `tools`, or `token_samples` rows from 00_regenerate.py, or a `datasets`
         folder saved with save_to_disk). Each assistant turn's context is its serving prompt under
         --chat-template-kwargs; the loss mask covers what the model generates (docs/reference.md
         "Kimi-K2.5 data").
Output:  one shard `<out-dir>/rows_<start>-<end>/` per row range: input_ids, assistant-only loss_mask,
         aux hidden states at `aux_layer_ids` (vLLM convention: id i = HF hidden_states[i]) and the last
         layer's pre-norm output for the teacher, in safetensors part files, with manifest.json
         (sample ids, token counts, sha256 per file), rejects.jsonl (every row not written, with its
         reason) and meta.json (verifier, layer ids, hidden size, dtype, counts, versions).
Storage: --storage-dtype float8_e4m3fn halves the disk (28,672 instead of 57,344 bytes per Kimi token,
plus 16 bytes of float32 scales per sample); later stages read it dequantised. Default: as computed.
--storage-dtype none writes token shards: the same samples (ids, loss masks, manifest) without states and
without running the verifier (about 5 bytes per token, seconds per thousand rows), for stage 04's
online states (`04_train.py --states online`: vLLM computes them while the draft trains).
Safe to interrupt: parts are written atomically; rerun the same command to finish a shard (finished
parts are skipped); --overwrite redoes it. A complete shard is a logged skip (exit 0). A full disk is an
error naming the file and the bytes; a run that would not fit (sampled tokens per row) does not start.
--plan prints what the whole run needs (disk per storage dtype, memory per GPU, steps, time) and runs
nothing; it needs only the verifier's config.json.
Engines: --engine hf (default: transformers in this process) or --engine vllm (vLLM's
extract_hidden_states method in its own environment, tensor parallel over the visible GPUs: what
configs/kimi_k25.toml uses). With vllm, --serve starts one engine for the config and keeps it; runs with
the same config are its clients, so a shell loop over shards loads the verifier once (docs/reference.md
"Extraction engines"). Rendering and writing overlap the forward in both engines.

Examples:
  # one shard with the real run's settings
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --start-row 0 --end-row 2000
  # a shell loop over shards (each one resumable, the loop stops on the first failure)
  set -euo pipefail; for s in $(seq 0 2000 600000); do
    python 01_extract_hidden_states.py --config configs/kimi_k25.toml --start-row $s --end-row $((s+2000)); done
  # vLLM (the Kimi config's engine): one server loads the verifier, the shard loop's runs are its clients
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --serve &
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --start-row 0 --end-row 2000   # a client
  # the same shards from one process: the verifier loads once, not once per shard (same bytes)
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --start-row 0 --end-row 600000 --shard-rows 2000
  # token shards for online states (no verifier runs)
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --storage-dtype none \
    --out-dir runs/kimi_k25/tokens
  # Kimi-K2.5 in instant mode (the config's default is thinking mode)
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --chat-template-kwargs '{"thinking":false}'
  # the tiny CI verifier
  python 01_extract_hidden_states.py --config configs/tiny.toml
  # size the whole run first (no weights needed); store fp8
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --plan --plan-gpus 8
  python 01_extract_hidden_states.py --config configs/kimi_k25.toml --storage-dtype float8_e4m3fn
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.data.config import ExtractConfig
from eagle3_pipeline.sizing.options import PlanOptions


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.data.extract import run

        return run(cfg)

    def plan(cfg, options, config_path):
        from eagle3_pipeline.sizing.plan import plan_extract

        return plan_extract(cfg, options, config_path)

    return run_stage(__doc__, ExtractConfig, argv, body, plan=(PlanOptions, plan))


if __name__ == "__main__":
    sys.exit(main())
