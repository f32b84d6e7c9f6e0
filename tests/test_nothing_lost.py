"""Nothing lost on a mistake (issue 28): a refused 04_train.py run, --overwrite or not, leaves a finished run
byte for byte as it was and creates no folder; --overwrite keeps the old run until the new one's first
checkpoint and puts it back when the new run fails before; a resume that changes any Recipe field is refused
naming its flag."""

from __future__ import annotations

import hashlib
import shutil
import socket
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import run_script, script
from test_resume import _flip_byte_in

from eagle3_pipeline.training.train_metrics import Recipe


def _tree_hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under root (tensorboard events, plots and checkpoints included)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once closed


def _train_args(shards: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return [
        script("04_train.py"), "--data-dir", str(shards["float32"]), "--vocab-mapping-dir",
        str(shards["vocab_float32"]), "--out-dir", str(out), "--max-steps", "2", "--num-attention-heads", "4",
        "--num-key-value-heads", "4", "--head-dim", "64", "--intermediate-size", "512", "--val-ratio", "0.2",
        "--loggers", "tensorboard", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished(tiny_shards, tmp_path_factory) -> Path:
    """A finished tiny run: checkpoints, train_log.jsonl, plots, tensorboard/, meta.json, trackers.json."""
    out = tmp_path_factory.mktemp("finished") / "run"
    run_script(*_train_args(tiny_shards, out, "--log-every", "1"))
    assert (out / "checkpoints" / "step_000002" / "COMPLETE").exists()
    assert (out / "tensorboard").is_dir() and (out / "train_log.jsonl").exists()
    return out


REFUSALS = {
    "heads not a multiple of kv heads": (["--num-key-value-heads", "3"], "must be a multiple of"),
    "odd head_dim": (["--head-dim", "65"], "must be even"),
    "norm_before_fc with fc_norm": (["--norm-before-fc", "--fc-norm"], "mutually exclusive"),
    "missing verifier": (["--verifier-path", "/nonexistent/verifier"], "/nonexistent/verifier"),
    "online without servers": (["--states", "online"], "needs servers"),
    "online with every server down": (
        ["--states", "online", "--servers", "http://127.0.0.1:{port}", "http://127.0.0.1:{port2}",
         "--request-timeout", "5"],  # fmt: skip
        "no vLLM server left at the start",
    ),
}


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "new-folder"])
@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refused_run_leaves_the_finished_run_byte_identical_and_creates_no_folder(
    finished, tiny_shards, tmp_path, case, overwrite
):
    flags, says = REFUSALS[case]
    flags = [f.format(port=_closed_port(), port2=_closed_port()) for f in flags]
    before = _tree_hashes(finished)
    out = finished if overwrite else tmp_path / "new" / "run"
    proc = run_script(*_train_args(tiny_shards, out, *flags, *(["--overwrite"] if overwrite else [])),
                      check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _tree_hashes(finished) == before
    assert not (tmp_path / "new").exists()
    assert sorted(p.name for p in finished.parent.iterdir()) == ["run"]  # nothing set aside is left


def test_overwrite_failing_before_its_first_checkpoint_puts_the_old_run_back(
    finished, tiny_shards, tiny_verifier, tmp_path
):
    """The new run opens its folder, then stops at the first batch that reads a corrupt sample: the old
    run is back, byte for byte, and nothing set aside is left."""
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    before = _tree_hashes(run)
    shard = tmp_path / "hs" / tiny_shards["float32"].name
    shutil.copytree(tiny_shards["float32"], shard)
    for part in shard.glob("part-*.safetensors"):
        _flip_byte_in(part, "aux_hidden_states")
    # (the copied shard's path to its verifier is relative to where it was extracted)
    args = _train_args(tiny_shards, run, "--overwrite", "--verifier-path", str(tiny_verifier))
    args[args.index("--data-dir") + 1] = str(shard)
    proc = run_script(*args, check=False)
    assert proc.returncode == 2 and "sha256 of sample" in proc.stderr, proc.stderr[-3000:]
    assert "the old run is back" in proc.stderr
    assert _tree_hashes(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hs", "run"]


def test_overwrite_replaces_the_old_run_once_the_new_one_has_a_checkpoint(finished, tiny_shards, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "step_000002" / "marker_of_the_old_run").write_text("old")
    proc = run_script(*_train_args(tiny_shards, run, "--overwrite", "--max-steps", "1"))
    assert "the old run is at" in proc.stderr
    assert not (run / "checkpoints" / "step_000002").exists()  # the old run's checkpoints are gone
    assert (run / "checkpoints" / "step_000001" / "COMPLETE").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def _changed(name: str, value: object) -> list[str]:
    """Command-line flags that give one Recipe field another value than the finished run's."""
    other = {
        "ttt_steps": "2", "ttt_step_loss_decay": "0.8", "loss": "kl_div", "served_k": "2",
        "loss_temperature": "0.7", "loss_top_p": "0.9", "seed": "1", "val_ratio": "0.3",
        "val_max_samples": "1", "max_seq_len": "512", "batch_tokens": "512", "batching": "mix",
        "grad_accum": "2",
        "state_noise": "0.1", "epochs": "2", "max_steps": "3", "lr": "2e-3", "lr_schedule": "linear",
        "min_lr_ratio": "0.2", "warmup_ratio": "0.5", "warmup_steps": "1", "weight_decay": "0.1",
        "grad_clip": "1.0", "parallel_k": "3", "cod_ratio": "0.5", "cod_ratio_min": "0.3",
    }  # fmt: skip
    flag = f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag if not value else f"--no-{flag[2:]}"]
    assert name in other, f"Recipe field {name!r}: give it a changed value here"
    assert other[name] != str(value)
    return [flag, other[name]]


def test_a_resume_that_changes_any_recipe_field_is_refused_naming_it(finished, tiny_shards, capsys):
    """Walks Recipe's fields (a new field is tested as soon as it exists), each changed on 04_train.py's
    command line (its main in this process: one import for 24 runs); the finished run's recorded recipe is
    the baseline and the run folder stays byte-identical."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("stage_04_train", script("04_train.py"))
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    recorded = json.loads((finished / "meta.json").read_text())["recipe"]
    assert sorted(recorded) == sorted(f.name for f in fields(Recipe))
    # batching orders the samples (a resume under another would train another order); sequence_parallel
    # computes the same maths (restore refuses another number of data-parallel ranks)
    assert "batching" in recorded and "sequence_parallel" not in recorded
    before = _tree_hashes(finished)
    for f in fields(Recipe):
        flag = _changed(f.name, recorded[f.name])
        code = stage.main(_train_args(tiny_shards, finished, *flag)[1:])  # the last flag wins
        err = capsys.readouterr().err
        assert code == 2, (f.name, err[-2000:])
        assert f"--{f.name.replace('_', '-')} (was " in err and "an exact resume needs" in err, (f.name, err)
    assert _tree_hashes(finished) == before


@pytest.mark.parametrize("stage", ["02_build_vocab_mapping.py", "03_split_data.py"])
def test_stages_02_and_03_check_their_inputs_before_touching_an_unfinished_output(tmp_path, stage):
    out = tmp_path / "out"
    out.mkdir()
    (out / "from_an_earlier_run.json").write_text("{}")
    before = _tree_hashes(out)
    proc = run_script(script(stage), "--data-dir", str(tmp_path / "missing"), "--out-dir", str(out),
                      check=False)  # fmt: skip
    assert proc.returncode == 2 and str(tmp_path / "missing") in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and _tree_hashes(out) == before


def test_regenerate_overwrite_interrupted_puts_the_old_output_back(tiny_verifier, tmp_path):
    """Stage 00 --overwrite moves the complete output aside; interrupted (SIGINT) after its first new part,
    the old output is back byte for byte; run through, the new one replaces it."""
    import signal
    import time

    from conftest import CONVERSATIONS, popen_script

    args = [
        script("00_regenerate.py"), "--verifier-path", str(tiny_verifier), "--data-path", str(CONVERSATIONS),
        "--out-dir", str(tmp_path / "regen"), "--engine", "hf", "--max-new-tokens", "4",
        "--rows-per-part", "1",
    ]  # fmt: skip
    run_script(*args)
    before = _tree_hashes(tmp_path / "regen")
    proc = popen_script([*args, "--overwrite", "--max-new-tokens", "48"], tmp_path)  # 10 slower parts
    aside = next(tmp_path.glob(".regen.old-*"), None)
    while not (tmp_path / "regen" / "part-00000.jsonl").exists() or aside is None:
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        aside = aside or next(tmp_path.glob(".regen.old-*"), None)
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=300) == 130
    assert "the old one is back" in proc.stderr.read()
    assert _tree_hashes(tmp_path / "regen") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen"]
    run_script(*args, "--overwrite", "--max-new-tokens", "5")
    assert _tree_hashes(tmp_path / "regen") != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["regen"]


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no process has it now


def test_an_overwrite_killed_outright_is_refused_until_its_old_run_is_put_back(
    finished, tiny_shards, tmp_path
):
    """What stage 04's run folder (StageOutput) leaves when --overwrite is SIGKILLed before the new run's
    first checkpoint: the old run in `.run.old-<pid>`, the new folder holding only its meta.json. The next
    run (any flags) refuses, naming the old run and both fixes, and changes nothing; put back, the old run
    is whole (a skip)."""
    run, aside = tmp_path / "run", tmp_path / f".run.old-{_dead_pid()}"
    shutil.copytree(finished, aside)
    run.mkdir()
    shutil.copy(finished / "meta.json", run / "meta.json")
    before = {p.name: _tree_hashes(p) for p in (run, aside)}
    for extra in ([], ["--overwrite"]):
        proc = run_script(*_train_args(tiny_shards, run, *extra), check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert f"{aside}: the output an --overwrite moved aside before it was killed" in proc.stderr
        assert f"Put it back: rm -rf {run} && mv {aside} {run}; or discard it: rm -rf {aside}" in proc.stderr
        assert {p.name: _tree_hashes(p) for p in (run, aside)} == before
    shutil.rmtree(run)
    aside.rename(run)
    proc = run_script(*_train_args(tiny_shards, run))
    assert "already reached step 2 of 2" in proc.stderr and _tree_hashes(run) == before[aside.name]


def test_a_leftover_old_run_beside_a_finished_replacement_is_named_not_refused(
    finished, tiny_shards, tmp_path
):
    """Killed after the new run's first checkpoint, before the old run was deleted: the new run goes on
    (here: finished, a skip) and the log names the leftover and its rm; a live process's aside is its own."""
    import os

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    stale, live = tmp_path / f".run.old-{_dead_pid()}", tmp_path / f".run.old-{os.getpid()}"
    stale.mkdir()
    live.mkdir()
    proc = run_script(*_train_args(tiny_shards, run))
    assert "already reached step 2 of 2" in proc.stderr
    assert f"{stale}: the output an interrupted --overwrite replaced, no longer needed" in proc.stderr
    assert f"rm -rf {stale}" in proc.stderr and str(live) not in proc.stderr
    assert stale.is_dir() and live.is_dir()  # named, never removed by the stage


def test_stage_00_refuses_too_while_a_killed_overwrite_left_its_old_output_aside(tiny_verifier, tmp_path):
    from conftest import CONVERSATIONS

    out, aside = tmp_path / "regen", tmp_path / f".regen.old-{_dead_pid()}"
    aside.mkdir()
    (aside / "COMPLETE").write_text("")
    out.mkdir()
    proc = run_script(script("00_regenerate.py"), "--verifier-path", str(tiny_verifier), "--data-path",
                      str(CONVERSATIONS), "--out-dir", str(out), "--engine", "hf", check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"Put it back: rm -rf {out} && mv {aside} {out}" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [] and (aside / "COMPLETE").exists()
