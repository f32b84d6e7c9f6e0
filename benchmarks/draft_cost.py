"""The cost beside a draft's acceptance length in the draft-quality tables (issue 27): what a step of it
costs to serve, and what its AL would buy Kimi-K2.5.

For a trained draft (its stage-04 meta.json `draft` spec, the project's or speculators' run alike):
  forwards per step   sequential EAGLE-3: k; parallel drafting (P-EAGLE): 1 (speedup.draft_forwards)
  draft KV bytes/token  kv_cache.draft_kv of the draft as trained (bf16, as vLLM caches it; all heads)
  Kimi-K2.5 speedup   the `--plan` cost model (sizing/speedup.py) for the draft of the same kind at Kimi's
                      scale: configs/kimi_k25.toml's [train] draft with the row's draft_arch and parallel
                      drafting, its [vocab] draft vocabulary, beside Kimi-K2.5 at TP 8 and the default
                      context, at the row's AL; per GPU kind and batch size (speedup.BATCH_SIZES)
Nothing here re-derives a byte or a second: each figure comes from its owner in eagle3_pipeline.sizing.
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from benchmarks import REPO

KIMI_CONFIG = REPO / "configs" / "kimi_k25.toml"
BATCH_SIZES = (1, 16, 64)  # = speedup.BATCH_SIZES, the batches its report holds (checked in the tests)
KIMI_TP = 8  # one node of 8 GPUs, tensor parallel: how the docs' speedup tables serve Kimi-K2.5


def draft_spec(train_dir: Path) -> Any:
    """The DraftSpec a run trained (its meta.json), the project's or speculators_baseline's."""
    from eagle3_pipeline.models.draft import DraftSpec

    return DraftSpec.from_json(json.loads((Path(train_dir) / "meta.json").read_text())["draft"])


@lru_cache(maxsize=None)
def kimi_draft(arch: str, parallel: bool) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """The Kimi-K2.5 draft of this kind: (spec, plan.draft_report, kv_cache_report at TP KIMI_TP)."""
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.data.config import VocabConfig
    from eagle3_pipeline.core.config import config_from_file
    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.models.verifier import default_aux_layer_ids
    from eagle3_pipeline.sizing import kv_cache
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG
    from eagle3_pipeline.sizing.plan import draft_report

    train = config_from_file(TrainConfig, str(KIMI_CONFIG))
    # norm_before_fc: the llama layer's EAGLE-3.1 input norm (kimi_k25.toml's llama alternative); an MLA
    # draft has none in vLLM (the config refuses the pair)
    train = dataclasses.replace(train, draft_arch=arch, parallel_drafting=parallel,
                                norm_before_fc=arch == "llama")
    vocab = config_from_file(VocabConfig, str(KIMI_CONFIG)).draft_vocab_size
    t = KIMI_K25_TEXT_CONFIG
    spec = spec_for_training(train, t, vocab, default_aux_layer_ids(int(t["num_hidden_layers"])))
    return spec, draft_report(spec, train.train_lm_head), kv_cache.kv_cache_report(spec, t, KIMI_TP)


def kimi_speedup(arch: str, parallel: bool, k: int, al: float) -> dict[str, dict[int, float]]:
    """The cost model's expected decode speedup of Kimi-K2.5 with this kind of draft at AL `al`, k drafts
    per step: {gpu: {batch: speedup}}."""
    from eagle3_pipeline.sizing import speedup
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG

    spec, draft, kv = kimi_draft(arch, parallel)
    verifier = speedup.verifier_model(KIMI_K25_TEXT_CONFIG, kv["verifier"]["per_tp_rank"])
    d = speedup.draft_model(draft["shapes"], kv["draft"]["per_tp_rank"], spec.num_attention_heads, spec.head_dim)
    r = speedup.report(verifier, d, k, spec.parallel, KIMI_TP, speedup.DEFAULT_CONTEXT, al)
    return {gpu: {b: s["speedup"] for b, s in rows.items()} for gpu, rows in r["by_gpu"].items()}


def row_cost(train_dir: Path, k: int, al: float | None) -> dict[str, Any]:
    """The cost columns of one table cell: a draft (its run folder) served at k with acceptance `al`."""
    from eagle3_pipeline.sizing import kv_cache, speedup

    spec = draft_spec(train_dir)
    arch, parallel = spec.draft_arch, spec.parallel
    _, _, kimi_kv = kimi_draft(arch, parallel)
    return {
        "draft_arch": arch,
        "parallel": parallel,
        "draft_forwards_per_step": speedup.draft_forwards(k, parallel),
        "draft_kv_bytes_per_token": kv_cache.draft_kv(spec, 1)["full"],
        "kimi_draft_kv_bytes_per_token_per_rank": kimi_kv["draft"]["per_tp_rank"],
        "kimi_speedup": None if al is None else kimi_speedup(arch, parallel, k, al),
    }


def cell_costs(train_dir: Path, sim: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """row_cost of every simulated cell of a row (keys `setting/k<k>`, draft_quality.setting_key), at the
    cell's simulated AL."""
    return {key: row_cost(train_dir, int(key.rsplit("/k", 1)[1]), cell["mean_acceptance_length"])
            for key, cell in sim.items()}  # fmt: skip


def cost_line(cost: dict[str, Any], gpu: str = "H200") -> str:
    """One cell's cost as the docs' table shows it: forwards per step | KV B/token (measured draft; Kimi
    draft per rank) | Kimi speedup at batch 1 / 16 / 64 on `gpu`."""
    sp = cost["kimi_speedup"] or {}
    speed = " / ".join(f"{v:.2f}x" for v in sp.get(gpu, {}).values()) or "-"
    return (f"{cost['draft_forwards_per_step']} | {cost['draft_kv_bytes_per_token']:,} B "
            f"(Kimi {cost['kimi_draft_kv_bytes_per_token_per_rank']:,} B/rank) | {speed}")  # fmt: skip
