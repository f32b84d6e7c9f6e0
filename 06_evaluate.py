#!/usr/bin/env python3
"""Stage 06: mean acceptance length and per-position acceptance of an export, before deploying it.

Inputs:  an export folder (stage 05), the verifier (default: the one the export records) and
         conversations whose first user turn(s) become prompts (--start-row, --num-prompts), rendered
         with the chat_template_kwargs the training shards were extracted with (or --chat-template-kwargs).
Engines: sim   this project's PyTorch run of vLLM's greedy EAGLE-3 chain, reading the export files
               exactly as vLLM does (head_dim, aux ids, d2t and norm flags from config.json);
         vllm  the real vLLM engine in its own environment (scripts/setup_vllm_cpu.sh on CPU);
         both  the two on the same prompts, checking that vLLM's speculative output equals the
               verifier's greedy output token for token and that per-position acceptance agrees
               within 0.01 (exit 1 otherwise; the simulation's counters equal vLLM's in fp32).
Output:  acceptance_<engine>.json in the export folder (or --out-dir): counters as vLLM names them
         (num_drafts, num_accepted_tokens, accepted_per_pos), rates, mean acceptance length.

Examples:
  python 06_evaluate.py --draft-dir runs/kimi/draft --data-path data/mtbench.jsonl --num-prompts 80
  python 06_evaluate.py --draft-dir runs/kimi/draft --data-path data/val.jsonl --engine vllm \
      --vllm-python $(which python)
  python 06_evaluate.py --config configs/tiny.toml --engine both
"""

import sys

from eagle3_pipeline.cli import run_stage


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.evaluate import run

        return run(cfg)

    return run_stage(__doc__, "evaluate", argv, body)


if __name__ == "__main__":
    sys.exit(main())
