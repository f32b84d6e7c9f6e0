"""Peak memory and time of one training step (forward + backward) against the sample's length, CPU.

  .venv/bin/python -m benchmarks.long_memory --quick        # tiny draft to 16k, SmolLM2-135M shapes to 4k
  .venv/bin/python -m benchmarks.long_memory                # both to 32k where the memory cap allows

Each point is one packed row holding one document of L tokens (the long-sample case: every query chunk
of blockwise attention reads all earlier keys), random states and random draft weights (no download),
3 TTT steps, kl_div, fp32, one forward + backward of train_metrics.forward, in a subprocess of its own,
which reads its max RSS (resource.getrusage) after a 256-token warm-up step (model, grads, batch: the
baseline) and after the timed step: `growth` is the step's own peak above that baseline. Two kernel
choices side by side: today's CPU default (sdpa + eager loss, speculators' forward) and the linear-memory
one (blockwise + chunked, models/linear_memory.py). Points whose estimated peak is over --max-gb are
skipped (the machine is shared). Writes the table and docs/results/long_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import REPO as ROOT
from benchmarks import RESULTS
from eagle3_pipeline.models.draft import DraftSpec, build_draft  # noqa: E402
from eagle3_pipeline.training import kernel_policy as kernels  # noqa: E402
from eagle3_pipeline.training.train_metrics import Recipe, forward  # noqa: E402

TTT = 3
WARMUP_TOKENS = 256
# hidden, heads, kv heads, head_dim, intermediate, vocab, draft vocab
SHAPES = {
    "tiny": (64, 4, 2, 32, 128, 200, 50),
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152, 32000),
}
IMPLS = {"sdpa+eager": ("sdpa", "eager"), "blockwise+chunked": ("blockwise", "chunked")}
QUICK = {"tiny": (1024, 2048, 4096, 8192, 16384), "smollm2-135m": (1024, 2048, 4096)}
FULL = {name: (1024, 2048, 4096, 8192, 16384, 32768) for name in SHAPES}


def spec_of(shape: str) -> DraftSpec:
    h, heads, kv, hd, inter, vocab, draft_vocab = SHAPES[shape]
    return DraftSpec(
        hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        intermediate_size=inter, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=65536,
        vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 2, 3), norm_before_residual=False,
    )  # fmt: skip


def estimated_gb(shape: str, impl: str, n: int) -> float:
    """A rough upper bound of the step's peak (to skip what would not fit): today's path keeps the
    verifier's and ~4 fp32 [L, draft vocab] tensors per TTT step and 2-byte [L, (s+1) L] masks."""
    h, _, _, _, inter, _, dv = SHAPES[shape]
    acts = n * (40 * h + 8 * inter) * 4 * TTT
    if impl == "sdpa+eager":
        return (acts + n * dv * 4 * (1 + 4 * TTT) + 6 * n * n * TTT) / 2**30 + 0.6
    return (acts + 4 * 2048 * dv * 4) / 2**30 + 0.6


def batch_of(shape: str, n: int) -> dict[str, torch.Tensor]:
    h, _, _, _, _, vocab, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(1, n, 3 * h, generator=g),
        "input_ids": torch.randint(0, vocab, (1, n), generator=g),
        "verifier_last": torch.randn(1, n, h, generator=g),
        "loss_mask": torch.ones(1, n, dtype=torch.bool),
        "document_ids": torch.zeros(1, n, dtype=torch.long),
        "position_ids": torch.arange(n)[None],
    }


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def point(shape: str, impl: str, n: int) -> dict[str, Any]:
    """One step at length n (run in its own process: max RSS only ever grows)."""
    attn, loss = IMPLS[impl]
    k = kernels.Kernels(attn, loss, False)
    torch.manual_seed(0)
    model = build_draft(spec_of(shape), attn_impl=k.hf_attn_impl)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    recipe, cpu = Recipe(TTT, 1.0, "kl_div"), torch.device("cpu")
    batch = batch_of(shape, n)
    warm = {key: v[:, :WARMUP_TOKENS] for key, v in batch.items()}
    forward(model, warm, recipe, cpu, None, k)[0].backward()
    base = max_rss_bytes()
    t0 = time.perf_counter()
    value, _ = forward(model, batch, recipe, cpu, None, k)
    value.backward()
    seconds = time.perf_counter() - t0
    peak = max_rss_bytes()
    return {"peak_gib": peak / 2**30, "growth_gib": (peak - base) / 2**30, "seconds": seconds,
            "us_per_token": seconds / n * 1e6, "loss": float(value.detach())}  # fmt: skip


def run_point(shape: str, impl: str, n: int, timeout: float, max_gb: float, threads: int | None
              ) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"shape": shape, "impl": impl, "tokens": n}
    est = estimated_gb(shape, impl, n)
    if est > max_gb:
        return {**row, "skipped": f"estimated {est:.1f} GiB > --max-gb {max_gb}"}
    cmd = [sys.executable, "-m", __spec__.name, "--point", shape, impl, str(n)]
    cmd += ["--threads", str(threads)] if threads else []
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "skipped": f"over {timeout:.0f} s"}
    if done.returncode != 0:
        return {**row, "skipped": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1])}


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "speculators": version("speculators"),
        "attn_chunk": kernels.ATTN_CHUNK,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | tokens | impl | peak GiB | step growth GiB | s / step | us / token |",
             "|---|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['impl']} | - | - | - | {r['skipped']} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['impl']} | {r['peak_gib']:.2f} | {r['growth_gib']:.2f} "
            f"| {r['seconds']:.1f} | {r['us_per_token']:.0f} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape, for the linear-memory path: step growth at 16k over 4k, and time per token from 4k
    to the longest length measured."""
    out: dict[str, Any] = {}
    for shape in SHAPES:
        got = {r["tokens"]: r for r in rows if r["shape"] == shape and r["impl"] == "blockwise+chunked"
               and "skipped" not in r}  # fmt: skip
        s: dict[str, Any] = {}
        if 4096 in got and 16384 in got:
            s["growth_16k_over_4k"] = got[16384]["growth_gib"] / got[4096]["growth_gib"]
            s["peak_16k_over_4k"] = got[16384]["peak_gib"] / got[4096]["peak_gib"]
        longest = max(got, default=0)
        if 4096 in got and longest > 4096:
            s[f"us_per_token_{longest}_over_4096"] = got[longest]["us_per_token"] / got[4096]["us_per_token"]
        out[shape] = s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny to 16k, SmolLM2-135M shapes to 4k")
    p.add_argument("--max-gb", type=float, default=8.0, help="skip points estimated above this (GiB)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per point")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="only these shapes")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="these sample lengths instead")
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS), help="only these paths")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per point (default: torch's; 1 on a machine shared with other jobs)")
    p.add_argument("--out", default=None, help="JSON output (default: docs/results/long_memory.json)")
    p.add_argument("--point", nargs=3, metavar=("SHAPE", "IMPL", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.point:
        print(json.dumps(point(a.point[0], a.point[1], int(a.point[2]))))
        return 0
    rows = []
    for shape, lengths in (QUICK if a.quick else FULL).items():
        if a.shapes and shape not in a.shapes:
            continue
        for n in a.lengths or lengths:
            for impl in a.impls:
                rows.append(run_point(shape, impl, n, a.timeout, a.max_gb, a.threads))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    out = {"machine": machine(), "ttt_steps": TTT, "quick": a.quick, "rows": rows, "summary": summary(rows)}
    print(table(rows))
    print(json.dumps(out["summary"], indent=2))
    path = Path(a.out) if a.out else RESULTS / "long_memory.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
