"""A config checks itself when it is built (issue 28): built in code, by dataclasses.replace or from flags
and a file alike, a value outside its field's type, range or choices, or settings that do not go together,
end in one UserError naming the flag, with the message the command line gives. The walks below cover every
field of every config class, so a new field is tested as soon as it exists."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
from all_stages import STAGE_CONFIGS

from eagle3_pipeline.core import config
from eagle3_pipeline.core.cli import build_parser
from eagle3_pipeline.core.config import (
    add_config_flags,
    config_from_file,
    options_from_args,
    resolve_config,
)
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.config import ExtractConfig, RegenerateConfig, SplitConfig, VocabConfig
from eagle3_pipeline.export_eval.config import EvaluateConfig
from eagle3_pipeline.sizing.options import PlanOptions
from eagle3_pipeline.training.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CLASSES: dict[str, type] = {**STAGE_CONFIGS, "plan": PlanOptions}
BOUND_KEYS = ("ge", "gt", "le", "lt")
# a value each field with a free-form `check` refuses (a new such field must add one here)
BAD_CHECKED = {"loss": "nope", "servers": ["localhost"], "transfer_args": "--path 'unclosed", "head_dim": 65,
               "rope_scaling": "yarn", "variant": "seed 1"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(cls: type, name: str) -> tuple[Any, bool, bool]:
    """(inner type, is a list, is optional) of a field: `list[int] | None` -> (int, True, True)."""
    tp = typing.get_type_hints(cls)[name]
    optional = type(None) in typing.get_args(tp)
    if optional:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is list:
        return typing.get_args(tp)[0], True, optional
    return tp, False, optional


FIELDS = [(section, f) for section, cls in CLASSES.items() for f in dataclasses.fields(cls)]
IDS = [f"{section}.{f.name}" for section, f in FIELDS]


def _outside(meta: Any, tp: type) -> list[Any]:
    """Values just outside each declared bound, of the field's type (and, for a float field, nan)."""
    step = 1 if tp is int else 0.5
    values: list[Any] = []
    if "ge" in meta:
        values.append(meta["ge"] - step)
    if "gt" in meta:
        values.append(meta["gt"])
    if "le" in meta:
        values.append(meta["le"] + step)
    if "lt" in meta:
        values.append(meta["lt"])
    return [tp(v) for v in values] + ([math.nan] if tp is float else [])


def _violations(section: str, f: dataclasses.Field[Any]) -> list[Any]:
    """Values the field's metadata refuses: outside its range, outside its choices, refused by its check."""
    tp, is_list, _ = _typed(CLASSES[section], f.name)
    values = _outside(f.metadata, tp)
    if "choices" in f.metadata:
        values.append("not-a-choice")
    values = [[1, v] if is_list and tp is int else [v] if is_list else v for v in values]
    return values + ([BAD_CHECKED[f.name]] if "check" in f.metadata else [])


def _cli(section: str, argv: list[str]) -> str:
    """The message resolve_config gives for `argv` (after the stage's required flags) on the command line."""
    parser = build_parser(None, STAGE_CONFIGS["train" if section == "plan" else section])
    if section == "plan":
        add_config_flags(parser.add_argument_group("plan"), PlanOptions, with_config=False)
    required = [a for f in dataclasses.fields(STAGE_CONFIGS["train" if section == "plan" else section])
                if f.metadata.get("required") for a in (_flag(f.name), "x")]  # fmt: skip
    args = parser.parse_args([*required, *argv])
    with pytest.raises(UserError) as e:
        if section == "plan":
            options_from_args(PlanOptions, args)
        else:
            resolve_config(STAGE_CONFIGS[section], args, section)
    return str(e.value)


def _argv(values: dict[str, Any]) -> list[str]:
    """The command line that gives these settings: `--flag` for True, `--no-flag` for False, `--flag v1 v2`
    for a list."""
    out: list[str] = []
    for key, v in values.items():
        if isinstance(v, bool):
            out.append(_flag(key) if v else "--no-" + _flag(key)[2:])
        else:
            out += [_flag(key), *map(str, v if isinstance(v, list) else [v])]
    return out


# ---- every class, every field ---------------------------------------------------------------------


def test_each_class_names_its_section_and_the_defaults_construct_cleanly():
    for section, cls in CLASSES.items():
        assert cls.SECTION == section
        cfg = cls()  # required paths unset (None): resolve_config says they are missing, not the class
        assert dataclasses.replace(cfg) == cfg


def test_every_checked_field_is_walked():
    """A field that declares a range, choices or a check is refused below with a violating value: a new
    field with a free-form check must name a refused value in BAD_CHECKED."""
    checked = [(s, f) for s, f in FIELDS if any(k in f.metadata for k in (*BOUND_KEYS, "choices", "check"))]
    assert len(checked) > 60  # every stage's numbers and names
    for section, f in checked:
        assert _violations(section, f), f"{section}.{f.name}: no violating value"
    assert {f.name for _, f in FIELDS if "check" in f.metadata} == set(BAD_CHECKED)


@pytest.mark.parametrize("section, f", FIELDS, ids=IDS)
def test_a_value_outside_the_field_is_refused_when_built_and_by_replace_naming_the_flag(section, f):
    cls = CLASSES[section]
    for value in _violations(section, f):
        for build in (lambda: cls(**{f.name: value}), lambda: dataclasses.replace(cls(), **{f.name: value})):
            with pytest.raises(config.SettingError) as e:
                build()
            assert str(e.value).startswith(f"{_flag(f.name)} must ") and f", got {value!r}" in str(e.value)
            assert e.value.name == f.name


def _wrong_types(tp: type, is_list: bool, optional: bool) -> list[Any]:
    """Values not of the field's type: a string for a number, a bool or a float for an int, a number for a
    string, a scalar for a list, a list for a table; None where the field is not optional."""
    kind = typing.get_origin(tp) or tp
    scalars = {int: ["1", True, 1.5], float: ["1.0", False], str: [1, 0.5], bool: ["yes", 1], dict: [[], "x"]}
    values = [[1, "x"] if tp is int else [1], "x"] if is_list else scalars[kind]
    return values + ([] if optional else [None])


@pytest.mark.parametrize("section, f", FIELDS, ids=IDS)
def test_a_value_of_the_wrong_type_is_refused_when_built_naming_section_key_and_flag(section, f):
    cls = CLASSES[section]
    for value in _wrong_types(*_typed(cls, f.name)):
        with pytest.raises(UserError) as e:
            dataclasses.replace(cls(), **{f.name: value})
        message = str(e.value)
        assert message.startswith(f"[{section}] {f.name} = {value!r}: expected "), message
        assert message.endswith(f"({_flag(f.name)})"), message


@pytest.mark.parametrize("section, f", [(s, f) for s, f in FIELDS if _violations(s, f)],
                         ids=[i for (s, f), i in zip(FIELDS, IDS) if _violations(s, f)])  # fmt: skip
def test_code_and_command_line_give_the_same_message(section, f):
    """One owner of each message: the class refuses what the command line refuses, word for word."""
    value = _violations(section, f)[0]
    with pytest.raises(UserError) as e:
        CLASSES[section](**{f.name: value})
    argv = [_flag(f.name), *map(str, value)] if isinstance(value, list) else [f"{_flag(f.name)}={value}"]
    assert _cli(section, argv) == str(e.value)


# ---- the rules between fields ---------------------------------------------------------------------

RULES = [
    (TrainConfig, {"num_key_value_heads": 16, "num_attention_heads": 24},
     "--num-attention-heads 24 must be a multiple of --num-key-value-heads 16"),
    (TrainConfig, {"num_key_value_heads": 3}, "--num-attention-heads 64 must be a multiple of"),
    (TrainConfig, {"norm_before_fc": True, "fc_norm": True},
     "--norm-before-fc and --fc-norm are mutually exclusive"),
    (TrainConfig, {"norm_before_fc": True, "draft_arch": "mla"},
     "--draft-arch mla: vLLM's deepseek_eagle3.py has no norm_before_fc"),
    (TrainConfig, {"norm_before_fc": False, "parallel_drafting": True, "draft_arch": "mla"},
     "--draft-arch mla with --parallel-drafting: vLLM 0.32's deepseek_eagle3.py has no mask_hidden"),
    (ExtractConfig, {"serve": True}, "--serve starts a vLLM server: add --engine vllm"),
    (ExtractConfig, {"start_row": 5, "end_row": 5}, "--end-row 5 must be > --start-row 5"),
    (ExtractConfig, {"start_row": 6, "end_row": 2}, "--end-row 2 must be > --start-row 6"),
]  # fmt: skip


@pytest.mark.parametrize("cls, values, message", RULES, ids=[m.split(" (")[0] for *_, m in RULES])
def test_settings_that_do_not_go_together_are_refused_when_built_and_by_replace(cls, values, message):
    with pytest.raises(UserError) as built:
        cls(**values)
    assert str(built.value).startswith(message)
    *first, last = values.items()
    ok = cls(**dict(first))  # all but the last setting: accepted
    with pytest.raises(UserError) as replaced:
        dataclasses.replace(ok, **dict([last]))
    assert str(replaced.value) == str(built.value)
    assert _cli(cls.SECTION, _argv(values)).startswith(message)


def test_rules_accept_what_goes_together():
    TrainConfig(num_attention_heads=8, num_key_value_heads=2, head_dim=64, norm_before_fc=False, fc_norm=True)
    TrainConfig(draft_arch="mla", norm_before_fc=False, num_key_value_heads=3)  # MLA: no KV-head rule
    TrainConfig(parallel_drafting=True)
    ExtractConfig(serve=True, engine="vllm", start_row=3, end_row=4)


def test_the_draft_spec_and_the_train_config_refuse_with_one_message():
    """draft.check_spec (a spec read back from a checkpoint) and TrainConfig share the rule's owner."""
    from eagle3_pipeline.models.draft import check_spec, spec_for_training

    good = TrainConfig(num_attention_heads=4, num_key_value_heads=4, head_dim=64)
    verifier = {"hidden_size": 256, "rms_norm_eps": 1e-6, "vocab_size": 512}
    spec = spec_for_training(good, verifier, 64, (1, 2, 3))
    check_spec(spec)
    for change in ({"num_key_value_heads": 3}, {"head_dim": 63}, {"fc_norm": True}):
        with pytest.raises(UserError) as from_config:
            dataclasses.replace(good, **change)
        with pytest.raises(UserError) as from_spec:
            check_spec(dataclasses.replace(spec, **change))
        assert str(from_spec.value) == str(from_config.value)


# ---- the re-checks that went: their bad configs cannot be built ------------------------------------

# (the site that re-checked the value before, the config, the value, the message the command line gives)
RECHECKS = [
    ("extract.run engine", ExtractConfig, {"engine": "auto"}, "--engine must be one of hf, vllm"),
    ("evaluate.run engine", EvaluateConfig, {"engine": "vllm-only"}, "--engine must be one of sim"),
    ("regenerate.resolve_engine", RegenerateConfig, {"engine": "trt"}, "--engine must be one of auto"),
    ("train.build_optimizer", TrainConfig, {"lr_schedule": "step"}, "--lr-schedule must be one of cosine"),
    ("train._autocast_dtype", TrainConfig, {"dtype": "float16"}, "--dtype must be one of auto, bfloat16"),
    ("state_dtype.resolve_dtype", ExtractConfig, {"dtype": "int8"}, "--dtype must be one of auto"),
    ("state_dtype.resolve_storage_dtype", ExtractConfig, {"storage_dtype": "int4"},
     "--storage-dtype must be one of auto"),
    ("state_dtype.resolve_storage_dtype (cache)", TrainConfig, {"cache_dtype": "none"},
     "--cache-dtype must be one of bfloat16, float32, float8_e4m3fn"),
    ("kernel_policy.resolve attn_impl", TrainConfig, {"attn_impl": "flash"},
     "--attn-impl must be one of auto, flex, sdpa, eager, blockwise, got 'flash'"),
    ("kernel_policy.resolve loss_impl", TrainConfig, {"loss_impl": "triton"}, "--loss-impl must be one of"),
    ("kernel_policy.resolve compile", TrainConfig, {"compile": "maybe"}, "--compile must be one of"),
    ("kernel_policy.check_loss", TrainConfig, {"loss": "kl"}, "--loss must be one of ce, kl_div"),
    ("online._backend", TrainConfig, {"transfer": "nccl"}, "--transfer must be one of file, fp8, mooncake"),
    ("trackers.check_loggers", TrainConfig, {"loggers": ["tensorbored"]},
     "--loggers must be one of tensorboard, wandb, mlflow, trackio (each)"),
    ("split.split_samples", SplitConfig, {"val_ratio": 1.0}, "--val-ratio must be in [0, 1), got 1.0"),
    ("split.split_samples (train)", TrainConfig, {"val_ratio": -0.1}, "--val-ratio must be in [0, 1)"),
    ("schedule.warmup_steps_for", TrainConfig, {"warmup_steps": -1}, "--warmup-steps must be >= 0"),
    ("schedule.every_for", TrainConfig, {"eval_every": 0}, "--eval-every must be >= 1"),
    ("schedule.every_for (save)", TrainConfig, {"save_every": 0}, "--save-every must be >= 1"),
    ("extract.run --serve", ExtractConfig, {"serve": True, "engine": "hf"}, "--serve starts a vLLM server"),
    ("train.run check_spec", TrainConfig, {"head_dim": 3},
     "--head-dim must be even (RoPE rotates pairs), got 3"),
]  # fmt: skip


@pytest.mark.parametrize("site, cls, values, message", RECHECKS, ids=[r[0] for r in RECHECKS])
def test_a_bad_config_for_a_removed_recheck_is_refused_when_built_with_the_command_lines_message(
    site, cls, values, message
):
    with pytest.raises(UserError) as e:
        cls(**values)
    assert str(e.value).startswith(message), (site, str(e.value))
    assert _cli(cls.SECTION, _argv(values)) == str(e.value)


# ---- the file a value came from ---------------------------------------------------------------------


def test_a_bad_value_read_by_another_stage_names_the_file(tmp_path):
    """config_from_file (04_train.py --plan reading [vocab] and [extract]; the run summary) checks the
    section it reads and names the file; a value of the command line names none."""
    path = tmp_path / "run.toml"
    path.write_text("[vocab]\ndraft_vocab_size = 0\n[extract]\nserve = true\n")
    with pytest.raises(UserError) as e:
        config_from_file(VocabConfig, str(path))
    assert str(e.value) == f"--draft-vocab-size must be >= 1, got 0 (draft_vocab_size in [vocab] of {path})"
    with pytest.raises(UserError, match="--serve starts a vLLM server"):
        config_from_file(ExtractConfig, str(path))
    assert config_from_file(VocabConfig, None) == VocabConfig()


def test_stage_01_refuses_settings_that_do_not_go_together_before_writing(tmp_path):
    """The real script: exit 2, one line, no traceback, nothing written (its data and verifier are absent:
    the config is refused first)."""
    base = [sys.executable, str(ROOT / "01_extract_hidden_states.py"), "--verifier-path", "v", "--data-path",
            "d", "--out-dir", str(tmp_path / "hs")]  # fmt: skip
    cases = [(["--serve"], "--serve starts a vLLM server: add --engine vllm"),
             (["--start-row", "4", "--end-row", "2"], "--end-row 2 must be > --start-row 4")]  # fmt: skip
    procs = [(says, subprocess.Popen([*base, *flags], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)) for flags, says in cases]  # fmt: skip
    for says, proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and f"error: {says}" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())
