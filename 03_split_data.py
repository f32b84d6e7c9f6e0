#!/usr/bin/env python3
"""Stage 03: a deterministic, seeded train/val split by conversation across shards.

Inputs:  one or more complete hidden-state shards from stage 01 (checksums verified).
Output:  <out-dir>/split.json (train and val sample ids) and meta.json (counts, tokens, shards).
A conversation's side depends only on (seed, its id): adding shards never moves existing ones, and no
conversation is split across sides. A complete output is a logged skip; --overwrite replaces it.

Examples:
  python 03_split_data.py --config configs/kimi_k25.toml
  python 03_split_data.py --data-dir runs/kimi/hidden_states --out-dir runs/kimi/split --val-ratio 0.02 --seed 0
  python 03_split_data.py --config configs/tiny.toml
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.data.config import SplitConfig


def main(argv=None) -> int:
    def body(cfg):
        from eagle3_pipeline.data.split import run

        return run(cfg)

    return run_stage(__doc__, SplitConfig, argv, body)


if __name__ == "__main__":
    sys.exit(main())
