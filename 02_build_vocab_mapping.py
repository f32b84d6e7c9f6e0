#!/usr/bin/env python3
"""Stage 02: choose the draft vocabulary and write vLLM's d2t / t2d mappings.

Inputs:  one or more complete hidden-state shards from stage 01 (checksums verified).
Output:  <out-dir>/vocab_mapping.safetensors with d2t (int64 offsets, target = draft + d2t[draft]),
         t2d (bool over the target vocabulary) and the token counts; meta.json with the coverage of
         loss-masked target tokens and the shards' verifier/layer facts.
Deterministic: ties in frequency go to the lower token id. A complete output is a logged skip;
--overwrite replaces it only once the new one is complete.

Examples:
  python 02_build_vocab_mapping.py --config configs/kimi_k25.toml
  python 02_build_vocab_mapping.py --data-dir runs/kimi/hidden_states --out-dir runs/kimi/vocab \
      --draft-vocab-size 32000
  python 02_build_vocab_mapping.py --config configs/tiny.toml
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.data.config import VocabConfig


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.data.vocab import run

        return run(cfg)

    return run_stage(__doc__, VocabConfig, argv, body)


if __name__ == "__main__":
    sys.exit(main())
