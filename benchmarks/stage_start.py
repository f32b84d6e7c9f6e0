"""Stage-start time vs number of parts and vs shard bytes: the start checks grow with parts, not bytes.

  .venv/bin/python -m benchmarks.stage_start [--quick] [--json docs/results/stage_start.json]

Writes synthetic shards with the real writer (shards.write_part, finish_shard; fp32 states, hidden
256, 3 aux layers), then times `shards.open_shards` (what stages 02-04 run at start: COMPLETE, meta.json,
manifest sha256, file sizes, safetensors headers, offsets) against the check stages used to run at start
(sha256 of every part file) on the same shards. Two sweeps: more parts of a fixed size, and a fixed
number of larger parts. Every figure is a ratio to the smallest case of its sweep, measured in this run.
Files are hot in the page cache (just written), so the hash baseline is CPU-bound here (~1-2 GB/s);
on a cold 50 TB shard set it is bound by the disk instead, which is only slower.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import RESULTS
from eagle3_pipeline.core import storage
from eagle3_pipeline.data.config import ExtractConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.data.shards import MANIFEST_FILE, SHARD_FORMAT, finish_shard, open_shards, write_part
from eagle3_pipeline.data.state_dtype import encode

HIDDEN, N_AUX = 256, 3
BYTES_PER_TOKEN = (N_AUX + 1) * HIDDEN * 4 + 5  # fp32 states + input_ids + loss_mask


def write_shard(root: Path, parts: int, part_bytes: int, samples_per_part: int = 4) -> Path:
    shard = root / f"rows_00000000-{parts * samples_per_part:08d}"
    shard.mkdir(parents=True)
    tokens = max(samples_per_part, part_bytes // BYTES_PER_TOKEN) // samples_per_part
    g = torch.Generator().manual_seed(0)
    blocks = []
    for n in range(parts):
        tensors: dict[str, list[torch.Tensor]] = {}
        samples = []
        for i in range(samples_per_part):
            stored = {
                "input_ids": torch.randint(0, 320, (tokens,), dtype=torch.int32, generator=g),
                "loss_mask": torch.ones(tokens, dtype=torch.uint8),
                **encode(
                    torch.randn(tokens, N_AUX, HIDDEN, generator=g), torch.randn(tokens, HIDDEN), "float32"
                ),
            }
            for k, v in stored.items():
                tensors.setdefault(k, []).append(v)
            row = n * samples_per_part + i
            samples.append({"id": f"row-{row}", "row": row, "num_tokens": tokens, "num_loss_tokens": tokens,
                            "sha256": storage.sha256_tensors(stored)})  # fmt: skip
        block = (n * samples_per_part, (n + 1) * samples_per_part)
        write_part(shard, n, samples, [], tensors, block)
        blocks.append(block)
    verifier = {
        "path": "/synthetic", "architecture": "Synthetic", "num_hidden_layers": 8, "hidden_size": HIDDEN,
        "vocab_size": 320, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }  # fmt: skip
    settings = {
        "format": SHARD_FORMAT, "verifier": verifier, "aux_layer_ids": [2, 4, 5], "dtype": "float32",
        "storage_dtype": "float32", "data_path": "/synthetic", "data_split": "train",
        "row_range": [0, parts * samples_per_part], "max_seq_len": 4096, "samples_per_file": samples_per_part,
    }  # fmt: skip
    made = provenance(ExtractConfig(verifier_path="/synthetic", data_path="/synthetic", out_dir=str(root)))
    finish_shard(StageOutput(shard), len(blocks), settings, made)
    return shard


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hash_every_part(shard: Path) -> None:
    """What stage start used to do on top of the header checks: sha256 of every byte."""
    for f in storage.read_json(shard / MANIFEST_FILE)["files"]:
        storage.sha256_file(shard / f["file"])


def measure(root: Path, parts: int, part_bytes: int, repeats: int) -> dict[str, float]:
    shard = write_shard(Path(tempfile.mkdtemp(dir=root)), parts, part_bytes)
    total = sum(p.stat().st_size for p in shard.glob("part-*.safetensors"))
    open_shards([str(shard)])  # warm-up: imports, first opens
    start = timed(lambda: open_shards([str(shard)]), repeats)
    full = timed(lambda: hash_every_part(shard), repeats)
    return {
        "parts": parts,
        "part_bytes": part_bytes,
        "shard_bytes": total,
        "start_s": start,
        "hash_all_s": full,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for iteration")
    p.add_argument("--json", default=str(RESULTS / "stage_start.json"))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mb = 1 << 20
    if a.quick:
        part_counts, fixed_bytes, part_sizes, fixed_parts, repeats = [4, 16], 1 * mb, [1 * mb, 16 * mb], 4, 3
    else:
        part_counts, fixed_bytes, part_sizes, fixed_parts, repeats = (
            [8, 32, 128],
            1 * mb,
            [1 * mb, 16 * mb, 128 * mb],
            8,
            5,
        )
    rows: dict[str, list[dict[str, float]]] = {"parts": [], "bytes": []}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        for n in part_counts:
            rows["parts"].append(measure(Path(tmp), n, fixed_bytes, repeats))
        for b in part_sizes:
            rows["bytes"].append(measure(Path(tmp), fixed_parts, b, repeats))
    print(f"machine {platform.machine()} | {os.cpu_count()} cpus | threads {a.threads} "
          f"| torch {torch.__version__} | python {platform.python_version()}")  # fmt: skip
    print("sweep | parts | shard MB | start s | x start | hash-all s | x hash-all | hash-all / start")
    for sweep, rs in rows.items():
        base = rs[0]
        for r in rs:
            r["start_ratio"] = r["start_s"] / base["start_s"]
            r["hash_all_ratio"] = r["hash_all_s"] / base["hash_all_s"]
            print(
                f"{sweep:5s} | {r['parts']:5d} | {r['shard_bytes'] / mb:8.1f} | {r['start_s']:7.4f} | "
                f"x{r['start_ratio']:5.2f} | {r['hash_all_s']:10.4f} | x{r['hash_all_ratio']:6.2f} | "
                f"x{r['hash_all_s'] / r['start_s']:.1f}"
            )
    out = {"rows": rows, "threads": a.threads, "quick": a.quick, "versions": storage.versions()}
    Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(f"json {a.json}")


if __name__ == "__main__":
    main()
