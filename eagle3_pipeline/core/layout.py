"""A run's layout, the one owner of the wiring between stages: the stages in order, each one's output folder
under `[run] dir`, and which input of a stage is an earlier stage's output.

A config file names the run's folder once (`[run] dir = "runs/kimi_k25"`); a stage whose section sets no
`out_dir` writes to `<dir>/<OUTPUT_DIRS[stage]>`, and an input its section leaves unset is the earlier
stage's (WIRES), so each path is written once. Any key in a stage's section, or on the command line, wins.
Config files (config.load_config_file), each stage's closing hint (cli.next_step) and scripts/run_tiny.sh
(`python -m eagle3_pipeline.core.cli stages`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_pipeline.core.errors import UserError

# The pipeline's stages in order: [section] -> script
STAGES = {
    "regenerate": "00_regenerate.py",
    "extract": "01_extract_hidden_states.py",
    "vocab": "02_build_vocab_mapping.py",
    "split": "03_split_data.py",
    "train": "04_train.py",
    "export": "05_export.py",
    "evaluate": "06_evaluate.py",
}
# Each stage's output folder under [run] dir (stage 06 writes into the draft folder it evaluates)
OUTPUT_DIRS = {
    "regenerate": "regenerated",
    "extract": "hidden_states",
    "vocab": "vocab",
    "split": "split",
    "train": "train",
    "export": "draft",
}
REGENERATED_FILE = "conversations.jsonl"  # what stage 00 writes in its folder, stage 01's input


@dataclass(frozen=True)
class Wire:
    """`stage`'s `key` defaults to `source`'s `source_key` (as `form` shapes it) when the file has a
    [source] section: that stage is part of the run."""

    stage: str
    key: str
    source: str
    source_key: str = "out_dir"
    form: str = "path"  # path: as is; list: a one-item list (data_dir); file: <folder>/REGENERATED_FILE

    def shape(self, value: str) -> Any:
        return {"path": value, "list": [value], "file": f"{value}/{REGENERATED_FILE}"}[self.form]


WIRES = (
    Wire("extract", "verifier_path", "regenerate", "verifier_path"),
    Wire("extract", "data_path", "regenerate", form="file"),
    Wire("vocab", "data_dir", "extract", form="list"),
    Wire("split", "data_dir", "extract", form="list"),
    Wire("train", "data_dir", "extract", form="list"),
    Wire("train", "split_dir", "split"),
    Wire("train", "vocab_mapping_dir", "vocab"),
    Wire("export", "train_dir", "train"),
    Wire("evaluate", "draft_dir", "export"),
)


def run_dir(data: dict[str, Any], path: str) -> str | None:
    """`[run] dir` of a config file's tables (None: unset)."""
    value = data.get("run", {}).get("dir")
    if value is not None and (not isinstance(value, str) or not value):
        raise UserError(f"{path}: [run] dir = {value!r}: expected a folder name such as \"runs/kimi_k25\"")
    return value


def section_values(data: dict[str, Any], section: str, path: str) -> dict[str, Any]:
    """`[section]` of a config file's tables over the folders the layout gives it: its out_dir under
    [run] dir, its inputs from the earlier stages' sections (themselves resolved the same way)."""
    values: dict[str, Any] = {}
    root = run_dir(data, path)
    if root is not None and section in OUTPUT_DIRS:
        values["out_dir"] = f"{root}/{OUTPUT_DIRS[section]}"
    for wire in WIRES:
        if wire.stage == section and wire.source in data:
            value = section_values(data, wire.source, path).get(wire.source_key)
            if value is not None:
                values[wire.key] = wire.shape(value)
    return values | data.get(section, {})


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def next_flags(section: str) -> str:
    """The flags by which the stage after `section` takes its output, `{out}` standing for that output
    (stage 02's is read two stages on): what a stage's closing hint prints when no config file was given."""
    order = list(STAGES)
    later = order[order.index(section) + 1 :]
    words = []
    for wire in (w for w in WIRES if w.stage == later[0] and w.source_key == "out_dir"):
        mine = wire.source == section
        value = wire.shape("{out}" if mine else OUTPUT_DIRS[wire.source].upper())
        words.append(f"{_flag(wire.key)} {value[0] if isinstance(value, list) else value}")
    onward = (w for w in WIRES if w.source == section and w.stage in later[1:] and w.source_key == "out_dir")
    return " ".join(words) + "".join(f", then {STAGES[w.stage]} {_flag(w.key)} {{out}}" for w in onward)
