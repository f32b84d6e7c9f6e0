#!/usr/bin/env python3
"""Stage 06: mean acceptance length and per-position acceptance of an export, before deploying it.

Inputs:  an export folder (stage 05), the verifier (default: the one the export records) and
         conversations whose first user turn(s) become prompts (--start-row, --num-prompts), rendered
         with the chat_template_kwargs the training shards were extracted with (or --chat-template-kwargs).
Sampling: as the export records it will be served (export_meta.json "served", from stage 05's
         --temperature/--top-p/--draft-sample-method or a [serving] mode), else greedy; a flag here wins.
         --temperature/--top-p/--top-k/--seed as the requests are served (Kimi-K2.5's
         thinking mode: --temperature 1.0 --top-p 0.95; instant mode 0.6 / 0.95), request i seeded
         seed + i, --samples-per-prompt independent draws per prompt. vLLM drafts the draft's argmax and
         accepts it with the verifier's probability of it after temperature/top-k/top-p; the simulation
         samples the verifier's trace and reports the exact expected acceptance per position.
Engines: sim   this project's PyTorch run of vLLM's EAGLE-3 chain, reading the export files
               exactly as vLLM does (head_dim, aux ids, d2t and norm flags from config.json); its
               first pass computes outputs from each prompt's last slot on (the slots the rounds read;
               exact, the draft is causal), so a long prompt costs the draft one linear pass;
         vllm  the real vLLM engine in its own environment (scripts/setup_vllm_cpu.sh on CPU);
         both  the two on the same prompts. Greedy: vLLM's speculative output must equal the verifier's
               greedy output token for token and per-position acceptance agree within 0.01 (the
               counters are equal in fp32). Sampled: the simulation counts over vLLM's own outputs,
               which settle vLLM's steps: the drafts must be equal, the accepted counts equal up to the
               last steps' unshown positions, and vLLM's rates within 3 standard deviations (the
               rejection sampler's coin flips, sum q(1-q)) of the expected ones. Exit 1 otherwise.
Output:  acceptance_<engine>.json in the export folder (or --out-dir; sampled runs add _t<T>_p<top_p>):
         counters as vLLM names them (num_drafts, num_accepted_tokens, accepted_per_pos), rates, mean
         acceptance length; sampled simulations also the expected counts and their standard errors;
         "acceptance_by_context": per context bucket (0-1k, 1k-2k, 2k-4k, ... of prompt + generated
         tokens at each verification step; vLLM: whole requests by prompt length, its counters being
         totals) the drafts, mean acceptance length and its standard error over the steps, also drawn
         in acceptance_<engine>_by_context.png. Long held-out prompts for it:
         python -m eagle3_pipeline.export_eval.long_prompts --tokenizer VERIFIER --lengths ... --out F

Examples:
  python 06_evaluate.py --draft-dir runs/kimi/draft --data-path data/mtbench.jsonl --num-prompts 80
  python 06_evaluate.py --draft-dir runs/kimi/draft --data-path data/mtbench.jsonl --num-prompts 80 \
      --temperature 1.0 --top-p 0.95 --samples-per-prompt 4          # as thinking mode is served
  python 06_evaluate.py --draft-dir runs/kimi/draft --data-path data/val.jsonl --engine vllm \
      --vllm-python $(which python)
  python 06_evaluate.py --config configs/tiny.toml --engine both
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.export_eval.config import EvaluateConfig


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.export_eval.evaluate import run

        return run(cfg)

    return run_stage(__doc__, EvaluateConfig, argv, body)


if __name__ == "__main__":
    sys.exit(main())
