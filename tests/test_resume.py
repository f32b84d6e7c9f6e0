"""Nothing lost: SIGKILL mid-stage, rerun, same bytes; corrupt shards refused; training resumes exactly."""

from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import time
from pathlib import Path

import pytest
from conftest import (
    DATA,
    REPO,
    extract_args,
    kill_when,
    popen_script,
    record_digests,
    run_killed_after,
    run_script,
    script,
    shard_of,
)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_one_process_writes_many_shards_with_one_verifier_load_and_the_same_bytes(tiny_verifier, tmp_path):
    base = [
        *extract_args(str(tiny_verifier), str(DATA / "conversations.jsonl"), "hs"),
        "--samples-per-file",
        "2",
    ]
    (tmp_path / "loop").mkdir()
    (tmp_path / "one").mkdir()
    for a, b in ((0, 4), (4, 8), (8, 10)):  # the shell loop over shards: one process (and load) each
        run_script(*base, "--start-row", str(a), "--end-row", str(b), cwd=tmp_path / "loop")
    one = run_script(*base, "--shard-rows", "4", cwd=tmp_path / "one")
    assert one.stderr.count("verifier loaded") == 1, one.stderr[-2000:]
    loop, together = _tree_bytes(tmp_path / "loop" / "hs"), _tree_bytes(tmp_path / "one" / "hs")
    assert sorted({k.split("/")[0] for k in together}) == [
        "rows_00000000-00000004", "rows_00000004-00000008", "rows_00000008-00000010",
    ]  # fmt: skip
    assert together == loop  # every file of every shard, meta.json included
    again = run_script(*base, "--shard-rows", "4", cwd=tmp_path / "one")  # complete shards: logged skips
    assert again.stderr.count("is complete") == 3 and "verifier loaded" not in again.stderr


def test_extraction_killed_then_rerun_is_byte_identical(tiny_verifier, tmp_path):
    args = [
        *extract_args(str(tiny_verifier), str(DATA / "conversations.jsonl"), "hs"),
        "--samples-per-file",
        "2",
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_script(*args, cwd=tmp_path / "a")  # uninterrupted
    run_killed_after(args, tmp_path / "b", "part-00001.json")  # parts 0 and 1 of 5 recorded
    assert not (tmp_path / "b" / "hs" / "rows_00000000-00000010" / "COMPLETE").exists()
    rerun = run_script(*args, cwd=tmp_path / "b")
    assert "5 parts, 3 to do" in rerun.stderr, rerun.stderr[-1500:]  # finished parts skipped, the rest redone
    a, b = _tree_bytes(tmp_path / "a" / "hs"), _tree_bytes(tmp_path / "b" / "hs")
    assert sorted(a) == sorted(b)
    assert a == b


def _flip_byte_in(part: Path, tensor: str) -> None:
    """Flip one bit in the middle of a tensor's bytes (located through the safetensors header)."""
    raw = bytearray(part.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    a, b = json.loads(raw[8 : 8 + n])[tensor]["data_offsets"]
    raw[8 + n + (a + b) // 2] ^= 0x01
    part.write_bytes(bytes(raw))


def test_corrupt_byte_in_shard_is_refused_when_read_naming_the_file(tiny_run, tmp_path):
    """Stage starts check only markers, manifests, sizes and headers; the bytes are hashed when read.

    A flipped bit in the hidden states passes stages 02 and 03 (they never read the states) and stops
    04 at the batch that reads that sample (in a DataLoader worker), with one line naming the file and
    the sample; a flipped bit in the token ids stops 02, which reads them.
    """
    shard = tmp_path / "hs" / shard_of(tiny_run / "hidden_states").name
    shutil.copytree(shard_of(tiny_run / "hidden_states"), shard)
    part = shard / "part-00001.safetensors"
    _flip_byte_in(part, "aux_hidden_states")
    vocab = [script("02_build_vocab_mapping.py"), "--data-dir", str(shard), "--draft-vocab-size", "64"]
    run_script(*vocab, "--out-dir", str(tmp_path / "v"))
    run_script(script("03_split_data.py"), "--data-dir", str(shard), "--out-dir", str(tmp_path / "s"))
    train = [
        script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--data-dir", str(shard),
        "--out-dir", str(tmp_path / "t"), "--epochs", "1", "--num-workers", "1",
        "--verifier-path", str(tiny_run / "verifier"),  # (the shard's own path to it is relative to its run)
    ]  # fmt: skip
    proc = run_script(*train, check=False)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert f"error: {part}: sha256 of sample" in proc.stderr, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and "DataLoader worker" not in proc.stderr

    shutil.copy(shard_of(tiny_run / "hidden_states") / part.name, part)
    _flip_byte_in(part, "input_ids")
    proc = run_script(*vocab, "--out-dir", str(tmp_path / "v2"), check=False)
    assert proc.returncode == 2, proc.stderr[-1500:]
    assert str(part) in proc.stderr and "sha256" in proc.stderr and "Traceback" not in proc.stderr


def test_truncated_part_file_is_refused_naming_it(tiny_run, tmp_path):
    shard = tmp_path / "hs" / shard_of(tiny_run / "hidden_states").name
    shutil.copytree(shard_of(tiny_run / "hidden_states"), shard)
    part = shard / "part-00000.safetensors"
    part.write_bytes(part.read_bytes()[:1000])
    proc = run_script(
        script("03_split_data.py"), "--data-dir", str(shard), "--out-dir", str(tmp_path / "s"), check=False
    )
    assert proc.returncode == 2 and str(part) in proc.stderr and "truncated" in proc.stderr


def _train_args(tiny_run: Path, out: Path) -> list[str]:
    return [
        script("04_train.py"),
        "--config",
        str(tiny_run / "tiny.toml"),
        "--out-dir",
        str(out),
        "--max-steps",
        "12",
        "--save-every",
        "4",
        "--eval-every",
        "4",
        "--log-every",
        "1",
        "--keep-last",
        "10",
        "--val-max-samples",
        "1",
    ]


# a parallel draft draws its COD sub-samples from torch's generator each step: the resume restores it
DRAFTS = {"sequential": [], "parallel": ["--parallel-drafting", "--parallel-k", "4"]}


@pytest.mark.parametrize("draft", DRAFTS)
def test_training_killed_between_checkpoints_resumes_to_identical_weights(tiny_run, tmp_path, draft):
    run_script(*_train_args(tiny_run, tmp_path / "straight"), *DRAFTS[draft])
    proc = popen_script(_train_args(tiny_run, tmp_path / "killed") + DRAFTS[draft], REPO)
    log = tmp_path / "killed" / "train_log.jsonl"

    def past_first_checkpoint() -> bool:  # killed at step 5 or 6: after step_000004, before step_000008
        if (
            not (tmp_path / "killed" / "checkpoints" / "step_000004" / "COMPLETE").exists()
            or not log.exists()
        ):
            return False
        return any(json.loads(x)["step"] >= 5 for x in log.read_text().splitlines() if x.strip())

    kill_when(proc, past_first_checkpoint)
    assert not (tmp_path / "killed" / "checkpoints" / "step_000012").exists()
    resumed = run_script(*_train_args(tiny_run, tmp_path / "killed"), *DRAFTS[draft])
    assert re.search(r"resumed from .*step_0000(04|08)", resumed.stderr), resumed.stderr[-1500:]
    final = "checkpoints/step_000012/model.safetensors"
    assert (tmp_path / "straight" / final).read_bytes() == (tmp_path / "killed" / final).read_bytes()


def test_sigterm_saves_a_checkpoint_and_exits_130(tiny_run, tmp_path):
    proc = popen_script(_train_args(tiny_run, tmp_path / "t"), REPO)
    log = tmp_path / "t" / "train_log.jsonl"
    deadline = time.time() + 600
    while not (log.exists() and log.read_text().strip()):
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 130
    ckpts = sorted(p.name for p in (tmp_path / "t" / "checkpoints").iterdir() if (p / "COMPLETE").exists())
    assert ckpts and "signal 15" in proc.stderr.read()


def test_export_killed_midway_leaves_the_good_export_in_place(tiny_run, tmp_path):
    out = tmp_path / "draft"
    shutil.copytree(tiny_run / "draft", out)
    before = _tree_bytes(out)
    args = [
        script("05_export.py"),
        "--train-dir",
        str(tiny_run / "train"),
        "--out-dir",
        str(out),
        "--overwrite",
        "--checkpoint",
        "latest",
    ]
    run_killed_after(args, tmp_path, "model.safetensors")  # the new weights in draft.tmp, not yet swapped in
    assert (tmp_path / "draft.tmp" / "model.safetensors").exists() and _tree_bytes(out) == before
    run_script(*args)
    assert (out / "COMPLETE").exists() and not (tmp_path / "draft.tmp").exists()


def test_a_checkpoint_saved_on_a_gpu_loads_to_cpu(tiny_run, tmp_path):
    """state.pt's tensors name the device they were saved from (rank 0's GPU on a CUDA run): a resume on a
    machine without one must still load it, and each torchrun rank must not load it onto cuda:0."""
    import torch
    import torch.serialization as ser

    from eagle3_pipeline.training import checkpoint

    src = checkpoint.resolve(checkpoint.root_of(tiny_run / "train"), "latest")
    ckpt = tmp_path / src.name
    shutil.copytree(src, ckpt)
    state = torch.load(ckpt / "state.pt", weights_only=False)

    def as_cuda(_storage):  # tag every storage as saved from cuda:0, as a GPU run's are
        return "cuda:0"

    ser.register_package(1, as_cuda, lambda _storage, _location: None)
    try:
        torch.save(state, ckpt / "state.pt")
    finally:
        ser._package_registry[:] = [p for p in ser._package_registry if p[1] is not as_cuda]
    record_digests(ckpt)  # the rewritten state.pt is this test's, not a corruption
    if not torch.cuda.is_available():  # the file is a GPU run's: loading it as saved needs CUDA
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(ckpt / "state.pt", weights_only=False)
    _, loaded, _ = checkpoint.load(ckpt)

    def moments(st):  # AdamW's exp_avg / exp_avg_sq (its step counts are 0-d)
        return [v for p in st["optimizer"]["state"].values() for v in p.values() if v.dim() > 0]

    assert moments(loaded) and all(t.device.type == "cpu" for t in moments(loaded))
    assert all(torch.equal(a, b) for a, b in zip(moments(loaded), moments(state), strict=True))


@pytest.fixture(scope="module")
def short_run(tiny_run, tmp_path_factory) -> Path:
    """A 4-step run of the tiny draft with checkpoints step_000002 and step_000004 (read only: copy it)."""
    out = tmp_path_factory.mktemp("short") / "train"
    run_script(*_short_train(tiny_run, out))
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    return out


def _short_train(tiny_run: Path, out: Path) -> list[str]:
    return [script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir", str(out),
            "--max-steps", "4", "--save-every", "2", "--eval-every", "2", "--keep-last", "5",
            "--val-max-samples", "1"]  # fmt: skip


def _flip_bytes(path: Path, n: int = 8) -> None:
    """Flip `n` bytes in the middle of a file (a tensor's bytes in a safetensors file this size)."""
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + n] = bytes(b ^ 0xFF for b in raw[mid : mid + n])
    path.write_bytes(bytes(raw))


def test_a_corrupt_checkpoint_is_refused_naming_the_file_and_the_previous_one(tiny_run, short_run, tmp_path):
    run = tmp_path / "train"
    shutil.copytree(short_run, run)
    latest = run / "checkpoints" / "step_000004"
    _flip_bytes(latest / "model.safetensors")
    before = _tree_bytes(run)
    proc = run_script(*_short_train(tiny_run, run), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{latest / 'model.safetensors'}: sha256 " in proc.stderr and "the file is corrupt" in proc.stderr
    assert f"the previous complete checkpoint is {run / 'checkpoints' / 'step_000002'}" in proc.stderr
    assert f"rm -rf {latest}" in proc.stderr and "Traceback" not in proc.stderr
    assert _tree_bytes(run) == before  # nothing written


def test_a_truncated_state_file_is_refused_naming_it(short_run, tmp_path):
    """In process (a UserError is the one `error:` line and exit 2 of every stage script)."""
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.training import checkpoint

    shutil.copytree(short_run / "checkpoints", tmp_path / "checkpoints")
    state = tmp_path / "checkpoints" / "step_000004" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    said = (f"{re.escape(str(state))}: {state.stat().st_size:,} bytes, .* when saved \\(truncated .* "
            f"previous complete checkpoint is {re.escape(str(state.parent.parent / 'step_000002'))}")
    with pytest.raises(UserError, match=said):
        checkpoint.load(checkpoint.resolve(tmp_path / "checkpoints", "latest"))


def test_export_of_a_corrupt_checkpoint_is_refused_writing_nothing(short_run, tmp_path):
    from eagle3_pipeline.export_eval.config import ExportConfig
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.export_eval import export

    run = tmp_path / "train"
    shutil.copytree(short_run, run)
    _flip_bytes(run / "checkpoints" / "step_000004" / "model.safetensors")
    cfg = ExportConfig(train_dir=str(run), checkpoint="latest", out_dir=str(tmp_path / "draft"))
    said = "step_000004/model.safetensors: sha256 .* 05_export.py --checkpoint step_000002"
    with pytest.raises(UserError, match=said):
        export.run(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train"]  # no export folder, no lock file


def test_a_checkpoint_without_digests_loads_and_an_unreadable_one_is_refused(short_run, tmp_path, caplog):
    """Checkpoints saved before the digests were recorded resume (with a warning); one whose file no
    longer parses is still a UserError naming it."""
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.training import checkpoint

    ckpt = tmp_path / "step_000004"
    shutil.copytree(short_run / "checkpoints" / "step_000004", ckpt)
    info = json.loads((ckpt / "checkpoint.json").read_text())
    del info["files"]
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    weights, state, _ = checkpoint.load(ckpt)
    assert weights and state is not None and "saved without file digests" in caplog.text
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:100])
    with pytest.raises(UserError, match=r"model\.safetensors: unreadable \(.*no earlier complete checkpoint"):
        checkpoint.load(ckpt)
