"""What a run will need, before any GPU is touched: shapes, parameters, disk, memory per GPU, steps, time.

`--plan` on 01_extract_hidden_states.py and 04_train.py prints this report (and `--plan-json` writes it)
from the verifier's config.json alone (no weights: the draft is built on the meta device) and the token
counts of the data: exact ones from shard manifests when shards exist, else a tokenized sample of the
data rows, else `--plan-tokens-per-row`. The real runs refuse to start when the disk they need exceeds
the free space (extract._check_free_space, checkpoint.check_space). It also shows what the draft
costs at serving time: its KV cache per token beside the verifier's, under tensor parallelism and under
data-parallel attention (kv_cache.py); and whether the trainer fits beside a vLLM server of the verifier
on the same GPUs, for online states (colocation.py); and the peak of one training step on one long
sample (32k-256k tokens) per GPU with the sequence-parallel ranks it needs (long_sample.py).

Memory per GPU under DDP (every rank holds the whole draft; PyTorch DDP docs) is an estimate from what
stays alive until backward (activations + mask checked against the tensors autograd saves for a tiny
draft on CPU: 0.998x at 1024 tokens, tests/test_plan.py; not yet measured on a GPU):
  weights      every parameter in fp32 (trainable ones, the frozen embedding, lm_head and the teacher head
               and norm) plus buffers (d2t int64, t2d bool)
  gradients    fp32, trainable parameters only; DDP keeps a second copy in its buckets
               (gradient_as_bucket_view=False, the default) when there is more than one GPU
  AdamW        exp_avg and exp_avg_sq, fp32 (torch.optim.AdamW)
  autocast     bf16 copies of the weights each Linear multiplies with (torch.autocast caches them)
  activations  per packed token T = max(batch_tokens, max_seq_len): the fp32 inputs (aux states, teacher
               state), fc in/out, the teacher's draft-vocab distribution (fp32); per TTT step the
               tensors the decoder layer, final norm, lm_head and the loss save for backward (KL: the larger)
               (8H + 2q + 4I + V_d values in the compute dtype, V_d fp32 log-probs); K/V of the
               growing cache (step s attends to (s+1)T keys: speculators Eagle3DraftModel.forward)
  attention    beyond q/k/v/output: masks and what the kernel keeps for backward, for the implementation
               the trainer resolves on the GPUs (auto: flex), from kernel_policy.attention_extra_terms,
               the trainer's own count (sdpa, flex, eager shown side by side).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.training import checkpoint
from eagle3_pipeline.sizing import colocation, kv_cache, long_sample, speedup
from eagle3_pipeline.data import length_mix, packing, state_dtype
from eagle3_pipeline.core import storage
from eagle3_pipeline.training import schedule
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.export_eval.config import ExportConfig
from eagle3_pipeline.data.config import ExtractConfig, SplitConfig, VocabConfig
from eagle3_pipeline.sizing.options import PlanOptions
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.core.config import SERVING_K, config_from_file, read_config_file, serving_k
from eagle3_pipeline.data.conversations import count_rows
from eagle3_pipeline.models.draft import DraftSpec, build_draft, spec_for_training, trainable_names
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.extract_render import extract_images
from eagle3_pipeline.data.samples import SampleOptions, sample_lengths
from eagle3_pipeline.models.verifier import (
    check_aux_layer_ids,
    default_aux_layer_ids,
    read_text_config,
    weight_bytes,
)

log = logging.getLogger("eagle3.plan")

TOKEN_ID_BYTES = 4 + 1  # input_ids int32 + loss_mask uint8 per token, beside the states
PLAN_DTYPES = ("float32", "bfloat16", state_dtype.FP8)


# ---- token counts -------------------------------------------------------------------------------


@dataclass
class Tokens:
    """The data as the plan sees it: token counts per sample (exact or a sample) scaled to the rows."""

    num_rows: int | None
    tokens_per_row: float | None
    lengths: list[int] | None  # per sample: all of them (exact) or a sample
    source: str

    @property
    def total(self) -> float | None:
        if self.num_rows is None or self.tokens_per_row is None:
            return None
        return self.num_rows * self.tokens_per_row


# ---- the draft ------------------------------------------------------------------------------------


def draft_report(spec: DraftSpec, train_lm_head: bool) -> dict[str, Any]:
    """Shapes and parameter counts of the draft, built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = build_draft(spec, attn_impl="sdpa")
    params = dict(model.named_parameters())
    trainable = set(trainable_names(model, train_lm_head))
    matmul = [n for n, p in params.items() if p.dim() == 2 and n != "embed_tokens.weight"]
    return {
        "shapes": {n: list(p.shape) for n, p in params.items()},
        "trainable": sorted(trainable),
        "trainable_parameters": sum(params[n].numel() for n in trainable),
        "total_parameters": sum(p.numel() for p in params.values()),
        "matmul_parameters": sum(params[n].numel() for n in matmul),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
    }


def memory_per_gpu(
    spec: DraftSpec, draft: dict[str, Any], cfg: TrainConfig, gpus: int, cuda: bool = True
) -> dict[str, Any]:
    """Bytes per GPU (module docstring); attention beyond q/k/v/output is kernel_policy's, for the
    implementation the trainer resolves on that device (`cuda`: the GPUs the plan is for)."""
    b = 4 if cfg.dtype == "float32" else 2  # auto is bf16 autocast on CUDA (train._autocast_dtype)
    T, S = max(cfg.batch_tokens, cfg.max_seq_len), cfg.ttt_steps
    H, inter, n_aux = spec.hidden_size, spec.intermediate_size, len(spec.aux_layer_ids)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
    cached = 2 * kv  # per cached token and step: k and v
    if spec.draft_arch == "mla":  # queries nope + rope wide; per cached token the latent, and the k and v
        q = spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim)  # expanded from it
        cached = spec.kv_lora_rank + q + spec.num_attention_heads * (spec.qk_nope_head_dim + spec.v_head_dim)
    Vd = spec.draft_vocab_size
    once = T * (n_aux * H * 4 + H * 4 + n_aux * H * b + H * b + Vd * 4)
    per_step = T * (b * (8 * H + 2 * q + 4 * inter + Vd) + 4 * Vd)
    kv_cache = sum(T * (s + 1) * cached * b for s in range(S))
    parts = {**long_sample.state_bytes(draft, gpus, b), "activations": once + S * per_step + kv_cache}
    chosen = kernels.attention_impl(cfg.attn_impl, cuda)
    heads = spec.num_attention_heads
    impls = {
        i: kernels.attention_extra_bytes(i, T, S, heads, b, sdpa_math=spec.draft_arch == "mla" and not cuda)
        for i in dict.fromkeys(("sdpa", "flex", chosen))
    }
    return {
        "tokens_per_micro_batch": T,
        "ttt_steps": S,
        "compute_bytes": b,
        "attn_impl": cfg.attn_impl,
        "mask_impl": chosen,
        **parts,
        "attention_mask": impls[chosen],
        "attention_mask_by_impl": impls,
        "total": sum(parts.values()) + impls[chosen],
        "total_by_impl": {k: sum(parts.values()) + v for k, v in impls.items()},
    }


def _recorded_verifier(vocab_meta: dict[str, Any], vocab_dir: Path) -> Path:
    """The verifier a vocab mapping's shards were extracted with: its first shard's meta.json records it,
    both paths relative to the folder of the meta.json that holds them (storage.record_path)."""
    shard = storage.recorded_path(vocab_meta["shards"][0], vocab_dir)
    return storage.recorded_path(storage.read_json(shard / storage.META_NAME)["verifier"]["path"], shard)


def ttt_steps_warning(cfg: TrainConfig, gpus: int, cuda: bool) -> str | None:
    """Why --ttt-steps above --served-k costs without serving (None: it is not above, or the inputs are
    unreadable, which the run itself refuses naming them): the steps vLLM will never propose, and the
    memory per device they take (memory_per_gpu) beside the memory at the served k. The draft is the
    run's: the vocab mapping's size, layer ids and verifier, the verifier's config.json."""
    if cfg.parallel_drafting or cfg.ttt_steps <= cfg.served_k:
        return None
    try:
        vocab_dir = Path(cfg.vocab_mapping_dir or "")
        vocab = storage.read_json(vocab_dir / storage.META_NAME)
        source = vocab["source"]
        text = read_text_config(Path(cfg.verifier_path or _recorded_verifier(vocab, vocab_dir)))
        verifier = {"hidden_size": int(text["hidden_size"]), "vocab_size": int(text["vocab_size"]),
                    "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6))}  # fmt: skip
        aux = source["aux_layer_ids"]
        spec = spec_for_training(cfg, {**text, **verifier}, int(vocab["draft_vocab_size"]), aux)
    except (UserError, OSError, KeyError, TypeError, ValueError):
        return None
    draft = draft_report(spec, cfg.train_lm_head)
    total = memory_per_gpu(spec, draft, cfg, gpus, cuda)["total"]
    at_k = memory_per_gpu(spec, draft, dataclasses.replace(cfg, ttt_steps=cfg.served_k), gpus, cuda)["total"]
    return (
        f"--ttt-steps {cfg.ttt_steps} > --served-k {cfg.served_k}: steps {cfg.served_k + 1}-{cfg.ttt_steps} "
        f"train draft tokens vLLM will not propose (num_speculative_tokens {cfg.served_k}); memory per "
        f"device ~{storage.format_bytes(total)} (plan estimate), ~{storage.format_bytes(at_k)} at "
        f"--ttt-steps {cfg.served_k}"
    )


# ---- steps ----------------------------------------------------------------------------------------


def window_lengths(lengths: list[int], max_seq_len: int) -> list[int]:
    """What the trainer packs of samples of these lengths: each, or its windows (length_mix.windows)."""
    return [n for length in lengths for _, n in length_mix.window_starts(length, max_seq_len)]


def micro_batches_per_token(lengths: list[int], batch_tokens: int, max_seq_len: int) -> float:
    """Micro-batches per token packed (packing's rule: longer samples in windows) over the sampled lengths."""
    units = window_lengths(lengths, max_seq_len)
    return len(packing.pack_lengths(units, batch_tokens, max_seq_len)) / max(sum(units), 1)


def data_parallel(cfg: TrainConfig, gpus: int) -> int:
    """The rows trained at once on `gpus` GPUs: one per sequence-parallel group (the trainer deals the
    micro-batches by data-parallel rank); refused as the trainer refuses it."""
    from eagle3_pipeline.training import sequence_parallel

    sequence_parallel.check(cfg, gpus)
    return gpus // int(cfg.sequence_parallel)


def steps(cfg: TrainConfig, tokens: Tokens, gpus: int, micro_batches: int | None = None) -> dict[str, Any]:
    """The optimizer steps of the run on `gpus` GPUs (data_parallel of them train a row each)."""
    if micro_batches is None:
        if tokens.total is None:
            return {}
        train_rows = tokens.num_rows * (1 - cfg.val_ratio)
        if tokens.lengths:  # tokens per row already counts rejected rows as 0
            windowed = sum(window_lengths(tokens.lengths, cfg.max_seq_len)) / sum(tokens.lengths)
            per_token = micro_batches_per_token(tokens.lengths, cfg.batch_tokens, cfg.max_seq_len)
            micro_batches = max(1, math.ceil(tokens.total * (1 - cfg.val_ratio) * windowed * per_token))
        else:  # every row tokens_per_row long: its windows
            units = window_lengths([max(1, int(tokens.tokens_per_row))], cfg.max_seq_len)
            per_batch = max(1, cfg.batch_tokens // max(units))
            micro_batches = max(1, math.ceil(train_rows * len(units) / per_batch))
    dp = data_parallel(cfg, gpus)
    per_epoch = schedule.steps_per_epoch(micro_batches, dp, cfg.grad_accum)  # what train.plan_run runs
    total = schedule.total_steps([per_epoch] * cfg.epochs, cfg.max_steps)  # each epoch as the first
    return {"micro_batches_per_epoch": micro_batches, "steps_per_epoch": per_epoch, "total_steps": total,
            "data_parallel": dp}


def _rows_at_once(gpus: int, st: dict[str, Any]) -> str:
    dp = st.get("data_parallel", gpus)
    return f"{gpus} GPUs" if dp == gpus else f"{dp} sequence-parallel groups of {gpus // dp} GPUs"


# ---- the report -----------------------------------------------------------------------------------


def _trained_tokens(train: TrainConfig, total_tokens: float | None, st: dict | None) -> float | None:
    """Tokens the run trains on: the training split, times the epochs (or the steps --max-steps allows)."""
    if total_tokens is None:
        return None
    trained = total_tokens * (1 - train.val_ratio)
    if st and train.max_steps is not None:
        return trained * st["total_steps"] / st["steps_per_epoch"]
    return trained * train.epochs


def build(verifier_path: Path, aux_layer_ids: list[int] | None, storage_name: str, train: TrainConfig,
          draft_vocab_size: int, tokens: Tokens, opts: PlanOptions, disk_dir: Path,
          micro_batches: int | None = None, serve_tp: int | None = None, serve_k: int = 3
          ) -> dict[str, Any]:  # fmt: skip
    """The plan; `serve_tp`: the tensor-parallel size vLLM serves with (default --plan-gpus), for the
    KV-cache and speedup lines; `serve_k`: the k it serves with."""
    text = read_text_config(verifier_path)
    H, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
    aux = check_aux_layer_ids(aux_layer_ids or default_aux_layer_ids(layers), layers)
    verifier = {"hidden_size": H, "vocab_size": int(text["vocab_size"]),
                "rms_norm_eps": float(text.get("rms_norm_eps", 1e-6))}  # fmt: skip
    spec = spec_for_training(train, {**text, **verifier}, draft_vocab_size, aux)  # text: the MLA dims
    draft = draft_report(spec, train.train_lm_head)
    # token shards (online states): the ids and masks only, planned when the run stores no states
    dtypes = (*PLAN_DTYPES, *((storage_name,) if storage_name == state_dtype.NO_STATES else ()))
    per_token = {dt: state_dtype.bytes_per_token(dt, len(aux), H) for dt in dtypes}
    per_sample = {dt: state_dtype.bytes_per_sample(dt, len(aux)) for dt in dtypes}
    total_tokens = tokens.total
    disk = {  # a row gives one sample unless it has several assistant turns: rows stand for samples
        dt: None
        if total_tokens is None
        else int(total_tokens * (bpt + TOKEN_ID_BYTES) + (tokens.num_rows or 0) * per_sample[dt])
        for dt, bpt in per_token.items()
    }
    st = steps(train, tokens, opts.plan_gpus, micro_batches)
    trained_tokens = _trained_tokens(train, total_tokens, st)
    seconds = (
        trained_tokens / opts.plan_tokens_per_second
        if trained_tokens is not None and opts.plan_tokens_per_second
        else None
    )
    memory = memory_per_gpu(spec, draft, train, opts.plan_gpus)
    long = _long_sample(train, {**text, **verifier}, draft_vocab_size, aux, spec, draft, opts.plan_gpus,
                        per_token.get(storage_name) or per_token["bfloat16"])
    kv = kv_cache.kv_cache_report(spec, text, serve_tp or opts.plan_gpus)
    online = colocation.report(
        weight_bytes(verifier_path), kv["tensor_parallel_size"], int(memory["total"]),
        kv["verifier"]["per_tp_rank"], train.max_seq_len, per_token.get(storage_name, per_token["bfloat16"]),
        opts.plan_tokens_per_second,
    )  # fmt: skip
    return {
        "verifier": {
            "path": str(verifier_path),
            "model_type": text.get("model_type"),
            "top_architecture": text["_top_architecture"],
            "num_hidden_layers": layers,
            "hidden_size": H,
            "vocab_size": int(text["vocab_size"]),
        },
        "aux_layer_ids": aux,
        "draft": {"spec": spec.to_json(), **draft},
        "tokens": {
            "num_rows": tokens.num_rows,
            "tokens_per_row": tokens.tokens_per_row,
            "total": total_tokens,
            "source": tokens.source,
        },
        "bytes_per_token": per_token,
        "bytes_per_sample": per_sample,
        "disk": disk,
        "storage_dtype": storage_name,
        "free_bytes": storage.free_bytes(disk_dir),
        "gpus": opts.plan_gpus,
        "memory_per_gpu": memory,
        "kv_cache": kv,
        "colocation": online,
        "long_sample": long,
        "speedup": serving_speedup(text, spec, draft, kv, serve_k, opts),
        "checkpoints_disk": checkpoint.checkpoints_disk(draft["trainable_parameters"], train.keep_last),
        "steps": st,
        "trained_tokens": trained_tokens,
        "tokens_per_second": opts.plan_tokens_per_second,
        "seconds": seconds,
    }


def _other_arch(train: TrainConfig, verifier: dict[str, Any], draft_vocab: int, aux: list[int]
                ) -> DraftSpec | None:  # fmt: skip
    """The draft of the other draft_arch at the same settings, for the long-sample lines (llama: with
    the input norm, as the public Kimi drafts; mla: without, vLLM has none); None for a parallel draft
    or a verifier without MLA dims."""
    if train.parallel_drafting:
        return None
    arch = "llama" if train.draft_arch == "mla" else "mla"
    try:
        norm = arch == "llama" and not train.fc_norm
        other = dataclasses.replace(train, draft_arch=arch, norm_before_fc=norm)
        return spec_for_training(other, verifier, draft_vocab, aux)
    except (UserError, KeyError, TypeError, ValueError):
        return None


def _long_sample(train: TrainConfig, verifier: dict[str, Any], draft_vocab: int, aux: list[int],
                 spec: DraftSpec, draft: dict[str, Any], gpus: int, bytes_per_token: int) -> dict[str, Any]:
    """long_sample.report for this run's draft and the other draft_arch's at the same settings."""
    drafts = {spec.draft_arch: (spec, draft)}
    other = _other_arch(train, verifier, draft_vocab, aux)
    if other is not None:
        drafts[other.draft_arch] = (other, draft_report(other, train.train_lm_head))
    compute = 4 if train.dtype == "float32" else 2  # as memory_per_gpu
    return long_sample.report(drafts, train.ttt_steps, compute, gpus, bytes_per_token, train.prefetch_batches)


def serving_speedup(
    text: dict[str, Any], spec: DraftSpec, draft: dict[str, Any], kv: dict[str, Any], k: int, opts: PlanOptions
) -> dict[str, Any]:
    """The serving cost model's lines (speedup.py) for this draft (one forward per step when it drafts in
    parallel) beside this verifier; {"missing": field} when the verifier's config lacks one it needs."""
    tp = kv["tensor_parallel_size"]
    try:
        verifier = speedup.verifier_model(text, kv["verifier"]["per_tp_rank"])
    except KeyError as e:
        return {"missing": str(e)}
    d = speedup.draft_model(draft["shapes"], kv["draft"]["per_tp_rank"], spec.num_attention_heads, spec.head_dim)
    return speedup.report(verifier, d, k, spec.parallel, tp, opts.plan_context, opts.plan_al)


def _gb(n: float | None) -> str:
    return "?" if n is None else storage.format_bytes(n)


def _attention_shapes(sh: dict[str, list[int]]) -> str:
    """The draft's attention projections: q and k/v (llama), or MLA's q_a/q_b (or q), kv_a and kv_b."""
    a = "layers.0.self_attn."
    if a + "kv_a_proj_with_mqa.weight" not in sh:
        return f"q {sh[a + 'q_proj.weight']} | k/v {sh[a + 'k_proj.weight']}"
    q = (f"q_a {sh[a + 'q_a_proj.weight']} q_b {sh[a + 'q_b_proj.weight']}" if a + "q_a_proj.weight" in sh
         else f"q {sh[a + 'q_proj.weight']}")  # fmt: skip
    return f"MLA {q} | kv_a {sh[a + 'kv_a_proj_with_mqa.weight']} kv_b {sh[a + 'kv_b_proj.weight']}"


def render(p: dict[str, Any]) -> str:
    v, d, m = p["verifier"], p["draft"], p["memory_per_gpu"]
    sh = d["shapes"]
    frozen = "trained" if "lm_head.weight" in d["trainable"] else "frozen"
    lines = [
        f"verifier      {v['path']} ({v['top_architecture']}, {v['model_type']}): {v['num_hidden_layers']} "
        f"layers, hidden {v['hidden_size']}, vocab {v['vocab_size']}",
        f"aux layer ids {p['aux_layer_ids']} (vLLM convention)",
        f"draft         fc {sh['fc.weight']} | {_attention_shapes(sh)} | "
        f"o {sh['layers.0.self_attn.o_proj.weight']} | "
        f"mlp 3 x {sh['layers.0.mlp.gate_proj.weight']} | lm_head {sh['lm_head.weight']} ({frozen})",
        f"parameters    trainable {d['trainable_parameters']:,} | total {d['total_parameters']:,} "
        "(with the frozen embedding and teacher head)",
    ]
    t = p["tokens"]
    rows = "?" if t["num_rows"] is None else f"{t['num_rows']:,}"
    per_row = "?" if t["tokens_per_row"] is None else f"{t['tokens_per_row']:,.0f}"
    total = "?" if t["total"] is None else f"{t['total']:,.0f}"
    lines.append(f"tokens        {rows} rows x {per_row} tokens/row = {total} tokens ({t['source']})")
    disk = " | ".join(
        f"{dt} {p['bytes_per_token'][dt]:,} B/token"
        + (f" + {p['bytes_per_sample'][dt]} B/sample" if p["bytes_per_sample"][dt] else "")
        + f" -> {_gb(p['disk'][dt])}"
        for dt in PLAN_DTYPES
    )
    lines.append(f"disk          {disk}")
    need = p["disk"].get(p["storage_dtype"])
    fits = "?" if need is None else ("fits" if need <= p["free_bytes"] else "DOES NOT FIT")
    lines.append(
        f"              stored as {p['storage_dtype']}: {_gb(need)} needed, {_gb(p['free_bytes'])} free "
        f"here: {fits}"
    )
    lines.append(
        f"memory/GPU    {p['gpus']} GPUs, DDP, {m['tokens_per_micro_batch']:,} tokens x {m['ttt_steps']} TTT "
        f"steps: weights {_gb(m['weights'])} | gradients {_gb(m['gradients'])} | DDP buckets "
        f"{_gb(m['ddp_buckets'])} | AdamW {_gb(m['adamw_states'])} | autocast copies "
        f"{_gb(m['autocast_weight_copies'])} | activations {_gb(m['activations'])} | attention "
        f"({m['mask_impl']}) {_gb(m['attention_mask'])} | total {_gb(m['total'])}"
    )
    by = m["total_by_impl"]
    lines.append(
        f"              attn_impl {m['attn_impl']}: total with sdpa {_gb(by['sdpa'])} (attention "
        f"{_gb(m['attention_mask_by_impl']['sdpa'])}), with flex {_gb(by['flex'])} (attention "
        f"{_gb(m['attention_mask_by_impl']['flex'])})"
    )
    lines.extend(long_sample.render_lines(p["long_sample"]))
    lines.extend(kv_cache.render_lines(p["kv_cache"]))
    lines.extend(colocation.render_lines(p["colocation"]))
    if "missing" in p["speedup"]:
        lines.append(f"speedup       ? (the verifier's config.json has no {p['speedup']['missing']})")
    else:
        lines.extend(speedup.render_lines(p["speedup"]))
    lines.append(f"checkpoints   {_gb(p['checkpoints_disk'])} (keep_last + best + one being written)")
    st = p["steps"]
    if st:
        lines.append(
            f"steps         {st['steps_per_epoch']:,} per epoch ({st['micro_batches_per_epoch']:,} "
            f"micro-batches / {_rows_at_once(p['gpus'], st)} / grad_accum) | {st['total_steps']:,} in all"
        )
    else:
        lines.append("steps         ? (give --plan-rows and --plan-tokens-per-row, or extract shards first)")
    if p["seconds"] is not None:
        lines.append(
            f"time          {p['seconds'] / 3600:,.1f} h for {p['trained_tokens']:,.0f} tokens at "
            f"{p['tokens_per_second']:,.0f} tokens/s (all GPUs)"
        )
    else:
        lines.append("time          ? (give --plan-tokens-per-second: the tok/s a training log line shows)")
    return "\n".join(lines)


def emit(p: dict[str, Any], opts: PlanOptions) -> int:
    print(render(p))
    if opts.plan_json:
        storage.write_json_atomic(Path(opts.plan_json), p)
        print(f"plan json     {opts.plan_json}")
    return 0


# ---- the two stages -------------------------------------------------------------------------------


def _tokens_from_data(
    data_path: Path | None, verifier_path: Path, max_seq_len: int, opts: PlanOptions, extract: ExtractConfig
) -> Tokens:
    """Rows and tokens per row of stage 01's data, tokenized as stage 01 renders it (`extract`: its
    split, engine and remote-code setting; an image row counts its image tokens where stage 01 takes it)."""
    split = extract.data_split
    rows = opts.plan_rows
    if rows is None and data_path is not None and data_path.exists():
        rows = count_rows(data_path, split)
    if opts.plan_tokens_per_row is not None:
        return Tokens(rows, opts.plan_tokens_per_row, None, "--plan-tokens-per-row")
    if data_path is None or not data_path.exists():
        return Tokens(rows, None, None, f"no data at {data_path}: give --plan-tokens-per-row")
    try:
        from transformers import AutoTokenizer

        trust = extract.trust_remote_code
        tokenizer = AutoTokenizer.from_pretrained(str(verifier_path), trust_remote_code=trust)
    except Exception as e:  # noqa: BLE001 - no tokenizer next to a config-only verifier: say so, go on
        return Tokens(rows, None, None, f"no tokenizer in {verifier_path} ({type(e).__name__}): "
                      "give --plan-tokens-per-row")  # fmt: skip
    render = SampleOptions(max_seq_len, extract.truncate, extract.chat_template_kwargs,
                           base_dir=data_path if data_path.is_dir() else data_path.parent)  # fmt: skip
    of_verifier = dataclasses.replace(extract, verifier_path=str(verifier_path))
    render.images, render.no_images_why = extract_images(of_verifier, tokenizer)
    lengths, read = sample_lengths(tokenizer, data_path, split, 0, rows or 0, max_seq_len,
                                   opts.plan_sample_rows, render, extract.context_tokens)  # fmt: skip
    per_row = sum(lengths) / read if read else None
    return Tokens(rows, per_row, lengths, f"tokenized {read} rows of {data_path}")


def _serve_k(config_path: str | None) -> int:
    """The k vLLM serves with: [serving] num_speculative_tokens (the export's serve line prints it)."""
    if config_path is None:
        return SERVING_K
    return serving_k(read_config_file(config_path).get("serving", {}), Path(config_path))


def _serve_tp(config_path: str | None, opts: PlanOptions) -> int:
    """The tensor-parallel size vLLM serves with: [export] serve_tensor_parallel_size when set (the size
    the export's serve line prints), else --plan-gpus (8 by default: one node)."""
    tp = config_from_file(ExportConfig, config_path).serve_tensor_parallel_size
    return tp if tp > 0 else opts.plan_gpus


def plan_extract(cfg: ExtractConfig, opts: PlanOptions, config_path: str | None) -> int:
    train = config_from_file(TrainConfig, config_path)
    vocab = config_from_file(VocabConfig, config_path)
    verifier_path = Path(cfg.verifier_path)
    storage_name = state_dtype.resolve_storage_dtype(cfg.storage_dtype, state_dtype.resolve_dtype(cfg.dtype))
    tokens = _tokens_from_data(Path(cfg.data_path), verifier_path, cfg.max_seq_len, opts, cfg)
    p = build(
        verifier_path, cfg.aux_layer_ids, storage_name, train, vocab.draft_vocab_size,
        tokens, opts, Path(cfg.out_dir), serve_tp=_serve_tp(config_path, opts), serve_k=_serve_k(config_path),
    )  # fmt: skip
    return emit(p, opts)


def plan_train(cfg: TrainConfig, opts: PlanOptions, config_path: str | None) -> int:
    from eagle3_pipeline.data.shards import find_shard_dirs, open_shards

    extract = config_from_file(ExtractConfig, config_path)
    verifier = cfg.verifier_path or extract.verifier_path
    aux, storage_name = extract.aux_layer_ids, extract.storage_dtype
    if storage_name == "auto":  # as computed: bf16 on the GPUs it plans for
        storage_name = "bfloat16" if extract.dtype == "auto" else extract.dtype
    draft_vocab = config_from_file(VocabConfig, config_path).draft_vocab_size
    vocab_meta = Path(cfg.vocab_mapping_dir or "") / storage.META_NAME
    if cfg.vocab_mapping_dir and vocab_meta.is_file():
        draft_vocab = int(storage.read_json(vocab_meta)["draft_vocab_size"])
    micro_batches = None
    try:
        shard_dirs = find_shard_dirs(cfg.data_dir)
    except UserError:
        shard_dirs = []
    if shard_dirs:  # exact token counts and layout from the shards (cheap start checks only)
        from eagle3_pipeline.data.split import split_samples

        shard_set = open_shards(cfg.data_dir)
        verifier = cfg.verifier_path or shard_set.meta["verifier"]["path"]
        aux, storage_name = shard_set.meta["aux_layer_ids"], shard_set.meta["storage_dtype"]
        train_refs, _ = split_samples(shard_set.samples, cfg.seed, cfg.val_ratio)
        micro_batches = len(packing.micro_batches(train_refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, 0,
                                                  cfg.batching))
        lengths = [r.num_tokens for r in shard_set.samples]
        n = sum(int(storage.read_json(s / storage.META_NAME)["num_rows"]) for s in shard_set.shards)
        tokens = Tokens(n, sum(lengths) / n, lengths, f"manifests of {len(shard_set.shards)} shards")
    else:
        if verifier is None:
            raise UserError("--plan needs the verifier's config.json: give --verifier-path")
        data = extract.data_path
        tokens = _tokens_from_data(Path(data) if data else None, Path(verifier), cfg.max_seq_len, opts, extract)
    if verifier is None:
        raise UserError("--plan needs the verifier's config.json: give --verifier-path")
    if cfg.split_dir and micro_batches is None:  # training then holds out what stage 03 held out
        cfg = dataclasses.replace(cfg, val_ratio=config_from_file(SplitConfig, config_path).val_ratio)
    p = build(
        Path(verifier), aux, storage_name, cfg, draft_vocab, tokens, opts, Path(cfg.out_dir), micro_batches,
        serve_tp=_serve_tp(config_path, opts), serve_k=_serve_k(config_path),
    )  # fmt: skip
    return emit(p, opts)
