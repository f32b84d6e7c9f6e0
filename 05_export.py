#!/usr/bin/env python3
"""Stage 05: export a trained draft in the flat format vLLM loads, behind a gate that refuses every
way a draft can load without error and still be wrong.

Inputs:  a training run folder (stage 04) and which checkpoint (best by validation acceptance length,
         latest, or a step_NNNNNN name); the run's meta.json names the verifier, vocab mapping, shards.
Output:  <out-dir>/config.json (LlamaForCausalLMEagle3, model_type llama, explicit head_dim, aux layer ids
         at top level and in eagle_config, explicit norm flags), model.safetensors (midlayer.* names, bf16,
         d2t int64 offsets, t2d bool, no embed_tokens), export_meta.json (provenance and gate results);
         then prints the `vllm serve ... --speculative-config` line.
The gate: every contract check (docs/vllm_contract.md) plus a read-back of the files
under vLLM's rules that must reproduce the trained draft's logits on stored samples. The export is built
in <out-dir>.tmp and replaces a previous good export only after it passed. A complete export is a
logged skip; --overwrite replaces it.

Examples:
  python 05_export.py --config configs/kimi_k25.toml
  python 05_export.py --train-dir runs/kimi/train --checkpoint step_004000 --out-dir runs/kimi/draft-step4000
  python 05_export.py --config configs/tiny.toml
  python 05_export.py --check runs/tiny/draft      # gate only, on any export folder (exit 2 if refused)
"""

import sys

from eagle3_pipeline.core.cli import run_stage, setup_logging
from eagle3_pipeline.export_eval.config import ExportConfig


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--check"]:
        return check_only(argv[1:])

    def body(cfg):
        from eagle3_pipeline.export_eval.export import run

        return run(cfg)

    return run_stage(__doc__, ExportConfig, argv, body)


def check_only(rest) -> int:
    import logging
    from pathlib import Path

    from eagle3_pipeline.core.errors import UserError

    setup_logging()
    if len(rest) != 1:
        logging.getLogger("eagle3").error("usage: 05_export.py --check EXPORT_DIR")
        return 2
    from eagle3_pipeline.export_eval.export import check

    try:
        stats = check(Path(rest[0]))
    except UserError as e:
        logging.getLogger("eagle3").error("error: %s", e)
        return 2
    logging.getLogger("eagle3").info("export %s passes the gate: %s", rest[0], stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
