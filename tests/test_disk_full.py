"""A full disk (ENOSPC injected at the one place storage.py writes files) during extraction,
checkpointing and export: a DiskFull error naming the file and the bytes, nothing half-written counted,
and the rerun after space is freed finishes byte-identical to a run that never failed."""

from __future__ import annotations

import errno
import os
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, REPO

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import DiskFull


def fill_disk_once(monkeypatch, when: Callable[[Path], bool]) -> list[Path]:
    """The first write whose temp file matches `when` leaves a partial file and fails with ENOSPC."""
    real, hits = storage._write_tmp, []

    def write(tmp: Path, writer: Callable[[Path], None]) -> None:
        if not hits and when(tmp):
            hits.append(tmp)
            tmp.write_bytes(b"\0" * 4096)  # what a full disk leaves: the start of the file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
        real(tmp, writer)

    monkeypatch.setattr(storage, "_write_tmp", write)
    return hits


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"*{storage.TMP_SUFFIX}*")]


@pytest.mark.parametrize("full_at", ["part-00001.safetensors", "part-00002.json", "COMPLETE"])
def test_disk_full_during_extraction_then_rerun_is_byte_identical(
    tiny_verifier, tmp_path, monkeypatch, full_at
):
    from eagle3_pipeline.data import extract
    from eagle3_pipeline.data.config import ExtractConfig

    cfg = ExtractConfig(
        verifier_path=str(tiny_verifier), data_path=str(CONVERSATIONS), out_dir="hs", samples_per_file=4
    )
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    monkeypatch.chdir(tmp_path / "a")
    extract.run(cfg)  # never full
    monkeypatch.chdir(tmp_path / "b")
    hits = fill_disk_once(monkeypatch, lambda tmp: tmp.name == full_at + storage.TMP_SUFFIX)
    with pytest.raises(DiskFull) as e:
        extract.run(cfg)
    shard = tmp_path / "b" / "hs" / "rows_00000000-00000010"
    assert hits and re.search(
        rf"^hs/rows_00000000-00000010/{re.escape(full_at)}: disk full .* writing .*\([\d,]+ bytes\)",
        str(e.value),
    )
    assert not leftovers(shard) and not storage.is_complete(shard)
    assert not (shard / "part-00002.json").exists() if full_at != "COMPLETE" else True
    extract.run(cfg)  # space freed: the rerun resumes
    assert tree(tmp_path / "a" / "hs") == tree(tmp_path / "b" / "hs")


def _train_cfg(shards: dict[str, Path], out: Path):
    from eagle3_pipeline.training.config import TrainConfig

    section = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())["train"]
    return TrainConfig(**{
        **section, "data_dir": [str(shards["float32"])], "split_dir": None, "val_ratio": 0.2,
        "vocab_mapping_dir": str(shards["vocab_float32"]), "out_dir": str(out), "max_steps": 8,
        "save_every": 4, "eval_every": 4, "keep_last": 10, "val_max_samples": 1,
    })  # fmt: skip


@pytest.fixture(scope="module")
def straight_run(tiny_shards, tmp_path_factory) -> Path:
    from eagle3_pipeline.training import train

    out = tmp_path_factory.mktemp("straight") / "train"
    assert train.run(_train_cfg(tiny_shards, out)) == 0
    return out


def test_disk_full_during_checkpoint_stops_training_and_rerun_resumes_identically(
    tiny_shards, straight_run, tmp_path, monkeypatch, caplog
):
    from eagle3_pipeline.training import checkpoint, train

    out = tmp_path / "train"
    hits = fill_disk_once(
        monkeypatch, lambda tmp: tmp.parent.name == "step_000008.tmp" and tmp.name == "state.pt.tmp"
    )
    with pytest.raises(DiskFull, match=r"step_000008\.tmp/state\.pt: disk full .* writing .*bytes"):
        train.run(_train_cfg(tiny_shards, out))
    assert hits
    ckpts = out / "checkpoints"
    assert [p.name for p in checkpoint.complete_checkpoints(ckpts)] == ["step_000004"]
    assert not leftovers(ckpts) and checkpoint.latest(ckpts).name == "step_000004"
    caplog.set_level("INFO")
    assert train.run(_train_cfg(tiny_shards, out)) == 0  # space freed
    assert "resumed from" in caplog.text and "step_000004" in caplog.text
    final = "checkpoints/step_000008/model.safetensors"
    assert (out / final).read_bytes() == (straight_run / final).read_bytes()


def test_disk_full_during_export_keeps_the_good_export_and_rerun_is_byte_identical(
    straight_run, tmp_path, monkeypatch
):
    from eagle3_pipeline.export_eval import export
    from eagle3_pipeline.export_eval.config import ExportConfig

    out = tmp_path / "draft"
    cfg = ExportConfig(train_dir=str(straight_run), checkpoint="latest", out_dir=str(out), overwrite=True)
    export.run(cfg)
    good = tree(out)
    for full_at in ("model.safetensors", "export_meta.json"):
        hits = fill_disk_once(monkeypatch, lambda tmp, f=full_at: tmp.name == f + storage.TMP_SUFFIX)
        with pytest.raises(DiskFull, match=rf"draft\.tmp/{re.escape(full_at)}: disk full .*bytes"):
            export.run(cfg)
        assert hits and tree(out) == good  # the good export is untouched
        assert not (tmp_path / "draft.tmp").exists() and not leftovers(tmp_path)
        monkeypatch.undo()
    shutil.rmtree(out)
    hits = fill_disk_once(monkeypatch, lambda tmp: tmp.name == "config.json" + storage.TMP_SUFFIX)
    with pytest.raises(DiskFull):
        export.run(cfg)
    assert not out.exists() and not (tmp_path / "draft.tmp").exists()
    monkeypatch.undo()
    export.run(cfg)  # space freed
    assert tree(out) == good


def test_disk_full_on_rank_0_stops_every_ddp_rank(tiny_shards, tmp_path):
    """Under torchrun, rank 0's full disk reaches rank 1 too (no rank left waiting at a barrier)."""
    import subprocess
    import sys
    import textwrap

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent('''
        import errno, os
        from eagle3_pipeline.core import storage
        real = storage._write_tmp
        def write(tmp, writer):
            if tmp.parent.name == "step_000004.tmp" and tmp.name == "state.pt.tmp":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
            real(tmp, writer)
        storage._write_tmp = write
    '''))  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{hook}:{REPO}"}
    out = tmp_path / "ddp"
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", str(REPO / "04_train.py"),
            "--config", str(REPO / "configs" / "tiny.toml"), "--data-dir", str(tiny_shards["float32"]),
            "--split-dir", "", "--val-ratio", "0.2", "--vocab-mapping-dir", str(tiny_shards["vocab_float32"]),
            "--out-dir", str(out), "--max-steps", "8", "--save-every", "4", "--eval-every", "4",
        ],
        env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert re.search(r"\[rank 0\] error: .*step_000004\.tmp/state\.pt: disk full", proc.stderr), proc.stderr[
        -3000:
    ]
    assert "[rank 1] error: rank 0 could not save checkpoint step 4 (disk full" in proc.stderr, proc.stderr[
        -3000:
    ]
    assert not list((out / "checkpoints").glob("step_*"))


FULL_FS_CHECK = """
import sys, torch
from pathlib import Path
from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import DiskFull
d = Path(sys.argv[1])
big = {"x": torch.zeros(1 << 20)}  # 4 MiB into a 1 MiB filesystem
for name, write in [
    ("a.safetensors", lambda p: storage.save_safetensors_atomic(big, p)),
    ("state.pt", lambda p: storage.torch_save_atomic({"optimizer": big}, p)),
    ("b.json", lambda p: storage.write_bytes_atomic(p, b"0" * (4 << 20))),
]:
    try:
        write(d / name)
    except DiskFull as e:
        assert str(e).startswith(f"{d / name}: disk full (No space left on device) writing"), e
    else:
        raise AssertionError(name + ": no error")
    assert not list(d.iterdir()), list(d.iterdir())  # the partial temp file is gone
print("all disk full")
"""


def test_a_real_full_filesystem_is_reported_as_disk_full_by_every_writer(tmp_path):
    """A 1 MiB tmpfs (in a private mount namespace): safetensors and torch.save report a full disk in
    their own ways (a Rust I/O error, a RuntimeError raised during the OSError); each is a DiskFull."""
    import subprocess
    import sys

    (tmp_path / "check.py").write_text(FULL_FS_CHECK)
    mnt = tmp_path / "full"
    mnt.mkdir()
    shell = f"mount -t tmpfs -o size=1m tmpfs {mnt} && {sys.executable} {tmp_path / 'check.py'} {mnt}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "all disk full" in proc.stdout, proc.stderr[-3000:]
