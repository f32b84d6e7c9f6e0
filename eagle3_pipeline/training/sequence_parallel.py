"""Sequence parallelism: one packed row trained by `sequence_parallel` (sp) ranks together, for samples
longer than one GPU holds; exact (the loss and gradients of one process on the whole row).

Ranks: world = data-parallel groups x sp, each sp group sp consecutive ranks (0..sp-1, sp..2sp-1, ...).
Every rank of a group trains the same packed row (the epoch's micro-batches are dealt by data-parallel
rank, `Dist.dp_rank`), different groups different rows; DDP around the draft as before.

The row (packed, L positions) is padded to a multiple of sp (document id -1, loss mask 0: padding sees
only itself and carries no loss) and rank r holds positions r*n..(r+1)*n-1 (n = ceil(L / sp)):
their aux states and position ids (RoPE at the row's own positions), plus the input ids, verifier states
and loss mask of the next ttt_steps - 1 positions (TTT step s reads the token and the target s positions
ahead), and the whole row's document ids. Per decoder layer, step 0's keys and values of all L positions
are all-gathered over the group (torch.distributed.nn.functional.all_gather: its backward sums each
position's key/value gradients back to the rank that holds it), once per forward, and the rank's queries
attend to them with linear_memory's blockwise attention (the row's document mask at the rank's offset);
later TTT steps' keys are each query's own position, local. Each rank's chunked loss covers its positions
and divides by the row's mask counts (all-reduced), so the group's losses sum to the row's; the
metrics are summed over the group (every rank holds the row's), and counted once per group
(distributed.all_reduce_sums). DDP averages gradients over all dp x sp ranks; each rank's loss is
returned times sp, so the average is the sum over the group (the row's gradient) meaned over the rows.

Memory per rank, at a packed row of L positions and sp ranks (what `--plan` sizes sp with):
  activations of L/sp positions (the draft's hidden states, q/k/v, MLP, the chunked loss: what one
  process holds at L/sp, linear_memory.py), plus per decoder layer step 0's keys and values of all L
  positions, all-gathered and kept for backward: 2 x L x num_attention_heads x head_dim x dtype bytes
  (the key/value heads repeated to the query heads, as the blockwise attention reads them), plus the
  row's inputs of L/sp positions (aux states [L/sp, 3 hidden]) and its document ids [L] (int64), plus
  the weights, gradients and AdamW state of the draft, replicated on every rank.
Launch: `torchrun --nproc-per-node 8 04_train.py --config run.toml --sequence-parallel 8
--attn-impl blockwise --loss-impl chunked` (docs/reference.md "Sequence parallelism").
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models import linear_memory
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.training.distributed import Dist

SETTING = "--sequence-parallel"


@dataclass
class SeqGroup:
    """This rank's sequence-parallel group: its size, this rank's index in it, the process group."""

    size: int
    rank: int
    group: Any


def check(cfg: Any, world: int) -> None:
    """Refuse a sequence_parallel the run cannot train with, naming the setting and the fix."""
    sp = int(cfg.sequence_parallel)
    if sp < 1 or world % sp:
        raise UserError(
            f"{SETTING} {sp}: it must divide the number of ranks ({world}: torchrun's nodes x "
            "--nproc-per-node); use a divisor of it, or launch sequence_parallel x data-parallel ranks"
        )
    if sp == 1:
        return
    if cfg.attn_impl != "blockwise" or cfg.loss_impl != "chunked":
        raise UserError(
            f"{SETTING} {sp} splits a row over ranks in the linear-memory forward: set --attn-impl "
            f"blockwise and --loss-impl chunked (now {cfg.attn_impl} and {cfg.loss_impl})"
        )
    if cfg.parallel_drafting:
        raise UserError(f"{SETTING} {sp}: a parallel draft (parallel_drafting) trains on one rank per row; "
                        f"set {SETTING} 1")  # fmt: skip
    if cfg.states != "shards":
        raise UserError(f"{SETTING} {sp}: states online fetch each row once per rank; train from shards "
                        f"(states = \"shards\") or set {SETTING} 1")  # fmt: skip


def setup(cfg: Any, dist: Dist) -> None:
    """Check the setting, make the groups (every rank makes every group, in one order, as torch wants)
    and record them on `dist` (sp, seq; dp_rank and dp_world follow)."""
    check(cfg, dist.world)
    sp = int(cfg.sequence_parallel)
    dist.sp = sp
    if sp == 1:
        return
    for first in range(0, dist.world, sp):
        group = torch.distributed.new_group(list(range(first, first + sp)))
        if first <= dist.rank < first + sp:
            dist.seq = SeqGroup(sp, dist.rank - first, group)


def slice_row(
    batch: dict[str, torch.Tensor], size: int, rank: int, ttt_steps: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s part of a packed row (pack() keys) split over `size` ranks: what linear_memory's
    ttt_forward takes with a RowShard (its docstring). The targets end where the row does, so the
    positions scored at each step are exactly one process's."""
    length = batch["input_ids"].shape[1]
    n = math.ceil(length / size)
    row = kernels.pad_batch(batch, n * size)
    a = rank * n
    ahead = min(a + n + ttt_steps - 1, length)
    return {
        "hidden_states": row["hidden_states"][:, a : a + n],
        "position_ids": row["position_ids"][:, a : a + n],
        "input_ids": row["input_ids"][:, a : a + n + ttt_steps - 1],
        "verifier_last": batch["verifier_last"][:, a : max(a, ahead)],
        "loss_mask": batch["loss_mask"][:, a : max(a, ahead)],
        "document_ids": row["document_ids"],
    }


@dataclass
class _Step0Gather:
    """DocumentMask.step0_keys over a group: each layer's step-0 keys and values all-gathered (autograd)
    once per forward, heads repeated for the queries, reused by the later TTT steps."""

    group: Any
    kept: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def __call__(self, module: Any, k: torch.Tensor, v: torch.Tensor, groups: int) -> tuple:
        from torch.distributed.nn.functional import all_gather
        from transformers.integrations.sdpa_attention import repeat_kv

        layer = getattr(module, "layer_idx", id(module))
        if layer not in self.kept:
            k0, v0 = (torch.cat(all_gather(t.contiguous(), group=self.group), dim=2) for t in (k, v))
            self.kept[layer] = repeat_kv(k0, groups), repeat_kv(v0, groups)
        return self.kept[layer]


def _group_sum(group: Any, t: torch.Tensor) -> torch.Tensor:
    out = t.detach().clone()
    torch.distributed.all_reduce(out, group=group)
    return out


def group_metrics(metrics: dict[str, torch.Tensor], group: Any) -> dict[str, torch.Tensor]:
    """The row's metrics from each rank's share: summed over the group, but the per-forward totals
    (loss_*_total: 1 each forward) that stay 1."""
    summed = sorted(k for k in metrics if not (k.endswith("_total") and "loss" in k))
    values = torch.stack([metrics[k].detach().double().reshape(()) for k in summed])
    torch.distributed.all_reduce(values, group=group)
    return {**metrics, **dict(zip(summed, values.unbind()))}


def _forward(self: Any, b: dict[str, torch.Tensor], ttt_steps: int, decay: float, loss_config: Any,
             blockwise: bool, chunked: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # fmt: skip
    """The draft's forward once bound: linear_memory.ttt_forward on the row, or on this rank's slice
    (b from slice_row), the loss times sp for DDP's average, the metrics the row's."""
    g: SeqGroup | None = self.sequence_parallel
    if g is None:
        return linear_memory.ttt_forward(self, b, ttt_steps, decay, loss_config, blockwise, chunked)
    n = b["hidden_states"].shape[1]
    shard = linear_memory.RowShard(g.rank * n, _Step0Gather(g.group), partial(_group_sum, g.group))
    loss, metrics = linear_memory.ttt_forward(self, b, ttt_steps, decay, loss_config, blockwise, chunked,
                                              shard)  # fmt: skip
    return loss * g.size, group_metrics(metrics, g.group)


def bind(model: Any, group: SeqGroup | None) -> None:
    """Make calling the model (or DDP around it, whose gradient hooks need the call to go through it)
    run the linear-memory TTT forward, over `group`'s slices of each row when given."""
    model.sequence_parallel = group
    model.forward = types.MethodType(_forward, model)


def bind_for(model: Any, spec: Any, kern: Any, dist: Dist) -> None:
    """`bind` a sequential draft that trains through the linear-memory forward (kern), sliced over
    `dist`'s sequence-parallel group if any; a parallel draft keeps its own forward (parallel.bind)."""
    if kern.linear_memory and not spec.parallel:
        bind(model, dist.seq)


def linear_forward(
    model: Any, batch: dict[str, torch.Tensor], recipe: Any, device: torch.device, kern: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """linear_memory.ttt_forward of a packed row: through the bound forward (`bind`), this rank's slice
    only moved to the device; an unbound draft (tests, benchmarks) runs it directly on the row."""
    inner = getattr(model, "module", model)
    group: SeqGroup | None = getattr(inner, "sequence_parallel", None)
    if group is None:
        part = kernels.pad_batch(batch, kernels.padded_length(batch["input_ids"].shape[1], kern))
    else:
        part = slice_row(batch, group.size, group.rank, recipe.ttt_steps)
    b = {k: v.to(device, non_blocking=True) for k, v in part.items()}
    args = (b, recipe.ttt_steps, recipe.ttt_step_loss_decay, recipe.loss_config(kern),
            kern.attn_impl == "blockwise", kern.loss_impl == "chunked")  # fmt: skip
    if hasattr(inner, "sequence_parallel"):
        return model(*args)
    return linear_memory.ttt_forward(model, *args)
