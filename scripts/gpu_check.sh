#!/usr/bin/env bash
# One prepared device run (at most 10 minutes on one H200) that measures training on CUDA and writes
# one JSON, gpu_check.json, to $OUT (or the folder given as $1). The machine has python3 (3.12) with
# torch (CUDA), transformers, safetensors, tqdm, accelerate, triton and tokenizers, and cannot download:
# speculators and the other pure-Python needs come with the tree, packed here by scripts/gpu_wheels.sh.
#   bash scripts/gpu_wheels.sh                          # here, once: .whl/ and .whl-packed/site.tar.xz
#   bash scripts/gpu_check.sh                           # on the GPU machine, .whl-packed/ beside the tree
#   OUT=/tmp/gc bash scripts/gpu_check.sh               # any CUDA box whose python3 has the packages
# Sections, each under its own time limit so the run ends in time and a failed one does not stop the
# rest (its log tail goes in the JSON):
#   1. the tiny pipeline, bf16 on CUDA, end to end (scripts/run_tiny.sh, default kernels: auto)
#   2. the Kimi-sized draft step: flex+fused+compile vs sdpa+eager vs speculators' own Trainer
#      (python -m benchmarks.train_kernels --kimi --device cuda), the llama layer speculators also trains
#   3. the same step for configs/kimi_k25.toml's MLA draft (--arch mla): flex+fused+compile, sdpa+eager
#   4. torchrun --nproc-per-node 1 of 04_train --parallel-drafting on the tiny run's data (kernels auto)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SITE=${SITE:-/tmp/site}
ROOT=${ROOT:-/tmp/gpu_check_runs}
T_TINY=${T_TINY:-170} T_KIMI=${T_KIMI:-210} T_MLA=${T_MLA:-100} T_DDP=${T_DDP:-60}  # seconds; sum + installs < 600
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
START=$(date +%s)

# --- wheels: the packed site (fits a 64 MiB carry) or the wheels themselves -------------------------
mkdir -p "$SITE"
if [ -f .whl-packed/site.tar.xz ]; then
  tar xJf .whl-packed/site.tar.xz -C "$SITE"
elif compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
fi
# keep the machine's own copy of anything it already has (its torch/transformers were built with it)
"$PY" - "$SITE" <<'PY'
import importlib.metadata as md, pathlib, shutil, sys
site = pathlib.Path(sys.argv[1])
have = {d.metadata["Name"].lower().replace("_", "-") for d in md.distributions() if d.metadata["Name"]}
for info in site.glob("*.dist-info"):
    name = md.Distribution.at(info).metadata["Name"].lower().replace("_", "-")
    if name in have:
        for line in (info / "RECORD").read_text().splitlines():
            p = (site / line.split(",")[0]).resolve()
            if p.is_relative_to(site.resolve()) and p.is_file():  # never a script path outside the site
                p.unlink()
        shutil.rmtree(info, ignore_errors=True)
        print(f"kept the machine's {name}")
for d in sorted(site.rglob("*"), reverse=True):  # emptied package folders would shadow as namespaces
    if d.is_dir() and not any(d.iterdir()):
        d.rmdir()
PY
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

section() {  # name, seconds, command...: runs it with a time limit, logs to $OUT/<name>.log
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "{\"rc\": $rc, \"wall_s\": $(( $(date +%s) - t0 ))}" > "$OUT/$name.rc.json"
  echo "section $name: rc $rc in $(( $(date +%s) - t0 ))s"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } > "$OUT/gpu.txt"
"$PY" -c "import torch, transformers, speculators; print(torch.__version__, transformers.__version__, \
speculators.__version__, torch.cuda.get_device_name())" > "$OUT/import.log" 2>&1

# --- 1. the tiny pipeline in bf16 on CUDA (dtype auto = bf16 autocast there; kernels auto) ----------
mkdir -p "$ROOT"
sed "s#\"runs/tiny/#\"$ROOT/tiny/#g" configs/tiny.toml > "$ROOT/tiny.toml"
section tiny "$T_TINY" env PYTHON="$PY" bash scripts/run_tiny.sh "$ROOT/tiny.toml"

# --- 2. the Kimi-sized draft step on one GPU ----------------------------------------------------------
section kimi "$T_KIMI" "$PY" -m benchmarks.train_kernels --kimi --device cuda --warmup 2 --steps 3 \
  --out "$OUT/kimi.json"

# --- 3. the MLA draft kimi_k25.toml trains, the same step on one GPU ---------------------------------
section kimi_mla "$T_MLA" "$PY" -m benchmarks.train_kernels --kimi --arch mla --device cuda --warmup 2 \
  --steps 3 --only flex+fused+compile sdpa+eager --out "$OUT/kimi_mla.json"

# --- 4. a parallel draft under torchrun with one process, on the tiny run's data ---------------------
#    (its draft_logits compiled for dynamic shapes: flex's fused kernel on CUDA; one process starts no
#    process group, so DDP and NCCL wait for a machine with two GPUs)
section ddp "$T_DDP" "$PY" -m torch.distributed.run --nproc-per-node 1 04_train.py --config "$ROOT/tiny.toml" \
  --out-dir "$ROOT/tiny/train_ddp" --max-steps 10 --eval-every 10 --overwrite --parallel-drafting

# --- one JSON ------------------------------------------------------------------------------------------
"$PY" - "$OUT" "$ROOT" "$START" <<'PY'
import json, pathlib, re, sys, time
out, root, start = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
def read(p):
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
def tail(name, n=3000):
    p = out / f"{name}.log"
    return p.read_text(errors="replace")[-n:] if p.exists() else None
res = {"gpu": (out / "gpu.txt").read_text().strip(), "import": tail("import", 500), "sections": {}}
for name in ("tiny", "kimi", "kimi_mla", "ddp"):
    res["sections"][name] = {**(read(out / f"{name}.rc.json") or {}), "log_tail": tail(name)}
log = tail("tiny", 10**7) or ""
done = re.findall(r"done .*? acceptance_length ([\d.]+) \(untrained ([\d.]+)\)", log)
# what run_tiny.sh's 06_evaluate.py --engine sim wrote (evaluate.result_name: acceptance_sim*.json)
acc = {p.name: read(p) for p in sorted((root / "tiny" / "draft").glob("acceptance_sim*.json"))}
res["tiny_bf16_cuda"] = {
    "val_acceptance_length": float(done[-1][0]) if done else None,
    "val_acceptance_length_untrained": float(done[-1][1]) if done else None,
    "train_meta_kernels": (read(root / "tiny" / "train" / "meta.json") or {}).get("kernels"),
    "simulated_acceptance": acc,
    # the same pipeline in fp32 on CPU (sdpa + eager, no compile), this script's own dry run on the
    # 2-core CPU machine at the commit that added it (docs/results.md "Summary" quotes another commit's run)
    "fp32_cpu_reference_val_acceptance_length": 2.224,
}
ddp = tail("ddp", 10**7) or ""
res["ddp_nproc1"] = {
    "finished": (root / "tiny" / "train_ddp" / "checkpoints").exists() and "Traceback" not in ddp,
    "meta_kernels": (read(root / "tiny" / "train_ddp" / "meta.json") or {}).get("kernels"),
}
res["kimi"] = read(out / "kimi.json")
res["kimi_mla"] = read(out / "kimi_mla.json")
res["wall_s"] = int(time.time()) - start
(out / "gpu_check.json").write_text(json.dumps(res, indent=2) + "\n")
print(f"wrote {out / 'gpu_check.json'}")
PY
