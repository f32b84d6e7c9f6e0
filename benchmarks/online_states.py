"""Extract-then-train vs online states, the same training steps on the same rows, on this machine.

  .venv/bin/python -m benchmarks.online_states [--rows 240] [--epochs 2] \
      [--json docs/results/online_states.json]

Both pipelines start from the conversations (tests/data/conversations.jsonl cycled to --rows rows) and the
tiny Kimi-latent MLA verifier in fp32 (vLLM's CPU build, the vLLM tier's verifier), and train the same
draft for the same steps with the same seed:
  offline: stage 01 --engine vllm (its own engine) -> 02 -> 03 -> 04 on the shards
  online:  stage 01 --storage-dtype none (token shards) -> 02 -> 03, one `vllm serve` started with
           `04_train.py --serve-line`'s command, 04 --states online
Reported per pipeline: the wall of each phase and in all, the bytes written (shards vs token shards), the
trainer's wait for states inside its loop (online: its epoch lines), and the share of the whole wall in
which the trainer was not training (offline: everything before stage 04; online: the server's start-up,
the token shards and the waits). The losses of both runs are compared step by step (online states are
vLLM's states: they should match to rounding). On 2 CPU cores the server and the trainer share the cores,
which a GPU node does not: the online trainer's own wall here is an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import REPO

from eagle3_pipeline.vllm_side import vllm_engine

TRAIN = ["--batch-tokens", "1024", "--num-attention-heads", "4", "--num-key-value-heads", "4",
         "--head-dim", "64", "--intermediate-size", "512", "--log-every", "5", "--eval-every", "100000",
         "--val-max-samples", "4", "--seed", "0"]  # fmt: skip
EXTRACT = ["--samples-per-file", "16", "--max-seq-len", "1024"]


def stage(name: str, *args: str, env: dict | None = None) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / name), *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0, proc.stderr


def prepare(root: Path, verifier: Path, data: Path, *extra: str) -> dict[str, float]:
    t = {}
    t["01"], _ = stage("01_extract_hidden_states.py", "--verifier-path", str(verifier), "--data-path",
                       str(data), "--out-dir", str(root / "hs"), *EXTRACT, *extra)  # fmt: skip
    t["02"], _ = stage("02_build_vocab_mapping.py", "--data-dir", str(root / "hs"), "--out-dir",
                       str(root / "vocab"), "--draft-vocab-size", "96")  # fmt: skip
    t["03"], _ = stage("03_split_data.py", "--data-dir", str(root / "hs"), "--out-dir", str(root / "split"))
    return t


def train(root: Path, epochs: int, *extra: str) -> tuple[float, str]:
    return stage("04_train.py", "--data-dir", str(root / "hs"), "--vocab-mapping-dir", str(root / "vocab"),
                 "--split-dir", str(root / "split"), "--out-dir", str(root / "run"), "--epochs", str(epochs),
                 *TRAIN, *extra)  # fmt: skip


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]


def start_server(root: Path) -> tuple[subprocess.Popen, str, float]:
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.training.online import serve_argv
    from eagle3_pipeline.data.shards import open_shards

    cfg = TrainConfig(
        vocab_mapping_dir="v", out_dir="o", transfer_args=f"--hidden-states-path {root / 'served'}"
    )
    argv = serve_argv(cfg, open_shards([str(root / "hs")], verify=False).meta, cpu=True,
                      python=str(vllm_engine.default_python()))  # fmt: skip
    url = "http://127.0.0.1:8931"
    t0 = time.perf_counter()
    proc = subprocess.Popen([*argv, "--port", "8931"], stdout=(root / "server.log").open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server failed: {(root / 'server.log').read_text()[-3000:]}")
        try:
            urllib.request.urlopen(f"{url}/v1/models", timeout=5).read()
            return proc, url, time.perf_counter() - t0
        except OSError:
            time.sleep(0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=240)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ok, why = vllm_engine.available()
    if not ok:
        raise SystemExit(f"needs the vLLM environment (scripts/setup_vllm_cpu.sh): {why}")
    from eagle3_pipeline.models.tiny import build_verifier

    tmp = Path(tempfile.mkdtemp(prefix="online-bench-"))
    verifier = build_verifier("kimi_mla", tmp / "verifier")
    rows = (REPO / "tests" / "data" / "conversations.jsonl").read_text().splitlines()
    data = tmp / "rows.jsonl"
    with data.open("w") as f:  # each copy its own id (stage 01 rejects a repeated id)
        for i in range(a.rows):
            row = json.loads(rows[i % len(rows)])
            f.write(json.dumps({**row, "id": f"{row['id']}-{i}"}) + "\n")

    off = tmp / "offline"
    t_off = prepare(off, verifier, data, "--engine", "vllm")
    t_off["04"], _ = train(off, a.epochs)

    on = tmp / "online"
    t_on = prepare(on, verifier, data, "--storage-dtype", "none")
    server, url, t_on["server_start"] = start_server(on)
    try:
        t_on["04"], log = train(on, a.epochs, "--states", "online", "--servers", url,
                                f"--transfer-args=--hidden-states-path {on / 'served'}")  # fmt: skip
    finally:
        os.killpg(server.pid, 9)
    waits = [
        (float(w), float(t))
        for w, t in re.findall(r"online \| epoch \d+ \| .* waited ([\d.]+)s of ([\d.]+)s", log)
    ]
    waited = sum(w for w, _ in waits)
    lo, ln = losses(off / "run"), losses(on / "run")
    worst = max(abs(x - y) / abs(x) for x, y in zip(lo, ln))
    total_off, total_on = sum(t_off.values()), sum(t_on.values())
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "rows": a.rows, "epochs": a.epochs,
        "steps": json.loads((on / "run" / "meta.json").read_text())["plan"]["total_steps"],
        "offline_s": {k: round(v, 1) for k, v in t_off.items()} | {"total": round(total_off, 1)},
        "online_s": {k: round(v, 1) for k, v in t_on.items()} | {"total": round(total_on, 1)},
        "written_bytes": {"offline_shards": du(off / "hs"), "online_token_shards": du(on / "hs")},
        "online_trainer_wait_s": round(waited, 1),
        "online_trainer_wait_share_of_its_loop": round(waited / max(sum(t for _, t in waits), 1e-9), 3),
        "not_training_share_of_wall": {
            "offline": round((total_off - t_off["04"]) / total_off, 3),
            "online": round((total_on - t_on["04"] + waited) / total_on, 3),
        },
        "wall_online_over_offline": round(total_on / total_off, 3),
        "worst_relative_loss_difference": worst,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
