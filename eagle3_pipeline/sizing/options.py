"""The options of `--plan` on stages 01 and 04 (sizing/plan.py): command-line only, never part of a run's
recorded config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from eagle3_pipeline.core.config import Settings, setting


@dataclass
class PlanOptions(Settings):
    """`--plan` on stages 01 and 04 (plan.py): command-line only, never part of a run's recorded config."""

    SECTION: ClassVar[str] = "plan"

    plan: bool = setting(
        False,
        "Print what the run will need (aux ids, draft shapes and parameters, disk per storage dtype, memory "
        "per GPU, steps, time) from the verifier's config.json and a sample of the data; run nothing.",
    )
    plan_gpus: int = setting(
        8,
        "GPUs the plan assumes for DDP (steps per epoch; DDP gradient buckets), and the tensor-parallel size "
        "of serving for the KV-cache lines unless [export] serve_tensor_parallel_size is set.",
        ge=1,
    )
    plan_rows: int | None = setting(
        None, "Input rows of the whole dataset (default: counted in --data-path).", ge=1
    )
    plan_tokens_per_row: float | None = setting(
        None,
        "Tokens per row when neither shards nor data and tokenizer are at hand (default: measured).",
        gt=0,
    )
    plan_sample_rows: int = setting(256, "Rows tokenized to measure tokens per row.", ge=1)
    plan_tokens_per_second: float | None = setting(
        None, "Training throughput of the whole run (a log line's tok/s) for the time estimate.", gt=0
    )
    plan_json: str | None = setting(None, "Also write the plan as JSON to this file.")
    plan_al: float | None = setting(
        None,
        "Acceptance length (06_evaluate's, at the k of [serving] num_speculative_tokens) for the expected "
        "speedup and output tokens/s lines of the serving cost model (sizing/speedup.py); without it they "
        "show the break-even AL.",
        ge=1,
    )
    plan_context: int = setting(2048, "Tokens of context per request for the serving cost model.", ge=1)

