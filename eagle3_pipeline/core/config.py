"""Typed stage configs, a TOML file per run, and command-line overrides.

Each stage has one dataclass; every field has a help text that becomes its `--flag` (underscores to
dashes) and declares what it accepts. Precedence: command line > config file section > field default. A
key in the file that the stage does not know is an error naming the key, so a typo never silently falls
back to a default. A config checks itself when it is built (`Settings.__post_init__`): each field's type
and range, then the rules between its fields; built from flags and a file, in code or by
`dataclasses.replace` alike, so the code that takes a config never checks it again.
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

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.rope_scaling import setting_problem as _rope_scaling_problem
from eagle3_pipeline.core.schedule import SCHEDULES
from eagle3_pipeline.core.trackers import KNOWN_LOGGERS

# Names that modules importing torch act on, owned here so that parsing a config never imports torch;
# kernel_policy.py, state_dtype.py, acceptance.py, extract.py, train.py and the engines import them.
# "auto" first: kernel_policy.py takes ATTN_IMPLS[1:]
ATTN_IMPLS = ("auto", "flex", "sdpa", "eager", "blockwise")
LOSS_IMPLS = ("auto", "fused", "eager", "chunked")
COMPILE_MODES = ("auto", "off", "on")
FP8 = "float8_e4m3fn"  # the fp8 storage dtype (state_dtype.py)
NO_STATES = "none"  # storage dtype of token shards: ids and loss masks only, states come online (stage 04)
STORAGE_DTYPES = ("auto", "bfloat16", "float32", FP8, NO_STATES)
EXTRACT_DTYPES = ("auto", "bfloat16", "float16", "float32")  # state_dtype.resolve_dtype
TRAIN_DTYPES = ("auto", "bfloat16", "float32")  # train._autocast_dtype
# vLLM's speculative-config draft_sample_method values (vllm/config/speculative.py, DraftSampleMethod)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REGENERATE_ENGINES = ("auto", "vllm", "hf")
EXTRACT_ENGINES = ("hf", "vllm")
STATE_SOURCES = ("shards", "online")  # [train] states (online.py)
TRANSFERS = ("file", "fp8", "mooncake")  # hs_connectors 0.9's backends (transfer.py's registry)
EVALUATE_ENGINES = ("sim", "vllm", "both")
# [train] draft_arch: the draft's decoder layer. llama: speculators' Eagle3 Llama layer (vLLM
# llama_eagle3.py); mla: a DeepSeek-V3 MLA layer with a dense MLP (vLLM deepseek_eagle3.py, models/mla_draft.py)
DRAFT_ARCHS = ("llama", "mla")
# speculators 0.9.0's loss names (losses/utils.py, _EAGER_LOSS_FN_MAP and _FUSED_LOSS_FN_MAP): importing
# them costs torch and seconds; tests/test_config_checks.py pins this tuple against that file.
LOSS_NAMES = ("ce", "kl_div", "tv", "nla", "lk_hybrid", "rkl", "jsd")
# Seeds: train.py seeds the state noise of a micro-batch ((seed * 1_000_003 + step) * 64 + micro) * 1024
# + rank, which torch's manual_seed must hold in 64 bits: seed < 2**28 leaves room for 1e13 steps.
SEED = {"ge": 0, "lt": 2**28}
# The most TTT steps [train] unrolls: twice the deepest draft served here (a parallel draft's k = 8; chains
# serve 3-5). A chained step is accepted with the product of the steps' rates before it (0.8**16 = 3 %),
# while memory and time grow with every step's KV ((s+1) x the row's tokens: sizing/plan.py); --ttt-steps 50
# on the tiny model took 10 GB at 8 tok/s.
TTT_STEPS_MAX = 16
_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text, optional flag aliases (`aliases`) and what it accepts: `ge`, `gt`,
    `le`, `lt` bound a number (each item of a list), `choices` lists the strings, `check(value)` says why
    anything else is refused (None: accepted). The config enforces them when built; --help shows them."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _req(help: str, **kw: Any) -> Any:
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


def _loss_problem(spec: str) -> str | None:
    """Why `spec` is no loss to train with (None: it is one): a name of LOSS_NAMES, or a JSON object of such
    names to weights >= 0, not all 0 (speculators takes any number: a negative weight ascends its loss)."""
    if spec in LOSS_NAMES:
        return None
    names = ", ".join(LOSS_NAMES)
    try:
        weights = json.loads(spec)
    except json.JSONDecodeError:
        weights = None
    if not isinstance(weights, dict) or not weights:
        example = '{"kl_div": 0.5, "ce": 0.5}'
        return f"must be one of {names}, or a JSON object of them to weights such as '{example}'"
    unknown = sorted(set(weights) - set(LOSS_NAMES))
    if unknown:
        return f"must name losses among {names}; unknown: {', '.join(unknown)}"
    if not all(_is_weight(w) for w in weights.values()) or not any(w > 0 for w in weights.values()):
        return "must weigh each loss by a finite number >= 0, at least one > 0"
    return None


def _server_problem(url: str) -> str | None:
    """Why `url` names no vLLM server (None: it does): http(s)://HOST:PORT, an optional /v1."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path not in (
        "", "/", "/v1"
    ):
        return "must be a server address such as http://10.0.0.5:8000"
    return None


def _shell_words_problem(text: str) -> str | None:
    import shlex

    try:
        shlex.split(text)
    except ValueError as e:
        return f"must split into options like a shell command line ({e})"
    return None


def _is_weight(w: Any) -> bool:
    if isinstance(w, bool) or not isinstance(w, int | float):
        return False
    try:
        return math.isfinite(float(w)) and w >= 0  # float(): speculators converts it; 10**400 overflows
    except OverflowError:
        return False


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


def _even_problem(n: int) -> str | None:
    return "must be even (RoPE rotates pairs)" if n % 2 else None


def _draft_shape_problem(d: Any) -> str | None:
    """Why the draft's shape settings do not go together (None: they do), naming the [train] flags and the
    fix; `d`, a TrainConfig or a DraftSpec (models/draft.py), which share the names."""
    mla = d.draft_arch == "mla"
    if mla and d.norm_before_fc:
        return (
            "--draft-arch mla: vLLM's deepseek_eagle3.py has no norm_before_fc (input_norm) and would skip "
            "it; add --no-norm-before-fc (--fc-norm normalises each aux state instead)"
        )
    if mla and (d.parallel if hasattr(d, "parallel") else d.parallel_drafting):
        return (
            "--draft-arch mla with --parallel-drafting: vLLM 0.32's deepseek_eagle3.py has no mask_hidden, "
            "so it cannot serve an MLA draft in parallel; drop either"
        )
    if not mla and d.num_attention_heads % d.num_key_value_heads:
        return (
            f"--num-attention-heads {d.num_attention_heads} must be a multiple of --num-key-value-heads "
            f"{d.num_key_value_heads} (grouped-query attention shares each key/value head among whole "
            "groups); change either"
        )
    if d.norm_before_fc and d.fc_norm:
        return (
            "--norm-before-fc and --fc-norm are mutually exclusive (speculators and vLLM); add "
            "--no-norm-before-fc to use --fc-norm"
        )
    return None


def check_draft_shape(d: Any) -> None:
    """The [train] rules of a draft's shape for a DraftSpec not built from a checked TrainConfig (read back
    from a checkpoint, built in code): its shape fields as TrainConfig declares them, then the rules between
    them; the messages a TrainConfig gives."""
    meta = {f.name: f.metadata for f in dataclasses.fields(TrainConfig)}
    for name in ("num_attention_heads", "num_key_value_heads", "head_dim"):
        check_value(name, getattr(d, name), meta[name])
    problem = _draft_shape_problem(d)
    if problem is not None:
        raise UserError(problem)


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


@dataclass
class RegenerateConfig(Settings):
    SECTION: ClassVar[str] = "regenerate"
    verifier_path: str | None = _req("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = _req("Conversations to regenerate (same formats as stage 01).")
    data_split: str = _f("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = _req(
        "Output folder: conversations.jsonl (stage 01's --data-path), parts, rejects.jsonl, meta.json."
    )
    engine: str = _f(
        "auto", "vllm (tensor parallel over the visible GPUs), hf (transformers), or auto: vllm when "
        "its environment is usable, else hf.", choices=REGENERATE_ENGINES
    )  # fmt: skip
    max_new_tokens: int = _f(2048, "Most tokens generated per assistant turn (reasoning included).", ge=1)
    max_seq_len: int = _f(
        4096, "Longest prompt + completion; a turn whose prompt is longer ends the row.", ge=1
    )
    temperature: float = _f(0.0, "0: greedy (reproducible); > 0: sampling with --top-p and --seed.", ge=0)
    top_p: float = _f(1.0, "Nucleus sampling mass when --temperature > 0.", gt=0, le=1)
    seed: int = _f(0, "Sampling seed.", **SEED)
    rows_per_part: int = _f(256, "Input rows per part file (the unit of resume).", ge=1)
    chat_template_kwargs: dict[str, Any] = _f(
        {},
        "Chat-template variables for the prompts (TOML table or JSON object), as stage 01 will use: e.g. "
        "'{\"thinking\": false}' for Kimi-K2.5's instant mode.",
    )
    vllm_python: str | None = _f(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    trust_remote_code: bool = _f(False, "Allow the verifier's own code (Kimi-K2.5's tokenizer needs it).")
    overwrite: bool = _f(False, "Redo an output that is already complete.")


@dataclass
class ExtractConfig(Settings):
    SECTION: ClassVar[str] = "extract"
    verifier_path: str | None = _req("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = _req(
        "Conversations: a .jsonl/.json file (ShareGPT `conversations` or "
        "OpenAI `messages` rows) or a `datasets` dataset saved with save_to_disk."
    )
    data_split: str = _f("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = _req(
        "Root folder of the hidden-state shards; each run writes one `rows_<start>-<end>/` shard inside it."
    )
    start_row: int = _f(0, "First input row of this shard (inclusive).", ge=0)
    end_row: int | None = _f(
        None, "Row after the last one of this shard (exclusive); default: end of data.", ge=1
    )
    shard_rows: int | None = _f(
        None,
        "Split [start_row, end_row) into shards of this many rows, written one after the other by this one "
        "process: the verifier loads once instead of once per shard. Each shard is the same, byte for "
        "byte, as its own --start-row/--end-row run would write, and resumes the same way.",
        ge=1,
    )
    aux_layer_ids: list[int] | None = _f(
        None,
        "Aux layer ids in vLLM's convention (id i = Hugging Face "
        "hidden_states[i], the residual stream entering layer i); "
        "default (2, N//2, N-3), [2, 30, 58] for Kimi-K2.5.",
        ge=1,
    )
    max_seq_len: int = _f(
        4096,
        "Longest sample in tokens; a row with a longer sample is rejected (rejects.jsonl) unless --truncate.",
        ge=1,
    )
    truncate: bool = _f(
        False,
        "Cut a sample longer than max_seq_len to its first max_seq_len tokens, supervising only what fits, "
        "instead of rejecting the row (counted as num_truncated in meta.json).",
    )
    chat_template_kwargs: dict[str, Any] = _f(
        {},
        "Extra chat-template variables, a TOML table or a JSON object on the command line, e.g. "
        "'{\"thinking\": false}' for Kimi-K2.5's instant mode (default: its thinking mode); recorded in "
        "meta.json, and 06_evaluate.py builds its prompts with the same.",
    )
    samples_per_file: int = _f(64, "Input rows per safetensors part file (the unit of resume).", ge=1)
    max_batch_tokens: int = _f(
        4096,
        "Padded tokens per verifier forward (batch x longest sequence, longest first); a longer sample runs "
        "alone. On CPU 1024-4096 measured best (benchmarks/extract_batching.py); on GPUs raise it to fill memory.",
        ge=1,
    )
    dtype: str = _f(
        "auto",
        "Storage and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32.",
        choices=EXTRACT_DTYPES,
    )
    storage_dtype: str = _f(
        "auto",
        "How aux/last hidden states are stored: auto (as computed, --dtype), bfloat16, float32, or "
        "float8_e4m3fn with a float32 scale per sample and layer (half the bytes of bfloat16 per "
        "token; stages 02-05 read it dequantised), or none: no states, the samples' token ids and loss "
        "masks only (no verifier runs; ~5 bytes/token), for stage 04's online states (`[train] states = "
        "\"online\"`); stages 02 and 03 read them like any shard.",
        choices=STORAGE_DTYPES,
    )
    trust_remote_code: bool = _f(
        False,
        "Allow the verifier's own code: Kimi-K2.5's tiktoken tokenizer needs it (its model also loads "
        "natively with transformers 5.19).",
    )
    engine: str = _f(
        "hf",
        "hf: transformers in this process (device_map=auto over the visible GPUs: one GPU at a time); "
        "vllm: vLLM's extract_hidden_states method in its own environment, tensor parallel over the "
        "visible GPUs, its MLA/MoE kernels, the states its EAGLE-3 code will feed the draft. With vllm, "
        "a server started by --serve for the same out_dir is used when one runs (the verifier loaded "
        "once for a whole shard loop); otherwise the run starts its own engine.",
        choices=EXTRACT_ENGINES,
    )
    serve: bool = _f(
        False,
        "With --engine vllm: start the vLLM extraction server for this config (loopback, the config's "
        "verifier, aux layers, dtype, max_seq_len), record it in <out_dir>/vllm-server.json and keep it "
        "until Ctrl-C or SIGTERM; stage 01 runs with the same config (the shard loop) are its clients.",
    )
    vllm_python: str | None = _f(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    overwrite: bool = _f(False, "Redo a shard that is already complete.")

    def rule_problem(self) -> str | None:
        if self.end_row is not None and self.end_row <= self.start_row:
            return f"--end-row {self.end_row} must be > --start-row {self.start_row} (an empty row range)"
        if self.serve and self.engine != "vllm":
            return "--serve starts a vLLM server: add --engine vllm"
        return None


@dataclass
class VocabConfig(Settings):
    SECTION: ClassVar[str] = "vocab"
    data_dir: list[str] = _f([], "One or more hidden-state shard folders (rows_*/) or roots holding them.")
    out_dir: str | None = _req("Folder for vocab_mapping.safetensors (d2t, t2d) and meta.json.")
    draft_vocab_size: int = _f(32000, "Draft vocabulary size K: the K most frequent target tokens.", ge=1)
    overwrite: bool = _f(False, "Replace an existing complete output.")


@dataclass
class SplitConfig(Settings):
    SECTION: ClassVar[str] = "split"
    data_dir: list[str] = _f([], "One or more hidden-state shard folders (rows_*/) or roots holding them.")
    out_dir: str | None = _req("Folder for split.json (train/val sample lists) and meta.json.")
    val_ratio: float = _f(0.05, "Fraction of conversations held out for validation.", ge=0, lt=1)
    seed: int = _f(0, "Seed of the conversation-level split (same seed, same split).", **SEED)
    overwrite: bool = _f(False, "Replace an existing complete output.")


@dataclass
class TrainConfig(Settings):
    SECTION: ClassVar[str] = "train"
    verifier_path: str | None = _f(
        None,
        "Verifier checkpoint (for embed_tokens, final norm, lm_head only); "
        "default: the one recorded in the shards' meta.json.",
    )
    data_dir: list[str] = _f(
        [], "Hidden-state shard folders (rows_*/) or roots holding them; token shards with --states online."
    )
    split_dir: str | None = _f(None, "Output of 03_split_data.py; default: split here with --val-ratio.")
    vocab_mapping_dir: str | None = _req("Output of 02_build_vocab_mapping.py.")
    # online states (eagle3_pipeline/training/online.py; README "Online states")
    states: str = _f(
        "shards",
        "Where the hidden states come from: shards (stage 01 wrote them) or online (running `vllm serve` "
        "processes compute them while training; --data-dir holds token shards, stage 01 with "
        "--storage-dtype none). `04_train.py --serve-line` prints the command that starts a server.",
        choices=STATE_SOURCES,
    )
    servers: list[str] = _f(
        [],
        "With --states online: the vLLM servers, http://HOST:PORT each; requests spread over them, a "
        "failed one's go to the others.",
        check=_server_problem,
    )
    transfer: str = _f(
        "file",
        "With --states online: hs_connectors' transfer of the states from vLLM to the trainer: file (a "
        "folder both see: one node, or a shared filesystem), fp8 (file, quantised), mooncake (across "
        "nodes, no shared filesystem). vLLM's CPU build runs file only.",
        choices=TRANSFERS,
    )
    transfer_args: str = _f(
        "",
        "hs_connectors' options for the transfer, as on its command line (one string): e.g. "
        "\"--hidden-states-path /dev/shm/eagle3\" (file, fp8; default /tmp/hidden_states) or "
        "\"--mooncake-master 10.0.0.1:50051 --mooncake-protocol rdma\"; on the command line "
        "--transfer-args='--hidden-states-path /dev/shm/eagle3'.",
        check=_shell_words_problem,
    )
    requests_in_flight: int = _f(
        8, "With --states online: samples requested at once (over all servers).", ge=1
    )
    prefetch_batches: int = _f(
        4, "With --states online: micro-batches whose states are fetched ahead of the one trained.", ge=0
    )
    request_timeout: float = _f(
        600.0, "With --states online: seconds one sample may take before its server counts as failed.", gt=0
    )
    cache_dir: str | None = _f(
        None, "With --states online: keep fetched states here for later epochs (up to --cache-gb)."
    )
    cache_gb: float = _f(0.0, "With --cache-dir: the cache's budget in GB (1e9 bytes); never exceeded.", ge=0)
    cache_dtype: str = _f(
        "bfloat16",
        "With --cache-dir: how cached states are stored: bfloat16, float32, float8_e4m3fn (as stage 01).",
        choices=tuple(s for s in STORAGE_DTYPES if s not in ("auto", NO_STATES)),
    )
    out_dir: str | None = _req(
        "Training run folder: checkpoints/, train_log.jsonl, meta.json.", aliases=["--output-dir"]
    )
    epochs: int = _f(1, "Passes over the training split.", ge=1)
    max_steps: int | None = _f(
        None, "Stop after this many optimizer steps (overrides --epochs if smaller).", ge=1
    )
    lr: float = _f(1e-3, "Peak AdamW learning rate (measured: benchmarks/draft_quality.py).", gt=0)
    lr_schedule: str = _f(
        "cosine", "After warm-up: cosine, linear (to --min-lr-ratio) or constant.", choices=SCHEDULES
    )
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of --lr.", ge=0, le=1)
    warmup_ratio: float = _f(0.02, "Linear warm-up as a fraction of the run's optimizer steps.", ge=0, le=1)
    warmup_steps: int | None = _f(None, "Warm-up in optimizer steps instead of --warmup-ratio.", ge=0)
    weight_decay: float = _f(0.0, "AdamW weight decay.", ge=0)
    grad_clip: float = _f(0.5, "Clip the global gradient norm to this value.", gt=0)
    # >= 2: slot t learns token t+1 (packing.py), so a sample cut to one token trains nothing
    max_seq_len: int = _f(4096, "Longer samples train in windows of this length (length_mix.py).", ge=2)
    batch_tokens: int = _f(8192, "Tokens per micro-batch (a window alone may reach max_seq_len).", ge=1)
    batching: str = _f("shuffle", "shuffle: pack in shuffled order; mix: best fit by length (length_mix.py).",
                       choices=("shuffle", "mix"))  # fmt: skip
    grad_accum: int = _f(1, "Micro-batches per optimizer step.", ge=1)
    ttt_steps: int = _f(
        3,
        "Training-time-test steps unrolled per position (= draft tokens trained); steps past --served-k "
        "are never served (a warning with the memory they cost).",
        ge=1,
        le=TTT_STEPS_MAX,
    )
    ttt_step_loss_decay: float = _f(1.0, "Weight of step s is decay**s.", gt=0)
    # Cross-entropy on the verifier's argmax: vLLM's draft proposes its argmax (draft_sample_method "greedy",
    # the default), so a token is accepted when it is the verifier's choice (greedy) or with the verifier's
    # probability of it (sampling): both reward the draft's top-1 only (measured: docs/results.md "Draft
    # quality"). Drafted probabilistically (what `[serving] mode` thinking and instant set, with kl_div) the
    # draft's whole distribution is tested: KL there (docs/results.md "Thinking mode").
    loss: str = _f(
        "ce",
        "Loss against the verifier over the draft vocab, speculators' names: ce (the verifier's argmax "
        "as label), kl_div (speculators' default), tv, nla (-log overlap), lk_hybrid, rkl, jsd; or JSON "
        'weights such as \'{"kl_div": 0.5, "ce": 0.5}\'.',
        check=_loss_problem,
    )
    loss_temperature: float = _f(
        1.0,
        "Temperature of the two distributions the loss compares: the verifier's and the draft's logits are "
        "divided by it, as vLLM samples a request and draws a probabilistic draft at its temperature "
        "(1: speculators' plain logits; greedy serving ignores it).",
        gt=0,
    )
    loss_top_p: float = _f(
        1.0,
        "Top-p of the verifier's distribution the loss matches: the tokens vLLM's sampler drops at this "
        "top-p get target 0, the rest renormalised, the served distribution (1: the whole distribution).",
        gt=0,
        le=1,
    )
    state_noise: float = _f(
        0.0,
        "Training-only Gaussian noise on the aux states, as a fraction of each token's RMS (0: none).",
        ge=0,
    )
    val_ratio: float = _f(0.05, "Validation fraction when no --split-dir is given.", ge=0, lt=1)
    num_workers: int = _f(0, "DataLoader worker processes (0: load in the training process).", ge=0)
    dist_timeout_s: float = _f(1800.0, "Under torchrun: seconds a rank waits for the others at a collective "
                               "(longer than a checkpoint save); a dead rank is seen at once.", gt=0)
    sequence_parallel: int = _f(1, "Under torchrun: ranks that train one packed row together, each a slice "
                                "of its positions (rows longer than one GPU holds; needs blockwise and "
                                "chunked; training/sequence_parallel.py).", ge=1)
    seed: int = _f(0, "Seed for initialisation, data order and split.", **SEED)
    dtype: str = _f(
        "auto", "auto (bfloat16 autocast on CUDA, float32 on CPU), bfloat16, float32.", choices=TRAIN_DTYPES
    )
    attn_impl: str = _f(
        "auto",
        "Draft attention: auto (flex on CUDA, sdpa on CPU), flex (speculators' block-sparse "
        "simple_flex_attention; no backward on CPU), sdpa (dense mask), eager (dense mask, scores kept), "
        "blockwise (query chunks, no mask: memory linear in the row's length; models/linear_memory.py).",
        choices=ATTN_IMPLS,
    )
    loss_impl: str = _f(
        "auto",
        "Loss kernels: auto (fused where CUDA and Triton are present, else eager), fused, eager, chunked "
        "(head and loss per chunk of positions, recomputed in backward: no [tokens, draft vocab] kept).",
        choices=LOSS_IMPLS,
    )
    compile: str = _f(
        "auto",
        "torch.compile of the draft forward: auto (on on CUDA, off on CPU), on (rows padded to 4 length "
        "buckets: a few static shapes), off. See eagle3_pipeline/training/kernel_policy.py.",
        choices=COMPILE_MODES,
    )
    draft_arch: str = _f(
        "llama",
        "Draft decoder layer: llama (GQA, the head_dim / num_key_value_heads below) or mla (DeepSeek-V3 "
        "multi-head latent attention as vLLM's deepseek_eagle3.py serves it: one latent of kv_lora_rank + "
        "qk_rope_head_dim cached per token; the mla_* dims below, default the verifier's).",
        choices=DRAFT_ARCHS,
    )
    mla_q_lora_rank: int | None = _f(
        None, "MLA draft query LoRA rank (0: a plain q_proj); default: the verifier's q_lora_rank.", ge=0
    )
    mla_kv_lora_rank: int | None = _f(
        None, "MLA draft latent width (cached per token); default: the verifier's kv_lora_rank.", ge=1
    )
    mla_qk_nope_head_dim: int | None = _f(
        None, "MLA draft per-head query/key width without RoPE; default: the verifier's.", ge=1
    )
    mla_qk_rope_head_dim: int | None = _f(
        None, "MLA draft per-head RoPE width (shared key, cached); default: the verifier's.", ge=2
    )
    mla_v_head_dim: int | None = _f(None, "MLA draft per-head value width; default: the verifier's.", ge=1)
    num_attention_heads: int = _f(64, "Draft attention heads (llama and mla).", ge=1)
    num_key_value_heads: int = _f(64, "Draft key/value heads.", ge=1)
    head_dim: int = _f(
        128,
        "Draft head dim, even, written explicitly to config.json (never hidden/heads).",
        ge=2,
        check=_even_problem,
    )
    intermediate_size: int = _f(18432, "Draft MLP width.", ge=1)
    rope_theta: float = _f(1e6, "Draft RoPE theta, both archs (independent of the verifier's).", gt=0)
    rope_scaling: str = _f(
        "none",
        "Draft RoPE scaling, trained with and exported for vLLM: none (plain RoPE), verifier (the verifier's "
        "own, e.g. Kimi-K2.5's yarn factor 64 over 4096 positions) or a JSON yarn table such as "
        '\'{"rope_type": "yarn", "factor": 64, "original_max_position_embeddings": 4096}\' (optional '
        "beta_fast, beta_slow, mscale with mscale_all_dim).",
        check=_rope_scaling_problem,
    )
    max_position_embeddings: int = _f(131072, "Draft max positions written to config.json.", ge=1)
    # The EAGLE-3.1 norms, all three on as in speculators (measured: docs/results.md "Ablations from the
    # plain EAGLE-3 recipe"); vLLM >= 0.32 reads them (older: ignored).
    norm_before_residual: bool = _f(True, "EAGLE-3 residual = hidden_norm(g) instead of g.")
    norm_before_fc: bool = _f(True, "RMSNorm over the concatenated aux states before fc (weight input_norm).")
    fc_norm: bool = _f(False, "RMSNorm over each aux state before fc (excludes --norm-before-fc).")
    norm_output: bool = _f(True, "Feed the normed output back to the next draft step.")
    loss_on_all_tokens: bool = _f(
        False, "Supervise every position against the verifier, prompts too (default: generated tokens only)."
    )
    served_k: int = _f(
        3, "Draft tokens vLLM will serve with: validation acceptance_length counts these steps.", ge=1
    )
    # Parallel drafting (P-EAGLE): vLLM 0.32 `"parallel_drafting": true` fills the k drafts of a step in one
    # forward, slots 2..k holding a mask token and the learned mask_hidden (training/parallel.py).
    parallel_drafting: bool = _f(
        False,
        "Train a parallel (P-EAGLE) draft: one forward proposes all k drafts of a step (mask token + learned "
        "mask_hidden in the k-1 extra slots), served with \"parallel_drafting\": true; --ttt-steps unused.",
    )
    parallel_k: int = _f(
        8, "With --parallel-drafting: the depths trained, the most draft tokens it serves with.", ge=1
    )
    cod_ratio: float = _f(
        0.7,
        "With --parallel-drafting: P-EAGLE's COD sub-sampling, depth d trains max(ratio**d, --cod-ratio-min) "
        "of the positions (1: all).",
        gt=0,
        le=1,
    )
    cod_ratio_min: float = _f(0.2, "With --parallel-drafting: floor of the COD fraction per depth.", gt=0, le=1)
    mask_token_id: int | None = _f(
        None,
        "With --parallel-drafting: the token id of the masked slots (vLLM's mask_token_id); its embedding is "
        "the verifier's. Default: the verifier's last id (vocab_size - 1).",
        ge=0,
    )
    train_lm_head: bool = _f(
        True, "Train the draft lm_head, initialised from the verifier's rows (--no-train-lm-head: frozen)."
    )
    log_every: int = _f(10, "Optimizer steps between log lines.", ge=1)
    loggers: list[str] = _f(
        [],
        "Experiment trackers, several allowed (`--logger tensorboard wandb`): tensorboard "
        "(<out_dir>/tensorboard), wandb (offline unless WANDB_MODE=online), mlflow (<out_dir>/mlruns "
        "unless MLFLOW_TRACKING_URI), trackio; rank 0 only, x axis the global step (trackers.py).",
        aliases=["--logger"],
        choices=tuple(KNOWN_LOGGERS),
    )
    eval_every: int | None = _f(
        None, "Optimizer steps between validations (and at the end); default: a tenth of the run.", ge=1
    )
    save_every: int | None = _f(
        None, "Optimizer steps between checkpoints (and at each validation); default: --eval-every.", ge=1
    )
    keep_last: int = _f(3, "Complete checkpoints kept besides the best one.", ge=1)
    val_max_samples: int | None = _f(None, "Cap on validation samples per evaluation.", ge=1)
    overwrite: bool = _f(False, "Start over even if --out-dir has checkpoints (default: resume).")

    def rule_problem(self) -> str | None:
        return _draft_shape_problem(self)


@dataclass
class ExportConfig(Settings):
    SECTION: ClassVar[str] = "export"
    train_dir: str | None = _req("Training run folder (the --out-dir of 04_train.py).")
    checkpoint: str = _f(
        "best",
        "best, latest, a checkpoint folder name such as step_000400, or init (the "
        "untrained draft as training initialised it: a baseline).",
    )
    out_dir: str | None = _req("Export folder: config.json + model.safetensors for vLLM.")
    gate_samples: int = _f(
        4, "Stored samples on which the read-back export must reproduce the trained draft's logits.", ge=1
    )
    num_speculative_tokens: int = _f(3, "k in the printed vllm serve line.", ge=1)
    draft_sample_method: str = _f(
        "greedy",
        "draft_sample_method in the printed vllm serve line (06_evaluate.py --draft-sample-method says what "
        "each does; a [serving] mode sets the one measured best for it). Recorded in export_meta.json: "
        "06_evaluate.py evaluates the export drafting so unless told otherwise.",
        choices=DRAFT_SAMPLE_METHODS,
    )
    temperature: float | None = _f(
        None,
        "Sampling temperature the requests will be served at (a [serving] mode sets it), recorded in "
        "export_meta.json for 06_evaluate.py (None: not recorded; stage 06 then evaluates greedy).",
        ge=0,
    )
    top_p: float | None = _f(
        None, "Nucleus mass the requests will be served at, recorded with --temperature.", gt=0, le=1
    )
    serve_tensor_parallel_size: int = _f(
        0,
        "--tensor-parallel-size in the printed vllm serve line; 0: the GPUs visible here (at least 1).",
        ge=0,
    )
    overwrite: bool = _f(False, "Replace an existing good export (only after the new one passes the gate).")


@dataclass
class EvaluateConfig(Settings):
    SECTION: ClassVar[str] = "evaluate"
    verifier_path: str | None = _f(None, "Verifier checkpoint; default: the one recorded by the export.")
    draft_dir: str | None = _req("An export folder from 05_export.py.")
    data_path: str | None = _req(
        "Conversations (same formats as stage 01); each prompt is a "
        "conversation up to its first assistant turn."
    )
    start_row: int = _f(0, "First row used for prompts.", ge=0)
    num_prompts: int = _f(8, "Prompts evaluated.", ge=1)
    max_new_tokens: int = _f(64, "Tokens generated per prompt.", ge=1)
    num_speculative_tokens: int = _f(3, "k draft tokens per step.", ge=1)
    temperature: float | None = _f(
        None,
        "Sampling temperature of the requests (default: the export's recorded one, else 0): 0 greedy; "
        "Kimi-K2.5 serves thinking mode at 1.0 (top_p 0.95) and instant mode at 0.6 (top_p 0.95). Drafting "
        "by argmax, the verifier accepts a draft with its probability of it; see --draft-sample-method. The "
        "simulation reports the expected acceptance exactly.",
        ge=0,
    )
    top_p: float | None = _f(
        None,
        "Nucleus mass of the requests when --temperature > 0 (Kimi-K2.5: 0.95; default: the export's "
        "recorded one, else 1).",
        gt=0,
        le=1,
    )
    top_k: int = _f(0, "Top-k of the requests when --temperature > 0 (0: off).", ge=0)
    seed: int = _f(
        0, "Sampling seed: request i is seeded seed + i, in the simulation and in vLLM alike.", **SEED
    )
    draft_sample_method: str | None = _f(
        None,
        "Default: the one the export records it will be served with (export_meta.json), else greedy. "
        "vLLM's speculative-config draft_sample_method: greedy (the draft proposes its argmax; vLLM's "
        "default) or probabilistic (drawn from the draft at the request's temperature, no top-p, and "
        "accepted with probability min(1, p/q)). The simulation follows either; pass the same to vllm serve "
        "(05_export.py prints it). A [serving] mode sets the one measured best for it.",
        choices=DRAFT_SAMPLE_METHODS,
    )
    samples_per_prompt: int = _f(
        1, "Requests per prompt (sampling: independent draws, seeds in sequence; more = less noise).", ge=1
    )
    engine: str = _f(
        "sim",
        "sim (this project's PyTorch simulation of vLLM's EAGLE-3 chain), vllm, or both (compared; exit 1 "
        "when they disagree).",
        choices=EVALUATE_ENGINES,
    )
    vllm_python: str | None = _f(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    out_dir: str | None = _f(None, "Where to write acceptance.json (default: the draft folder).")
    trust_remote_code: bool = _f(
        False, "Allow the verifier's own code (Kimi-K2.5's tiktoken tokenizer needs it)."
    )
    chat_template_kwargs: dict[str, Any] | None = _f(
        None,
        "Chat-template variables for the prompts (JSON object, e.g. '{\"thinking\": false}'); default: the "
        "ones the training shards were extracted with (export -> training run -> shards' meta.json).",
    )


@dataclass
class PlanOptions(Settings):
    """`--plan` on stages 01 and 04 (plan.py): command-line only, never part of a run's recorded config."""

    SECTION: ClassVar[str] = "plan"

    plan: bool = _f(
        False,
        "Print what the run will need (aux ids, draft shapes and parameters, disk per storage dtype, memory "
        "per GPU, steps, time) from the verifier's config.json and a sample of the data; run nothing.",
    )
    plan_gpus: int = _f(
        8,
        "GPUs the plan assumes for DDP (steps per epoch; DDP gradient buckets), and the tensor-parallel size "
        "of serving for the KV-cache lines unless [export] serve_tensor_parallel_size is set.",
        ge=1,
    )
    plan_rows: int | None = _f(
        None, "Input rows of the whole dataset (default: counted in --data-path).", ge=1
    )
    plan_tokens_per_row: float | None = _f(
        None,
        "Tokens per row when neither shards nor data and tokenizer are at hand (default: measured).",
        gt=0,
    )
    plan_sample_rows: int = _f(256, "Rows tokenized to measure tokens per row.", ge=1)
    plan_tokens_per_second: float | None = _f(
        None, "Training throughput of the whole run (a log line's tok/s) for the time estimate.", gt=0
    )
    plan_json: str | None = _f(None, "Also write the plan as JSON to this file.")
    plan_al: float | None = _f(
        None,
        "Acceptance length (06_evaluate's, at the k of [export] num_speculative_tokens) for the expected "
        "speedup and output tokens/s lines of the serving cost model (sizing/speedup.py); without it they "
        "show the break-even AL.",
        ge=1,
    )
    plan_context: int = _f(2048, "Tokens of context per request for the serving cost model.", ge=1)


STAGE_CONFIGS = {
    cls.SECTION: cls
    for cls in (
        RegenerateConfig, ExtractConfig, VocabConfig, SplitConfig, TrainConfig, ExportConfig, EvaluateConfig
    )
}


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
NON_STAGE_SECTIONS = ("run", "serving")  # [run]: what scripts/run_tiny.sh builds; [serving]: SERVED_MODES


def served_mode_defaults(serving: dict[str, Any], section: str, path: Path) -> dict[str, Any]:
    """The keys `[serving]` sets for `section` (empty without a [serving] table)."""
    if not serving:
        return {}
    unknown = sorted(set(serving) - {"mode"})
    if unknown:
        raise UserError(f"{path}: unknown key(s) {unknown} in [serving]; known keys: ['mode']")
    mode = SERVED_MODES.get(serving.get("mode"))  # type: ignore[arg-type]
    if mode is None:
        raise UserError(
            f"{path}: [serving] mode = {serving.get('mode')!r}: choose one of {sorted(SERVED_MODES)}"
        )
    return {key: dataclasses.asdict(mode)[key] for key in SERVED_MODE_KEYS.get(section, ())}


def load_config_file(path: str | None, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML file (empty without a file), over what its `[serving]` mode sets."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    unknown_sections = set(data) - set(STAGE_CONFIGS) - set(NON_STAGE_SECTIONS)
    if unknown_sections:
        raise UserError(
            f"{p}: unknown section(s) {sorted(unknown_sections)}; known: {sorted(STAGE_CONFIGS)}, [run] and "
            "[serving]"
        )
    return {**served_mode_defaults(data.get("serving", {}), section, p), **data.get(section, {})}


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
