"""One owner of the served mode (issue 28 item 3): stage 05 records how the export will be served
(export_meta.json "served": draft_sample_method, temperature, top_p), and 06_evaluate.py --draft-dir D without
--config evaluates it that way unless its command line says otherwise; the run scripts loop over the stage
order that cli.py owns."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DATA, REPO, moved_config, run_script, script
from test_nothing_lost import _train_args

from eagle3_pipeline.core.cli import STAGES


@pytest.fixture(scope="module")
def export(tiny_shards, tmp_path_factory) -> Path:
    """A 2-step tiny run exported as thinking mode serves it: probabilistic drafting at 1.0 / 0.95."""
    root = tmp_path_factory.mktemp("served")
    run_script(*_train_args(tiny_shards, root / "run"))
    run_script(script("05_export.py"), "--train-dir", str(root / "run"), "--out-dir", str(root / "draft"),
               "--draft-sample-method", "probabilistic", "--temperature", "1.0",
               "--top-p", "0.95")  # fmt: skip
    served = json.loads((root / "draft" / "export_meta.json").read_text())["served"]
    assert served == {"draft_sample_method": "probabilistic", "temperature": 1.0, "top_p": 0.95,
                      "parallel_drafting": False}  # a sequential draft
    return root / "draft"


def _evaluate(draft: Path, out: Path, *flags: str) -> dict:
    run_script(script("06_evaluate.py"), "--draft-dir", str(draft), "--data-path",
               str(DATA / "heldout_prompts.jsonl"), "--num-prompts", "1", "--max-new-tokens", "8",
               "--out-dir", str(out), *flags)  # fmt: skip
    (path,) = out.glob("acceptance_*.json")
    return {"name": path.name, **json.loads(path.read_text())}


def test_evaluate_without_config_serves_the_export_as_it_records(export, tmp_path):
    result = _evaluate(export, tmp_path / "as_recorded")
    assert result["name"] == "acceptance_sim_t1_p0.95_probabilistic.json"
    assert (result["sampling"]["temperature"], result["sampling"]["top_p"]) == (1.0, 0.95)
    assert result["config"]["draft_sample_method"] == "probabilistic"


def test_the_command_line_wins_over_what_the_export_records(export, tmp_path):
    result = _evaluate(export, tmp_path / "argmax", "--draft-sample-method", "greedy", "--top-p", "1.0")
    assert result["name"] == "acceptance_sim_t1_p1.json"  # temperature still as recorded
    assert result["config"]["draft_sample_method"] == "greedy"
    greedy = _evaluate(export, tmp_path / "greedy", "--temperature", "0")
    assert greedy["name"] == "acceptance_sim.json"


def test_run_kimi_k25_waits_in_the_folder_stage_01_writes(tmp_path):
    """run_kimi_k25.sh waits for the --serve server's record in stage 01's folder, which the Kimi config
    gives by [run] dir alone (no [extract] out_dir): the script's line names it as the layout does, and a
    config that names no folder is a one-line error, not a traceback."""
    import os

    from eagle3_pipeline.core.layout import OUTPUT_DIRS

    lines = (REPO / "scripts" / "run_kimi_k25.sh").read_text().splitlines()
    line = next(x for x in lines if x.startswith("OUT_DIR="))

    def out_dir(config):
        env = {**os.environ, "PY": sys.executable, "CONFIG": str(config)}
        cmd = f'set -euo pipefail; {line}; echo "$OUT_DIR"'
        return subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True)

    found = out_dir("configs/kimi_k25.toml")
    assert found.returncode == 0 and found.stdout.strip() == f"runs/kimi_k25/{OUTPUT_DIRS['extract']}"
    bare = tmp_path / "bare.toml"
    bare.write_text('[extract]\nverifier_path = "/models/x"\n')
    refused = out_dir(bare)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"{bare}: [extract] has no out_dir" in refused.stderr


def test_run_tiny_loops_over_the_stage_order_cli_owns():
    """run_kimi_k25.sh keeps one line per stage: each has its own launch (the shard loop, torchrun)."""
    listed = subprocess.run([sys.executable, "-m", "eagle3_pipeline.core.cli", "stages"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert listed == list(STAGES.values()) and listed[0] == "00_regenerate.py" and len(listed) == 7
    assert "-m eagle3_pipeline.core.cli stages" in (REPO / "scripts" / "run_tiny.sh").read_text()


# run_kimi_k25.sh's own logic, every stage replaced by a recorder: the stages it runs and their flags, in
# order (the stages themselves are tested on the tiny verifiers; this script needs eight GPUs and Kimi-K2.5)
RECORDER = """#!{python}
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
if args[:2] == ["-m", "eagle3_pipeline.core.cli"]:
    os.execv(sys.executable, [sys.executable, *args])
with open(os.environ["RECORD"], "a") as f:
    f.write(json.dumps([Path(sys.argv[0]).name, *args]) + "\\n")
if "--serve" in args:  # as extract_vllm.serve: a record while it runs, removed when stopped
    record = Path(os.environ["OUT_DIR_EXPECTED"]) / "vllm-server.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{{}}")
    signal.signal(signal.SIGTERM, lambda *_: (record.unlink(), sys.exit(0)))
    time.sleep(600)
if args[:2] == ["-m", "eagle3_pipeline.data.sessions"]:
    out = Path(args[args.index("--out") + 1])
    out.write_text("{{}}\\n" * 3)
    Path(str(out) + ".meta.json").write_text("{{}}")
"""


def test_run_kimi_k25_extracts_the_rows_then_their_sessions_each_through_its_own_server(tmp_path):
    run = tmp_path / "run"
    config = moved_config(REPO / "configs" / "kimi_k25.toml", "runs/kimi_k25", run, tmp_path / "kimi.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python", "torchrun"):
        (bin_dir / name).write_text(RECORDER.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    record = tmp_path / "calls.jsonl"

    def calls(**env):
        record.unlink(missing_ok=True)
        full = {**__import__("os").environ, "PYTHON": str(bin_dir / "python"), "CONFIG": str(config),
                "RECORD": str(record), "OUT_DIR_EXPECTED": str(run / "hidden_states"), "NUM_ROWS": "5",
                "SHARD_ROWS": "2", **env}  # fmt: skip
        subprocess.run(["bash", "scripts/run_kimi_k25.sh"], cwd=REPO, env=full, check=True, timeout=120)
        return [json.loads(x) for x in record.read_text().splitlines()]

    def stage01(*flags, ranges):
        return [["python", "01_extract_hidden_states.py", "--config", str(config), *flags, "--serve"]] + [
            ["python", "01_extract_hidden_states.py", "--config", str(config), *flags, "--start-row", str(a),
             "--end-row", str(b)] for a, b in ranges]  # fmt: skip

    sessions = run / "sessions.jsonl"
    session_flags = ("--data-path", str(sessions), "--variant", "sessions", "--max-seq-len", "4096")
    first = calls(SESSION_TOKENS="4096")
    tool = ["python", "-m", "eagle3_pipeline.data.sessions", "--config", str(config), "--max-tokens", "4096",
            "--passes", "1", "--out", str(sessions)]  # fmt: skip
    rows = stage01(ranges=[(0, 2), (2, 4), (4, 5)])
    assert first[2:] == [*rows, tool, *stage01(*session_flags, ranges=[(0, 2), (2, 3)]),
                         ["python", "02_build_vocab_mapping.py", "--config", str(config)],
                         ["python", "03_split_data.py", "--config", str(config)],
                         ["torchrun", "--nproc-per-node", "8", "04_train.py", "--config", str(config)],
                         ["python", "05_export.py", "--config", str(config)],
                         ["python", "06_evaluate.py", "--config", str(config)]]  # fmt: skip
    assert [c[1] for c in first[:2]] == ["01_extract_hidden_states.py", "00_regenerate.py"]  # --plan first
    assert not (run / "hidden_states" / "vllm-server.json").exists()  # each server stopped
    again = calls(SESSION_TOKENS="4096")  # the sessions made: not made again, their shards resumed
    assert tool not in again and again.count(stage01(*session_flags, ranges=[])[0]) == 1
    assert not any("--variant" in c for c in calls(SESSION_TOKENS="0"))
