"""One forward of the draft with its loss, and the validation metrics summed over batches and ranks.

Validation reports per TTT step s: acc_s (steps 0..s all right: a prefix accepted) and cond_s (step s
right given 0..s-1 right), and acceptance_length = 1 + sum_s acc_s, the mean tokens per verifier step
that a greedy chain of ttt_steps drafts would yield; the best checkpoint is picked by it.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch

from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.training import sequence_parallel
from eagle3_pipeline.models.acceptance import Sampling
from eagle3_pipeline.training.distributed import Dist, all_reduce_sums

log = logging.getLogger("eagle3.train")


# Positions whose served targets are computed at once (a sort of [chunk, draft vocab] and its int64
# indices: 0.8 GB at Kimi's 32k draft vocab), so the transform never holds a batch's worth of them.
TARGET_CHUNK = 2048
# What a dropped token's target logit becomes: finite, so no loss meets -inf (0 * -inf is NaN where a
# loss multiplies a probability by a log-probability), and exp() of it is exactly 0 beside any kept logit.
DROPPED_LOGIT = -1e4


@dataclass(frozen=True)
class Recipe:
    """Every setting that changes a run's samples, their order, its loss or its weights: what one forward
    optimises and validation reports, and what a resume must find unchanged (train.check_resume compares
    these fields one by one; a new field is compared as soon as it is added here). Field names are the
    [train] keys. The forward reads TTT depth, the per-step loss decay, the loss (a speculators loss name or
    JSON weights, kernel_policy.loss_config), the k vLLM will serve with (acceptance_length counts that many
    steps; None: all), and the served distribution the loss compares: both logits / loss_temperature, the
    verifier's after top-p loss_top_p (1 and 1: speculators' plain logits). The rest shape the samples and
    the optimizer; None where only a forward is built (tests, benchmarks).

    Deliberately not here: how the same maths is computed (dtype, attn_impl, loss_impl, compile: a run may
    resume on another device; meta.json records them under "kernels"), where states come from (states,
    servers, transfer, cache_*: the same states), the draft's shapes and the data (compared as meta.json's
    "draft", "shard_manifests", "vocab_mapping_sha256"), and what only watches or keeps the run (log_every,
    eval_every, save_every, keep_last, num_workers, loggers, prefetch and request settings)."""

    ttt_steps: int
    ttt_step_loss_decay: float
    loss: str
    served_k: int | None = None
    loss_temperature: float = 1.0
    loss_top_p: float = 1.0
    # a parallel (P-EAGLE) draft: the depths trained and COD's sub-sampling (training/parallel.py)
    parallel_drafting: bool = False
    parallel_k: int | None = None
    cod_ratio: float | None = None
    cod_ratio_min: float | None = None
    # the samples and their order (split, shuffle, packing)
    seed: int | None = None
    val_ratio: float | None = None
    val_max_samples: int | None = None
    max_seq_len: int | None = None
    batch_tokens: int | None = None
    batching: str | None = None
    grad_accum: int | None = None
    loss_on_all_tokens: bool | None = None
    state_noise: float | None = None
    # the optimizer, the schedule and its length, what it trains
    epochs: int | None = None
    max_steps: int | None = None
    lr: float | None = None
    lr_schedule: str | None = None
    min_lr_ratio: float | None = None
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    train_lm_head: bool | None = None

    @classmethod
    def of(cls, cfg: Any) -> Recipe:
        """The recipe of a TrainConfig: each field read under its own name (val_ratio None with a split_dir:
        the split is stage 03's then, and num_train compares it)."""
        recipe = cls(**{f.name: getattr(cfg, f.name) for f in fields(cls)})
        return replace(recipe, val_ratio=None) if getattr(cfg, "split_dir", None) else recipe

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def depths(self) -> int:
        """The draft positions one forward trains and validation reports: TTT steps, or parallel_k."""
        return int(self.parallel_k) if self.parallel_drafting else self.ttt_steps

    def loss_config(self, kern: kernels.Kernels) -> dict[str, Any]:
        """speculators' loss_config for this recipe: its losses as they are, or (a served distribution)
        each loss called on the draft's logits / T and the verifier's served logits (served_targets)."""
        config = kernels.loss_config(kern, self.loss)
        if self.loss_temperature == 1.0 and self.loss_top_p >= 1.0:
            return config
        sampling = Sampling(self.loss_temperature, self.loss_top_p)

        def served(fn: Any) -> Any:
            def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
                drawn = logits if sampling.temperature == 1.0 else logits / sampling.temperature
                return fn(drawn, served_targets(targets, sampling))

            return loss

        return {name: (served(fn), weight) for name, (fn, weight) in config.items()}


@torch.no_grad()
def served_targets(targets: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The verifier's logits [..., T, V] as the distribution vLLM samples from (acceptance.Sampling:
    / temperature, top-p), dropped tokens at DROPPED_LOGIT; in targets' dtype, TARGET_CHUNK positions at
    a time."""
    out = torch.empty_like(targets)
    for i in range(0, targets.shape[-2], TARGET_CHUNK):
        chunk = sampling.logits(targets[..., i : i + TARGET_CHUNK, :])
        out[..., i : i + TARGET_CHUNK, :] = chunk.clamp_min(DROPPED_LOGIT).to(out.dtype)
    return out


def forward(
    model: Any,
    batch: dict[str, torch.Tensor],
    recipe: Recipe,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
    kern: kernels.Kernels,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """speculators' Eagle3DraftModel.forward over a packed batch: TTT unrolled, the recipe's loss against
    the verifier's distribution (a parallel draft: training/parallel.py, COD-sampled while training,
    every rollout in validation).

    The row is padded first where the kernels ask for it (flex: a multiple of its block; compile: a
    length bucket; kernel_policy.py says why); padding carries loss mask 0 and document id -1. Blockwise
    attention or the chunked loss: linear_memory.ttt_forward, the same loop in memory linear in the row
    (sequence parallelism: on this rank's slice of the row, training/sequence_parallel.py).
    """
    n = batch["input_ids"].shape[1]
    if kern.linear_memory and not recipe.parallel_drafting:  # the row, or this rank's slice of it
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            return sequence_parallel.linear_forward(model, batch, recipe, device, kern)
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if recipe.parallel_drafting:  # training/parallel.py's forward, bound by parallel.bind (not padded)
        cod = (recipe.cod_ratio, recipe.cod_ratio_min) if model.training else None
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            return model(b, recipe.depths, cod, recipe.loss_config(kern))
    b = kernels.pad_batch(b, kernels.padded_length(n, kern))
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        _, value, metrics = model(
            hidden_states=b["hidden_states"],
            input_ids=b["input_ids"],
            document_ids=b["document_ids"],
            loss_mask=b["loss_mask"],
            position_ids=b["position_ids"],
            verifier_last_hidden_states=b["verifier_last"],
            ttt_steps=recipe.ttt_steps,
            ttt_step_loss_decay=recipe.ttt_step_loss_decay,
            loss_config=recipe.loss_config(kern),
        )
    return value, metrics


def with_state_noise(batch: dict[str, torch.Tensor], scale: float, seed: int) -> dict[str, torch.Tensor]:
    """The batch with Gaussian noise on its aux states, `scale` times each token's RMS (EAGLE's feature
    augmentation: the draft meets states it has not memorised); seeded per step, so a resume repeats it."""
    h = batch["hidden_states"]
    g = torch.Generator().manual_seed(seed)
    rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(h.shape, generator=g, dtype=torch.float32) * (scale * rms)
    return {**batch, "hidden_states": (h.float() + noise).to(h.dtype)}


def accumulate(sums: dict[str, float], metrics: dict[str, torch.Tensor], weight: float = 1.0) -> None:
    """Add a batch's metrics; weight 0 (a padding micro-batch) adds only its keys, so that the sums of
    every rank have the same keys when all_reduce_sums adds them up."""
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + weight * float(v)
    sums["n"] = sums.get("n", 0.0) + weight


def non_finite_slots(flags: torch.Tensor, dist: Dist) -> list[int]:
    """The slots of a step (micro x world + rank) whose loss was NaN or Inf, `flags` [slots] set by each
    rank for its own; all-reduced, so every rank takes the same decision (one rank stopping alone would
    leave the others waiting in the next collective)."""
    if dist.enabled:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    return [int(i) for i in flags.nonzero().flatten().tolist()]


def summarize(sums: dict[str, float], ttt_steps: int, served_k: int | None = None) -> dict[str, float]:
    """Ratios from summed counts: acc_s, cond_s, loss, and acceptance_length over the first `served_k`
    steps (the k vLLM will serve with; a run may train deeper than it serves)."""
    out = {"loss": sums.get("loss_sum", 0.0) / max(sums.get("n", 1.0), 1.0)}
    acc_total = 0.0
    for s in range(ttt_steps):
        acc = sums.get(f"full_acc_{s}_sum", 0.0) / max(sums.get(f"full_acc_{s}_total", 0.0), 1.0)
        out[f"acc_{s}"] = acc
        out[f"cond_{s}"] = sums.get(f"cond_acc_{s}_sum", 0.0) / max(sums.get(f"cond_acc_{s}_total", 0.0), 1.0)
        if served_k is None or s < served_k:
            acc_total += acc
    out["acceptance_length"] = 1.0 + acc_total
    return out


@torch.no_grad()
def validate(
    model: Any,
    loader: Any,
    recipe: Recipe,
    device: torch.device,
    autocast_dtype: Any,
    dist: Dist,
    kern: kernels.Kernels,
) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    for batch in loader:
        _, metrics = forward(model, batch, recipe, device, autocast_dtype, kern)
        accumulate(sums, metrics)
    model.train()
    return summarize(all_reduce_sums(sums, dist, device), recipe.depths, recipe.served_k)


def log_validation(step: int, val: dict[str, float], label: str) -> None:
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
