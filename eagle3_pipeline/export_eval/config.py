"""The export and evaluation stages' settings ([export], [evaluate]) and the values they accept.

k (`num_speculative_tokens`) defaults to [serving]'s (core/config.py SERVING_K): one k per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from eagle3_pipeline.core.config import SEED, SERVING_K, Settings, required, setting

# vLLM's speculative-config draft_sample_method values (vllm/config/speculative.py, DraftSampleMethod)
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
EVALUATE_ENGINES = ("sim", "vllm", "both")


@dataclass
class ExportConfig(Settings):
    SECTION: ClassVar[str] = "export"
    train_dir: str | None = required("Training run folder (the --out-dir of 04_train.py).")
    checkpoint: str = setting(
        "best",
        "best, latest, a checkpoint folder name such as step_000400, or init (the "
        "untrained draft as training initialised it: a baseline).",
    )
    out_dir: str | None = required("Export folder: config.json + model.safetensors for vLLM.")
    gate_samples: int = setting(
        4, "Stored samples on which the read-back export must reproduce the trained draft's logits.", ge=1
    )
    num_speculative_tokens: int = setting(
        SERVING_K, "k in the printed vllm serve line; default: [serving] num_speculative_tokens.", ge=1
    )
    draft_sample_method: str = setting(
        "greedy",
        "draft_sample_method in the printed vllm serve line (06_evaluate.py --draft-sample-method says what "
        "each does; a [serving] mode sets the one measured best for it). Recorded in export_meta.json: "
        "06_evaluate.py evaluates the export drafting so unless told otherwise.",
        choices=DRAFT_SAMPLE_METHODS,
    )
    temperature: float | None = setting(
        None,
        "Sampling temperature the requests will be served at (a [serving] mode sets it), recorded in "
        "export_meta.json for 06_evaluate.py (None: not recorded; stage 06 then evaluates greedy).",
        ge=0,
    )
    top_p: float | None = setting(
        None, "Nucleus mass the requests will be served at, recorded with --temperature.", gt=0, le=1
    )
    serve_tensor_parallel_size: int = setting(
        0,
        "--tensor-parallel-size in the printed vllm serve line; 0: the GPUs visible here (at least 1).",
        ge=0,
    )
    overwrite: bool = setting(
        False, "Replace an existing good export (only after the new one passes the gate)."
    )


@dataclass
class EvaluateConfig(Settings):
    SECTION: ClassVar[str] = "evaluate"
    verifier_path: str | None = setting(None, "Verifier checkpoint; default: the one recorded by the export.")
    draft_dir: str | None = required("An export folder from 05_export.py.")
    data_path: str | None = required(
        "Conversations (same formats as stage 01); each prompt is a "
        "conversation up to its first assistant turn."
    )
    start_row: int = setting(0, "First row used for prompts.", ge=0)
    num_prompts: int = setting(8, "Prompts evaluated.", ge=1)
    max_new_tokens: int = setting(64, "Tokens generated per prompt.", ge=1)
    num_speculative_tokens: int = setting(
        SERVING_K, "k draft tokens per step; default: [serving] num_speculative_tokens.", ge=1
    )
    temperature: float | None = setting(
        None,
        "Sampling temperature of the requests (default: the export's recorded one, else 0): 0 greedy; "
        "Kimi-K2.5 serves thinking mode at 1.0 (top_p 0.95) and instant mode at 0.6 (top_p 0.95). Drafting "
        "by argmax, the verifier accepts a draft with its probability of it; see --draft-sample-method. The "
        "simulation reports the expected acceptance exactly.",
        ge=0,
    )
    top_p: float | None = setting(
        None,
        "Nucleus mass of the requests when --temperature > 0 (Kimi-K2.5: 0.95; default: the export's "
        "recorded one, else 1).",
        gt=0,
        le=1,
    )
    top_k: int = setting(0, "Top-k of the requests when --temperature > 0 (0: off).", ge=0)
    seed: int = setting(
        0, "Sampling seed: request i is seeded seed + i, in the simulation and in vLLM alike.", **SEED
    )
    draft_sample_method: str | None = setting(
        None,
        "Default: the one the export records it will be served with (export_meta.json), else greedy. "
        "vLLM's speculative-config draft_sample_method: greedy (the draft proposes its argmax; vLLM's "
        "default) or probabilistic (drawn from the draft at the request's temperature, no top-p, and "
        "accepted with probability min(1, p/q)). The simulation follows either; pass the same to vllm serve "
        "(05_export.py prints it). A [serving] mode sets the one measured best for it.",
        choices=DRAFT_SAMPLE_METHODS,
    )
    samples_per_prompt: int = setting(
        1, "Requests per prompt (sampling: independent draws, seeds in sequence; more = less noise).", ge=1
    )
    engine: str = setting(
        "sim",
        "sim (this project's PyTorch simulation of vLLM's EAGLE-3 chain), vllm, or both (compared; exit 1 "
        "when they disagree).",
        choices=EVALUATE_ENGINES,
    )
    vllm_python: str | None = setting(None, "Python of the vLLM environment (default .venv-vllm/bin/python).")
    out_dir: str | None = setting(None, "Where to write acceptance.json (default: the draft folder).")
    trust_remote_code: bool = setting(
        False, "Allow the verifier's own code (Kimi-K2.5's tiktoken tokenizer needs it)."
    )
    chat_template_kwargs: dict[str, Any] | None = setting(
        None,
        "Chat-template variables for the prompts (JSON object, e.g. '{\"thinking\": false}'); default: the "
        "ones the training shards were extracted with (export -> training run -> shards' meta.json).",
    )

