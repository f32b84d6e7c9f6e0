"""Several ranks, several nodes, for real: torchrun (its own c10d rendezvous) and gloo on this CPU.

Two torchrun agents on this machine stand for two nodes (`--nnodes 2 --rdzv-backend c10d`). Every epoch
trains every sample once on any number of ranks (the last step padded, epochs.py); 2 ranks x grad_accum 1
train the losses of 1 process x grad_accum 2; a node lost (its agent and worker SIGKILLed, either agent)
stops the other with one line naming the lost rank, and the same command rerun resumes to the
uninterrupted result; a frozen rank is given up after --dist-timeout-s; a run folder local to each node,
or a resume on another number of ranks, is refused at start with one line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, read_jsonl

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
RUN_TIMEOUT_S = 600  # a hang fails the test instead of blocking CI
BATCH_TOKENS = "384"  # 9 training samples -> 7 micro-batches an epoch: a remainder for 2 x 2, 3 x 1, 2 x 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train_args(shards: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        str(REPO / "04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"),
        "--data-dir", str(shards["float32"]), "--split-dir", "", "--val-ratio", "0.2",
        "--vocab-mapping-dir", str(shards["vocab_float32"]), "--out-dir", str(out),
        "--batch-tokens", BATCH_TOKENS, "--log-every", "1", "--val-max-samples", "1", *extra,
    ]  # fmt: skip


def _agents(node_args: list[list[str]], logs: Path, rdzv_id: str, port: int) -> list[subprocess.Popen]:
    """One torchrun agent of one process per entry (its node's 04_train.py arguments), as on as many
    machines; each in its own session, so that a test can kill one with its worker (a node lost)."""
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for node, args in enumerate(node_args):
        cmd = [TORCHRUN, "--nnodes", str(len(node_args)), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id, *args]  # fmt: skip
        out = open(logs / f"node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, env=ENV, cwd=logs, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))  # fmt: skip
        time.sleep(1.0)  # the first agent hosts the rendezvous store
    return procs


def _wait(procs: list[subprocess.Popen], timeout_s: float = RUN_TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout_s
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            _kill_node(p)
        raise


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers (torchrun starts them in sessions of their own): a node lost."""
    children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children")
    workers = [int(p) for p in children.read_text().split()] if children.exists() else []
    for pid in [agent.pid, *workers]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait(timeout=60)


def _log(logs: Path, node: int) -> str:
    return (logs / f"node{node}.log").read_text()


def _single(shards: dict[str, Path], out: Path, *extra: str) -> str:
    proc = subprocess.run([sys.executable, *_train_args(shards, out, *extra)], env=ENV, cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def _expected_epoch(shards: dict[str, Path]) -> tuple[int, int]:
    """(training samples, packed positions they make) of the split the runs use, counted here."""
    from eagle3_pipeline.data.shards import open_shards
    from eagle3_pipeline.data.split import split_samples

    train, _ = split_samples(open_shards([str(shards["float32"])], verify=False).samples, 0, 0.2)
    return len(train), sum(max(0, min(r.num_tokens, 1024) - 1) for r in train)


EPOCH_LINE = re.compile(r"train \| epoch (\d+) \| samples (\d+), each once \| positions (\d+) \| "
                        r"micro-batches (\d+) \(\+(\d+) padding\) \| ranks (\d+) x")  # fmt: skip


@pytest.mark.parametrize("ranks,grad_accum", [(2, 2), (3, 1)])
def test_every_sample_is_trained_once_per_epoch_on_2_and_3_ranks(tiny_shards, tmp_path, ranks, grad_accum):
    """7 micro-batches an epoch over 2 ranks x grad_accum 2 (4 a step) or 3 ranks (3 a step): none dropped,
    the last step padded; the counts summed over the ranks equal the split's, counted independently."""
    out = tmp_path / "run"
    args = _train_args(tiny_shards, out, "--epochs", "2", "--grad-accum", str(grad_accum))
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", str(ranks), *args], env=ENV,
                          cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples, positions = _expected_epoch(tiny_shards)
    epochs = [tuple(map(int, m)) for m in EPOCH_LINE.findall(proc.stderr)]
    per_step = ranks * grad_accum
    assert [e[0] for e in epochs] == [0, 1], proc.stderr[-3000:]
    for _, n, pos, batches, padding, world in epochs:
        assert (n, pos, world) == (samples, positions, ranks)
        assert batches % per_step and padding == -batches % per_step  # a remainder, padded, not dropped
    steps = [e["step"] for e in read_jsonl(out / "train_log.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == sum(-(-e[3] // per_step) for e in epochs)
    if ranks == 2:  # a rerun on another number of ranks would train other samples in each step: refused
        more = [TORCHRUN, "--standalone", "--nproc-per-node", "3", *args]  # the same recipe, 3 ranks
        proc = subprocess.run(more, env=ENV, cwd=tmp_path, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)  # fmt: skip
        want = "trained with 4 micro-batches a step (ranks x grad_accum), this run takes 6; rerun with"
        assert proc.returncode != 0 and want in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def two_nodes(tiny_shards, tmp_path_factory) -> dict[str, Path]:
    """The reference runs: two torchrun agents (c10d rendezvous, 1 rank each, grad_accum 1) and one
    process with grad_accum 2: the same 2 micro-batches a step."""
    root = tmp_path_factory.mktemp("two_nodes")
    args = _train_args(tiny_shards, root / "nodes", *STEPS)
    rcs = _wait(_agents([args, args], root / "logs", "reference", _free_port()))
    assert rcs == [0, 0], _log(root / "logs", 0)[-3000:] + _log(root / "logs", 1)[-3000:]
    _single(tiny_shards, root / "single", *STEPS, "--grad-accum", "2")
    return {"root": root, "nodes": root / "nodes", "single": root / "single", "logs": root / "logs"}


STEPS = ("--max-steps", "6", "--save-every", "2", "--eval-every", "2", "--keep-last", "10")


def test_two_torchrun_nodes_train_the_losses_of_one_process_with_the_same_global_batch(two_nodes):
    nodes = read_jsonl(two_nodes["nodes"] / "train_log.jsonl")
    single = read_jsonl(two_nodes["single"] / "train_log.jsonl")
    assert [e["step"] for e in nodes] == [e["step"] for e in single] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(nodes, single):  # step 4 ends epoch 0: its second micro-batch is padding on rank 1
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    logs = _log(two_nodes["logs"], 0) + _log(two_nodes["logs"], 1)
    saved = re.findall(r"\[rank (\d)\] checkpoint (\S+)", logs)
    assert {r for r, _ in saved} == {"0"} and len(saved) == 3  # steps 2, 4, 6: once each, by global rank 0
    assert sorted(p.name for p in (two_nodes["nodes"] / "checkpoints").glob("step_*")) == [
        "step_000002", "step_000004", "step_000006"]  # fmt: skip
    assert "[rank 0] train | epoch 0 | samples 9, each once" in logs and "[rank 1] train |" not in logs
    assert not list(two_nodes["nodes"].glob(".rank0-*"))  # the shared-folder probe is gone


def _lose_a_node(tiny_shards: dict[str, Path], out: Path, logs: Path, lost: int) -> list[str]:
    """Two agents; once step 3 is logged (after checkpoint step 2), agent `lost` and its worker SIGKILLed:
    the other exits non-zero within 60 s, its worker's error naming the lost rank. Returns the args."""
    args = _train_args(tiny_shards, out, *STEPS)
    agents = _agents([args, args], logs, f"lost{lost}", _free_port())
    deadline = time.monotonic() + RUN_TIMEOUT_S
    train_log = out / "train_log.jsonl"
    while not (train_log.exists() and any(e["step"] >= 3 for e in read_jsonl(train_log))):
        assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, _log(logs, 0)[-3000:]
        time.sleep(0.05)
    rank_of = [0 if "[rank 0]" in _log(logs, n) else 1 for n in (0, 1)]  # only rank 0 logs progress
    _kill_node(agents[lost])
    t0 = time.monotonic()
    survivor = agents[1 - lost]
    _wait([survivor], timeout_s=120)
    stopped_s = time.monotonic() - t0
    text = _log(logs, 1 - lost)
    assert survivor.returncode != 0 and stopped_s < 60, (stopped_s, text[-3000:])
    me, gone = rank_of[1 - lost], rank_of[lost]
    named = rf"\[rank {me}\] error: rank {me} lost rank {gone} .*step_00000[24]: rerun the same torchrun"
    assert re.search(named, text), text[-3000:]
    print(f"node {lost} lost: the other agent exited {survivor.returncode} after {stopped_s:.1f}s")
    return args


def test_losing_the_node_that_hosts_the_rendezvous_stops_the_other_naming_it(tiny_shards, tmp_path):
    """The first agent hosts the c10d store: its loss also costs the other agent its store (torchrun
    stops that worker), yet the worker's own line names the rank lost first."""
    _lose_a_node(tiny_shards, tmp_path / "nodes", tmp_path / "logs", lost=0)


def test_a_lost_node_stops_the_other_naming_it_and_the_rerun_resumes_to_the_same_losses(
    two_nodes, tiny_shards, tmp_path
):
    out = tmp_path / "nodes"
    args = _lose_a_node(tiny_shards, out, tmp_path / "logs", lost=1)
    train_log = out / "train_log.jsonl"
    rerun = _agents([args, args], tmp_path / "logs2", "lost-rerun", _free_port())
    assert _wait(rerun) == [0, 0], _log(tmp_path / "logs2", 0)[-3000:]
    resumed = _log(tmp_path / "logs2", 0) + _log(tmp_path / "logs2", 1)
    assert re.search(r"resumed from .*step_00000[24]", resumed), resumed[-3000:]
    final = "checkpoints/step_000006/model.safetensors"
    assert (out / final).read_bytes() == (two_nodes["nodes"] / final).read_bytes()
    last = {e["step"]: e["loss"] for e in read_jsonl(train_log)}  # the rerun's entries come last
    assert last == {e["step"]: e["loss"] for e in read_jsonl(two_nodes["nodes"] / "train_log.jsonl")}


@pytest.mark.parametrize("batches,world,grad_accum", [(7, 2, 2), (7, 3, 1), (2, 3, 1), (9, 1, 2), (8, 2, 2)])
def test_the_slots_of_an_epoch_hold_each_micro_batch_once_and_weigh_a_step_by_its_real_ones(
    batches, world, grad_accum
):
    """Over every rank's slots, each micro-batch exactly once, in order; a step's real micro-batches over
    the ranks times 1 / loss_divisor each is the ranks' count (DDP's mean then is the mean of the real)."""
    from eagle3_pipeline.training.epochs import EpochPlan
    from eagle3_pipeline.data.shards import SampleRef

    refs = [[SampleRef("s", "p", i, f"id{i}", 10)] for i in range(batches)]
    plans = [EpochPlan(0, refs, world, r, grad_accum) for r in range(world)]
    steps = plans[0].steps
    assert steps == -(-batches // (world * grad_accum))
    trained = [b for p in plans for b in p.rank_batches(0)]
    assert sorted(b[0].index for b in trained) == list(range(batches))
    for s in range(steps):
        real = [(p.rank, m) for p in plans for m in range(grad_accum) if p.is_real(s, m)]
        assert len(real) == plans[0].real_in_step(s) >= 1
        assert sum(1 / (p.loss_divisor(s) * world) for p in plans for m in range(grad_accum)
                   if p.is_real(s, m)) == pytest.approx(1.0)  # fmt: skip
    resumed = [b for p in plans for b in p.rank_batches(1)]
    assert sorted(b[0].index for b in resumed) == list(range(min(batches, world * grad_accum), batches))


def test_a_gloo_error_names_the_lost_rank_and_other_errors_pass(tmp_path):
    from eagle3_pipeline.training.distributed import Dist, lost_rank_error

    hosts = [("node-0", ["10.0.0.1"]), ("node-1", ["10.0.0.2"]), ("node-1", ["10.0.0.2"]),
             ("node-2", ["10.0.0.3"])]  # fmt: skip
    dist = Dist(rank=0, world=4, timeout_s=30, hosts=hosts)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.3]:41523: Connection reset")
    e = lost_rank_error(gloo, dist, tmp_path / "step_000004")
    assert str(e).startswith("rank 0 lost rank 3 on node-2 (connection lost") and "step_000004" in str(e)
    two = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:1: Connection closed by peer")
    assert str(lost_rank_error(two, dist, None)).startswith("rank 0 lost ranks 1, 2 on node-1")
    assert lost_rank_error(RuntimeError("CUDA out of memory"), dist, None) is None
    # a timeout, where it expired and on the pairs gloo closes because of it (no peer address there)
    pair = Dist(rank=1, world=2, timeout_s=15, hosts=hosts[:2])
    for text in ("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms for recv operation",
                 "Application timeout caused pair closure"):
        named = str(lost_rank_error(RuntimeError(text), pair, None))
        assert named.startswith("rank 1 lost rank 0 on node-0 (timed out"), named


def test_a_run_folder_local_to_each_node_is_refused_at_start_naming_the_rank(tiny_shards, tmp_path):
    """Each node given its own --out-dir (a folder local to it): rank 1 does not see rank 0's files there,
    so both stop before training, with one line saying the run folder must be shared."""
    node_args = [_train_args(tiny_shards, tmp_path / f"local{n}", *STEPS) for n in (0, 1)]
    agents = _agents(node_args, tmp_path / "logs", "local", _free_port())
    assert all(rc != 0 for rc in _wait(agents))
    logs = _log(tmp_path / "logs", 0) + _log(tmp_path / "logs", 1)
    want = r"\[rank 0\] error: --out-dir \S+: rank 1 \(\S+\) does not see the files rank 0 writes there"
    assert re.search(want, logs), logs[-3000:]
    assert "[rank 0] step " not in logs  # stopped before training
    assert "[rank0]: Traceback" not in logs and "[rank1]: Traceback" not in logs  # one line, no traceback


def test_a_rank_that_hangs_is_given_up_after_dist_timeout_s_naming_it(tiny_shards, tmp_path):
    """A worker frozen (SIGSTOP: alive, its connections open, silent) is not noticed by a closed
    connection: the other rank gives up after --dist-timeout-s and says so, naming it."""
    out, logs = tmp_path / "nodes", tmp_path / "logs"
    args = _train_args(tiny_shards, out, *STEPS, "--dist-timeout-s", "15")
    agents = _agents([args, args], logs, "hang", _free_port())
    train_log = out / "train_log.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (train_log.exists() and any(e["step"] >= 3 for e in read_jsonl(train_log))):
        assert all(a.poll() is None for a in agents) and time.monotonic() < deadline, _log(logs, 0)[-3000:]
        time.sleep(0.05)
    rank_of = [0 if "[rank 0]" in _log(logs, n) else 1 for n in (0, 1)]
    children = Path(f"/proc/{agents[1].pid}/task/{agents[1].pid}/children")
    frozen = [int(p) for p in children.read_text().split()]
    try:
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _wait(agents[:1], timeout_s=120)
        stopped_s = time.monotonic() - t0
    finally:
        _kill_node(agents[1])
    text = _log(logs, 0)
    assert agents[0].returncode != 0 and stopped_s < 60, (stopped_s, text[-3000:])
    named = rf"error: rank {rank_of[0]} lost rank {rank_of[1]} .*\(timed out: .* dist_timeout_s 15s\)"
    assert re.search(named, text), text[-3000:]
    print(f"a frozen rank: the other agent exited {agents[0].returncode} after {stopped_s:.1f}s")
