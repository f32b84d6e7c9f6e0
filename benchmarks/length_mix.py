"""Micro-batches an epoch, greedy packing in shuffled order ("shuffle") against length_mix ("mix"), on the
lengths of a tiny run's shards and on a synthetic long-tailed set at configs/kimi_k25.toml's lengths.

Per set and batching: micro-batches, fill (trained tokens / (micro-batches x batch_tokens)), windows of
samples over max_seq_len, the largest micro-batch, where in the epoch the longest sample's windows fall,
and the seconds to build the epoch. The synthetic set is log-normal (median 3,000 tokens, sigma 1.0, at
most 60,000): a stand-in with a long tail, not Kimi-K2.5's measured lengths.

    .venv/bin/python -m benchmarks.length_mix --tiny-run runs/tiny          # table; docs/results/length_mix.json
    .venv/bin/python -m benchmarks.length_mix --tiny-run runs/tiny --quick    # 20,000 synthetic samples, not 200,000
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from benchmarks import RESULTS
from eagle3_pipeline.data.packing import micro_batches
from eagle3_pipeline.data.shards import SampleRef, open_shards

KIMI_LENGTHS = (20000, 20000)  # configs/kimi_k25.toml [train] batch_tokens, max_seq_len


def synthetic(n: int, seed: int = 0) -> list[SampleRef]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) + torch.log(torch.tensor(3000.0))).clamp(16, 60000)
    return [SampleRef("s", "p", i, f"x{i}", int(n)) for i, n in enumerate(lengths.tolist())]


def measure(refs: list[SampleRef], batch_tokens: int, max_seq_len: int, batching: str) -> dict[str, float]:
    t0 = time.perf_counter()
    batches = micro_batches(refs, batch_tokens, max_seq_len, 0, 0, batching)
    seconds = time.perf_counter() - t0
    longest = max(refs, key=lambda r: r.num_tokens).sample_id
    at = [i / len(batches) for i, b in enumerate(batches) if any(r.sample_id == longest for r in b)]
    tokens = [sum(r.num_tokens for r in b) for b in batches]
    return {
        "micro_batches": len(batches),
        "fill": sum(tokens) / (len(batches) * batch_tokens),
        "windows": sum(r.start > 0 for b in batches for r in b),
        "max_batch_tokens": max(tokens),
        "longest_at": [round(a, 3) for a in at],
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny-run", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "length_mix.json")
    args = ap.parse_args()
    tiny = open_shards([str(p) for p in sorted((args.tiny_run / "hidden_states").iterdir()) if p.is_dir()])
    sets = {
        "tiny run, 1024/1024": (tiny.samples, 1024, 1024),
        "tiny run, max_seq_len 96": (tiny.samples, 1024, 96),
        "synthetic, kimi_k25.toml": (synthetic(20_000 if args.quick else 200_000), *KIMI_LENGTHS),
    }
    rows = {}
    print(f"{'set':28} {'batching':8} {'micro-batches':>13} {'ratio':>6} {'fill':>6} {'windows':>8} "
          f"{'max tokens':>10} {'seconds':>8}")  # fmt: skip
    for name, (refs, batch_tokens, max_seq_len) in sets.items():
        base = None
        for batching in ("shuffle", "mix"):
            m = measure(refs, batch_tokens, max_seq_len, batching)
            base = base or m["micro_batches"]
            rows[f"{name} | {batching}"] = {**m, "ratio": m["micro_batches"] / base}
            print(f"{name:28} {batching:8} {m['micro_batches']:>13,} {m['micro_batches'] / base:>6.3f} "
                  f"{m['fill']:>6.3f} {m['windows']:>8,} {m['max_batch_tokens']:>10,} {m['seconds']:>8.2f}")
    meta = {"machine": platform.machine(), "python": platform.python_version(), "torch": torch.__version__,
            "threads": torch.get_num_threads(), "quick": args.quick}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
