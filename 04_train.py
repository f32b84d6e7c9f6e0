#!/usr/bin/env python3
"""Stage 04: train the EAGLE-3 draft head with training-time test, on CPU, one GPU or torchrun.

Inputs:  hidden-state shards (stage 01), the vocab mapping (stage 02), optionally the split (stage 03),
         and from the verifier only embed_tokens, the final norm and lm_head (read through the
         safetensors index, whatever the prefix: `language_model.` for Kimi-K2.5).
Output:  <out-dir>/checkpoints/step_NNNNNN/ (complete ones only; the last --keep-last and the best by
         validation acceptance length, named in checkpoints/best.json), train_log.jsonl, meta.json.
The draft is speculators' Eagle3DraftModel with an explicit Llama decoder config (head_dim 128 for
Kimi, never inherited from the verifier). Loss (--loss): cross-entropy on the verifier's argmax over the
draft vocab, since vLLM drafts the argmax (docs/results.md "Draft quality"); kl_div and speculators'
others by name.
Validation: acc/cond accuracy per TTT step and the simulated acceptance length, also before training.
Kernels (--attn-impl, --loss-impl, --compile; eagle3_pipeline/training/kernel_policy.py): auto is flex attention, the
fused Triton loss and a compiled forward on CUDA, sdpa + eager loss uncompiled on CPU; meta.json records
the choice under "kernels".
Safe to interrupt: SIGTERM/SIGINT save a checkpoint and exit 130; rerunning the same command resumes
from the latest complete checkpoint with model, optimizer, scheduler, RNG and data position restored
(bitwise identical to an uninterrupted run on CPU). --overwrite starts over. A full disk while saving a
checkpoint stops the run with an error naming the file and the bytes (the unfinished checkpoint is
deleted; a rerun resumes from the last complete one); a run whose checkpoints would not fit does not start.
--plan prints draft shapes, parameters, memory per GPU, steps per epoch and time, and runs nothing
(the verifier's config.json is enough; token counts from the shards' manifests when they exist).
Online states (--states online, eagle3_pipeline/training/online.py): --data-dir holds token shards (stage 01 with
--storage-dtype none) and running `vllm serve` processes (--servers) compute each sample's states while
the draft trains; --serve-line prints the command that starts one. Nothing is written but the run
folder (and --cache-dir, within --cache-gb); a dead server's requests go to the others.
Several ranks or nodes (torchrun, its c10d rendezvous; docs/multi_node.md): every epoch trains every
sample once (the last step's empty slots are zero-weight padding), logged per epoch; --out-dir must be
the same folder on every node (rank 0 writes, every rank resumes from it), the shards, vocab mapping,
split and verifier at the same paths; a lost rank stops the others with a line naming it.

Examples:
  python 04_train.py --config configs/kimi_k25.toml                        # one GPU, bf16
  torchrun --nproc-per-node 8 04_train.py --config configs/kimi_k25.toml   # 8 GPUs, DDP
  torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint train-0:29500 --rdzv-id k \
    04_train.py --config configs/kimi_k25.toml --out-dir /nfs/kimi/train   # on each of 4 nodes
  python 04_train.py --config configs/tiny.toml                            # CPU smoke, fp32
  python 04_train.py --config configs/kimi_k25.toml --plan --plan-gpus 8 --plan-tokens-per-second 200000
  python 04_train.py --config configs/kimi_k25.toml --states online --data-dir runs/kimi/tokens --serve-line
"""

import sys

from eagle3_pipeline.core.cli import run_stage
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.sizing.options import PlanOptions


def _warn_ttt_steps(cfg) -> None:
    """Rank 0 says what --ttt-steps above --served-k costs (sizing/plan.py: training may not import it)."""
    import logging
    import os

    import torch

    from eagle3_pipeline.sizing.plan import ttt_steps_warning

    if os.environ.get("RANK", "0") == "0":
        gpus = int(os.environ.get("WORLD_SIZE", "1"))
        warning = ttt_steps_warning(cfg, gpus, torch.cuda.is_available())
        if warning:
            logging.getLogger("eagle3.train").warning("%s", warning)


def main(argv=None) -> int:
    def body(cfg_args):
        cfg, args = cfg_args
        if args.serve_line:
            from eagle3_pipeline.training.online import print_serve_line

            return print_serve_line(cfg)
        from eagle3_pipeline.training.train import run

        _warn_ttt_steps(cfg)
        return run(cfg)

    def extra_args(parser):
        parser.add_argument(
            "--serve-line",
            action="store_true",
            help="Print the `vllm serve` command that computes this run's states online (--states online: "
            "the verifier, layers, dtype, max length and hs_connectors transfer of the token shards in "
            "--data-dir), and run nothing.",
        )

    def plan(cfg, options, config_path):
        from eagle3_pipeline.sizing.plan import plan_train

        return plan_train(cfg, options, config_path)

    return run_stage(__doc__, TrainConfig, argv, body, extra_args=extra_args, plan=(PlanOptions, plan))


if __name__ == "__main__":
    sys.exit(main())
