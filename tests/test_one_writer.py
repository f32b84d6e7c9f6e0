"""One writer per output folder: every stage takes output_lock (StageOutput.lock) before any work on its
output; a second writer exits 2 naming the holder and writes nothing; a lock whose holder died is taken
over."""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    CONVERSATIONS,
    REPO,
    extract_args,
    popen_script,
    read_jsonl,
    run_script,
    script,
    script_env,
)

from eagle3_pipeline.core.output_lock import lock_path, output_lock


def _stage_args(stage: str, run: Path, verifier: Path, out: Path) -> list[str]:
    """A command of `stage` on the tiny run whose output is `out`."""
    config = ["--config", str(run / "tiny.toml")]
    return {
        "00": [script("00_regenerate.py"), *config, "--out-dir", str(out)],
        "01": extract_args(verifier, CONVERSATIONS, out.parent),
        "02": [script("02_build_vocab_mapping.py"), *config, "--out-dir", str(out)],
        "03": [script("03_split_data.py"), *config, "--out-dir", str(out)],
        "04": [script("04_train.py"), *config, "--out-dir", str(out)],
        "05": [script("05_export.py"), *config, "--out-dir", str(out)],
        "06": [script("06_evaluate.py"), *config, "--out-dir", str(out)],
    }[stage]


@pytest.mark.parametrize("stage", ["00", "01", "02", "03", "04", "05", "06"])
def test_a_stage_refuses_an_output_folder_in_use_and_writes_nothing(stage, tiny_run, tiny_verifier, tmp_path):
    out = tmp_path / "hs" / "rows_00000000-00000010" if stage == "01" else tmp_path / "out"
    with output_lock(out):  # this test process is the writer the stage finds
        proc = run_script(*_stage_args(stage, tiny_run, tiny_verifier, out), check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert f"{out}: in use by pid {os.getpid()} on host {socket.gethostname()} since " in proc.stderr
        assert "wait for it or stop it" in proc.stderr and "Traceback" not in proc.stderr
        assert not out.exists()  # nothing written, not even the folder
    assert not lock_path(out).exists()  # released: the next writer finds no stale holder


def _train(tiny_run: Path, out: Path) -> list[str]:
    return [script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir", str(out),
            "--max-steps", "4", "--save-every", "2", "--eval-every", "2", "--log-every", "1",
            "--val-max-samples", "1"]  # fmt: skip


def test_two_trainings_started_together_on_one_folder_one_runs_the_other_exits_2(tiny_run, tmp_path):
    out = tmp_path / "train"
    procs = [popen_script(_train(tiny_run, out), REPO) for _ in range(2)]
    errs = [p.communicate(timeout=600)[1] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], [e[-1500:] for e in errs]
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    assert f"{out}: in use by pid {procs[winner].pid} on host {socket.gethostname()}" in errs[loser]
    steps = [e["step"] for e in read_jsonl(out / "train_log.jsonl")]
    assert steps == [1, 2, 3, 4]  # each step logged once, by the one writer


def test_a_lock_left_by_a_killed_holder_is_taken_over_naming_it(tmp_path, caplog):
    out = tmp_path / "out"
    code = ("import os, signal, sys\nfrom pathlib import Path\n"
            "from eagle3_pipeline.core.output_lock import output_lock\n"
            "with output_lock(Path(sys.argv[1])):\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], env=script_env())  # dies holding it
    assert holder.wait(timeout=120) == -signal.SIGKILL
    assert f'"pid": {holder.pid}' in lock_path(out).read_text()  # its record is still there
    with caplog.at_level(logging.WARNING, logger="eagle3.stage"), output_lock(out):
        assert f'"pid": {os.getpid()}' in lock_path(out).read_text()
    assert not lock_path(out).exists()  # released cleanly: removed
    assert f"{out}: taking over a stale lock: its holder, pid {holder.pid} on host {socket.gethostname()}" \
        in caplog.text


def test_an_output_folder_that_cannot_be_made_is_one_error_line_naming_it(tiny_run, tmp_path):
    """--out-dir under a file (or on a read-only filesystem): the lock, every stage's first write, says which
    folder and why, instead of a traceback from mkdir; nothing is written."""
    from eagle3_pipeline.core.errors import UserError

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    want = f"{blocker / 'out'}: cannot write there ({blocker} is a file); give an output folder"
    with pytest.raises(UserError, match=re.escape(want)), output_lock(blocker / "out"):
        pass
    proc = run_script(script("03_split_data.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir",
                      str(blocker / "split"), check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{blocker / 'split'}: cannot write there ({blocker} is a file)" in proc.stderr
    assert sorted(tmp_path.iterdir()) == [blocker] and blocker.read_text() == ""


def test_under_torchrun_every_rank_stops_on_a_run_folder_in_use(tiny_run, tmp_path):
    """Rank 0 takes the lock; its refusal is every rank's, so rank 1 does not wait for it at a collective."""
    out = tmp_path / "train"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**script_env(), "OMP_NUM_THREADS": "1"}
    with output_lock(out):
        proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", *_train(tiny_run, out)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode != 0
    for rank in (0, 1):
        said = f"[rank {rank}] error: {out}: in use by pid {os.getpid()} on host"
        assert said in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()
