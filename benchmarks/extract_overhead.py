#!/usr/bin/env python3
"""Stage 01's wall time against a bare forward pass over the same samples (issue 9: <= 1.10x on CPU).

Both run in their own process with the same torch threads: `01_extract_hidden_states.py` end to end
(load, render, tokenise, forward, encode, hash, write, finish), and a bare run that loads the same
verifier, builds the same samples (not timed) and times only `extract._forward_batched` over the same
blocks. Ratio = stage-01 wall / (bare forward + verifier load); a second ratio leaves out what any
process pays before its first row: a process that only imports what stage 01 imports (torch,
transformers and its model classes, the package). Data: tests/data/conversations.jsonl repeated under fresh ids. Engine: hf only:
the vLLM extraction engine is not built yet. Stage 01 renders, tokenises, encodes and writes in series
with the forward (no overlap yet).

    .venv/bin/python benchmarks/extract_overhead.py            # 200 rows, tiny kimi_mla verifier
    .venv/bin/python benchmarks/extract_overhead.py --quick    # 40 rows
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMPORTS = "import torch, transformers; from transformers import AutoModelForCausalLM, AutoTokenizer; import eagle3_pipeline.extract"
BARE = r"""
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(int(sys.argv[4]))
from transformers import AutoTokenizer
from eagle3_pipeline.conversations import read_rows
from eagle3_pipeline.extract import _forward_batched, block_samples
from eagle3_pipeline.samples import SampleOptions
from eagle3_pipeline.verifier import AuxCapture, find_decoder_layers, load_verifier_model, verifier_facts
verifier, data, rows_per_part = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(str(verifier))
opts, seen, blocks = SampleOptions(1024, False, {}), {}, []
n_rows = sum(1 for _ in open(data))
for a in range(0, n_rows, rows_per_part):
    accepted, _ = block_samples(read_rows(data, a, a + rows_per_part), tok, opts, seen)
    blocks.append([s.input_ids for _, s in accepted])
t0 = time.perf_counter()
model = load_verifier_model(verifier, torch.float32, False)
load_s = time.perf_counter() - t0
facts = verifier_facts(verifier)
capture = AuxCapture(find_decoder_layers(model, facts.num_hidden_layers), [1, 4, 7])
t0 = time.perf_counter()
for seqs in blocks:
    _forward_batched(model, capture, seqs, 4096)
forward_s = time.perf_counter() - t0
print(json.dumps({"load_s": load_s, "forward_s": forward_s, "tokens": sum(len(s) for b in blocks for s in b)}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 rows instead of 200")
    p.add_argument("--threads", type=int, default=1, help="torch threads of both runs (default 1)")
    p.add_argument("--arch", default="kimi_mla", help="tiny verifier (eagle3_pipeline/tiny.py --arch)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; medians reported")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "extract_overhead.json"))
    a = p.parse_args(argv)
    rows_wanted, rows_per_part = (40, 16) if a.quick else (200, 16)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads),
           "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="extract-overhead-") as tmp:
        tmp_path = Path(tmp)
        verifier = tmp_path / "verifier"
        subprocess.run([sys.executable, "-m", "eagle3_pipeline.tiny", "--arch", a.arch, "--out", str(verifier)],
                       env=env, check=True, capture_output=True)  # fmt: skip
        src = [json.loads(x) for x in (REPO / "tests/data/conversations.jsonl").read_text().splitlines()]
        src = [r for r in src if "messages" in r or "conversations" in r]
        data = tmp_path / "rows.jsonl"
        with open(data, "w") as f:
            for i in range(rows_wanted):
                f.write(json.dumps({**src[i % len(src)], "id": f"row-{i}"}) + "\n")
        stage = [sys.executable, str(REPO / "01_extract_hidden_states.py"), "--verifier-path", str(verifier),
                 "--data-path", str(data), "--samples-per-file", str(rows_per_part), "--dtype", "float32",
                 "--aux-layer-ids", "1", "4", "7", "--max-batch-tokens", "4096", "--max-seq-len", "1024"]  # fmt: skip
        bare_cmd = [sys.executable, "-c", BARE, str(verifier), str(data), str(rows_per_part), str(a.threads)]
        runs: dict[str, list[float]] = {"stage": [], "startup": [], "forward": [], "load": []}
        for r in range(a.repeats):  # interleaved, medians: this machine is shared and noisy
            t0 = time.perf_counter()
            subprocess.run(
                [*stage, "--out-dir", str(tmp_path / f"hs{r}")], env=env, check=True, capture_output=True
            )
            runs["stage"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=True, capture_output=True)
            runs["startup"].append(time.perf_counter() - t0)
            bare = subprocess.run(bare_cmd, env=env, check=True, capture_output=True, text=True)
            b = json.loads(bare.stdout.strip().splitlines()[-1])
            runs["forward"].append(b["forward_s"])
            runs["load"].append(b["load_s"])
        stage_s, startup_s = statistics.median(runs["stage"]), statistics.median(runs["startup"])
        b = {"forward_s": statistics.median(runs["forward"]), "load_s": statistics.median(runs["load"]),
             "tokens": b["tokens"]}  # fmt: skip
    ratio = stage_s / (b["forward_s"] + b["load_s"])
    after_startup = (stage_s - startup_s) / (b["forward_s"] + b["load_s"])
    report = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": a.threads},
        "arch": a.arch, "rows": rows_wanted, "tokens": b["tokens"], "engine": "hf",
        "stage01_wall_s": round(stage_s, 2), "bare_forward_s": round(b["forward_s"], 2),
        "verifier_load_s": round(b["load_s"], 2), "process_startup_s": round(startup_s, 2),
        "ratio": round(ratio, 3), "ratio_after_startup": round(after_startup, 3), "runs_s": runs,
    }  # fmt: skip
    print(
        "| engine | rows | tokens | stage 01 wall | bare forward + load | ratio | start-up | ratio without it |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(f"| hf | {rows_wanted} | {b['tokens']:,} | {stage_s:.1f} s | {b['forward_s']:.1f} + {b['load_s']:.1f} s | "
          f"**{ratio:.2f}x** | {startup_s:.1f} s | {after_startup:.2f}x |")  # fmt: skip
    Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
