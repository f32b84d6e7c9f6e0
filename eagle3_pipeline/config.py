"""Typed stage configs, a TOML file per run, and command-line overrides.

Each stage has one dataclass; every field has a help text that becomes its `--flag` (underscores to
dashes). Precedence: command line > config file section > field default. A key in the file that the
stage does not know is an error naming the key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UserError


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its help text (and optional flag aliases)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _req(help: str, **kw: Any) -> Any:
    """A field that must come from the config file or the command line."""
    return field(default=None, metadata={"help": help, "required": True, **kw})


@dataclass
class RegenerateConfig:
    verifier_path: str | None = _req("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = _req("Conversations to regenerate (same formats as stage 01).")
    data_split: str = _f("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = _req(
        "Output folder: conversations.jsonl (stage 01's --data-path), parts, rejects.jsonl, meta.json."
    )
    engine: str = _f(
        "auto", "vllm (tensor parallel over the visible GPUs), hf (transformers), or auto: vllm when "
        "its environment is usable, else hf."
    )  # fmt: skip
    max_new_tokens: int = _f(2048, "Most tokens generated per assistant turn (reasoning included).")
    max_seq_len: int = _f(4096, "Longest prompt + completion; a turn whose prompt is longer ends the row.")
    temperature: float = _f(0.0, "0: greedy (reproducible); > 0: sampling with --top-p and --seed.")
    top_p: float = _f(1.0, "Nucleus sampling mass when --temperature > 0.")
    seed: int = _f(0, "Sampling seed.")
    rows_per_part: int = _f(256, "Input rows per part file (the unit of resume).")
    chat_template_kwargs: dict[str, Any] = _f(
        {},
        "Chat-template variables for the prompts (TOML table or JSON object), as stage 01 will use: e.g. "
        "'{\"thinking\": false}' for Kimi-K2.5's instant mode.",
    )
    vllm_python: str | None = _f(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    trust_remote_code: bool = _f(False, "Allow the verifier's own code (Kimi-K2.5's tokenizer needs it).")
    overwrite: bool = _f(False, "Redo an output that is already complete.")


@dataclass
class ExtractConfig:
    verifier_path: str | None = _req("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = _req(
        "Conversations: a .jsonl/.json file (ShareGPT `conversations` or "
        "OpenAI `messages` rows) or a `datasets` dataset saved with save_to_disk."
    )
    data_split: str = _f("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = _req(
        "Root folder of the hidden-state shards; each run writes one `rows_<start>-<end>/` shard inside it."
    )
    start_row: int = _f(0, "First input row of this shard (inclusive).")
    end_row: int | None = _f(None, "Row after the last one of this shard (exclusive); default: end of data.")
    shard_rows: int | None = _f(
        None,
        "Split [start_row, end_row) into shards of this many rows, written one after the other by this one "
        "process: the verifier loads once instead of once per shard. Each shard is the same, byte for "
        "byte, as its own --start-row/--end-row run would write, and resumes the same way.",
    )
    aux_layer_ids: list[int] | None = _f(
        None,
        "Aux layer ids in vLLM's convention (id i = Hugging Face "
        "hidden_states[i], the residual stream entering layer i); "
        "default (2, N//2, N-3), [2, 30, 58] for Kimi-K2.5.",
    )
    max_seq_len: int = _f(
        4096,
        "Longest sample in tokens; a row with a longer sample is rejected (rejects.jsonl) unless --truncate.",
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
    samples_per_file: int = _f(64, "Input rows per safetensors part file (the unit of resume).")
    max_batch_tokens: int = _f(
        4096,
        "Padded tokens per verifier forward (batch x longest sequence, longest first); a longer sample runs "
        "alone. On CPU 1024-4096 measured best (benchmarks/extract_batching.py); on GPUs raise it to fill memory.",
    )
    dtype: str = _f(
        "auto", "Storage and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32."
    )
    storage_dtype: str = _f(
        "auto",
        "How aux/last hidden states are stored: auto (as computed, --dtype), bfloat16, float32, or "
        "float8_e4m3fn with a float32 scale per sample and layer (half the bytes of bfloat16 per "
        "token; stages 02-05 read it dequantised).",
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
    )
    serve: bool = _f(
        False,
        "With --engine vllm: start the vLLM extraction server for this config (loopback, the config's "
        "verifier, aux layers, dtype, max_seq_len), record it in <out_dir>/vllm-server.json and keep it "
        "until Ctrl-C or SIGTERM; stage 01 runs with the same config (the shard loop) are its clients.",
    )
    vllm_python: str | None = _f(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    overwrite: bool = _f(False, "Redo a shard that is already complete.")


@dataclass
class VocabConfig:
    data_dir: list[str] = _f([], "One or more hidden-state shard folders (rows_*/) or roots holding them.")
    out_dir: str | None = _req("Folder for vocab_mapping.safetensors (d2t, t2d) and meta.json.")
    draft_vocab_size: int = _f(32000, "Draft vocabulary size K: the K most frequent target tokens.")
    overwrite: bool = _f(False, "Replace an existing complete output.")


@dataclass
class SplitConfig:
    data_dir: list[str] = _f([], "One or more hidden-state shard folders (rows_*/) or roots holding them.")
    out_dir: str | None = _req("Folder for split.json (train/val sample lists) and meta.json.")
    val_ratio: float = _f(0.05, "Fraction of conversations held out for validation.")
    seed: int = _f(0, "Seed of the conversation-level split (same seed, same split).")
    overwrite: bool = _f(False, "Replace an existing complete output.")


@dataclass
class TrainConfig:
    verifier_path: str | None = _f(
        None,
        "Verifier checkpoint (for embed_tokens, final norm, lm_head only); "
        "default: the one recorded in the shards' meta.json.",
    )
    data_dir: list[str] = _f([], "Hidden-state shard folders (rows_*/) or roots holding them.")
    split_dir: str | None = _f(None, "Output of 03_split_data.py; default: split here with --val-ratio.")
    vocab_mapping_dir: str | None = _req("Output of 02_build_vocab_mapping.py.")
    out_dir: str | None = _req(
        "Training run folder: checkpoints/, train_log.jsonl, meta.json.", aliases=["--output-dir"]
    )
    epochs: int = _f(1, "Passes over the training split.")
    max_steps: int | None = _f(None, "Stop after this many optimizer steps (overrides --epochs if smaller).")
    lr: float = _f(1e-3, "Peak AdamW learning rate (measured: benchmarks/draft_quality.py).")
    lr_schedule: str = _f("cosine", "After warm-up: cosine, linear (to --min-lr-ratio) or constant.")
    min_lr_ratio: float = _f(0.1, "Final learning rate as a fraction of --lr.")
    warmup_ratio: float = _f(0.02, "Linear warm-up as a fraction of the run's optimizer steps.")
    warmup_steps: int | None = _f(None, "Warm-up in optimizer steps instead of --warmup-ratio.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    grad_clip: float = _f(0.5, "Clip the global gradient norm to this value.")
    max_seq_len: int = _f(4096, "Longer samples are truncated (the prefix is still valid training data).")
    batch_tokens: int = _f(8192, "Tokens packed into one micro-batch (samples are never split).")
    grad_accum: int = _f(1, "Micro-batches per optimizer step.")
    ttt_steps: int = _f(3, "Training-time-test steps unrolled per position (= draft tokens trained).")
    ttt_step_loss_decay: float = _f(1.0, "Weight of step s is decay**s.")
    # Cross-entropy on the verifier's argmax: vLLM's draft proposes its argmax (draft_sample_method "greedy",
    # the default), so a token is accepted when it is the verifier's choice (greedy) or with the verifier's
    # probability of it (sampling): both reward the draft's top-1 only. Measured +11% AL over KL
    # (README "Draft quality"); with vLLM's draft_sample_method "probabilistic" use kl_div or lk_hybrid.
    loss: str = _f(
        "ce",
        "Loss against the verifier over the draft vocab, speculators' names: ce (the verifier's argmax "
        "as label), kl_div (speculators' default), tv, nla (-log overlap), lk_hybrid, rkl, jsd; or JSON "
        'weights such as \'{"kl_div": 0.5, "ce": 0.5}\'.',
    )
    state_noise: float = _f(
        0.0, "Training-only Gaussian noise on the aux states, as a fraction of each token's RMS (0: none)."
    )
    val_ratio: float = _f(0.05, "Validation fraction when no --split-dir is given.")
    num_workers: int = _f(0, "DataLoader worker processes (0: load in the training process).")
    seed: int = _f(0, "Seed for initialisation, data order and split.")
    dtype: str = _f("auto", "auto (bfloat16 autocast on CUDA, float32 on CPU), bfloat16, float32.")
    attn_impl: str = _f(
        "auto",
        "Draft attention: auto (flex on CUDA, sdpa on CPU), flex (speculators' block-sparse "
        "simple_flex_attention; no backward on CPU), sdpa (dense mask), eager (dense mask, scores kept).",
    )
    loss_impl: str = _f(
        "auto", "Loss kernels: auto (fused where CUDA and Triton are present, else eager), fused, eager."
    )
    compile: str = _f(
        "auto",
        "torch.compile of the draft forward: auto (on on CUDA, off on CPU), on (rows padded to 4 length "
        "buckets: a few static shapes), off. See eagle3_pipeline/kernel_policy.py.",
    )
    num_attention_heads: int = _f(64, "Draft attention heads.")
    num_key_value_heads: int = _f(64, "Draft key/value heads.")
    head_dim: int = _f(128, "Draft head dim, written explicitly to config.json (never hidden/heads).")
    intermediate_size: int = _f(18432, "Draft MLP width.")
    rope_theta: float = _f(1e6, "Draft RoPE theta (independent of the verifier's MLA RoPE).")
    max_position_embeddings: int = _f(131072, "Draft max positions written to config.json.")
    # The EAGLE-3.1 norms, all three on as in speculators (+15.6% simulated acceptance over the plain layout
    # on the draft-quality benchmark, README "Draft quality"); vLLM >= 0.32 reads them (older: ignored).
    norm_before_residual: bool = _f(True, "EAGLE-3 residual = hidden_norm(g) instead of g.")
    norm_before_fc: bool = _f(True, "RMSNorm over the concatenated aux states before fc (weight input_norm).")
    fc_norm: bool = _f(False, "RMSNorm over each aux state before fc (excludes --norm-before-fc).")
    norm_output: bool = _f(True, "Feed the normed output back to the next draft step.")
    loss_on_all_tokens: bool = _f(
        False, "Supervise every position against the verifier, prompts too (default: generated tokens only)."
    )
    served_k: int = _f(
        3, "Draft tokens vLLM will serve with: validation acceptance_length counts these steps."
    )
    train_lm_head: bool = _f(
        True, "Train the draft lm_head, initialised from the verifier's rows (--no-train-lm-head: frozen)."
    )
    log_every: int = _f(10, "Optimizer steps between log lines.")
    loggers: list[str] = _f(
        [],
        "Experiment trackers, several allowed (`--logger tensorboard wandb`): tensorboard "
        "(<out_dir>/tensorboard), wandb (offline unless WANDB_MODE=online), mlflow (<out_dir>/mlruns "
        "unless MLFLOW_TRACKING_URI), trackio; rank 0 only, x axis the global step (trackers.py).",
        aliases=["--logger"],
    )
    eval_every: int | None = _f(
        None, "Optimizer steps between validations (and at the end); default: a tenth of the run."
    )
    save_every: int | None = _f(
        None, "Optimizer steps between checkpoints (and at each validation); default: --eval-every."
    )
    keep_last: int = _f(3, "Complete checkpoints kept besides the best one.")
    val_max_samples: int | None = _f(None, "Cap on validation samples per evaluation.")
    overwrite: bool = _f(False, "Start over even if --out-dir has checkpoints (default: resume).")


@dataclass
class ExportConfig:
    train_dir: str | None = _req("Training run folder (the --out-dir of 04_train.py).")
    checkpoint: str = _f(
        "best",
        "best, latest, a checkpoint folder name such as step_000400, or init (the "
        "untrained draft as training initialised it: a baseline).",
    )
    out_dir: str | None = _req("Export folder: config.json + model.safetensors for vLLM.")
    gate_samples: int = _f(
        4, "Stored samples on which the read-back export must reproduce the trained draft's logits."
    )
    num_speculative_tokens: int = _f(3, "k in the printed vllm serve line.")
    serve_tensor_parallel_size: int = _f(
        0, "--tensor-parallel-size in the printed vllm serve line; 0: the GPUs visible here (at least 1)."
    )
    overwrite: bool = _f(False, "Replace an existing good export (only after the new one passes the gate).")


@dataclass
class EvaluateConfig:
    verifier_path: str | None = _f(None, "Verifier checkpoint; default: the one recorded by the export.")
    draft_dir: str | None = _req("An export folder from 05_export.py.")
    data_path: str | None = _req(
        "Conversations (same formats as stage 01); each prompt is a "
        "conversation up to its first assistant turn."
    )
    start_row: int = _f(0, "First row used for prompts.")
    num_prompts: int = _f(8, "Prompts evaluated.")
    max_new_tokens: int = _f(64, "Tokens generated per prompt.")
    num_speculative_tokens: int = _f(3, "k draft tokens per step.")
    temperature: float = _f(
        0.0,
        "Sampling temperature of the requests: 0 greedy; Kimi-K2.5 serves thinking mode at 1.0 (top_p 0.95) "
        "and instant mode at 0.6 (top_p 0.95). vLLM's draft still proposes its argmax; the verifier accepts "
        "it with its probability of it. The simulation reports the expected acceptance exactly.",
    )
    top_p: float = _f(1.0, "Nucleus mass of the requests when --temperature > 0 (Kimi-K2.5: 0.95).")
    top_k: int = _f(0, "Top-k of the requests when --temperature > 0 (0: off).")
    seed: int = _f(0, "Sampling seed: request i is seeded seed + i, in the simulation and in vLLM alike.")
    draft_sample_method: str = _f(
        "greedy",
        "vLLM's speculative-config draft_sample_method: greedy (the draft proposes its argmax; vLLM's default) "
        "or probabilistic (drawn from the draft at the request's temperature, no top-p, and accepted with "
        "probability min(1, p/q)). The simulation follows either; pass the same to vllm serve.",
    )
    samples_per_prompt: int = _f(
        1, "Requests per prompt (sampling: independent draws, seeds in sequence; more = less noise)."
    )
    engine: str = _f("sim", "sim (this project's PyTorch simulation of vLLM's EAGLE-3 chain) or vllm.")
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
class PlanOptions:
    """`--plan` on stages 01 and 04 (plan.py): command-line only, never part of a run's recorded config."""

    plan: bool = _f(
        False,
        "Print what the run will need (aux ids, draft shapes and parameters, disk per storage dtype, memory "
        "per GPU, steps, time) from the verifier's config.json and a sample of the data; run nothing.",
    )
    plan_gpus: int = _f(
        8,
        "GPUs the plan assumes for DDP (steps per epoch; DDP gradient buckets), and the tensor-parallel size "
        "of serving for the KV-cache lines unless [export] serve_tensor_parallel_size is set.",
    )
    plan_rows: int | None = _f(None, "Input rows of the whole dataset (default: counted in --data-path).")
    plan_tokens_per_row: float | None = _f(
        None, "Tokens per row when neither shards nor data and tokenizer are at hand (default: measured)."
    )
    plan_sample_rows: int = _f(256, "Rows tokenized to measure tokens per row.")
    plan_tokens_per_second: float | None = _f(
        None, "Training throughput of the whole run (a log line's tok/s) for the time estimate."
    )
    plan_json: str | None = _f(None, "Also write the plan as JSON to this file.")


STAGE_CONFIGS = {
    "regenerate": RegenerateConfig,
    "extract": ExtractConfig,
    "vocab": VocabConfig,
    "split": SplitConfig,
    "train": TrainConfig,
    "export": ExportConfig,
    "evaluate": EvaluateConfig,
}


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(inner type, is_optional) of a field annotation such as `int | None` or `list[int]`."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return inner[0], True
    return tp, False


def add_config_flags(parser: argparse.ArgumentParser, cls: type, with_config: bool = True) -> None:
    """One `--flag` per config field; defaults are None so unset flags don't mask the file."""
    if with_config:
        parser.add_argument("--config", help="TOML config file; this stage reads its own section.")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _base_type(hints[f.name])
        flags = ["--" + f.name.replace("_", "-"), *f.metadata.get("aliases", [])]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "required" if f.metadata.get("required") else f"default: {default}"
        help_text = f"{f.metadata['help']} ({shown})"
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


def load_config_file(path: str | None, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML file (empty without a file)."""
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: config file not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    unknown_sections = set(data) - set(STAGE_CONFIGS) - {"run"}
    if unknown_sections:
        raise UserError(
            f"{p}: unknown section(s) {sorted(unknown_sections)}; known: {sorted(STAGE_CONFIGS)} and [run]"
        )
    return dict(data.get(section, {}))


def resolve_config(cls: type, args: argparse.Namespace, section: str) -> Any:
    """Defaults < file section < command line; unknown file keys and missing required values are errors."""
    from_file = load_config_file(args.config, section)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(from_file) - names)
    if unknown:
        raise UserError(
            f"{args.config}: unknown key(s) {unknown} in [{section}]; known keys: {sorted(names)}"
        )
    values = dict(from_file)
    for name in names:
        cli_value = getattr(args, name, None)
        if cli_value is not None:
            values[name] = cli_value
    try:
        cfg = cls(**values)
    except TypeError as e:
        raise UserError(f"[{section}]: {e}") from None
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = getattr(cfg, f.name)
        tp, optional = _base_type(hints[f.name])
        if value is None:
            if f.metadata.get("required"):
                raise UserError(
                    f"--{f.name.replace('_', '-')} is required (or `{f.name}` in [{section}] of --config)"
                )
            continue
        _check_type(section, f.name, value, tp)
    return cfg


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
        raise UserError(f"[{section}] {name} = {value!r}: expected {getattr(tp, '__name__', tp)}")


def options_from_args(cls: type, args: argparse.Namespace) -> Any:
    """A command-line-only options dataclass (PlanOptions): flags given, else the field defaults."""
    given = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name) is not None
    }
    return cls(**given)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
