"""Every setting of every stage is checked when its config is parsed (issue 16): a number outside its
declared range, a value of the wrong type or a name outside its choices ends in one error naming the flag
(a UserError, or argparse's exit 2 for a command-line value of the wrong type), never in a traceback
further on or a silent run. The property tests drive the real parser and config file path; the config
classes check themselves when built (test_config_validation.py), which is where these refusals come from."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import math
import shlex
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from all_stages import STAGE_CONFIGS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from eagle3_pipeline.core import config
from eagle3_pipeline.core.cli import build_parser
from eagle3_pipeline.core.config import (
    accepts,
    add_config_flags,
    options_from_args,
    resolve_config,
)
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.sizing.options import PlanOptions
from eagle3_pipeline.training.config import LOSS_NAMES

ROOT = Path(__file__).resolve().parents[1]
CLASSES: dict[str, type] = {**STAGE_CONFIGS, "plan": PlanOptions}  # "plan": command line only
BOUND_KEYS = ("ge", "gt", "le", "lt")
# Strings that name a path, a dataset split or a checkpoint: any text parses; they are checked when used.
FREE_TEXT = {
    "verifier_path", "data_path", "data_split", "out_dir", "vllm_python", "data_dir", "split_dir",
    "vocab_mapping_dir", "train_dir", "checkpoint", "draft_dir", "plan_json", "cache_dir",
}  # fmt: skip
EXAMPLES = settings(
    max_examples=8,  # per field and property: 354 cases in about 15 s on a busy 2-core machine
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
INT64 = 2**63  # a TOML integer is 64-bit
toml_text = st.text(st.characters(max_codepoint=0xFFFF, exclude_categories=("Cs",)), max_size=12)
# argparse drops a value "--" (its end-of-options marker), even as `--flag=--`, and passes [] on:
# tested once on its own (test_a_lone_double_dash_value_is_refused_naming_the_flag)
cli_text = toml_text.filter(lambda t: t != "--")


def _type(cls: type, name: str) -> tuple[Any, bool]:
    """(item type, is a list) of a field: `int | None` -> (int, False), `list[int]` -> (int, True)."""
    tp, _ = config._base_type(typing.get_type_hints(cls)[name])
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True
    return tp, False


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _declares(meta: Any) -> bool:
    return any(k in meta for k in (*BOUND_KEYS, "choices", "check"))


def _meta(section: str, name: str) -> Any:
    return next(f.metadata for f in dataclasses.fields(CLASSES[section]) if f.name == name)


FIELDS = [(section, f) for section, cls in CLASSES.items() for f in dataclasses.fields(cls)]
CHECKED = [(section, f.name) for section, f in FIELDS if _declares(f.metadata)]
BOUNDED = [(s, n) for s, n in CHECKED if any(k in _meta(s, n) for k in BOUND_KEYS)]
CHOICES = [(s, n) for s, n in CHECKED if "choices" in _meta(s, n)]
NUMBERS = [(s, n) for s, n in CHECKED if _type(CLASSES[s], n)[0] in (int, float)]


def _in_file(section: str, name: str) -> bool:
    """Whether a config file may set the key in [section]: PlanOptions has no file; k is [serving]'s."""
    return section != "plan" and name not in config.K_KEYS_MOVED.get(section, ())


TYPED = [(section, f.name) for section, f in FIELDS if _in_file(section, f.name)]


@functools.cache
def _parser(section: str) -> Any:
    """The stage's parser as cli.run_stage builds it; PlanOptions' flags ride on stage 04's."""
    parser = build_parser(None, STAGE_CONFIGS["train" if section == "plan" else section])
    if section == "plan":
        add_config_flags(parser.add_argument_group("plan"), PlanOptions, with_config=False)
    return parser


def _required(section: str, but: str | None = None) -> list[str]:
    """Placeholder values for the stage's required flags (paths are only checked when a stage runs)."""
    if section == "plan":
        return _required("train")
    fields = dataclasses.fields(STAGE_CONFIGS[section])
    return [a for f in fields if f.metadata.get("required") and f.name != but for a in (_flag(f.name), "x")]


def _resolve(section: str, argv: list[str], toml: str | None = None, tmp: Path | None = None) -> Any:
    """The config from the command line `argv` (after the required flags) and a file holding the one
    `key = value` line `toml` (its key then left off the command line)."""
    head = _required(section, but=None if toml is None else toml.split(" = ")[0])
    if toml is not None:
        assert tmp is not None
        path = tmp / "stage.toml"
        path.write_text(f"[{section}]\n{toml}\n")
        head = ["--config", str(path), *head]
    args = _parser(section).parse_args([*head, *argv])
    if section == "plan":
        return options_from_args(PlanOptions, args)
    return resolve_config(STAGE_CONFIGS[section], args, section)


def _refusal(section: str, argv: list[str], toml: str | None = None, tmp: Path | None = None) -> str:
    """The message of the refusal: a UserError's, or what argparse printed before exiting with 2. Any
    other exception propagates and fails the test; an accepted value fails it too."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = _resolve(section, argv, toml, tmp)
    except UserError as e:
        return str(e)
    except SystemExit as e:
        assert e.code == 2, err.getvalue()
        return err.getvalue()
    raise AssertionError(f"accepted: {argv} {toml!r} -> {cfg}")


def _toml(value: Any) -> str:
    """A TOML literal for a Python value (strings escaped to stay valid TOML whatever they hold)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if _plain(c) else f"\\u{ord(c):04x}" for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _plain(c: str) -> bool:
    """Whether a character may stand as itself in a TOML basic string (else it is written \\uXXXX)."""
    return c.isascii() and c.isprintable() and c not in '"\\'


def _cli(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _outside(meta: Any, tp: type) -> st.SearchStrategy[Any]:
    """Numbers just outside or far outside the declared bounds (and, for floats, nan and the infinities)."""
    sides = []
    for key, below in (("ge", True), ("gt", True), ("le", False), ("lt", False)):
        if key not in meta:
            continue
        bound, closed = meta[key], key in ("ge", "le")  # closed: the bound itself is inside
        if tp is int:
            edge = bound - closed if below else bound + closed
            sides.append(st.integers(max_value=edge) if below else st.integers(min_value=edge))
            continue
        if below:
            floats = st.floats(max_value=bound, exclude_max=closed, allow_nan=False, allow_infinity=False)
        else:
            floats = st.floats(min_value=bound, exclude_min=closed, allow_nan=False, allow_infinity=False)
        sides.append(floats.filter(lambda x, b=bound: x != b) if closed else floats)  # -0.0 is 0.0: inside
    if tp is float:
        sides.append(st.sampled_from([math.nan, math.inf, -math.inf]))
    return st.one_of(sides)


_loss_names = st.sampled_from(LOSS_NAMES)
_loss_weights = st.dictionaries(_loss_names, st.floats(0, 1e6) | st.integers(0, 10**6), min_size=1)
# values accepted by the fields with a `check`, one strategy per field
CHECKED_VALUES = {
    # a loss name, or JSON weights >= 0 not all 0
    "loss": _loss_names | _loss_weights.filter(lambda w: any(v > 0 for v in w.values())).map(json.dumps),
    "servers": st.builds("{}://{}:{}{}".format, st.sampled_from(["http", "https"]),
                         st.sampled_from(["127.0.0.1", "node-3", "10.0.0.5"]), st.integers(1, 65535),
                         st.sampled_from(["", "/v1"])),  # fmt: skip
    "transfer_args": st.lists(st.from_regex(r"[A-Za-z0-9_./-]{1,12}", fullmatch=True), max_size=4).map(
        shlex.join
    ),
    "head_dim": st.integers(1, 2**62).map(lambda n: 2 * n),  # even (RoPE rotates pairs)
    "variant": st.from_regex(r"[A-Za-z0-9_.-]{1,16}", fullmatch=True),  # a name that goes into sample ids
    # none, verifier, or a JSON yarn table: factor > 1 over an integer length, betas or both mscales
    "rope_scaling": st.sampled_from(["none", "verifier"]) | st.builds(
        lambda f, n, extra: json.dumps({"rope_type": "yarn", "factor": f, "original_max_position_embeddings": n,
                                        **extra}),
        st.floats(1.001, 1e4), st.integers(1, 10**6),
        st.sampled_from([{}, {"beta_fast": 32, "beta_slow": 1}, {"mscale": 1.0, "mscale_all_dim": 0.5}]),
    ),  # fmt: skip
}
# Fields whose in-range values stand only beside a fitting other field (TrainConfig's rules between
# fields: the heads a multiple of the key/value heads; test_config_validation.py refuses the rest): the
# flags given with `value` so that it stands.
COMPANIONS = {
    ("train", "num_attention_heads"): lambda value: ["--num-key-value-heads", "1"],
    ("train", "num_key_value_heads"): lambda value: ["--num-attention-heads", str(value)],
    # the MLA draft refuses norm_before_fc (on by default): vLLM's MLA draft has no input_norm
    ("train", "draft_arch"): lambda value: ["--no-norm-before-fc"] if value == "mla" else [],
}


def _inside(meta: Any, tp: type) -> st.SearchStrategy[Any]:
    if "choices" in meta:
        return st.sampled_from(meta["choices"])
    low = meta.get("ge", meta.get("gt"))
    high = meta.get("le", meta.get("lt"))
    if tp is int:
        return st.integers(
            min_value=None if low is None else low + ("gt" in meta),
            max_value=None if high is None else high - ("lt" in meta),
        )
    return st.floats(
        min_value=low, max_value=high, exclude_min="gt" in meta, exclude_max="lt" in meta,
        allow_nan=False, allow_infinity=False,
    )  # fmt: skip


# ---- every field declares what it accepts, and --help shows it -------------------------------------


def test_every_number_and_choice_field_of_every_stage_declares_its_range_or_choices():
    """A new numeric field without a range, or a string field that is neither free text nor checked,
    fails here: it would reach the stage unchecked."""
    missing = []
    for section, f in FIELDS:
        tp, _ = _type(CLASSES[section], f.name)
        if tp in (int, float) and not any(k in f.metadata for k in BOUND_KEYS):
            missing.append(f"{section}.{f.name}: no range")
        if tp is str and f.name not in FREE_TEXT and not _declares(f.metadata):
            missing.append(f"{section}.{f.name}: no choices or check (or add it to FREE_TEXT)")
    assert not missing, missing
    str_fields = {f.name for section, f in FIELDS if _type(CLASSES[section], f.name)[0] is str}
    assert FREE_TEXT <= str_fields, FREE_TEXT - str_fields  # the list names no field that is gone


def test_every_default_lies_inside_what_its_field_accepts():
    for section, name in CHECKED:
        field = next(f for f in dataclasses.fields(CLASSES[section]) if f.name == name)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        if default is not None:
            config.check_value(name, default, field.metadata)


def test_help_shows_what_each_checked_flag_accepts():
    for section, name in CHECKED:
        shown = accepts(_meta(section, name))
        if shown is None:  # a free-form check (the loss) says what it takes in its own help
            continue
        action = next(a for a in _parser(section)._actions if a.dest == name)
        assert shown in action.help, (section, name, action.help)


def test_loss_names_are_speculators_names():
    """LOSS_NAMES is a copy (importing speculators' losses costs torch and seconds): pinned to its source."""
    spec = importlib.util.find_spec("speculators")
    assert spec is not None and spec.submodule_search_locations
    source = Path(spec.submodule_search_locations[0], "losses", "utils.py").read_text()
    maps = {
        node.targets[0].id if isinstance(node, ast.Assign) else node.target.id: node.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict)
    }
    for name in ("_EAGER_LOSS_FN_MAP", "_FUSED_LOSS_FN_MAP"):
        assert {ast.literal_eval(k) for k in maps[name].keys} == set(LOSS_NAMES), name


@pytest.mark.parametrize("path", sorted(ROOT.glob("configs/*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves_in_every_section(path):
    for section, cls in STAGE_CONFIGS.items():
        args = _parser(section).parse_args(["--config", str(path), *_required(section)])
        resolve_config(cls, args, section)


# ---- the reviewer's cases -------------------------------------------------------------------------

# Measured by a reviewer before the checks: a traceback (the first three), a silent run or an empty output
# (the next three), a refusal far downstream (the last three).
REVIEWED = [
    ("evaluate", ["--num-speculative-tokens", "0"], "--num-speculative-tokens must be >= 1, got 0"),
    ("train", ["--ttt-steps", "0"], "--ttt-steps must be in [1, 16], got 0"),
    ("train", ["--lr", "-1"], "--lr must be > 0, got -1.0"),
    ("train", ["--batch-tokens", "-5"], "--batch-tokens must be >= 1, got -5"),
    ("regenerate", ["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    ("extract", ["--max-seq-len", "0"], "--max-seq-len must be >= 1, got 0"),
    ("split", ["--val-ratio", "1.5"], "--val-ratio must be in [0, 1), got 1.5"),
    ("train", ["--val-ratio", "1.5"], "--val-ratio must be in [0, 1), got 1.5"),
    ("vocab", ["--draft-vocab-size", "0"], "--draft-vocab-size must be >= 1, got 0"),
]
CASES = REVIEWED + [
    ("train", ["--attn-impl", "fast"],
     "--attn-impl must be one of auto, flex, sdpa, eager, blockwise, got 'fast'"),
    ("train", ["--loss", '{"ce": -1}'], "--loss must weigh each loss by a finite number >= 0"),
    ("extract", ["--aux-layer-ids", "0", "30"], "--aux-layer-ids must be >= 1 (each), got [0, 30]"),
]
SCRIPTS = {"regenerate": "00_regenerate.py", "extract": "01_extract_hidden_states.py",
           "vocab": "02_build_vocab_mapping.py", "split": "03_split_data.py", "train": "04_train.py",
           "evaluate": "06_evaluate.py"}  # fmt: skip


@pytest.mark.parametrize("section, argv, message", CASES, ids=[f"{c[0]} {' '.join(c[1])}" for c in CASES])
def test_reviewers_bad_values_are_refused_when_parsed_naming_the_flag(section, argv, message):
    with pytest.raises(UserError) as e:
        _resolve(section, argv)
    assert str(e.value).startswith(message)


def test_a_bad_value_in_the_config_file_names_the_flag_the_key_and_the_file(tmp_path):
    with pytest.raises(UserError) as e:
        _resolve("train", [], "ttt_steps = 0", tmp_path)
    where = f"(ttt_steps in [train] of {tmp_path / 'stage.toml'})"
    assert str(e.value) == f"--ttt-steps must be in [1, 16], got 0 {where}"


def test_the_stage_scripts_exit_2_with_one_line_before_doing_anything(tmp_path):
    """The real scripts, as the reviewer ran them: exit 2, the message, no traceback, nothing written."""
    procs = [
        (message, subprocess.Popen(
            [sys.executable, str(ROOT / SCRIPTS[section]), *_required(section), *argv], cwd=tmp_path,
            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        ))
        for section, argv, message in REVIEWED
    ]  # fmt: skip
    for message, proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and f"error: {message}" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())  # the placeholder paths (x): no stage got as far as writing


# ---- properties over the schema --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("configs")


@pytest.mark.parametrize("section, name", BOUNDED)
@EXAMPLES
@given(data=st.data())
def test_a_number_outside_its_range_is_refused_naming_the_flag(section, name, data, tmp):
    meta, (tp, is_list) = _meta(section, name), _type(CLASSES[section], name)
    value = data.draw(_outside(meta, tp))
    flag = _flag(name)
    message = _refusal(section, [flag, "1", _cli(value)] if is_list else [f"{flag}={_cli(value)}"])
    assert message.startswith(f"{flag} must be "), message
    if _in_file(section, name) and (tp is float or -INT64 <= value < INT64):
        toml_value = [1, value] if is_list else value
        message = _refusal(section, [], f"{name} = {_toml(toml_value)}", tmp)
        assert message.startswith(f"{flag} must be ") and f"({name} in [{section}] of " in message, message


@pytest.mark.parametrize("section, name", CHECKED)
@EXAMPLES
@given(data=st.data())
def test_a_value_inside_its_range_or_choices_resolves_to_itself(section, name, data, tmp):
    meta, (tp, is_list) = _meta(section, name), _type(CLASSES[section], name)
    if "check" in meta:
        values = CHECKED_VALUES[name]
        value = data.draw(st.lists(values, min_size=1, max_size=3) if is_list else values)
    else:
        inside = _inside(meta, tp)
        value = data.draw(st.lists(inside, min_size=1, max_size=3) if is_list else inside)
    beside = COMPANIONS.get((section, name), lambda _: [])(value)
    argv = [_flag(name), *map(_cli, value)] if is_list else [f"{_flag(name)}={_cli(value)}"]
    assert getattr(_resolve(section, [*beside, *argv]), name) == value
    fits_toml = tp is not int or all(-INT64 <= v < INT64 for v in (value if is_list else [value]))
    if _in_file(section, name) and fits_toml:
        assert getattr(_resolve(section, beside, f"{name} = {_toml(value)}", tmp), name) == value


@pytest.mark.parametrize("section, name", CHOICES)
@EXAMPLES
@given(data=st.data())
def test_a_name_outside_the_choices_is_refused_naming_the_flag(section, name, data, tmp):
    meta, (_, is_list) = _meta(section, name), _type(CLASSES[section], name)
    text = data.draw(cli_text.filter(lambda t: t not in meta["choices"]))
    flag = _flag(name)
    message = _refusal(section, [f"{flag}={text}"])
    assert message.startswith(f"{flag} must be one of "), message
    message = _refusal(section, [], f"{name} = {_toml([text] if is_list else text)}", tmp)
    assert message.startswith(f"{flag} must be one of ") and f"({name} in [{section}] of " in message, message


@EXAMPLES
@given(
    text=cli_text.filter(lambda t: t not in LOSS_NAMES and not t.lstrip().startswith("{")),
    weights=st.dictionaries(
        st.sampled_from(LOSS_NAMES) | st.text(max_size=8),
        st.floats() | st.integers(-(10**6), 10**6) | st.booleans() | st.text(max_size=3),
    ),
)
def test_a_loss_that_is_no_name_nor_weights_of_names_is_refused(text, weights):
    assert _refusal("train", [f"--loss={text}"]).startswith("--loss must ")
    valid = (
        weights
        and set(weights) <= set(LOSS_NAMES)
        and all(type(w) in (int, float) and math.isfinite(w) and w >= 0 for w in weights.values())
        and any(w > 0 for w in weights.values())
    )
    assume(not valid)
    assert _refusal("train", [f"--loss={json.dumps(weights)}"]).startswith("--loss must ")


@pytest.mark.parametrize("section, name", NUMBERS)
@EXAMPLES
@given(data=st.data())
def test_a_command_line_number_of_the_wrong_type_exits_2_naming_the_flag(section, name, data):
    tp, is_list = _type(CLASSES[section], name)
    text = data.draw(st.sampled_from(["True", "false", "1.5", "2.0", "", "1e3", "0x10"]) | cli_text)
    try:
        tp(text)
    except ValueError:
        pass
    else:
        assume(False)  # it is a number of the type after all
    message = _refusal(section, [f"{_flag(name)}={text}"])
    assert f"argument {_flag(name)}: invalid {tp.__name__} value" in message, message


@pytest.mark.parametrize("flag", ["--ttt-steps", "--attn-impl", "--lr"])
def test_a_lone_double_dash_value_is_refused_naming_the_flag(flag):
    message = _refusal("train", [f"{flag}=--"])
    assert "= []: expected" in message and message.endswith(f"({flag})"), message


def _wrong_type(tp: type, is_list: bool) -> st.SearchStrategy[Any]:
    """TOML values that are not of the field's type: a string for a number, a bool or a float for an int,
    a number for a string, a scalar for a list, and so on."""
    kind = typing.get_origin(tp) or tp  # dict[str, Any] -> dict
    scalars = {
        int: st.booleans() | toml_text | st.floats().filter(lambda x: not x.is_integer()) | st.just(2.0),
        float: st.booleans() | toml_text,
        str: st.booleans() | st.integers(-INT64, INT64 - 1) | st.floats(),
        bool: st.integers(-INT64, INT64 - 1) | toml_text | st.floats(),
        dict: st.booleans() | toml_text | st.integers(-INT64, INT64 - 1),
    }[kind]
    if is_list:  # a bare item, or a list holding a wrong item beside a right one
        item = {int: st.integers(1, 9), str: st.just("tensorboard")}[tp]
        return item | st.lists(scalars, min_size=1, max_size=2).flatmap(lambda xs: st.permutations([*xs, 1]))
    table = st.just({"a": 1}) if kind is not dict else st.nothing()
    return scalars | st.lists(st.integers(0, 3), max_size=2) | table


@pytest.mark.parametrize("section, name", TYPED)
@EXAMPLES
@given(data=st.data())
def test_a_config_file_value_of_the_wrong_type_is_refused_naming_key_and_flag(section, name, data, tmp):
    tp, is_list = _type(CLASSES[section], name)
    value = data.draw(_wrong_type(tp, is_list))
    message = _refusal(section, [], f"{name} = {_toml(value)}", tmp)
    assert f"[{section}] {name} = " in message and f"({_flag(name)})" in message, message


@pytest.mark.parametrize(
    "flag, value, why",
    [("--servers", "localhost", "server address"), ("--servers", "http://h:8000/x", "server address"),
     ("--transfer-args", "--hidden-states-path 'unclosed", "shell command line")],
)  # fmt: skip
def test_a_server_without_scheme_and_port_or_unsplittable_transfer_args_are_refused(flag, value, why):
    message = _refusal("train", [f"{flag}={value}"])
    assert flag in message and why in message, message
