"""The run as the unit: one k for the run ([serving] num_speculative_tokens) and one folder ([run] dir) from
which every stage's folders follow (core/layout.py), the closing hints included."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from all_stages import STAGE_CONFIGS

from eagle3_pipeline.core import cli, layout
from eagle3_pipeline.core.config import SERVING_K, config_from_file, load_config_file
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.export_eval.config import EvaluateConfig, ExportConfig
from eagle3_pipeline.sizing import plan
from eagle3_pipeline.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
K_NAMES = {"num_speculative_tokens", "served_k", "ttt_steps", "k"}  # the names k goes by
FIELD_MAKERS = {"setting", "_f", "field"}  # a config field's default is their first argument
RUN = """
[run]
dir = "{root}"
[serving]
num_speculative_tokens = {k}
[regenerate]
verifier_path = "/models/v"
data_path = "/data/prompts.jsonl"
[extract]
[vocab]
[split]
[train]
[export]
[evaluate]
data_path = "/data/heldout.jsonl"
"""


def _config(tmp_path: Path, k: int = 5, extra: str = "") -> str:
    path = tmp_path / "run.toml"
    path.write_text(RUN.format(root=tmp_path / "run", k=k) + extra)
    return str(path)


def test_serving_k_is_what_training_export_evaluation_and_the_plan_read(tmp_path):
    for k in (2, 5):
        path = _config(tmp_path, k)
        train = config_from_file(TrainConfig, path)
        assert (train.ttt_steps, train.served_k) == (k, k)
        assert config_from_file(ExportConfig, path).num_speculative_tokens == k
        assert config_from_file(EvaluateConfig, path).num_speculative_tokens == k
        assert plan._serve_k(path) == k


def test_training_deeper_than_served_stays_a_train_key(tmp_path):
    path = _config(tmp_path, 3)
    text = Path(path).read_text().replace("[train]\n", "[train]\nttt_steps = 4\n")
    Path(path).write_text(text)
    train = config_from_file(TrainConfig, path)
    assert (train.ttt_steps, train.served_k) == (4, 3)


@pytest.mark.parametrize(
    "section, key",
    [("train", "served_k"), ("export", "num_speculative_tokens"), ("evaluate", "num_speculative_tokens")],
)
def test_a_stage_that_restates_k_is_refused_naming_serving(tmp_path, section, key):
    path = _config(tmp_path)
    Path(path).write_text(Path(path).read_text().replace(f"[{section}]\n", f"[{section}]\n{key} = 3\n"))
    with pytest.raises(UserError, match=rf"\[{section}\] {key}: .*\[serving\] num_speculative_tokens"):
        load_config_file(path, "train")


def _int_defaults_of_k(tree: ast.AST) -> list[str]:
    """Places that give k a number of their own: `name = 3`, `name: int = 3`, `name: int = setting(3, ...)`
    or a keyword `name=3`, for the names k goes by."""
    found = []
    for node in ast.walk(tree):
        target, value = None, None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.keyword):
            target, value = node.arg, node.value
        elif isinstance(node, ast.arguments):
            positional = [*node.posonlyargs, *node.args]
            defaulted = positional[len(positional) - len(node.defaults) :]
            for arg, default in [*zip(defaulted, node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]:
                if arg.arg in K_NAMES and _int(default) is not None:
                    found.append(f"line {arg.lineno}: {arg.arg} = {_int(default)}")
            continue
        if target not in K_NAMES or value is None:
            continue
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) in FIELD_MAKERS and value.args:
            value = value.args[0]
        if _int(value) is not None:
            found.append(f"line {node.lineno}: {target} = {_int(value)}")
    return found


def _int(node: ast.AST | None) -> int | None:
    ok = isinstance(node, ast.Constant) and type(node.value) is int
    return node.value if ok else None  # type: ignore[union-attr]


def test_k_has_one_default_in_the_package():
    """A second literal default of k anywhere in the package fails here; SERVING_K is the one."""
    found = {}
    for path in sorted((ROOT / "eagle3_pipeline").rglob("*.py")):
        hits = _int_defaults_of_k(ast.parse(path.read_text()))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert found == {}, found
    src = (ROOT / "eagle3_pipeline" / "core" / "config.py").read_text()
    assert src.count("\nSERVING_K = ") == 1
    for section, cls in STAGE_CONFIGS.items():
        fields = {f.name: f.default for f in cls.__dataclass_fields__.values()}
        for key in {"ttt_steps", "served_k", "num_speculative_tokens"} & set(fields):
            assert fields[key] == SERVING_K, (section, key)


def test_run_dir_gives_every_stage_its_folders_and_a_stage_key_wins(tmp_path):
    path = _config(tmp_path)
    run = tmp_path / "run"
    values = {section: load_config_file(path, section) for section in layout.STAGES}
    assert values["regenerate"]["out_dir"] == f"{run}/regenerated"
    assert values["extract"]["verifier_path"] == "/models/v"
    assert values["extract"]["data_path"] == f"{run}/regenerated/conversations.jsonl"
    assert values["extract"]["out_dir"] == f"{run}/hidden_states"
    for section in ("vocab", "split", "train"):
        assert values[section]["data_dir"] == [f"{run}/hidden_states"]
    assert values["train"]["split_dir"] == f"{run}/split"
    assert values["train"]["vocab_mapping_dir"] == f"{run}/vocab"
    assert values["export"]["train_dir"] == f"{run}/train"
    assert values["evaluate"]["draft_dir"] == f"{run}/draft"
    # a stage's own key wins, and the next stage reads it
    text = Path(path).read_text().replace("[extract]\n", '[extract]\nout_dir = "/nvme/states"\n')
    Path(path).write_text(text)
    assert load_config_file(path, "train")["data_dir"] == ["/nvme/states"]
    assert load_config_file(path, "split")["out_dir"] == f"{run}/split"


def test_the_closing_hints_take_the_outputs_the_layout_wires(tmp_path):
    """Each stage's hint without a config names the flags by which the next stage reads its output: the
    same values the next stage gets from [run] dir."""
    path = _config(tmp_path)
    run = tmp_path / "run"
    assert cli.NEXT_FLAGS["regenerate"] == "--data-path {out}/conversations.jsonl"
    for section, flags in cli.NEXT_FLAGS.items():
        nxt = list(layout.STAGES)[list(layout.STAGES).index(section) + 1]
        wanted = load_config_file(path, nxt)
        out = f"{run}/{layout.OUTPUT_DIRS[section]}"
        words = flags.split(", then ")[0].split(" ")
        for flag, value in zip(words[::2], words[1::2], strict=True):
            key = flag.removeprefix("--").replace("-", "_")
            for placeholder, folder in layout.OUTPUT_DIRS.items():
                value = value.replace(folder.upper(), f"{run}/{folder}")
            value = value.format(out=out)
            got = wanted[key]
            assert (got[0] if isinstance(got, list) else got) == value, (section, flag)


def test_the_kimi_config_names_each_path_once():
    data = tomllib.loads((ROOT / "configs" / "kimi_k25.toml").read_text())
    paths = [v for table in data.values() for v in table.values() if isinstance(v, str) and "/" in v]
    assert len(paths) == len(set(paths)), paths
    run_dir = data["run"]["dir"]
    assert [p for p in paths if p.startswith(run_dir + "/")] == []
