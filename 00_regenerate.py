#!/usr/bin/env python3
"""Stage 00: regenerate every assistant turn of the conversations with the verifier itself.

Why: the draft should learn what the verifier says, since that is what it must predict when serving
(the EAGLE-3 paper and every public Kimi-K2.5 draft train on regenerated responses; the draft-quality
benchmark measures it as the largest lever). Prompts (user, system, tool turns) are kept; each
assistant turn is regenerated in order, conditioned on the turns regenerated before it.

Inputs:  a verifier checkpoint and conversations (the formats of stage 01).
Output:  <out-dir>/conversations.jsonl: rows with the regenerated text in `messages` and the exact
         prompt and completion token ids in `token_samples` (stage 01 uses the ids verbatim), plus
         rejects.jsonl and meta.json (engine, sampling, stop ids, counts, finish reasons, versions).
Engines: vllm (its own environment, one engine for the whole run, tensor parallel over the visible
         GPUs), hf (transformers, the CPU fallback), auto (vllm when usable). Greedy by default
         (--temperature 0), so a rerun gives the same bytes.
Safe to interrupt: blocks of --rows-per-part rows are written atomically; rerun the same command to
finish (done parts are skipped); --overwrite starts over. A complete output is a logged skip.

Examples:
  python 00_regenerate.py --config configs/kimi_k25.toml            # vLLM over 8 GPUs
  python 00_regenerate.py --verifier-path V --data-path raw.jsonl --out-dir runs/regen --engine hf
  python 00_regenerate.py --config configs/tiny_llama.toml          # the tiny CPU verifier
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.data.config import RegenerateConfig


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.data.regenerate import run

        return run(cfg)

    return run_stage(__doc__, RegenerateConfig, argv, body)


if __name__ == "__main__":
    sys.exit(main())
