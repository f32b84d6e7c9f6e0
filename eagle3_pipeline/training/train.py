"""Stage 04: train the EAGLE-3 head with training-time test (TTT), resumable bit for bit.

A run is set up in pieces, each readable on its own: the data (`open_data`), the draft's shape
(`draft_spec`), the resume check (`check_resume`), the model (`build_model`), the optimizer and the
scheduler sized from the run's length (`build_optimizer`, schedule.py), the resume (`restore`), the
online servers; only then the output folder (core/output.py's StageOutput, built in place: a refused run
writes nothing, and --overwrite keeps the old run until the new one's first checkpoint), then the step loop
(`TrainLoop`), its interval log in interval_log.py and a NaN step's diagnosis in non_finite.py. Packing
lives in packing.py, which micro-batches each rank trains at each step (every sample once an epoch, on any
number of ranks) in epochs.py, the loss, validation metrics and the Recipe a resume compares in
train_metrics.py, torchrun plumbing (several nodes, a lost rank) in distributed.py, the choice of
attention, loss and compile for the device in kernel_policy.py (recorded in meta.json under "kernels").
Per micro-batch, samples are packed into one row with document ids (packing.py); TTT unrolls
`ttt_steps` steps, each feeding the draft's own output back (speculators' Eagle3DraftModel.forward); a
parallel draft (`parallel_drafting`) trains all its depths in one forward instead (parallel.py; its COD
sampling draws from the CPU generator that checkpoints save and restore).
With `states = "online"` the micro-batches are the same, their states asked of `vllm serve` processes
while training (online.py) instead of read from shards.
"""

from __future__ import annotations

import gc
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.training import checkpoint, parallel, plots, schedule, sequence_parallel, trackers
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.core import rope_scaling, storage
from eagle3_pipeline.core.cli import EXIT_INTERRUPTED, progress
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.core.config import config_to_dict, provenance
from eagle3_pipeline.training.distributed import (
    Dist,
    StopFlag,
    check_run_dir,
    init_distributed,
    lost_rank_error,
    rank0_output_lock,
    rank_slice,
)
from eagle3_pipeline.models.draft import (
    DraftSpec,
    attach_verifier_tensors,
    build_draft,
    rope_parameters_of,
    spec_for_training,
    trainable_names,
)
from eagle3_pipeline.training.interval_log import Meter, log_interval
from eagle3_pipeline.training.non_finite import step_error
from eagle3_pipeline.training.epochs import EpochCount, EpochPlan, padding_of
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import StageOutput, same_run
from eagle3_pipeline.training.online import NoServerLeft
from eagle3_pipeline.data.packing import ERROR_KEY, BatchDataset, micro_batches, pack, raise_batch_errors
from eagle3_pipeline.data.shards import (
    SampleRef, ShardSet, check_built_from, has_states, open_shards,
)
from eagle3_pipeline.data.split import load_split, split_samples
from eagle3_pipeline.training.train_metrics import (
    Recipe,
    accumulate,
    forward,
    log_validation,
    non_finite_slots,
    validate,
    with_state_noise,
)
from eagle3_pipeline.models.verifier import check_verifier, draft_tensors_of, read_text_config
from eagle3_pipeline.data.vocab import load_mapping

log = logging.getLogger("eagle3.train")

# Fields of meta.json that must not change under a resume (bitwise-exact continuation needs them).
# "recipe" is train_metrics.Recipe, compared field by field (check_resume).
# The shards are compared by content (shard_manifests), not by path: a copied or moved run resumes.
RESUME_KEYS = ("draft", "vocab_mapping_sha256", "shard_manifests", "num_train", "recipe")


@dataclass
class RunData:
    shard_set: ShardSet
    train_refs: list[SampleRef]
    val_refs: list[SampleRef]
    vocab_meta: dict[str, Any]
    d2t: torch.Tensor
    t2d: torch.Tensor


@dataclass
class Plan:
    """How long the run is and how often it validates and saves, resolved from the config."""

    steps_per_epoch: int  # the first epoch's (each epoch packs its own shuffle: see epoch_steps)
    total_steps: int
    warmup_steps: int
    eval_every: int
    save_every: int
    epoch_steps: list[int]  # optimizer steps of each of the config's epochs: every micro-batch once


def epoch_plan(cfg: TrainConfig, refs: list[SampleRef], dist: Dist, epoch: int) -> EpochPlan:
    """One epoch's shuffle packed, dealt over the ranks and grad_accum (epochs.py)."""
    batches = micro_batches(refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, epoch, cfg.batching)
    return EpochPlan(epoch, batches, dist.dp_world, dist.dp_rank, cfg.grad_accum)


def steps_of_epoch(cfg: TrainConfig, refs: list[SampleRef], dist: Dist, epoch: int) -> int:
    """Optimizer steps of one epoch: every micro-batch once, the last step padded (epochs.py)."""
    return epoch_plan(cfg, refs, dist, epoch).steps


@dataclass
class Progress:
    step: int = 0
    history: dict[str, Any] = field(default_factory=dict)


def open_data(cfg: TrainConfig) -> RunData:
    vocab_meta, d2t, t2d = load_mapping(Path(cfg.vocab_mapping_dir))
    expect = {**vocab_meta["source"], "_source": f"{cfg.vocab_mapping_dir}/meta.json"}
    expect["verifier"] = {k: v for k, v in expect["verifier"].items() if k != "path"}
    shard_set = open_shards(cfg.data_dir, expect=expect)
    check_built_from(Path(cfg.vocab_mapping_dir), shard_set, "--vocab-mapping-dir")
    if cfg.states == "shards" and not has_states(shard_set.meta):
        raise UserError(
            f"{shard_set.shards[0]}: a token shard (stage 01 --storage-dtype none: no hidden states); train "
            'on it with --states online and running vLLM servers (--servers), or extract states into shards'
        )
    needs_all = {"states online": cfg.states == "online", "loss_on_all_tokens": cfg.loss_on_all_tokens}
    cut = next((r for r in shard_set.samples if r.position), None) if any(needs_all.values()) else None
    if cut is not None:
        raise UserError(
            f"{cut.shard}: sample {cut.sample_id!r} is stored from position {cut.position} on (stage 01's "
            f"context_tokens), but {' and '.join(k for k, v in needs_all.items() if v)} needs every token "
            "of a sample; extract without --context-tokens (online: token shards, --storage-dtype none)"
        )
    if cfg.split_dir:
        check_built_from(Path(cfg.split_dir), shard_set, "--split-dir")
        train_refs, val_refs = load_split(Path(cfg.split_dir), shard_set.samples)
    else:
        train_refs, val_refs = split_samples(shard_set.samples, cfg.seed, cfg.val_ratio)
    if cfg.val_max_samples is not None:
        val_refs = val_refs[: cfg.val_max_samples]
    return RunData(shard_set, train_refs, val_refs, vocab_meta, d2t, t2d)


def draft_spec(cfg: TrainConfig, data: RunData) -> DraftSpec:
    meta = data.shard_set.meta
    verifier = meta["verifier"]
    # the MLA dims [train] leaves unset, and rope_scaling "verifier", come from the verifier's config.json
    if cfg.draft_arch == "mla" or cfg.rope_scaling == rope_scaling.VERIFIER:
        verifier = {**read_text_config(Path(cfg.verifier_path or data.shard_set.verifier_path())), **verifier}
    return spec_for_training(cfg, verifier, int(data.d2t.numel()), meta["aux_layer_ids"])


def check_resume(cfg: TrainConfig, run_meta: dict[str, Any]) -> Path | None:
    """The checkpoint to resume from, if any (none with --overwrite), refused when the run folder's meta.json
    records other RESUME_KEYS or another Recipe field (named, with the flag: output.same_run); reads
    only."""
    out_dir = Path(cfg.out_dir)
    resume_from = None if cfg.overwrite else checkpoint.latest(checkpoint.root_of(out_dir))
    meta_path = out_dir / storage.META_NAME
    if resume_from is None or not meta_path.exists():
        return resume_from
    keys = list(RESUME_KEYS)
    if "shard_manifests" not in storage.read_json(meta_path):  # an older version's: shards recorded by path
        log.warning("%s records no shard checksums (older version): the shards are not compared", meta_path)
        keys.remove("shard_manifests")
    same_run(meta_path, run_meta, keys, flags="recipe",
             state=f"trained the checkpoints in {checkpoint.root_of(out_dir)}")  # fmt: skip
    return resume_from


def resolve_kernels(cfg: TrainConfig, device: torch.device) -> kernels.Kernels:
    """attn_impl, loss_impl and compile for this device (kernel_policy.py); a packed row holds at most
    max(batch_tokens, max_seq_len) tokens (one over-long sample alone)."""
    return kernels.resolve(cfg.attn_impl, cfg.loss_impl, cfg.compile, device,
                           max(cfg.batch_tokens, cfg.max_seq_len), windowed=cfg.sliding_window is not None)


def build_model(
    cfg: TrainConfig,
    spec: DraftSpec,
    data: RunData,
    verifier_path: Path,
    device: torch.device,
    kern: kernels.Kernels,
) -> tuple[Any, list[str]]:
    """The draft with the verifier's embedding, teacher head/norm and draft lm_head rows attached,
    built for the resolved attention and with its forward compiled or not (kernels.set_compile)."""
    model = build_draft(spec, attn_impl=kern.hf_attn_impl)
    attach_verifier_tensors(model, draft_tensors_of(verifier_path), data.t2d, data.d2t)
    names = trainable_names(model, cfg.train_lm_head)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    model = model.to(device)
    if spec.parallel:  # its forward is training/parallel.py's, its attention compiled for dynamic shapes
        parallel.bind(model, compiled=kern.compile)
    else:
        kernels.set_compile(model, kern)
    return model, names


def plan_run(cfg: TrainConfig, data: RunData, dist: Dist) -> Plan:
    epoch_steps = [steps_of_epoch(cfg, data.train_refs, dist, e) for e in range(cfg.epochs)]
    total = schedule.total_steps(epoch_steps, cfg.max_steps)
    return Plan(
        steps_per_epoch=epoch_steps[0],
        epoch_steps=epoch_steps,
        total_steps=total,
        warmup_steps=schedule.warmup_steps_for(total, cfg.warmup_ratio, cfg.warmup_steps),
        eval_every=schedule.every_for(total, cfg.eval_every),
        save_every=schedule.every_for(total, cfg.save_every if cfg.save_every else cfg.eval_every),
    )


def build_optimizer(cfg: TrainConfig, params: list[torch.nn.Parameter], plan: Plan) -> tuple[Any, Any]:
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: schedule.lr_factor(
            s, plan.warmup_steps, plan.total_steps, cfg.min_lr_ratio, cfg.lr_schedule
        ),
    )
    return optimizer, scheduler


def restore(
    resume_from: Path | None, model: Any, optimizer: Any, scheduler: Any, total: int, per_step: int
) -> Progress:
    """The checkpoint's weights, optimizer, scheduler and RNG; refused when its steps took another number
    of micro-batches (ranks x grad_accum: which samples a step trains, epochs.py)."""
    if resume_from is None:
        return Progress()
    weights, state, info = checkpoint.load(resume_from)
    if info.get("micro_batches_per_step", per_step) != per_step:
        raise UserError(
            f"{resume_from}: trained with {info['micro_batches_per_step']} micro-batches a step (ranks x "
            f"grad_accum), this run takes {per_step}; rerun with as many data-parallel "
            "ranks (nodes x processes per node / sequence_parallel) as the run had, or use another --out-dir"
        )
    model.load_state_dict(weights, strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    checkpoint.set_rng_state(state["rng"])
    log.info("resumed from %s (step %d of %d)", resume_from, info["step"], total)
    return Progress(info["step"], info.get("history", {}))


def run(cfg: TrainConfig) -> int:
    """Every check and every input first (nothing written), then the run folder, then the steps; rank 0
    the one writer of the run folder from the start (a skip of a finished run too: it reads checkpoints
    a writer would be pruning)."""
    trackers.check_loggers(cfg.loggers)  # a tracker whose package is missing stops the run before any work
    dist, device = init_distributed(cfg.dist_timeout_s)
    out = StageOutput(cfg.out_dir, cfg.overwrite)
    with rank0_output_lock(out, dist):
        return _run(cfg, dist, device, out)


def _run(cfg: TrainConfig, dist: Dist, device: torch.device, out: StageOutput) -> int:
    torch.manual_seed(cfg.seed)
    sequence_parallel.setup(cfg, dist)  # before the plan: rows are dealt by data-parallel rank
    data = open_data(cfg)
    spec = draft_spec(cfg, data)
    verifier_path = Path(cfg.verifier_path or data.shard_set.verifier_path())
    shard_set = data.shard_set
    check_verifier(verifier_path, shard_set.meta["verifier"].get("fingerprint"),
                   shard_set.shards[0] / storage.META_NAME, shard_set.verifier_path())  # fmt: skip
    plan = plan_run(cfg, data, dist)
    kern = resolve_kernels(cfg, device)
    run_meta = _run_meta(cfg, data, spec, verifier_path, plan, kern)
    resume_from = check_resume(cfg, run_meta)
    if dist.rank == 0:
        out.check_asides(checkpoint.latest(checkpoint.root_of(out.out_dir)) is not None)
    model, names = build_model(cfg, spec, data, verifier_path, device, kern)
    sequence_parallel.bind_for(model, spec, kern, dist)  # the linear-memory forward called through DDP
    log.info("kernels | attention %s | loss %s (%s) | compile %s | rows padded to %s", kern.attn_impl,
             cfg.loss, kern.loss_impl, "on" if kern.compile else "off",
             kern.length_buckets or kern.pad_multiple)  # fmt: skip
    params = [p for n, p in model.named_parameters() if n in names]
    if dist.rank == 0:
        checkpoint.check_space(
            checkpoint.root_of(Path(cfg.out_dir)), cfg.keep_last, sum(p.numel() for p in params)
        )
    optimizer, scheduler = build_optimizer(cfg, params, plan)
    prog = restore(resume_from, model, optimizer, scheduler, plan.total_steps, dist.dp_world * cfg.grad_accum)
    if prog.step >= plan.total_steps:
        out.log_skip(f"already reached step {prog.step} of {plan.total_steps}", "retrain")
        return 0
    online = _open_online(cfg, data, dist)  # the servers asked before anything is written
    log.info("plan | steps %d (%d per epoch) | warm-up %d | validate every %d | save every %d | lr %.1e %s",
             plan.total_steps, plan.steps_per_epoch, plan.warmup_steps, plan.eval_every, plan.save_every,
             cfg.lr, cfg.lr_schedule)  # fmt: skip
    try:
        # the old run (--overwrite) kept aside until the new run's first checkpoint; opened inside the
        # block, so that a meta.json the disk refuses puts the old run back
        if dist.rank == 0:
            out.open_in_place("run", {**run_meta, **provenance(cfg)})
        # every rank sees rank 0's run folder and its checkpoint (a folder local to each node is refused)
        check_run_dir(Path(cfg.out_dir), resume_from, dist)
        tracker = trackers.open_trackers(
            cfg.loggers, Path(cfg.out_dir), config_to_dict(cfg), prog.step, dist.rank
        )
        ddp_model = model
        if dist.enabled:
            # broadcast_buffers off: the draft's buffers (d2t, t2d, rotary inv_freq) are built equal on every
            # rank and never change, so rank 0's copy sent before each forward is a collective for nothing
            ddp_model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False
            )
        loop = TrainLoop(cfg, plan, dist, device, ddp_model, model, names, params, optimizer, scheduler, data,
                         kern, online, tracker, out.kept)  # fmt: skip
        try:
            code = loop.run(prog)
        except RuntimeError as e:  # a rank lost (its node, its process): one line naming it, not a traceback
            lost = lost_rank_error(e, dist, checkpoint.latest(checkpoint.root_of(Path(cfg.out_dir))))
            if lost is None:
                raise
            raise lost from None
        finally:
            tracker.close()
    finally:
        if dist.rank == 0:  # no checkpoint saved: the old run back, a folder this run made removed
            out.close_in_place()
    # DDP's reducer holds the process group: freed (its reference cycles too) before the group is destroyed,
    # not at interpreter exit, where a gloo worker thread still alive aborts the rank ("terminate called
    # without an active exception", SIGABRT after a finished run)
    del loop, ddp_model
    gc.collect()
    return _finish(cfg, plan, dist, prog, code)


def _open_online(cfg: TrainConfig, data: RunData, dist: Dist) -> Any:
    """With states = "online": the servers' client (one of them must answer) and the cache; else None."""
    if cfg.states != "online":
        return None
    from eagle3_pipeline.training.online import OnlineSource

    return OnlineSource(cfg, data.shard_set.meta, Path(cfg.out_dir), dist.world)


def _run_meta(cfg: TrainConfig, data: RunData, spec: DraftSpec, verifier_path: Path, plan: Plan,
              kern: kernels.Kernels) -> dict[str, Any]:  # fmt: skip
    """What meta.json records of the run (a resume must find the same RESUME_KEYS)."""
    return {
        "stage": "04_train",
        "draft": spec.to_json(),
        **data.shard_set.made_from(Path(cfg.out_dir)),
        "verifier_path": storage.record_path(verifier_path, Path(cfg.out_dir)),
        "vocab_mapping_dir": storage.record_path(cfg.vocab_mapping_dir, Path(cfg.out_dir)),
        storage.WRITTEN_IN: os.path.abspath(cfg.out_dir),
        "vocab_mapping_sha256": data.vocab_meta["mapping_sha256"],
        "num_train": len(data.train_refs),
        "num_val": len(data.val_refs),
        "train_lm_head": cfg.train_lm_head,
        "ttt_steps": cfg.ttt_steps,
        "recipe": Recipe.of(cfg).to_json(),
        "plan": vars(plan),
        "kernels": kern.to_json(),
        "states": {"source": cfg.states, **({"servers": cfg.servers, "transfer": cfg.transfer}
                                            if cfg.states == "online" else {})},
    }


def _finish(cfg: TrainConfig, plan: Plan, dist: Dist, prog: Progress, code: int) -> int:
    """Plots (an interrupted run too: they show the run so far), the closing line, the process group."""
    if dist.rank == 0:
        paths = plots.write_training_plots(Path(cfg.out_dir), prog.history)
        log.info("plots %s", ", ".join(str(p) for p in paths))
    if code:
        return code
    if dist.rank == 0 and "untrained" in prog.history:
        final, untrained = prog.history.get(f"step_{plan.total_steps}", {}), prog.history["untrained"]
        log.info("done %s | val acc0 %.3f (untrained %.3f) | acceptance_length %.3f (untrained %.3f)",
                 cfg.out_dir, final.get("acc_0", float("nan")), untrained["acc_0"],
                 final.get("acceptance_length", float("nan")), untrained["acceptance_length"])  # fmt: skip
    if dist.enabled:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


@dataclass
class TrainLoop:
    """The optimizer steps from a Progress to the plan's end: log, validate, save, stop on signal."""

    cfg: TrainConfig
    plan: Plan
    dist: Dist
    device: torch.device
    ddp_model: Any
    model: Any
    names: list[str]
    params: list[torch.nn.Parameter]
    optimizer: Any
    scheduler: Any
    data: RunData
    kern: kernels.Kernels
    online: Any = None  # online.OnlineSource with states = "online"
    tracker: trackers.Trackers = field(default_factory=trackers.Trackers)
    on_saved: Any = None  # called after each complete checkpoint (StageOutput.kept)

    def __post_init__(self) -> None:
        self.autocast_dtype = _autocast_dtype(self.cfg.dtype, self.device)
        self.recipe = Recipe.of(self.cfg)
        self.checkpoints = checkpoint.Checkpointer(
            checkpoint.root_of(Path(self.cfg.out_dir)), self.cfg.keep_last, self.plan.save_every,
            self.plan.total_steps, self.model, self.names, self.optimizer, self.scheduler, self.dist,
            self.device, on_saved=self.on_saved,
            facts={"micro_batches_per_step": self.dist.dp_world * self.cfg.grad_accum,
                   "rope_parameters": rope_parameters_of(self.model)},
        )  # fmt: skip
        self.val_loader = self._loader(
            rank_slice(micro_batches(self.data.val_refs, self.cfg.batch_tokens, self.cfg.max_seq_len,
                                     self.cfg.seed, 0), self.dist), "validation"
        )  # fmt: skip

    def _loader(self, batches: list[list[SampleRef]], label: str) -> Any:
        """The packed micro-batches: read from the shards (DataLoader workers), or online (online.py)."""
        if self.online is not None:
            return self.online.batches(batches, label)
        return _Checked(
            torch.utils.data.DataLoader(
                BatchDataset(batches, self.cfg.max_seq_len, self.cfg.loss_on_all_tokens),
                batch_size=None,
                shuffle=False,
                num_workers=self.cfg.num_workers,
                persistent_workers=False,
            )
        )

    def validate(self) -> dict[str, float]:
        return validate(self.ddp_model, self.val_loader, self.recipe, self.device, self.autocast_dtype,
                        self.dist, self.kern)  # fmt: skip

    def epoch_batches(self, step: int) -> tuple[EpochPlan, int, Any]:
        """(the epoch's plan, position in it, iterator of (refs, batch) over the rest of this rank's real
        micro-batches) for a global step. Each epoch trains each of its micro-batches once (epochs.py)."""
        epoch, in_epoch = 0, step
        while in_epoch >= _steps_in(self, epoch):
            in_epoch -= _steps_in(self, epoch)
            epoch += 1
        ep = epoch_plan(self.cfg, self.data.train_refs, self.dist, epoch)
        mine = ep.rank_batches(in_epoch)
        return ep, in_epoch, zip(mine, self._loader(mine, f"epoch {epoch}"))

    def optimizer_step(
        self, it: Any, sums: dict[str, float], step: int, count: EpochCount
    ) -> tuple[float, int]:
        """grad_accum micro-batches (padding past the epoch's last: weight 0), clip, step; (gradient norm,
        tokens seen by all ranks). A step whose loss (on any rank) or gradient norm is NaN or Inf is not
        applied: the run stops with a UserError naming the step and its samples (non_finite.py)."""
        cfg, ep, in_epoch = self.cfg, count.plan, step - count.epoch_start
        self.optimizer.zero_grad(set_to_none=True)
        tokens = 0
        # per slot of the step (micro x world + rank): its loss is not finite; set on the device, no sync
        flags = torch.zeros(cfg.grad_accum * self.dist.dp_world, device=self.device)
        for micro in range(cfg.grad_accum):
            refs, batch = next(it) if ep.is_real(in_epoch, micro) else (None, _padding(self))
            if cfg.state_noise:
                seed = ((cfg.seed * 1_000_003 + step) * 64 + micro) * 1024 + self.dist.dp_rank
                batch = with_state_noise(batch, cfg.state_noise, seed)
            loss, metrics = forward(
                self.ddp_model, batch, self.recipe, self.device, self.autocast_dtype, self.kern
            )
            flags[micro * self.dist.dp_world + self.dist.dp_rank] = (~torch.isfinite(loss.detach())).any()
            count.add(refs, batch)
            if refs is None:
                (loss * 0.0).backward()  # DDP's all-reduce needs this rank's backward; it adds nothing
                accumulate(sums, metrics, weight=0.0)
                continue
            (loss / ep.loss_divisor(in_epoch)).backward()
            accumulate(sums, metrics)
            tokens += int(batch["input_ids"].numel()) * self.dist.dp_world
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)  # global under DDP
        bad_slots = non_finite_slots(flags, self.dist)  # every rank the same: all stop, none waits
        if bad_slots or not math.isfinite(float(grad_norm)):
            raise step_error(self, step, ep, in_epoch, bad_slots, float(grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        return float(grad_norm), tokens

    def run(self, prog: Progress) -> int:
        cfg, plan = self.cfg, self.plan
        if "untrained" not in prog.history and self.data.val_refs:
            prog.history["untrained"] = self.validate()
            log_validation(0, prog.history["untrained"], "untrained")
            self.tracker.log(trackers.prefixed("val", prog.history["untrained"]), 0)
        stop = StopFlag()
        meter = Meter(prog.step)
        bar = progress(total=plan.total_steps, initial=prog.step, desc="train", unit="step")
        self.ddp_model.train()
        try:
            while prog.step < plan.total_steps:
                ep, in_epoch, it = self.epoch_batches(prog.step)
                count = EpochCount(ep, in_epoch, cfg.max_seq_len, epoch_start=prog.step - in_epoch)
                while prog.step < plan.total_steps and in_epoch < ep.steps:
                    grad_norm, tokens = self.optimizer_step(it, meter.sums, prog.step, count)
                    prog.step += 1
                    in_epoch += 1
                    meter.tokens += tokens
                    bar.update(1)
                    if prog.step % cfg.log_every == 0 or prog.step == plan.total_steps:
                        log_interval(self, prog.step, ep.epoch, grad_norm, meter)
                    if in_epoch == ep.steps:  # every rank at the same step: the sum over ranks, checked
                        count.report(self.dist, self.device)
                    if self._after_step(prog, stop):
                        msg = "signal %d: checkpoint saved at step %d; rerun the same command to resume"
                        log.warning(msg, stop.signum, prog.step)
                        return EXIT_INTERRUPTED
        except NoServerLeft:  # online states: keep the steps done; the same command resumes from here
            if prog.step:
                self.checkpoints.save(prog.step, prog.history, None)
                log.warning("checkpoint saved at step %d", prog.step)
            raise
        finally:
            bar.close()
        return 0

    def _after_step(self, prog: Progress, stop: StopFlag) -> bool:
        """Validate and save on the plan's cadence (and at the end, and on a signal); True to stop."""
        last = prog.step == self.plan.total_steps
        val = None
        if self.data.val_refs and (prog.step % self.plan.eval_every == 0 or last):
            val = self.validate()
            prog.history[f"step_{prog.step}"] = val
            log_validation(prog.step, val, "val")
            self.tracker.log(trackers.prefixed("val", val), prog.step)
        stopping = stop.agreed(self.dist, self.device)
        if self.checkpoints.due(prog.step, val is not None, stopping):
            self.checkpoints.save(prog.step, prog.history, val)
        return stopping


def _steps_in(loop: TrainLoop, epoch: int) -> int:
    """Optimizer steps of an epoch (past the config's epochs when max_steps cycles on)."""
    steps = loop.plan.epoch_steps
    while len(steps) <= epoch:
        steps.append(steps_of_epoch(loop.cfg, loop.data.train_refs, loop.dist, len(steps)))
    return steps[epoch]


def _padding(loop: TrainLoop) -> dict[str, torch.Tensor]:
    """The padding micro-batch (epochs.padding_of) of the run's first training sample, made once: read
    from its shard, or its states asked of the servers."""
    if getattr(loop, "_padding_batch", None) is None:
        ref, cfg = loop.data.train_refs[0], loop.cfg
        if loop.online is not None:
            batch = pack([loop.online.sample(ref)], cfg.max_seq_len, cfg.loss_on_all_tokens)
        else:
            batch = BatchDataset([[ref]], cfg.max_seq_len, cfg.loss_on_all_tokens)[0]
            if ERROR_KEY in batch:
                raise UserError(batch[ERROR_KEY])
        loop._padding_batch = padding_of(batch)
    return loop._padding_batch


@dataclass
class _Checked:
    """A DataLoader whose iteration raises the UserError of a batch that failed to load (packing.py)."""

    loader: Any

    def __iter__(self) -> Any:
        return raise_batch_errors(self.loader)


def _autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; fp32 on CPU (this CPU has no bf16 instructions: ~35x slower).
    `name` is one of config.TRAIN_DTYPES (TrainConfig refuses any other)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return torch.bfloat16 if name == "bfloat16" else None
