"""Typed stage configs, a TOML file per run, and command-line overrides.

Each stage has one dataclass; every field has a help text that becomes its `--flag` (underscores to
dashes) and declares what it accepts. Precedence: command line > config file section > field default. A
key in the file that the stage does not know is an error naming the key, so a typo never silently falls
back to a default. A config checks itself when it is built (`Settings.__post_init__`): each field's type
and range, then the rules between its fields; built from flags and a file, in code or by
`dataclasses.replace` alike, so the code that takes a config never checks it again.

Each stage's dataclass lives with the package that owns the stage (data/config.py, training/config.py,
export_eval/config.py), with the values it accepts; this module is the machinery they share and the two
sections that are no stage's: [serving] (how the draft will be served, k included) and [run] (the run's
folder, from which core/layout.py derives every stage's folders).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import operator
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eagle3_pipeline.core import layout, storage
from eagle3_pipeline.core.errors import UserError

# Seeds: train.py seeds the state noise of a micro-batch ((seed * 1_000_003 + step) * 64 + micro) * 1024
# + rank, which torch's manual_seed must hold in 64 bits: seed < 2**28 leaves room for 1e13 steps.
SEED = {"ge": 0, "lt": 2**28}
# k, the draft tokens vLLM proposes per step: its one default. `[serving] num_speculative_tokens` sets it
# for the run (SERVING_K_KEYS); the stage fields that take it default to this name, never to a number.
SERVING_K = 3
_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text, optional flag aliases (`aliases`) and what it accepts: `ge`, `gt`,
    `le`, `lt` bound a number (each item of a list), `choices` lists the strings, `check(value)` says why
    anything else is refused (None: accepted). The config enforces them when built; --help shows them."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def required(help: str, **kw: Any) -> Any:
    """A field that must come from the config file or the command line."""
    return field(default=None, metadata={"help": help, "required": True, **kw})


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _range(meta: Any) -> str | None:
    """A field's declared range in words: `>= 1`, `in (0, 1]` (None: it declares none)."""
    low = [k for k in ("ge", "gt") if k in meta]
    high = [k for k in ("le", "lt") if k in meta]
    if low and high:
        opening, closing = "[" if low[0] == "ge" else "(", "]" if high[0] == "le" else ")"
        return f"in {opening}{meta[low[0]]}, {meta[high[0]]}{closing}"
    if low or high:
        key = (low or high)[0]
        return f"{_BOUNDS[key][1]} {meta[key]}"
    return None


def accepts(meta: Any) -> str | None:
    """What a field's metadata accepts, as --help shows it: `[>= 1]`, `(0, 1]`, `{auto, on, off}`; None
    when it declares neither range nor choices."""
    if "choices" in meta:
        return "{" + ", ".join(meta["choices"]) + "}"
    words = _range(meta)
    if words is None:
        return None
    return words.removeprefix("in ") if words.startswith("in ") else f"[{words}]"


def _item_problem(meta: Any, value: Any) -> str | None:
    """Why one value is outside what the metadata accepts, as `must be ...` (None: it is inside)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if "choices" in meta and value not in meta["choices"]:
        return f"must be one of {', '.join(meta['choices'])}"
    if any(not op(value, meta[key]) for key, (op, _) in _BOUNDS.items() if key in meta):
        return f"must be {_range(meta)}"
    check = meta.get("check")
    return check(value) if check is not None else None


class SettingError(UserError):
    """A value outside its field's range or choices; `name`, the field (resolve_config names the file)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def check_value(name: str, value: Any, meta: Any) -> None:
    """Refuse a value (each item of a list) outside its field's declared range or choices, naming the flag
    (build_config adds the config file it came from)."""
    items = value if isinstance(value, list) else [value]
    problem = next((p for p in (_item_problem(meta, v) for v in items) if p), None)
    if problem is None:
        return
    each = " (each)" if isinstance(value, list) else ""
    raise SettingError(name, f"{_flag(name)} {problem}{each}, got {value!r}")


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) of a field annotation such as `int | None` or `list[int]`."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def _check_type(section: str, name: str, value: Any, tp: Any) -> None:
    ok: bool
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        ok = isinstance(value, list) and all(
            isinstance(v, item) and not isinstance(v, bool) or (item is str and isinstance(v, str))
            for v in value
        )
    elif typing.get_origin(tp) is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) for k in value)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, tp)
    if not ok:
        expected = getattr(tp, "__name__", tp)
        raise UserError(f"[{section}] {name} = {value!r}: expected {expected} ({_flag(name)})")



@functools.cache
def _typed_fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], Any, bool], ...]:
    """(field, inner type, is_optional) of each field of a config class."""
    hints = typing.get_type_hints(cls)
    return tuple((f, *_base_type(hints[f.name])) for f in dataclasses.fields(cls))


class Settings:
    """What every stage config shares: it checks itself when built (by resolve_config, in code, or by
    dataclasses.replace), the way torchtitan's typed configs do: each field's type and declared range or
    choices, then `rule_problem`, the rules between its fields. `SECTION` names its [section] (and the
    messages' `[section] key`)."""

    SECTION: ClassVar[str]

    def __post_init__(self) -> None:
        for f, tp, optional in _typed_fields(type(self)):
            value = getattr(self, f.name)
            if value is None and optional:  # unset (a required one: resolve_config says it is missing)
                continue
            _check_type(self.SECTION, f.name, value, tp)
            check_value(f.name, value, f.metadata)
        problem = self.rule_problem()
        if problem is not None:
            raise UserError(problem)

    def rule_problem(self) -> str | None:
        """Why the fields do not go together (None: they do); a config with such rules overrides it."""
        return None



def add_config_flags(parser: argparse.ArgumentParser, cls: type, with_config: bool = True) -> None:
    """One `--flag` per config field; defaults are None so unset flags don't mask the file."""
    if with_config:
        parser.add_argument("--config", help="TOML config file; this stage reads its own section.")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _base_type(hints[f.name])
        flags = [_flag(f.name), *f.metadata.get("aliases", [])]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "required" if f.metadata.get("required") else f"default: {default}"
        help_text = " ".join(filter(None, [f.metadata["help"], accepts(f.metadata), f"({shown})"]))
        if tp is bool:
            parser.add_argument(
                *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        elif typing.get_origin(tp) is list:
            item = typing.get_args(tp)[0]
            parser.add_argument(*flags, dest=f.name, nargs="+", type=item, default=None, help=help_text)
        elif typing.get_origin(tp) is dict:
            parser.add_argument(*flags, dest=f.name, type=json_object, default=None, help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=tp, default=None, help=help_text)


def json_object(text: str) -> dict[str, Any]:
    """A dict-valued flag: a JSON object such as '{"thinking": false}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"key\": value}}', got {text!r}")
    return value


@dataclass(frozen=True)
class ServedMode:
    """How requests will be served: the sampling stage 00 regenerates at and stage 06 evaluates at, the
    chat-template variables of the prompts (stages 00 and 01), the loss stage 04 trains with and vLLM's
    draft_sample_method (stage 05's serve line, stage 06)."""

    temperature: float
    top_p: float
    chat_template_kwargs: dict[str, Any]
    loss: str
    draft_sample_method: str


# `[serving] mode` in a config: Kimi-K2.5's two modes as Moonshot recommends serving them (its API fixes
# them: thinking 1.0 / top_p 0.95, instant 0.6 / 0.95, `{"thinking": false}` in the template), and greedy
# (temperature 0) for benchmarks and deterministic tests.
# The recipe per mode (benchmarks/draft_quality.py, docs/results.md "Thinking mode"): at temperature > 0
# the draft is served drawing from its distribution (vLLM's draft_sample_method "probabilistic": accepted
# with min(1, p~/q), ceiling 1 per position where argmax drafting's is p~(argmax)) and trained to match the
# verifier's distribution; greedy it proposes its argmax, trained with CE on the verifier's argmax.
SERVED_MODES = {
    "thinking": ServedMode(1.0, 0.95, {}, "kl_div", "probabilistic"),
    "instant": ServedMode(0.6, 0.95, {"thinking": False}, "kl_div", "probabilistic"),
    "greedy": ServedMode(0.0, 1.0, {}, "ce", "greedy"),
}
# Which stage keys a served mode sets (a key in the stage's own section, or on the command line, wins);
# evaluate reads the template variables from the shards it was trained on.
SERVED_MODE_KEYS = {
    "regenerate": ("temperature", "top_p", "chat_template_kwargs"),
    "extract": ("chat_template_kwargs",),
    "train": ("loss",),
    "export": ("temperature", "top_p", "draft_sample_method"),  # recorded for stage 06
    "evaluate": ("temperature", "top_p", "draft_sample_method"),
}
# [run]: the run's folder (core/layout.py) and what scripts/run_tiny.sh builds; [serving]: below
NON_STAGE_SECTIONS = ("run", "serving")
SERVING_KEYS = ("mode", "num_speculative_tokens")
# Which stage keys `[serving] num_speculative_tokens` (k) sets, the way a mode sets SERVED_MODE_KEYS (a key in
# the stage's own section, or on the command line, wins): training unrolls k steps and counts k in its
# validation acceptance length, the export's serve line and the evaluation draft k tokens per step.
SERVING_K_KEYS = {
    "train": ("ttt_steps", "served_k"),
    "export": ("num_speculative_tokens",),
    "evaluate": ("num_speculative_tokens",),
}
# The keys by which a stage's section used to restate k: refused with the new key's name rather than mapped,
# since two sections could disagree and a draft must be trained, exported and measured at the k it serves.
K_KEYS_MOVED = {
    "train": ("served_k",),
    "export": ("num_speculative_tokens",),
    "evaluate": ("num_speculative_tokens",),
}


def serving_k(serving: dict[str, Any], path: Path) -> int:
    """k of a config file's [serving] table (SERVING_K when it sets none)."""
    k = serving.get("num_speculative_tokens", SERVING_K)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"{path}: [serving] num_speculative_tokens = {k!r}: expected an integer >= 1")
    return k


def served_mode_defaults(serving: dict[str, Any], section: str, path: Path) -> dict[str, Any]:
    """The keys `[serving]` sets for `section`: k's, and its mode's (none without a mode)."""
    unknown = sorted(set(serving) - set(SERVING_KEYS))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown} in [serving]; known keys: {list(SERVING_KEYS)}")
    values: dict[str, Any] = {key: serving_k(serving, path) for key in SERVING_K_KEYS.get(section, ())}
    if "mode" not in serving:
        return values
    mode = SERVED_MODES.get(serving["mode"])
    if mode is None:
        raise UserError(f"{path}: [serving] mode = {serving['mode']!r}: choose one of {sorted(SERVED_MODES)}")
    return values | {key: dataclasses.asdict(mode)[key] for key in SERVED_MODE_KEYS.get(section, ())}


def read_config_file(path: str) -> dict[str, Any]:
    """A config file's tables, its sections and keys checked against what the pipeline knows."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    unknown_sections = set(data) - set(layout.STAGES) - set(NON_STAGE_SECTIONS)
    if unknown_sections:
        raise UserError(
            f"{p}: unknown section(s) {sorted(unknown_sections)}; known: {sorted(layout.STAGES)}, [run] and "
            "[serving]"
        )
    for section, keys in K_KEYS_MOVED.items():
        for key in keys:
            if key in data.get(section, {}):
                raise UserError(
                    f"{p}: [{section}] {key}: k is set once for the run, as [serving] num_speculative_tokens "
                    f"(training, export and evaluation read it); move it there"
                )
    return data


def load_config_file(path: str | None, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML file (empty without a file), over what its `[serving]` sets and the
    folders that follow from `[run] dir` and the earlier stages' sections (core/layout.py)."""
    if path is None:
        return {}
    data = read_config_file(path)
    serving = served_mode_defaults(data.get("serving", {}), section, Path(path))
    return {**serving, **layout.section_values(data, section, path)}


def resolve_config(cls: type, args: argparse.Namespace, section: str) -> Any:
    """Defaults < file section < command line; unknown file keys and missing required values are errors.
    The config checks its values when built (Settings); a refused value from the file names the file."""
    from_file = load_config_file(args.config, section)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(from_file) - names)
    if unknown:
        raise UserError(
            f"{args.config}: unknown key(s) {unknown} in [{section}]; known keys: {sorted(names)}"
        )
    from_cli = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    values = {**from_file, **from_cli}
    for f in dataclasses.fields(cls):
        if f.metadata.get("required") and values.get(f.name) is None:
            raise UserError(f"{_flag(f.name)} is required (or `{f.name}` in [{section}] of --config)")
    return build_config(cls, values, args.config, set(from_file) - set(from_cli))


def build_config(cls: type, values: dict[str, Any], path: str | None = None, from_file: Any = ()) -> Any:
    """`cls(**values)`; a refused value among `from_file`, the keys read from the config file `path`, is
    named with the file and its [section]."""
    try:
        return cls(**values)
    except TypeError as e:  # a key the class does not know
        raise UserError(f"{path + ' ' if path else ''}[{cls.SECTION}]: {e}") from None
    except SettingError as e:
        if path is None or e.name not in from_file:
            raise
        raise SettingError(e.name, f"{e} ({e.name} in [{cls.SECTION}] of {path})") from None


def config_from_file(cls: type, path: str | None) -> Any:
    """The config of `cls`'s section of the file `path` alone (no command line; required keys may be
    missing): what another stage of the same run is set to."""
    values = load_config_file(path, cls.SECTION)
    return build_config(cls, values, path, set(values))


def options_from_args(cls: type, args: argparse.Namespace) -> Any:
    """A command-line-only options dataclass (PlanOptions): flags given, else the field defaults."""
    names = (f.name for f in dataclasses.fields(cls))
    return cls(**{name: getattr(args, name) for name in names if getattr(args, name) is not None})


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


HOW_IT_RAN = ("overwrite", "serve", "vllm_python")  # settings of how a stage ran, not of what it wrote


def provenance(cfg: Any) -> dict[str, Any]:
    """What every stage's meta.json records of how it was made: its settings (less HOW_IT_RAN) and the
    library versions."""
    recorded = {k: v for k, v in config_to_dict(cfg).items() if k not in HOW_IT_RAN}
    return {"config": recorded, "versions": storage.versions()}