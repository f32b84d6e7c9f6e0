"""Draft training step by kernel choice: time of fwd+bwd+AdamW, tokens/s, peak memory, MFU, in one run.

  .venv/bin/python -m benchmarks.train_kernels --quick                 # CPU, a small draft, ~1 minute
  python3 -m benchmarks.train_kernels --kimi --device cuda --out k.json  # one GPU (scripts/gpu_check.sh)
  python3 -m benchmarks.train_kernels --kimi --arch mla --device cuda     # configs/kimi_k25.toml's MLA draft

Every row is one optimizer step of this project (train_metrics.forward, backward, clip, AdamW from
train.build_optimizer) on the same packed batch of random hidden states (documents of ~doc_tokens
packed into batch_tokens, as packing.py makes them), with one kernels.Kernels choice; ratios are
against sdpa + eager loss, uncompiled, measured in the same run. The last row is speculators' own
Trainer.train_epoch on that batch (its Eagle3DraftModel defaults: flex + fused loss, forward compiled
at import on CUDA; on CPU sdpa + eager, flex having no backward there, and the Trainer's hard-coded
`model.to(local_rank)` pointed at the CPU). flex is timed forward-only on CPU (no backward there; its
eager CPU path materialises the full score matrix, so CPU says nothing about GPU flex speed).
MFU counts model FLOPs: matmuls 2 x m x n per token, attention 4 x heads x head_dim per attended
(query, key) pair of the packed mask (not the masked-out pairs sdpa also computes), backward 2x
forward for trained weights and 1x for the frozen lm_head; over --peak-tflops (H200 bf16 dense: 989).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.core import storage
from eagle3_pipeline.models.draft import MLA_DIMS, DraftSpec, build_draft, trainable_names
from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    vocab: int
    aux_layers: int
    batch_tokens: int
    ttt_steps: int
    doc_tokens: int  # mean document length packed into a row
    # --arch mla: the MLA layer's dims (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
    # v_head_dim); None: the llama layer (kv_heads / head_dim)
    mla: tuple[int, int, int, int, int] | None = None


KIMI = Shape(7168, 64, 64, 128, 18432, 32000, 163840, 3, 16384, 3, 2048)  # kimi_k25.toml's llama layer
QUICK = Shape(256, 4, 4, 64, 512, 2000, 4000, 3, 1024, 3, 256)
TINY = Shape(64, 2, 2, 32, 128, 64, 128, 3, 256, 2, 64)  # tests
MLA_OF = {  # each size's MLA draft: Kimi-K2.5's own dims (kimi_k25.toml's draft), the others scaled down
    KIMI: tuple(KIMI_K25_TEXT_CONFIG[k] for k in MLA_DIMS),
    QUICK: (128, 64, 32, 32, 64),
    TINY: (32, 32, 16, 16, 16),
}


def with_arch(s: Shape, arch: str) -> Shape:
    return replace(s, mla=MLA_OF[s]) if arch == "mla" else s


def spec_of(s: Shape) -> DraftSpec:
    mla = {} if s.mla is None else {"draft_arch": "mla", **dict(zip(MLA_DIMS, s.mla))}
    return DraftSpec(
        hidden_size=s.hidden,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        rms_norm_eps=1e-5,
        rope_theta=5e4,
        max_position_embeddings=4 * s.batch_tokens,
        vocab_size=s.vocab,
        draft_vocab_size=s.draft_vocab,
        aux_layer_ids=tuple(range(2, 2 + s.aux_layers)),
        norm_before_residual=False,
        **mla,
    )


def doc_lengths(s: Shape, seed: int = 0) -> list[int]:
    """Document lengths within [doc_tokens/2, 3 doc_tokens/2] that fill batch_tokens exactly."""
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < s.batch_tokens:
        out.append(int(torch.randint(s.doc_tokens // 2, s.doc_tokens * 3 // 2 + 1, (1,), generator=g)))
    out[-1] -= sum(out) - s.batch_tokens
    return [n for n in out if n > 0]


def make_batch(s: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed row with pack()'s keys: random aux and teacher states, 90% of positions supervised."""
    g = torch.Generator().manual_seed(seed)
    lengths = doc_lengths(s, seed)
    t = s.batch_tokens
    return {
        "hidden_states": torch.randn(1, t, s.aux_layers * s.hidden, generator=g),
        "input_ids": torch.randint(0, s.vocab, (1, t), generator=g),
        "verifier_last": torch.randn(1, t, s.hidden, generator=g),
        "loss_mask": torch.rand(1, t, generator=g) < 0.9,
        "document_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }


def attended_pairs(lengths: list[int], ttt_steps: int) -> int:
    """(query, key) pairs the packed EAGLE-3 mask allows over all TTT steps (speculators'
    create_combined_mask_mod): causal within each document at every step, plus one diagonal pair per
    earlier step's block (step s attends KV = T (s + 1))."""
    causal = sum(n * (n + 1) // 2 for n in lengths)
    t = sum(lengths)
    return sum(causal + s * t for s in range(ttt_steps))


def layer_weights(s: Shape) -> int:
    """The decoder layer's matmul weights (one multiply-add each per token); its attention reads
    cat(embeds, hidden), 2 x hidden wide."""
    mlp = 3 * s.hidden * s.intermediate
    if s.mla is None:  # q/k/v, o
        return 2 * s.hidden * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * s.hidden + mlp
    q_lora, kv_lora, nope, rope, v = s.mla  # q_a, q_b; kv_a (latent + shared rope key), kv_b; o over v
    q = 2 * s.hidden * q_lora + q_lora * s.heads * (nope + rope)
    kv = 2 * s.hidden * (kv_lora + rope) + kv_lora * s.heads * (nope + v)
    return q + kv + s.heads * v * s.hidden + mlp


def pair_flops(s: Shape) -> int:
    """Attention FLOPs per attended (query, key) pair: QK^T and PV over every head."""
    if s.mla is None:
        return 4 * s.heads * s.head_dim
    _, _, nope, rope, v = s.mla
    return 2 * s.heads * (nope + rope + v)


def step_flops(s: Shape, lengths: list[int]) -> float:
    """Model FLOPs of one training step (fwd + bwd) on a packed row (see the module docstring)."""
    t = sum(lengths)
    layer = 2 * t * layer_weights(s)
    attention = pair_flops(s) * attended_pairs(lengths, s.ttt_steps)
    fc = 2 * t * s.aux_layers * s.hidden * s.hidden
    lm_head = 2 * t * s.hidden * s.draft_vocab
    trained = fc + s.ttt_steps * layer + attention
    return 3.0 * trained + 2.0 * s.ttt_steps * lm_head + lm_head  # frozen draft head; teacher head fwd only


def build(s: Shape, k: kernels.Kernels, device: torch.device, seed: int = 0) -> tuple[Any, list]:
    """The draft on `device` with every tensor random (seeded: every row gets the same weights)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = build_draft(spec_of(s), attn_impl=k.hf_attn_impl)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
        model.d2t.copy_(torch.arange(s.draft_vocab) * 0)
        model.t2d.copy_(torch.arange(s.vocab) < s.draft_vocab)
    names = set(trainable_names(model, train_lm_head=False))
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    kernels.set_compile(model, k)
    return model, [p for n, p in model.named_parameters() if n in names]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _autocast(device: torch.device) -> torch.dtype | None:
    return torch.bfloat16 if device.type == "cuda" else None  # train._autocast_dtype("auto")


def time_project(
    s: Shape, k: kernels.Kernels, batch: dict, device: torch.device, warmup: int, steps: int, train: bool
) -> list[float]:
    """Seconds per step of the project's optimizer step (or its no-grad forward when not train)."""
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.training.train import Plan, build_optimizer
    from eagle3_pipeline.training.train_metrics import Recipe, forward

    model, params = build(s, k, device)
    cfg = TrainConfig()
    opt, _ = build_optimizer(cfg, params, Plan(1, warmup + steps, 0, 1, 1, [warmup + steps]))
    times = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        if train:
            opt.zero_grad(set_to_none=True)
            loss, _ = forward(model, batch, Recipe(s.ttt_steps, 1.0, "kl_div"), device, _autocast(device), k)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
        else:
            with torch.no_grad():
                forward(model, batch, Recipe(s.ttt_steps, 1.0, "kl_div"), device, _autocast(device), k)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    del model, params, opt
    return times


def time_speculators(s: Shape, batch: dict, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds per step of speculators' Trainer.train_epoch on copies of `batch`."""
    import speculators.train.trainer as trainer_mod
    from speculators.losses import resolve_loss_config
    from speculators.train.trainer import Trainer, TrainerConfig

    cuda = device.type == "cuda"
    k = kernels.Kernels("flex" if cuda else "sdpa", "fused" if cuda else "eager", cuda)
    model, _ = build(s, k, device)
    del model.forward  # back to the class's forward: compiled by speculators at import on CUDA
    spec_batch = {
        "hidden_states": batch["hidden_states"],
        "input_ids": batch["input_ids"],
        "document_ids": batch["document_ids"],
        "loss_mask": batch["loss_mask"],
        "position_ids": batch["position_ids"],
        "verifier_last_hidden_states": batch["verifier_last"],
        "error_records": 0,
    }
    loader = torch.utils.data.DataLoader(
        [dict(spec_batch) for _ in range(warmup + steps)], batch_size=None, collate_fn=lambda b: b
    )
    stamps: list[float] = []

    def mark() -> None:
        _sync(device)
        stamps.append(time.perf_counter())

    patch = contextlib.nullcontext()
    if not cuda:  # the Trainer moves the model to cuda:{local_rank}; point it at the CPU instead
        patch = _patched(trainer_mod, "get_local_rank", lambda: "cpu")
    with tempfile.TemporaryDirectory() as tmp, patch:
        trainer = Trainer(
            model,
            TrainerConfig(
                lr=1e-4,
                num_epochs=1,
                save_path=tmp,
                train_call_kwargs={
                    "ttt_steps": s.ttt_steps,
                    "ttt_step_loss_decay": 1.0,
                    "loss_config": resolve_loss_config("kl_div", k.loss_impl),
                },
                hidden_states_dtype=torch.bfloat16,
                log_freq=10**9,
                scheduler_type="none",
            ),
            train_loader=loader,
        )
        # global step 0 is a profiled step (log_freq), whose timer synchronizes an accelerator (none on
        # CPU) and logs; starting the count at 1 makes every step a plain one (the count only logs)
        trainer.global_step = 1
        mark()
        trainer.train_epoch(0, step_callback=mark)
    del trainer, model
    return [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :])]


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


BASELINE = "sdpa+eager"


def rows_for(device: torch.device, mla: bool = False) -> list[tuple[str, kernels.Kernels | None, bool]]:
    """(label, kernels or None for speculators' Trainer, full train step?) measured on this device,
    the most wanted first (a device run has minutes). The MLA draft has no speculators row: speculators
    trains no MLA draft."""
    K = kernels.Kernels
    base = K("sdpa", "eager", False)
    if device.type == "cuda":
        rows = [
            ("flex+fused+compile", K("flex", "fused", True, kernels.FLEX_BLOCK), True),
            (BASELINE, base, True),
            ("speculators Trainer (flex+fused, compiled)", None, True),
            ("sdpa+fused", K("sdpa", "fused", False), True),
        ]
        return [r for r in rows if not (mla and r[1] is None)]
    rows = [
        (BASELINE, base, True),
        ("eager+eager", K("eager", "eager", False), True),
        ("sdpa+eager+compile", K("sdpa", "eager", True, kernels.FLEX_BLOCK), True),
        ("sdpa+eager fwd only", base, False),
        ("flex fwd only (CPU eager flex)", K("flex", "eager", False, kernels.FLEX_BLOCK), False),
        ("speculators Trainer (sdpa+eager)", None, True),
    ]
    return [r for r in rows if not (mla and r[1] is None)]


def run(
    s: Shape, device: torch.device, warmup: int, steps: int, peak_tflops: float, only: list[str], path: Path
) -> dict:
    """Every row in turn; the JSON is rewritten after each row, so a run cut short keeps what it measured."""
    batch = make_batch(s)
    lengths = doc_lengths(s)
    flops = step_flops(s, lengths)
    out: dict[str, Any] = {
        "shape": asdict(s),
        "doc_lengths": lengths,
        "step_flops": flops,
        "peak_tflops": peak_tflops,
        "attention_extra_gib": {
            i: kernels.attention_extra_bytes(i, s.batch_tokens, s.ttt_steps, s.heads, 2) / 2**30
            for i in ("flex", "sdpa", "eager")
        },
        "machine": _machine(device),
        "rows": [],
    }
    for label, k, train in rows_for(device, s.mla is not None):
        if only and label not in only:
            continue
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        row: dict[str, Any] = {
            "row": label,
            "train_step": train,
            "kernels": k.to_json() if k else "speculators",
        }
        try:
            t0 = time.perf_counter()
            if k is None:
                times = time_speculators(s, batch, device, warmup, steps)
            else:
                times = time_project(s, k, batch, device, warmup, steps, train)
            step_s = statistics.median(times)
            # median and fastest: on a shared machine the fastest step is the least disturbed one
            row.update(
                step_s=step_s, min_step_s=min(times), steps_s=times, tokens_per_s=s.batch_tokens / step_s
            )
            row["wall_s"] = time.perf_counter() - t0  # compile and warm-up included
            if train:
                row["mfu"] = flops / step_s / (peak_tflops * 1e12)
            if device.type == "cuda":
                row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:  # noqa: BLE001 - a row that fails (OOM, missing kernel) is reported
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out["rows"].append(row)
        _ratios(out, device)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(_line(row), flush=True)
    return out


def _ratios(out: dict, device: torch.device) -> None:
    """Speed-ups against sdpa+eager of the same kind (train step or forward only), and the project's
    auto choice against speculators' Trainer (step time ratio: <= 1.0 is the project as fast or faster)."""
    timed = [r for r in out["rows"] if "step_s" in r]
    base_rows = [r for r in timed if r["row"] in (BASELINE, f"{BASELINE} fwd only")]
    base = {r["train_step"]: r["step_s"] for r in base_rows}
    base_min = {r["train_step"]: r["min_step_s"] for r in base_rows}
    for r in timed:
        if r["train_step"] in base:
            r["speedup_vs_sdpa_eager"] = base[r["train_step"]] / r["step_s"]
            r["speedup_vs_sdpa_eager_fastest"] = base_min[r["train_step"]] / r["min_step_s"]
    ours = "flex+fused+compile" if device.type == "cuda" else BASELINE
    by = {r["row"]: r for r in timed}
    spec = next((r for r in timed if r["row"].startswith("speculators")), None)
    if spec and ours in by:
        out["project_vs_speculators_step_ratio"] = by[ours]["step_s"] / spec["step_s"]
        out["project_vs_speculators_fastest_step_ratio"] = by[ours]["min_step_s"] / spec["min_step_s"]


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['row']:44s} | error {r['error']}"
    mem = f" | peak {r['peak_memory_gib']:.1f} GiB" if "peak_memory_gib" in r else ""
    mfu = f" | MFU {100 * r['mfu']:.1f}%" if "mfu" in r else ""
    return (
        f"{r['row']:44s} | {1000 * r['step_s']:9.1f} ms/step | {r['tokens_per_s']:9.0f} tok/s{mfu}{mem}"
        + (f" | x{r['speedup_vs_sdpa_eager']:.2f} vs sdpa+eager" if "speedup_vs_sdpa_eager" in r else "")
    )


def _machine(device: torch.device) -> dict[str, Any]:
    m = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "triton": kernels.triton_available(),
    }
    return {**m, **storage.versions()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a small draft (default on CPU)")
    size.add_argument("--kimi", action="store_true", help="the Kimi-K2.5 draft at batch_tokens 16384, TTT 3")
    size.add_argument("--tiny", action="store_true", help="a toy size for the tests")
    p.add_argument("--arch", choices=["llama", "mla"], default="llama",
                   help="the draft's layer ([train] draft_arch); mla at --kimi: Kimi-K2.5's MLA dims")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile, autotune)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per row (median reported)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H200 SXM: 989)")
    p.add_argument("--only", nargs="*", default=[], help="run only the rows with these labels")
    p.add_argument("--out", default=None, help="JSON output (default: docs/results/train_kernels.json)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    shape = with_arch(KIMI if a.kimi else TINY if a.tiny else QUICK, a.arch)
    print(
        f"shape {asdict(shape)} | device {device} | threads {torch.get_num_threads()}"
        f" | torch {torch.__version__}"
    )
    path = Path(a.out) if a.out else RESULTS / "train_kernels.json"
    out = run(shape, device, a.warmup, a.steps, a.peak_tflops, a.only, path)
    if "project_vs_speculators_step_ratio" in out:
        print(f"project / speculators step time: {out['project_vs_speculators_step_ratio']:.2f}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
