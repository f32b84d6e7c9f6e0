"""What a stage depends on is named by content, not by path: the verifier by its fingerprint, the shards by
their manifests' sha256; and a run copied whole (cp -r) is a run of its own, reading only its own files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import (
    CONVERSATIONS,
    REPO,
    extract_args,
    moved_config,
    run_killed_after,
    run_script,
    script,
    shard_of,
)


@pytest.fixture(scope="module")
def reseeded_verifier(tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 verifier's config with other weights (another seed)."""
    from eagle3_pipeline.models.tiny import build_verifier

    return build_verifier("deepseek_v3", tmp_path_factory.mktemp("verifier") / "reseeded", seed=1)


@pytest.fixture(params=["llama", "reseeded"])
def other_verifier(request, tiny_llama_verifier, reseeded_verifier) -> Path:
    """A verifier that did not make the run's states: another model, or the same config with other weights."""
    return tiny_llama_verifier if request.param == "llama" else reseeded_verifier


def refused(proc, *names: object) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for name in names:
        assert str(name) in proc.stderr, (name, proc.stderr[-3000:])


def test_fingerprint_is_content_same_config_other_weights_differ(tiny_run, reseeded_verifier, tmp_path):
    from eagle3_pipeline.models.verifier import verifier_fingerprint

    verifier = tiny_run / "verifier"
    copy = shutil.copytree(verifier, tmp_path / "elsewhere")
    assert verifier_fingerprint(copy) == verifier_fingerprint(verifier)
    assert (reseeded_verifier / "config.json").read_text() == (verifier / "config.json").read_text()
    assert verifier_fingerprint(reseeded_verifier) != verifier_fingerprint(verifier)
    shard = json.loads((shard_of(tiny_run / "hidden_states") / "meta.json").read_text())
    assert shard["verifier"]["fingerprint"] == verifier_fingerprint(verifier)
    assert json.loads((tiny_run / "regenerated" / "meta.json").read_text())["verifier_fingerprint"] == (
        verifier_fingerprint(verifier)
    )


@pytest.fixture(scope="module")
def unfinished_shard(tiny_verifier, tmp_path_factory) -> tuple[list[str], Path, Path]:
    """(the stage-01 command line, its verifier folder, its shard), killed after the first of three parts."""
    root = tmp_path_factory.mktemp("unfinished")
    verifier = shutil.copytree(tiny_verifier, root / "verifier")
    args = [*extract_args(verifier, CONVERSATIONS, root / "hs"), "--samples-per-file", "4"]
    run_killed_after(args, root, "part-00000.json")
    return args, verifier, shard_of(root / "hs")


def test_resumed_shard_refuses_another_verifier_in_the_same_folder(unfinished_shard, other_verifier):
    """The resume's command line unchanged, the verifier folder's contents replaced."""
    args, verifier, shard = unfinished_shard
    verifier.rename(verifier.with_name("kept"))
    try:
        shutil.copytree(other_verifier, verifier)
        proc = run_script(*args, check=False)
        shutil.rmtree(verifier)
    finally:
        verifier.with_name("kept").rename(verifier)
    refused(proc, verifier, shard / "run.json", "fingerprint")
    assert not (shard / "part-00001.json").exists() and not (shard / "COMPLETE").exists()


def test_train_export_evaluate_refuse_another_verifier(tiny_run, other_verifier, tmp_path):
    config = tiny_run / "tiny.toml"
    shard = shard_of(tiny_run / "hidden_states")
    proc = run_script(script("04_train.py"), "--config", str(config), "--verifier-path", str(other_verifier),
                      "--out-dir", str(tmp_path / "train"), "--max-steps", "1", check=False)  # fmt: skip
    refused(proc, other_verifier, shard / "meta.json", tiny_run / "verifier")
    assert not (tmp_path / "train").exists()
    proc = run_script(script("06_evaluate.py"), "--config", str(config), "--engine", "sim", "--verifier-path",
                      str(other_verifier), "--out-dir", str(tmp_path / "eval"), "--num-prompts", "1",
                      "--max-new-tokens", "4", check=False)  # fmt: skip
    refused(proc, other_verifier, tiny_run / "draft" / "export_meta.json", tiny_run / "verifier")
    assert not (tmp_path / "eval").exists()


def test_export_refuses_a_verifier_replaced_in_place(tiny_run, other_verifier, tmp_path):
    """Stage 05 exports for the verifier the run records: other weights in that folder are refused."""
    run = shutil.copytree(tiny_run, tmp_path / "run", ignore=shutil.ignore_patterns("draft*", "tensorboard"))
    config = moved_config(REPO / "configs" / "tiny.toml", "runs/tiny", run, run / "tiny.toml")
    shutil.rmtree(run / "verifier")
    shutil.copytree(other_verifier, run / "verifier")
    proc = run_script(script("05_export.py"), "--config", str(config), check=False)
    refused(proc, run / "verifier", run / "train" / "meta.json")
    assert "vllm serve" not in proc.stdout and not (run / "draft").exists()


def test_train_refuses_a_vocab_mapping_and_split_of_other_shards(tiny_run, tmp_path):
    config = tiny_run / "tiny.toml"
    other = tmp_path / "other"  # shards of the same verifier, other rows
    run_script(*extract_args(tiny_run / "verifier", tiny_run / "regenerated" / "conversations.jsonl", other),
               "--end-row", "4")  # fmt: skip
    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(other), "--out-dir",
               str(tmp_path / "vocab"), "--draft-vocab-size", "64")  # fmt: skip
    run_script(script("03_split_data.py"), "--data-dir", str(other), "--out-dir", str(tmp_path / "split"))
    shard = shard_of(tiny_run / "hidden_states")
    for flag, folder in (("--vocab-mapping-dir", "vocab"), ("--split-dir", "split")):
        proc = run_script(script("04_train.py"), "--config", str(config), flag, str(tmp_path / folder),
                          "--out-dir", str(tmp_path / "train"), "--max-steps", "1", check=False)  # fmt: skip
        refused(proc, flag, tmp_path / folder, "other shards", shard_of(other), shard)
        assert not (tmp_path / "train").exists()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def test_a_copied_run_is_its_own_run(tiny_run, tmp_path):
    """cp -r of a finished run, the original moved away: every stage on the copy skips (06 evaluates) with
    no error, reading only the copy."""
    original = shutil.copytree(tiny_run, tmp_path / "original")
    copy = shutil.copytree(original, tmp_path / "copy")
    gone = original.rename(tmp_path / "gone")  # a stage reading the original's files fails
    before = tree(gone)
    config = moved_config(REPO / "configs" / "tiny.toml", "runs/tiny", copy, copy / "tiny.toml")
    for stage in ("00_regenerate.py", "01_extract_hidden_states.py", "02_build_vocab_mapping.py",
                  "03_split_data.py", "04_train.py", "05_export.py"):  # fmt: skip
        proc = run_script(script(stage), "--config", str(config))
        assert "skip" in proc.stderr, (stage, proc.stderr[-2000:])
        assert str(original) + os.sep not in proc.stderr + proc.stdout, (stage, proc.stderr[-2000:])
    run_script(script("06_evaluate.py"), "--config", str(config), "--engine", "sim", "--num-prompts", "1",
               "--max-new-tokens", "8", "--out-dir", str(copy / "eval"))  # fmt: skip
    result = json.loads(next((copy / "eval").glob("acceptance_sim*.json")).read_text())
    assert Path(result["verifier_path"]) == copy / "verifier" and result["sim"]["num_drafts"] > 0
    assert tree(gone) == before
    train = json.loads((copy / "train" / "meta.json").read_text())
    recorded = (train["verifier_path"], train["vocab_mapping_dir"], *train["shards"])
    assert not any(os.path.isabs(p) for p in recorded), recorded


def test_shards_of_one_set_must_share_the_verifier_fingerprint(tiny_run, reseeded_verifier, tmp_path):
    """Same config, other weights (a base model beside its fine-tune): every shape agrees, only the
    fingerprint tells the two shards' states apart; stage 02 on both is refused naming it."""
    other = tmp_path / "other"
    run_script(*extract_args(reseeded_verifier, tiny_run / "regenerated" / "conversations.jsonl", other),
               "--start-row", "4", "--end-row", "8")  # fmt: skip
    proc = run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(tiny_run / "hidden_states"),
                      str(other), "--out-dir", str(tmp_path / "vocab"), check=False)  # fmt: skip
    refused(proc, "verifier fingerprint", shard_of(other))
    assert not (tmp_path / "vocab").exists()
