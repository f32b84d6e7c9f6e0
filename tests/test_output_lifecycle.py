"""Every stage's output goes through core/output.py's StageOutput: its lock, its skip, its publish or its
build in place, its same-run check. A static walk of each stage's modules (a stage that takes a lock,
writes COMPLETE, logs its own skip or moves an old output aside by itself fails here), and each stage on
the tiny run, in this process: a complete output is the one skip line with nothing rewritten, and a
refused --overwrite leaves the old output byte for byte, with nothing set aside, locked or half-built
beside it."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, script

PACKAGE = REPO / "eagle3_pipeline"
LIFECYCLE = {"core/output.py", "core/output_lock.py"}  # the owner, and the flock it takes
# each stage: the modules its output passes through, and the StageOutput calls it must make there
STAGES = {
    "00": (["data/regenerate.py"], {"skip", "lock", "in_place", "finish"}),
    "01": (["data/extract.py", "data/shards.py"],
           {"wanted", "lock", "skip", "same_run", "in_place", "finish"}),
    "02": (["data/vocab.py", "data/shards.py"], {"skip", "lock", "start_fresh", "building", "publish"}),
    "03": (["data/split.py", "data/shards.py"], {"skip", "lock", "start_fresh", "building", "publish"}),
    "04": (
        ["training/train.py", "training/distributed.py", "training/checkpoint.py"],
        {"lock", "check_asides", "same_run", "log_skip", "open_in_place", "kept", "close_in_place",
         "building", "publish"},
    ),  # fmt: skip
    "05": (["export_eval/export.py"], {"skip", "lock", "building", "publish"}),
    "06": (["export_eval/evaluate.py"], {"lock"}),
}
# what only the lifecycle module may do: the primitives it owns (by name), writing COMPLETE, the skip
# line, the hidden sibling an --overwrite keeps, the same-run refusal, "complete, so skip" decided elsewhere
OWNED = [
    r"\boutput_lock\b", r"write\w*\([^)\n]*COMPLETE",
    r"\b(publish_dir|fresh_tmp_dir|prepare_output_dir|mark_complete|check_stale_asides"
    r"|pin_run_settings|check_run_settings|overwriting|aside_dir|open_output)\b",
    r"[\"']skip: ", r"\.old-", r"a run with other settings", r"RUN_FILE\s*,\s*settings",
    r"is_complete\([^)]*\)\s+and\s+not\s+[\w.]*overwrite", r"overwrite\s+or\s+not\s+[\w.]*is_complete",
]  # fmt: skip


def _used(path: Path) -> set[str]:
    """Names of the functions a module calls and the attributes it reads (a method passed as a callback)."""
    tree = ast.parse(path.read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return called | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


@pytest.mark.parametrize("stage", list(STAGES))
def test_each_stage_goes_through_the_one_output_lifecycle(stage):
    modules, needed = STAGES[stage]
    first = (PACKAGE / modules[0]).read_text()
    assert "StageOutput" in first, f"stage {stage}: {modules[0]} does not use core/output.py's StageOutput"
    called = set().union(*(_used(PACKAGE / m) for m in modules))
    assert needed <= called, f"stage {stage}: {sorted(needed - called)} not called through StageOutput"
    for m in modules:
        text = (PACKAGE / m).read_text()
        found = [p for p in OWNED if re.search(p, text)]
        assert found == [], f"{m}: does itself what core/output.py owns: {found}"


def test_no_module_but_the_lifecycle_touches_its_primitives():
    """The whole package, stage modules or not: one owner of the output lifecycle."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel in LIFECYCLE:
            continue
        found = [p for p in OWNED if re.search(p, path.read_text())]
        if found:
            offenders[rel] = found
    assert offenders == {}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}  # fmt: skip


@pytest.fixture(scope="module")
def run_copy(tiny_run, tmp_path_factory) -> Path:
    """A copy of the tiny run (its config moved with it): these tests must leave it as it is, and this
    keeps a failure here from touching the session's run."""
    from conftest import moved_config

    root = tmp_path_factory.mktemp("lifecycle") / "run"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("tiny.toml"))
    moved_config(REPO / "configs" / "tiny.toml", "runs/tiny", root, root / "tiny.toml")
    return root


# stage: (script, its output in the tiny run, the skip line's tail, flags that make --overwrite refuse,
# what the refusal says)
BEHAVIOUR = {
    "00": ("00_regenerate.py", "regenerated", "is complete (use --overwrite to redo it)",
           ["--data-path", "{root}/missing.jsonl"], "data not found"),
    "01": ("01_extract_hidden_states.py", "hidden_states/rows_00000000-00000010",
           "is complete (use --overwrite to redo it)", ["--max-seq-len", "8"], "no empty shard is published"),
    "02": ("02_build_vocab_mapping.py", "vocab", "is complete (use --overwrite to redo it)",
           ["--data-dir", "{root}/missing"], "{root}/missing"),
    "03": ("03_split_data.py", "split", "is complete (use --overwrite to redo it)",
           ["--data-dir", "{root}/missing"], "{root}/missing"),
    "04": ("04_train.py", "train", "already reached step 40 of 40 (use --overwrite to retrain)",
           ["--verifier-path", "{root}/missing"], "{root}/missing"),
    "05": ("05_export.py", "draft", "is a complete export (use --overwrite to replace it)",
           ["--checkpoint", "step_999999"], "no complete checkpoint 'step_999999'"),
    "06": ("06_evaluate.py", "draft", None, ["--data-path", "{root}/missing.jsonl"], "missing.jsonl"),
}  # fmt: skip


def _main(name: str):
    spec = importlib.util.spec_from_file_location(f"stage_{name[:2]}", script(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("stage", list(BEHAVIOUR))
def test_a_complete_output_is_skipped_and_a_refused_overwrite_keeps_it(stage, run_copy, capsys):
    """Each stage's main in this process (one import of torch for all): a complete output is the one skip
    line, nothing rewritten; --overwrite refused leaves it byte for byte and nothing beside it."""
    name, out_rel, skip_tail, refusal, says = BEHAVIOUR[stage]
    out, config = run_copy / out_rel, ["--config", str(run_copy / "tiny.toml")]
    if stage == "06":
        config += ["--engine", "sim"]
    main, before, beside = _main(name), _tree(out), sorted(p.name for p in out.parent.iterdir())
    if skip_tail is not None:
        assert main(config) == 0, capsys.readouterr().err[-2000:]
        err = capsys.readouterr().err
        assert f"skip: {out} {skip_tail}" in err, err[-2000:]
        assert _tree(out) == before
    flags = [f.format(root=run_copy) for f in refusal] + (["--overwrite"] if stage != "06" else [])
    assert main([*config, *flags]) == 2  # (06 writes a result file into a folder it does not own)
    err = capsys.readouterr().err
    assert "error: " in err and says.format(root=run_copy) in err and "Traceback" not in err, err[-2000:]
    assert _tree(out) == before
    assert sorted(p.name for p in out.parent.iterdir()) == beside  # no aside, lock or .tmp left
