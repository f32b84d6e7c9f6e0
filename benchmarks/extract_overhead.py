#!/usr/bin/env python3
"""Stage 01's wall time against a bare forward over the same samples, both engines (issue 9: <= 1.10x on CPU).

Each measured thing runs in its own process, the way a user runs it, and its wall time is taken from the
outside: `01_extract_hidden_states.py` end to end (imports, verifier or vLLM engine start, rendering,
tokenising, forward, encoding, hashing, writing, the finished shard), and a bare program that does only
what no extraction can skip: import the engine, load the verifier, run the forward over the same samples
(token ids given, part by part as stage 01 groups them) and, for vLLM, read its states back.
hf: transformers, torch threads as --threads; vllm: vLLM's extract_hidden_states method in its CPU build
(engine settings from vllm_side/worker.py, as stage 01 uses them). Ratio = stage wall / bare
wall, medians of interleaved runs (this machine is shared and noisy). The bare programs' own timings
(load, forward) are reported beside it. Data: tests/data/conversations.jsonl repeated under fresh ids.

    .venv/bin/python -m benchmarks.extract_overhead                 # 400 rows, both engines
    .venv/bin/python -m benchmarks.extract_overhead --rows 200 --repeats 5 \
        --out docs/results/extract_overhead_200.json                  # the 200-row run in docs/results.md
    .venv/bin/python -m benchmarks.extract_overhead --engines hf    # hf only (no vLLM environment)
    .venv/bin/python -m benchmarks.extract_overhead --quick         # 40 rows, one run each
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

from benchmarks import REPO, RESULTS

AUX = [1, 4, 7]
BARE_HF = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from pathlib import Path
from eagle3_pipeline.data.extract import _forward_batched
from eagle3_pipeline.models.verifier import AuxCapture, find_decoder_layers, load_verifier_model
blocks = json.loads(Path(sys.argv[2]).read_text())
t0 = time.perf_counter()
model = load_verifier_model(Path(sys.argv[1]), torch.float32, False)
load_s = time.perf_counter() - t0
capture = AuxCapture(find_decoder_layers(model, model.config.num_hidden_layers), [1, 4, 7])
t0 = time.perf_counter()
for seqs in blocks:
    _forward_batched(model, capture, seqs, 4096)
print(json.dumps({"load_s": load_s, "forward_s": time.perf_counter() - t0}))
"""
BARE_VLLM = r"""
import json, os, sys, time
from eagle3_pipeline.vllm_side import worker as w
from eagle3_pipeline.vllm_side.protocol import load_request
from safetensors.torch import load_file
from vllm import LLM, SamplingParams
req = load_request(sys.argv[1])
blocks = json.loads(open(sys.argv[2]).read())
t0 = time.perf_counter()
llm = LLM(**w.engine_kwargs(req))
load_s = time.perf_counter() - t0
params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
t0 = time.perf_counter()
for seqs in blocks:
    for path in w._extract(llm, {**req, "prompts": seqs}, params, 0.0)["paths"]:
        load_file(path)
        os.unlink(path)
forward_s = time.perf_counter() - t0
w._shutdown(llm)
print(json.dumps({"load_s": load_s, "forward_s": forward_s}))
"""


def _bare_blocks(verifier: Path, data: Path, rows_per_part: int, path: Path) -> int:
    """The samples' token ids, part by part, as stage 01 builds them; their token count."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.conversations import read_rows
    from eagle3_pipeline.data.samples import SampleOptions, block_samples

    tok = AutoTokenizer.from_pretrained(str(verifier))
    opts, seen, blocks = SampleOptions(1024, False, {}), {}, []
    n_rows = sum(1 for _ in open(data))
    for a in range(0, n_rows, rows_per_part):
        accepted, _ = block_samples(read_rows(data, a, a + rows_per_part), tok, opts, seen)
        blocks.append([s.input_ids for _, s in accepted])
    path.write_text(json.dumps(blocks))
    return sum(len(s) for b in blocks for s in b)


def _wall(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stdout


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=400, help="rows of conversations (default 400)")
    p.add_argument("--quick", action="store_true", help="40 rows, one run of each (for iteration)")
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--threads", type=int, default=1, help="torch threads of the hf runs (default 1)")
    p.add_argument("--arch", default="kimi_mla", help="tiny verifier (eagle3_pipeline/models/tiny.py --arch)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, interleaved; medians reported")
    p.add_argument("--out", default=str(RESULTS / "extract_overhead.json"))
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.repeats = 40, 1
    rows_per_part = 16
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(a.threads),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    from eagle3_pipeline.vllm_side import vllm_engine
    from eagle3_pipeline.data.config import ExtractConfig
    from eagle3_pipeline.vllm_side.extract_vllm import engine_fields, vllm_version
    from eagle3_pipeline.core.storage import versions

    report: dict = {
        "versions": {**versions(), "vllm": vllm_version(None) if "vllm" in a.engines else "not run"},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "threads": a.threads},
        "arch": a.arch,
        "rows": a.rows,
        "engines": {},
    }
    with tempfile.TemporaryDirectory(prefix="extract-overhead-") as tmp:
        tmp_path = Path(tmp)
        verifier = tmp_path / "verifier"
        subprocess.run([sys.executable, "-m", "eagle3_pipeline.models.tiny", "--arch", a.arch, "--out",
                        str(verifier)], env=env, check=True, capture_output=True)  # fmt: skip
        data = _rows_file(tmp_path / "rows.jsonl", a.rows)
        blocks = tmp_path / "blocks.json"
        report["tokens"] = _bare_blocks(verifier, data, rows_per_part, blocks)
        stage = [
            sys.executable,
            str(REPO / "01_extract_hidden_states.py"),
            "--verifier-path",
            str(verifier),
            "--data-path",
            str(data),
            "--samples-per-file",
            str(rows_per_part),
            "--dtype",
            "float32",
            "--aux-layer-ids",
            *map(str, AUX),
            "--max-batch-tokens",
            "4096",
            "--max-seq-len",
            "1024",
        ]
        fields = engine_fields(
            ExtractConfig(
                verifier_path=str(verifier), data_path=str(data), out_dir=str(tmp_path), max_seq_len=1024
            ),
            AUX,
            8,
            __import__("torch").float32,
        )
        request = tmp_path / "bare_request.json"
        request.write_text(json.dumps({**fields, "storage_path": str(tmp_path / "bare_states")}))
        bare = {
            "hf": [sys.executable, "-c", BARE_HF, str(verifier), str(blocks), str(a.threads)],
            "vllm": [str(vllm_engine.default_python()), "-c", BARE_VLLM, str(request), str(blocks)],
        }
        for engine in a.engines:
            stage_of = [*stage, "--engine", engine, "--out-dir"]
            runs = _engine_runs(stage_of, bare[engine], env, a.repeats, tmp_path / engine)
            report["engines"][engine] = runs
    _print_table(report)
    Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


def _rows_file(path: Path, n: int) -> Path:
    """`n` rows: the shipped conversations repeated under fresh ids."""
    src = [json.loads(x) for x in (REPO / "tests/data/conversations.jsonl").read_text().splitlines()]
    src = [r for r in src if "messages" in r or "conversations" in r]
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({**src[i % len(src)], "id": f"row-{i}"}) + "\n")
    return path


def _engine_runs(stage_of: list[str], bare: list[str], env: dict[str, str], repeats: int, out: Path) -> dict:
    """Stage 01 (`stage_of` + an out dir) and the bare program, interleaved `repeats` times: medians."""
    runs: dict[str, list[float]] = {"stage": [], "bare": [], "load": [], "forward": []}
    for r in range(repeats):  # interleaved, medians: this machine is shared and noisy
        runs["stage"].append(_wall([*stage_of, str(out / f"hs-{r}")], env)[0])
        wall, stdout = _wall(bare, env)
        inner = json.loads(stdout.strip().splitlines()[-1])
        runs["bare"].append(wall)
        runs["load"].append(inner["load_s"])
        runs["forward"].append(inner["forward_s"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {
        "stage01_wall_s": round(med["stage"], 2),
        "bare_wall_s": round(med["bare"], 2),
        "bare_load_s": round(med["load"], 2),
        "bare_forward_s": round(med["forward"], 2),
        "ratio": round(med["stage"] / med["bare"], 3),
        "ratio_vs_load_and_forward": round(med["stage"] / (med["load"] + med["forward"]), 3),
        "runs_s": runs,
    }


def _print_table(report: dict) -> None:
    print("| engine | rows | tokens | stage 01 wall | bare wall (load, forward inside) | ratio |")
    print("|---|---|---|---|---|---|")
    for engine, e in report["engines"].items():
        bare_s = f"{e['bare_wall_s']:.1f} s ({e['bare_load_s']:.1f}, {e['bare_forward_s']:.1f})"
        print(
            f"| {engine} | {report['rows']} | {report['tokens']:,} | {e['stage01_wall_s']:.1f} s | "
            f"{bare_s} | **{e['ratio']:.2f}x** |"
        )


if __name__ == "__main__":
    sys.exit(main())
