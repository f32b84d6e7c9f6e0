"""The baseline draft: speculators 0.9.0's own recipe, run by its own Trainer, on this project's shards.

What is speculators' here: the draft built by its CLI's default construction path
(`speculators.train.cli.build_draft_model`: decoder shape from the verifier config, head_dim included;
norm_before_residual, norm_before_fc and norm_output true), its config defaults
(`speculators.train.config.TrainConfig.resolve`), its loss (`get_trainer_kwargs`: kl_div), its
collate and shift (`CollateFn`, `shift_batch`), its `Trainer` (AdamW, clip 1.0, linear decay to 0
with 1% warm-up, weight decay 0.01, lr 1e-3). What is not: the optimizer is AdamW instead of its
default Muon (Muon's Newton-Schulz step is ~11x slower per step on this CPU), its flex attention and
fused losses are replaced by sdpa and eager (no CUDA here), and the batches are this project's
micro-batches (same samples in the same steps as the project's run), fed through its CollateFn.
Three CPU patches make its Trainer run without an accelerator (DEVELOPERS.md).

The trained weights are written as a checkpoint of this project (`<out>/checkpoints/step_N`, with a
meta.json), so that 05_export.py exports it under the same contract gate as the project's draft.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks import REPO

from eagle3_pipeline.training import checkpoint
from eagle3_pipeline.core import rope_scaling, storage
from eagle3_pipeline.models.draft import DraftSpec
from eagle3_pipeline.data.packing import micro_batches
from eagle3_pipeline.data.shards import load_sample, open_shards
from eagle3_pipeline.data.split import load_split
from eagle3_pipeline.data.vocab import load_mapping

# speculators' own training arguments (its defaults) that its TrainerConfig takes under the same names
PASSED_THROUGH = (
    "optimizer", "weight_decay", "scheduler_type", "scheduler_warmup_steps", "scheduler_warmup_ratio",
    "scheduler_total_steps", "checkpoint_freq", "save_best",
)  # fmt: skip


def _patch_for_cpu() -> None:
    """speculators' Trainer assumes an accelerator; these three points are all that need it."""
    import speculators.train.trainer as trainer_mod

    if torch.accelerator.current_accelerator() is None:
        trainer_mod.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None


def _raw_sample(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stored sample in speculators' per-sample layout (before its shift_batch)."""
    n = len(s["input_ids"])
    return {
        "input_ids": s["input_ids"].long(),
        "hidden_states": s["aux_hidden_states"].flatten(1).float(),
        "verifier_last_hidden_states": s["last_hidden_state"].float(),
        "loss_mask": s["loss_mask"].bool(),
        "lengths": torch.tensor([n]),
        "position_ids": torch.arange(n),
    }


def spec_of(model: Any, d2t: torch.Tensor, parallel_k: int | None = None) -> DraftSpec:
    """This project's DraftSpec for the draft speculators built (so export rebuilds the same maths);
    `parallel_k`: a P-EAGLE draft's depths (its mask token from the model)."""
    c, tl = model.config, model.config.transformer_layer_config
    rope = getattr(tl, "rope_parameters", None) or {"rope_theta": getattr(tl, "rope_theta", 10000.0)}
    return DraftSpec(
        hidden_size=tl.hidden_size,
        num_attention_heads=tl.num_attention_heads,
        num_key_value_heads=tl.num_key_value_heads,
        head_dim=tl.head_dim or tl.hidden_size // tl.num_attention_heads,
        intermediate_size=tl.intermediate_size,
        rms_norm_eps=tl.rms_norm_eps,
        rope_theta=float(rope["rope_theta"]),
        max_position_embeddings=tl.max_position_embeddings,
        # its rotary embedding is built from this layer config, so a yarn verifier's scaling trained it
        rope_scaling=rope_scaling.of_verifier({"rope_parameters": dict(rope)}, "speculators' layer config"),
        # speculators 0.9.0's default layer is sliding (layer_types ["sliding_attention"], window 2048): it
        # trains and is served with that window
        sliding_window=tl.sliding_window if "sliding_attention" in (getattr(tl, "layer_types", None) or [])
        else None,
        vocab_size=tl.vocab_size,
        draft_vocab_size=int(d2t.numel()),
        aux_layer_ids=tuple(c.eagle_aux_hidden_state_layer_ids),
        norm_before_residual=c.norm_before_residual,
        hidden_act=tl.hidden_act,
        norm_before_fc=c.norm_before_fc,
        fc_norm=c.fc_norm,
        norm_output=c.norm_output,
        mask_token_id=getattr(model, "mask_token_id", None) if parallel_k else None,
        parallel_k=parallel_k,
    )


class _Batches(torch.utils.data.Dataset):
    """The project's micro-batches (sample refs), collated by speculators' CollateFn."""

    def __init__(self, batches: list, collate: Any) -> None:
        self.batches, self.collate = batches, collate

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> Any:
        return self.collate([_raw_sample(load_sample(r)) for r in self.batches[i]])


def _loaders(train_refs: list, val_refs: list, collate: Any, total_steps: int, batch_tokens: int,
             max_seq_len: int, seed: int) -> tuple[Any, Any]:  # fmt: skip
    """The project's batch plan for `total_steps` (epochs as the project shuffles them) and one
    validation pass, as speculators' Trainer reads loaders."""
    steps_per_epoch = len(micro_batches(train_refs, batch_tokens, max_seq_len, seed, 0))
    plan = []
    for epoch in range(math.ceil(total_steps / steps_per_epoch)):
        plan += micro_batches(train_refs, batch_tokens, max_seq_len, seed, epoch)
    plan = plan[:total_steps]
    val = micro_batches(val_refs, batch_tokens, max_seq_len, seed, 0)
    loader = torch.utils.data.DataLoader
    return (loader(_Batches(plan, collate), batch_size=None, shuffle=False, num_workers=0),
            loader(_Batches(val, collate), batch_size=None, num_workers=0))  # fmt: skip


def train(
    data_dir: Path,
    split_dir: Path,
    vocab_dir: Path,
    out_dir: Path,
    total_steps: int,
    batch_tokens: int,
    max_seq_len: int,
    seed: int = 0,
    ttt_steps: int = 3,
    peagle_depths: int | None = None,
) -> dict[str, Any]:
    """Train speculators' default draft for `total_steps` on the project's micro-batches; returns stats.
    `peagle_depths`: speculators' P-EAGLE draft (`--speculator-type peagle`, its defaults: COD 0.7 / 0.2,
    max_anchors 512, norm_before_fc and norm_output off) with that many depths, in place of EAGLE-3. Two
    of its defaults are changed so that the draft can be exported and served as trained: its decoder layer
    is Llama's (`--draft-arch llama`; its default for peagle is Qwen3's, q_norm / k_norm, which this
    project's export, simulation and vLLM's llama_eagle3.py do not build), and its embedding stays frozen
    (speculators' peagle trains it, but vLLM serves an EAGLE-3 draft with the verifier's: the export ships
    none). Its mask token is the project's default (the verifier's last id)."""
    import numpy as np
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.peagle import PEagleDraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings, set_seed
    from speculators.train.config import TrainConfig as SpecConfig
    from speculators.train.data import CollateFn
    from speculators.train.trainer import Trainer, TrainerConfig

    _patch_for_cpu()
    shard_set = open_shards([str(data_dir)])
    train_refs, val_refs = load_split(split_dir, shard_set.samples)
    vocab_meta, d2t, t2d = load_mapping(vocab_dir)
    verifier = shard_set.meta["verifier"]["path"]
    tmp = Path(tempfile.mkdtemp(prefix="spec-baseline-"))
    np.save(tmp / "d2t.npy", d2t.numpy())
    np.save(tmp / "t2d.npy", t2d.numpy())
    kind = ["--speculator-type", "eagle3"] if peagle_depths is None else [
        "--speculator-type", "peagle", "--num-depths", str(peagle_depths), "--draft-arch", "llama",
        "--mask-token-id", str(int(shard_set.meta["verifier"]["vocab_size"]) - 1)]  # fmt: skip
    argv = [
        "--verifier-name-or-path", verifier, "--data-path", str(tmp), *kind,
        "--draft-vocab-size", str(d2t.numel()), "--d2t-path", str(tmp / "d2t.npy"),
        "--t2d-path", str(tmp / "t2d.npy"),
        "--target-layer-ids", *map(str, shard_set.meta["aux_layer_ids"]),
        "--optimizer", "adamw", "--draft-attn-impl", "sdpa", "--loss-implementation", "eager",
        "--num-workers", "0", "--hidden-states-dtype", "float32", "--total-seq-len", str(batch_tokens),
        "--max-steps", str(total_steps), "--ttt-steps", str(ttt_steps), "--seed", str(seed),
        "--save-path", str(out_dir / "speculators_checkpoints"), "--no-resume-from-checkpoint",
    ]  # fmt: skip
    cfg = SpecConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())
    set_seed(args.seed, getattr(args, "deterministic_cuda", False))
    d2t_s, t2d_s, dv = parse_vocab_mappings(args)
    model_class = Eagle3DraftModel if peagle_depths is None else PEagleDraftModel
    model = build_draft_model(args, model_class, t2d_s, d2t_s, dv)
    model.embed_tokens.weight.requires_grad_(False)  # served with the verifier's (docstring)
    train_kwargs, val_kwargs = model_class.get_trainer_kwargs(**vars(args))
    hidden = model.config.transformer_layer_config.hidden_size
    collate = CollateFn(batch_tokens, hidden, len(model.target_layer_ids), torch.float32, shift_batch)

    loader, val_loader = _loaders(train_refs, val_refs, collate, total_steps, batch_tokens, max_seq_len, seed)
    trainer_config = TrainerConfig(
        num_epochs=1,
        save_path=args.save_path,
        lr=args.lr,
        resume_from_checkpoint=False,
        train_call_kwargs=train_kwargs,
        val_call_kwargs=val_kwargs,
        **{name: getattr(args, name) for name in PASSED_THROUGH},
        hidden_states_dtype=torch.float32,
        log_freq=max(1, total_steps // 10),
        max_steps=args.max_steps,
    )
    trainer = Trainer(model, trainer_config, loader, val_loader)
    trainer.device_type = "cpu" if torch.accelerator.current_accelerator() is None else trainer.device_type
    trainer.run_training()
    return _write_project_checkpoint(model, out_dir, shard_set, vocab_dir, vocab_meta, d2t, total_steps, seed,
                                     ttt_steps, train_refs, val_refs, argv, peagle_depths)  # fmt: skip


def _write_project_checkpoint(
    model: Any, out_dir: Path, shard_set: Any, vocab_dir: Path, vocab_meta: dict, d2t: torch.Tensor,
    step: int, seed: int, ttt_steps: int, train_refs: list, val_refs: list, argv: list[str],
    parallel_k: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The trained weights as this project's checkpoint + meta.json, for 05_export.py."""
    model = model.cpu().float()
    spec = spec_of(model, d2t, parallel_k)
    frozen = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "d2t", "t2d"}
    weights = {n: p.detach() for n, p in model.named_parameters() if n not in frozen}
    meta = {
        "stage": "speculators_baseline",
        "draft": spec.to_json(),
        "source": shard_set.contract(),
        "verifier_path": str(Path(shard_set.meta["verifier"]["path"]).resolve()),
        "vocab_mapping_dir": str(vocab_dir.resolve()),
        "vocab_mapping_sha256": vocab_meta["mapping_sha256"],
        "shards": [str(s.resolve()) for s in shard_set.shards],
        "num_train": len(train_refs),
        "num_val": len(val_refs),
        "ttt_steps": ttt_steps,
        "config": {"seed": seed},
        "speculators_argv": argv,
        "versions": storage.versions(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    storage.write_json_atomic(out_dir / storage.META_NAME, meta)
    checkpoint.save(out_dir / "checkpoints", step, weights, {}, {"history": {}}, keep_last=1)
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--split-dir", required=True)
    p.add_argument("--vocab-mapping-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch-tokens", type=int, default=1024)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    meta = train(Path(a.data_dir), Path(a.split_dir), Path(a.vocab_mapping_dir), Path(a.out_dir), a.steps,
                 a.batch_tokens, a.max_seq_len, a.seed)  # fmt: skip
    print(json.dumps(meta["draft"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
