"""Stage 04: train the EAGLE-3 head with training-time test (TTT), resumable bit for bit.

Per micro-batch, samples are packed into one row with document ids and shifted as the draft serves:
slot t gets the verifier's aux states at t, the embedding of token t+1 and RoPE position t, and learns
the verifier's distribution at t+1 (KL against lm_head(norm(last hidden)) restricted to the draft
vocabulary: [tokens, draft_vocab] logits, never [tokens, 163840]). TTT unrolls `ttt_steps` steps, each
feeding the draft's own output back (speculators' Eagle3DraftModel.forward).
Validation reports per step s: acc_s (all steps 0..s right, a prefix accepted) and cond_s (step s right
given 0..s-1 right), and acceptance_length = 1 + sum_s acc_s, the mean tokens per verifier step that a
greedy chain of ttt_steps drafts would yield; the best checkpoint is picked by it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline import checkpoint, storage
from eagle3_pipeline.cli import EXIT_INTERRUPTED, progress
from eagle3_pipeline.config import TrainConfig, config_to_dict
from eagle3_pipeline.draft import DraftSpec, attach_verifier_tensors, build_draft, trainable_names
from eagle3_pipeline.errors import UserError
from eagle3_pipeline.shards import SampleRef, load_sample, open_shards
from eagle3_pipeline.split import load_split, split_samples
from eagle3_pipeline.verifier import load_verifier_tensors
from eagle3_pipeline.vocab import load_mapping

log = logging.getLogger("eagle3.train")


def pack(samples: list[dict[str, torch.Tensor]], max_seq_len: int) -> dict[str, torch.Tensor]:
    """Shift each sample to (aux_t, token_{t+1}, teacher_{t+1}, mask_{t+1}) and pack them in one row."""
    parts: dict[str, list[torch.Tensor]] = {
        k: []
        for k in ("hidden_states", "input_ids", "verifier_last", "loss_mask", "document_ids", "position_ids")
    }
    for doc, s in enumerate(samples):
        n = min(len(s["input_ids"]), max_seq_len)
        if n < 2:
            continue
        parts["hidden_states"].append(s["aux_hidden_states"][: n - 1].flatten(1).float())
        parts["input_ids"].append(s["input_ids"][1:n].long())
        parts["verifier_last"].append(s["last_hidden_state"][1:n].float())
        parts["loss_mask"].append(s["loss_mask"][1:n].bool())
        parts["document_ids"].append(torch.full((n - 1,), doc, dtype=torch.long))
        parts["position_ids"].append(torch.arange(n - 1))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


def micro_batches(
    samples: list[SampleRef], batch_tokens: int, max_seq_len: int, seed: int, epoch: int
) -> list[list[SampleRef]]:
    """A seeded shuffle of the samples, packed greedily into micro-batches of at most batch_tokens."""
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(len(samples), generator=g).tolist()
    batches: list[list[SampleRef]] = []
    current: list[SampleRef] = []
    used = 0
    for i in order:
        n = min(samples[i].num_tokens, max_seq_len)
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(samples[i])
        used += n
    if current:
        batches.append(current)
    return batches


class BatchDataset(torch.utils.data.Dataset):
    def __init__(self, batches: list[list[SampleRef]], max_seq_len: int):
        self.batches = batches
        self.max_seq_len = max_seq_len

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return pack([load_sample(r) for r in self.batches[i]], self.max_seq_len)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def init_distributed() -> tuple[Dist, torch.device]:
    """torchrun sets WORLD_SIZE/RANK/LOCAL_RANK: NCCL on GPUs, gloo on CPU."""
    d = Dist(
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )
    if torch.cuda.is_available():
        torch.cuda.set_device(d.local_rank)
        device = torch.device("cuda", d.local_rank)
    else:
        device = torch.device("cpu")
    if d.enabled and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return d, device


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine from 1 to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress_frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress_frac))


def forward(
    model: Any,
    batch: dict[str, torch.Tensor],
    ttt_steps: int,
    decay: float,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from speculators.losses.eager import kl_div_loss

    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        _, loss, metrics = model(
            hidden_states=b["hidden_states"],
            input_ids=b["input_ids"],
            document_ids=b["document_ids"],
            loss_mask=b["loss_mask"],
            position_ids=b["position_ids"],
            verifier_last_hidden_states=b["verifier_last"],
            ttt_steps=ttt_steps,
            ttt_step_loss_decay=decay,
            loss_config={"kl_div": (kl_div_loss, 1.0)},
        )
    return loss, metrics


def summarize(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """Ratios from summed counts: acc_s, cond_s, loss, acceptance_length."""
    out = {"loss": sums.get("loss_sum", 0.0) / max(sums.get("n", 1.0), 1.0)}
    acc_total = 0.0
    for s in range(ttt_steps):
        acc = sums.get(f"full_acc_{s}_sum", 0.0) / max(sums.get(f"full_acc_{s}_total", 0.0), 1.0)
        out[f"acc_{s}"] = acc
        out[f"cond_{s}"] = sums.get(f"cond_acc_{s}_sum", 0.0) / max(sums.get(f"cond_acc_{s}_total", 0.0), 1.0)
        acc_total += acc
    out["acceptance_length"] = 1.0 + acc_total
    return out


def accumulate(sums: dict[str, float], metrics: dict[str, torch.Tensor]) -> None:
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    sums["n"] = sums.get("n", 0.0) + 1.0


def all_reduce_sums(sums: dict[str, float], dist: Dist, device: torch.device) -> dict[str, float]:
    if not dist.enabled:
        return sums
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


@torch.no_grad()
def validate(
    model: Any, loader: Any, cfg: TrainConfig, device: torch.device, autocast_dtype: Any, dist: Dist
) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    for batch in loader:
        _, metrics = forward(model, batch, cfg.ttt_steps, cfg.ttt_step_loss_decay, device, autocast_dtype)
        accumulate(sums, metrics)
    model.train()
    return summarize(all_reduce_sums(sums, dist, device), cfg.ttt_steps)


class StopFlag:
    """SIGTERM/SIGINT set a flag; the loop saves a checkpoint at the next step boundary and exits.
    A second signal stops at once (the last complete checkpoint still counts)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        log.warning("signal %d: finishing this step, then saving a checkpoint (again to stop now)", signum)

    def agreed(self, dist: Dist, device: torch.device) -> bool:
        """Whether any rank was signalled: all ranks must stop at the same step or the barrier hangs."""
        if not dist.enabled:
            return self.signum is not None
        flag = torch.tensor([0 if self.signum is None else self.signum], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.signum is None:
            self.signum = int(flag.item())
        return bool(flag.item())


def run(cfg: TrainConfig) -> int:
    dist, device = init_distributed()
    torch.manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    ckpt_root = out_dir / "checkpoints"

    vocab_meta, d2t, t2d = load_mapping(Path(cfg.vocab_mapping_dir))
    expect = {**vocab_meta["source"], "_source": f"{cfg.vocab_mapping_dir}/meta.json"}
    expect["verifier"] = {k: v for k, v in expect["verifier"].items() if k != "path"}
    shard_set = open_shards(cfg.data_dir, expect=expect)
    if cfg.split_dir:
        train_refs, val_refs = load_split(Path(cfg.split_dir), shard_set.samples)
    else:
        train_refs, val_refs = split_samples(shard_set.samples, cfg.seed, cfg.val_ratio)
    if cfg.val_max_samples is not None:
        val_refs = val_refs[: cfg.val_max_samples]
    verifier_path = Path(cfg.verifier_path or shard_set.meta["verifier"]["path"])
    vmeta = shard_set.meta["verifier"]
    spec = DraftSpec(
        hidden_size=vmeta["hidden_size"],
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_norm_eps=vmeta["rms_norm_eps"],
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=vmeta["vocab_size"],
        draft_vocab_size=int(d2t.numel()),
        aux_layer_ids=tuple(shard_set.meta["aux_layer_ids"]),
        norm_before_residual=cfg.norm_before_residual,
    )

    run_meta = {
        "stage": "04_train",
        "draft": spec.to_json(),
        "source": shard_set.contract(),
        "verifier_path": str(verifier_path.resolve()),
        "vocab_mapping_dir": str(Path(cfg.vocab_mapping_dir).resolve()),
        "vocab_mapping_sha256": vocab_meta["mapping_sha256"],
        "shards": [str(s.resolve()) for s in shard_set.shards],
        "num_train": len(train_refs),
        "num_val": len(val_refs),
        "train_lm_head": cfg.train_lm_head,
        "ttt_steps": cfg.ttt_steps,
    }
    resume_from = None if cfg.overwrite else checkpoint.latest(ckpt_root)
    if dist.rank == 0:
        if cfg.overwrite and out_dir.exists():
            import shutil

            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        meta_path = out_dir / storage.META_NAME
        if resume_from is not None and meta_path.exists():
            old = storage.read_json(meta_path)
            changed = [
                k
                for k in ("draft", "vocab_mapping_sha256", "shards", "num_train", "ttt_steps")
                if old.get(k) != run_meta[k]
            ]
            if changed:
                raise UserError(
                    f"{meta_path}: the checkpoints in {ckpt_root} were trained with other {', '.join(changed)}; "
                    "an exact resume needs the same; use another --out-dir or --overwrite"
                )
        storage.write_json_atomic(
            meta_path, {**run_meta, "config": config_to_dict(cfg), "versions": storage.versions()}
        )

    model = build_draft(spec, attn_impl="sdpa")
    attach_verifier_tensors(
        model, load_verifier_tensors(verifier_path, vmeta.get("tie_word_embeddings", False)), t2d, d2t
    )
    names = trainable_names(model, cfg.train_lm_head)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    model.to(device)
    autocast_dtype = _autocast_dtype(cfg.dtype, device)
    ddp_model = model
    if dist.enabled:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    params = [p for n, p in model.named_parameters() if n in names]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    per_rank = max(
        1,
        len(micro_batches(train_refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, 0))
        // (dist.world * cfg.grad_accum),
    )
    total_steps = (
        per_rank * cfg.epochs if cfg.max_steps is None else min(cfg.max_steps, per_rank * cfg.epochs)
    )
    if cfg.max_steps is not None and cfg.max_steps > per_rank * cfg.epochs:
        total_steps = cfg.max_steps  # more steps than epochs allow: keep cycling over the data
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    )

    step = 0
    history: dict[str, Any] = {}
    if resume_from is not None:
        weights, state, info = checkpoint.load(resume_from)
        model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        step = info["step"]
        history = info.get("history", {})
        log.info("resumed from %s (step %d of %d)", resume_from, step, total_steps)
    if step >= total_steps:
        log.info(
            "skip: %s already reached step %d of %d (use --overwrite to retrain)", out_dir, step, total_steps
        )
        return 0

    val_loader = _loader(
        _rank_slice(micro_batches(val_refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, 0), dist), cfg
    )
    if "untrained" not in history and val_refs:
        history["untrained"] = validate(ddp_model, val_loader, cfg, device, autocast_dtype, dist)
        _log_val(0, history["untrained"], "untrained")

    stop = StopFlag()
    t0, tokens_seen, sums, start_step = time.time(), 0, {}, step
    log_path = out_dir / "train_log.jsonl"
    bar = progress(total=total_steps, initial=step, desc="train", unit="step")
    ddp_model.train()
    while step < total_steps:
        epoch, in_epoch = divmod(step, per_rank)
        batches = _rank_slice(
            micro_batches(train_refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, epoch), dist
        )
        start = in_epoch * cfg.grad_accum
        take = [batches[i % len(batches)] for i in range(start, per_rank * cfg.grad_accum)]
        loader = _loader(take, cfg)
        it = iter(loader)
        while step < total_steps and in_epoch < per_rank:
            optimizer.zero_grad(set_to_none=True)
            for _ in range(cfg.grad_accum):
                batch = next(it)
                loss, metrics = forward(
                    ddp_model, batch, cfg.ttt_steps, cfg.ttt_step_loss_decay, device, autocast_dtype
                )
                (loss / cfg.grad_accum).backward()
                accumulate(sums, metrics)
                tokens_seen += int(batch["input_ids"].numel()) * dist.world
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            in_epoch += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                m = summarize(all_reduce_sums(sums, dist, device), cfg.ttt_steps)
                elapsed = time.time() - t0
                line = {
                    "step": step,
                    "epoch": epoch,
                    "loss": m["loss"],
                    "acc0": m["acc_0"],
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(grad_norm),
                    "tok_per_s": tokens_seen / max(elapsed, 1e-9),
                }
                log.info(
                    "step %d/%d | loss %.4f | acc0 %.3f | lr %.2e | gnorm %.2f | tok/s %.0f | eta %.0fs",
                    step,
                    total_steps,
                    m["loss"],
                    m["acc_0"],
                    line["lr"],
                    line["grad_norm"],
                    line["tok_per_s"],
                    elapsed / max(1, step - start_step) * (total_steps - step),
                )
                if dist.rank == 0:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(line) + "\n")
                sums = {}
            last = step == total_steps
            val = None
            if val_refs and (step % cfg.eval_every == 0 or last):
                val = validate(ddp_model, val_loader, cfg, device, autocast_dtype, dist)
                history[f"step_{step}"] = val
                _log_val(step, val, "val")
            stopping = stop.agreed(dist, device)
            if step % cfg.save_every == 0 or last or stopping:
                _save(ckpt_root, step, model, names, optimizer, scheduler, val, history, cfg, dist)
            if stopping:
                log.warning(
                    "signal %d: checkpoint saved at step %d; rerun the same command to resume",
                    stop.signum,
                    step,
                )
                bar.close()
                return EXIT_INTERRUPTED
    bar.close()
    if dist.rank == 0 and "untrained" in history:
        final = history.get(f"step_{total_steps}", {})
        log.info(
            "done %s | val acc0 %.3f (untrained %.3f) | acceptance_length %.3f (untrained %.3f)",
            out_dir,
            final.get("acc_0", float("nan")),
            history["untrained"]["acc_0"],
            final.get("acceptance_length", float("nan")),
            history["untrained"]["acceptance_length"],
        )
    if dist.enabled:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


def _autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; fp32 on CPU (this CPU has no bf16 instructions: ~35x slower)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float32":
        return None
    raise UserError(f"dtype {name!r}: use auto, bfloat16 or float32")


def _rank_slice(batches: list[list[SampleRef]], dist: Dist) -> list[list[SampleRef]]:
    return batches[dist.rank :: dist.world] or batches[:1]


def _loader(batches: list[list[SampleRef]], cfg: TrainConfig) -> Any:
    return torch.utils.data.DataLoader(
        BatchDataset(batches, cfg.max_seq_len),
        batch_size=None,
        shuffle=False,
        num_workers=cfg.num_workers,
        persistent_workers=False,
    )


def _log_val(step: int, val: dict[str, float], label: str) -> None:
    steps = sorted(int(k.split("_")[1]) for k in val if k.startswith("acc_"))
    accs = " ".join(f"acc{s} {val[f'acc_{s}']:.3f}" for s in steps)
    conds = " ".join(f"cond{s} {val[f'cond_{s}']:.3f}" for s in steps)
    log.info(
        "%s step %d | loss %.4f | %s | %s | acceptance_length %.3f",
        label,
        step,
        val["loss"],
        accs,
        conds,
        val["acceptance_length"],
    )


def _save(
    root: Path,
    step: int,
    model: Any,
    names: list[str],
    optimizer: Any,
    scheduler: Any,
    val: dict[str, float] | None,
    history: dict[str, Any],
    cfg: TrainConfig,
    dist: Dist,
) -> None:
    if dist.rank == 0:
        state = dict(model.named_parameters())
        weights = {n: state[n] for n in names}
        train_state = {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": checkpoint.rng_state(),
        }
        info = {"history": history}
        if val is not None:
            info["val"] = val
        path = checkpoint.save(root, step, weights, train_state, info, cfg.keep_last)
        log.info("checkpoint %s", path)
    if dist.enabled:
        torch.distributed.barrier()
