"""The data stages' settings ([regenerate], [extract], [vocab], [split]) and the values they accept.

The storage and compute dtype names are owned here, not in state_dtype.py, so that parsing a config never
imports torch; state_dtype.py and the extraction engines import them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3_pipeline.core.config import SEED, Settings, required, setting
from eagle3_pipeline.data.samples import VARIANT_NAME

FP8 = "float8_e4m3fn"  # the fp8 storage dtype (state_dtype.py)
NO_STATES = "none"  # storage dtype of token shards: ids and loss masks only, states come online (stage 04)
STORAGE_DTYPES = ("auto", "bfloat16", "float32", FP8, NO_STATES)
EXTRACT_DTYPES = ("auto", "bfloat16", "float16", "float32")  # state_dtype.resolve_dtype
REGENERATE_ENGINES = ("auto", "vllm", "hf")
EXTRACT_ENGINES = ("hf", "vllm")


@dataclass
class RegenerateConfig(Settings):
    SECTION: ClassVar[str] = "regenerate"
    verifier_path: str | None = required("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = required("Conversations to regenerate (same formats as stage 01).")
    data_split: str = setting("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = required(
        "Output folder: conversations.jsonl (stage 01's --data-path), parts, rejects.jsonl, meta.json."
    )
    engine: str = setting(
        "auto", "vllm (tensor parallel over the visible GPUs), hf (transformers), or auto: vllm when "
        "its environment is usable, else hf.", choices=REGENERATE_ENGINES
    )  # fmt: skip
    max_new_tokens: int = setting(
        2048, "Most tokens generated per assistant turn (reasoning included).", ge=1
    )
    max_seq_len: int = setting(
        4096, "Longest prompt + completion; a turn whose prompt is longer ends the row.", ge=1
    )
    temperature: float = setting(
        0.0, "0: greedy (reproducible); > 0: sampling with --top-p and --seed.", ge=0
    )
    top_p: float = setting(1.0, "Nucleus sampling mass when --temperature > 0.", gt=0, le=1)
    seed: int = setting(0, "Sampling seed.", **SEED)
    rows_per_part: int = setting(256, "Input rows per part file (the unit of resume).", ge=1)
    chat_template_kwargs: dict[str, Any] = setting(
        {},
        "Chat-template variables for the prompts (TOML table or JSON object), as stage 01 will use: e.g. "
        "'{\"thinking\": false}' for Kimi-K2.5's instant mode.",
    )
    vllm_python: str | None = setting(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    trust_remote_code: bool = setting(
        False, "Allow the verifier's own code (Kimi-K2.5's tokenizer needs it)."
    )
    overwrite: bool = setting(False, "Redo an output that is already complete.")


def _variant_problem(value: str | None) -> str | None:
    if value is None or VARIANT_NAME.fullmatch(value):
        return None
    return "must be a name of letters, digits, '_', '.' and '-' (e.g. \"given\" or \"seed1\")"


@dataclass
class ExtractConfig(Settings):
    SECTION: ClassVar[str] = "extract"
    verifier_path: str | None = required("Verifier checkpoint directory (Hugging Face layout).")
    data_path: str | None = required(
        "Conversations: a .jsonl/.json file (ShareGPT `conversations` or "
        "OpenAI `messages` rows) or a `datasets` dataset saved with save_to_disk."
    )
    data_split: str = setting("train", "Split to read when --data-path is a saved DatasetDict.")
    out_dir: str | None = required(
        "Root folder of the hidden-state shards; each run writes one `rows_<start>-<end>/` shard inside it."
    )
    start_row: int = setting(0, "First input row of this shard (inclusive).", ge=0)
    end_row: int | None = setting(
        None, "Row after the last one of this shard (exclusive); default: end of data.", ge=1
    )
    shard_rows: int | None = setting(
        None,
        "Split [start_row, end_row) into shards of this many rows, written one after the other by this one "
        "process: the verifier loads once instead of once per shard. Each shard is the same, byte for "
        "byte, as its own --start-row/--end-row run would write, and resumes the same way.",
        ge=1,
    )
    aux_layer_ids: list[int] | None = setting(
        None,
        "Aux layer ids in vLLM's convention (id i = Hugging Face "
        "hidden_states[i], the residual stream entering layer i); "
        "default (2, N//2, N-3), [2, 30, 58] for Kimi-K2.5.",
        ge=1,
    )
    max_seq_len: int = setting(
        4096,
        "Longest sample in tokens; a row with a longer sample is rejected (rejects.jsonl) unless --truncate.",
        ge=1,
    )
    truncate: bool = setting(
        False,
        "Cut a sample longer than max_seq_len to its first max_seq_len tokens, supervising only what fits, "
        "instead of rejecting the row (counted as num_truncated in meta.json).",
    )
    chat_template_kwargs: dict[str, Any] = setting(
        {},
        "Extra chat-template variables, a TOML table or a JSON object on the command line, e.g. "
        "'{\"thinking\": false}' for Kimi-K2.5's instant mode (default: its thinking mode); recorded in "
        "meta.json, and 06_evaluate.py builds its prompts with the same.",
    )
    variant: str | None = setting(
        None,
        "Name a second version of conversations extracted already (the given answers beside stage 00's "
        "regenerated ones, or a second seed's answers) so both can train together: its sample ids become "
        "<row id>#v:<variant>, never those of the first version's shards, and stage 03 keeps both versions "
        "of a conversation on one side. Letters, digits, '_', '.', '-'. Its shards are named "
        "rows_<start>-<end>_<variant>, so the same out_dir holds both versions and stages 02-04 read them "
        "together.",
        check=_variant_problem,
    )
    context_tokens: int | None = setting(
        None,
        "Store at most this many context tokens before a sample's first supervised one (default: all). "
        "The verifier still runs the whole sample; only the states of its earlier tokens are not stored, "
        "and the sample keeps its true positions (stage 04 trains it there). For templates that render "
        "each turn as a sample of its whole context (Kimi-K2.5's thinking mode erases earlier reasoning): "
        "a conversation of n turns then stores about n x (this + a turn) tokens instead of n / 2 times its "
        "length. Token shards (--storage-dtype none) keep every token: online states need the prefix.",
        ge=0,
    )
    samples_per_file: int = setting(64, "Input rows per safetensors part file (the unit of resume).", ge=1)
    max_batch_tokens: int = setting(
        4096,
        "Padded tokens per verifier forward (batch x longest sequence, longest first); a longer sample runs "
        "alone. On CPU 1024-4096 measured best (benchmarks/extract_batching.py); on GPUs raise it to fill "
        "memory.",
        ge=1,
    )
    dtype: str = setting(
        "auto",
        "Storage and compute dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32.",
        choices=EXTRACT_DTYPES,
    )
    storage_dtype: str = setting(
        "auto",
        "How aux/last hidden states are stored: auto (as computed, --dtype), bfloat16, float32, or "
        "float8_e4m3fn with a float32 scale per sample and layer (half the bytes of bfloat16 per "
        "token; stages 02-05 read it dequantised), or none: no states, the samples' token ids and loss "
        "masks only (no verifier runs; ~5 bytes/token), for stage 04's online states (`[train] states = "
        "\"online\"`); stages 02 and 03 read them like any shard.",
        choices=STORAGE_DTYPES,
    )
    trust_remote_code: bool = setting(
        False,
        "Allow the verifier's own code: Kimi-K2.5's tiktoken tokenizer needs it (its model also loads "
        "natively with transformers 5.19).",
    )
    engine: str = setting(
        "hf",
        "hf: transformers in this process (device_map=auto over the visible GPUs: one GPU at a time); "
        "vllm: vLLM's extract_hidden_states method in its own environment, tensor parallel over the "
        "visible GPUs, its MLA/MoE kernels, the states its EAGLE-3 code will feed the draft. With vllm, "
        "a server started by --serve for the same out_dir is used when one runs (the verifier loaded "
        "once for a whole shard loop); otherwise the run starts its own engine.",
        choices=EXTRACT_ENGINES,
    )
    serve: bool = setting(
        False,
        "With --engine vllm: start the vLLM extraction server for this config (loopback, the config's "
        "verifier, aux layers, dtype, max_seq_len), record it in <out_dir>/vllm-server.json and keep it "
        "until Ctrl-C or SIGTERM; stage 01 runs with the same config (the shard loop) are its clients.",
    )
    vllm_python: str | None = setting(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    overwrite: bool = setting(False, "Redo a shard that is already complete.")

    def rule_problem(self) -> str | None:
        if self.end_row is not None and self.end_row <= self.start_row:
            return f"--end-row {self.end_row} must be > --start-row {self.start_row} (an empty row range)"
        if self.serve and self.engine != "vllm":
            return "--serve starts a vLLM server: add --engine vllm"
        return None


@dataclass
class VocabConfig(Settings):
    SECTION: ClassVar[str] = "vocab"
    data_dir: list[str] = setting(
        [], "One or more hidden-state shard folders (rows_*/) or roots holding them."
    )
    out_dir: str | None = required("Folder for vocab_mapping.safetensors (d2t, t2d) and meta.json.")
    draft_vocab_size: int = setting(
        32000, "Draft vocabulary size K: the K most frequent target tokens.", ge=1
    )
    overwrite: bool = setting(False, "Replace an existing complete output.")


@dataclass
class SplitConfig(Settings):
    SECTION: ClassVar[str] = "split"
    data_dir: list[str] = setting(
        [], "One or more hidden-state shard folders (rows_*/) or roots holding them."
    )
    out_dir: str | None = required("Folder for split.json (train/val sample lists) and meta.json.")
    val_ratio: float = setting(0.05, "Fraction of conversations held out for validation.", ge=0, lt=1)
    seed: int = setting(0, "Seed of the conversation-level split (same seed, same split).", **SEED)
    overwrite: bool = setting(False, "Replace an existing complete output.")

