"""Stage 02: the draft vocabulary (top-K loss-masked target tokens) and its d2t / t2d mappings.

vLLM maps a draft id to a target id as `target = draft + d2t[draft]` (d2t holds int64 OFFSETS,
`vllm/model_executor/models/llama_eagle3.py`); t2d is a bool mask over the target vocabulary.
Draft ids are the chosen target ids in ascending order; ties in frequency go to the lower token id,
and when the data has fewer than K distinct tokens the rest are filled with the lowest unused ids,
so the same shards always give the same mapping.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from eagle3_pipeline.core import storage
from eagle3_pipeline.data.config import VocabConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.data.shards import iter_part_tokens, open_for_output

log = logging.getLogger("eagle3.vocab")

MAPPING_FILE = "vocab_mapping.safetensors"
STAGE = "02_build_vocab_mapping"  # meta.json's "stage": what load_mapping accepts as a mapping


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """Ascending target ids of the K most frequent tokens (ties: lower id first; zero counts: lowest ids)."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise UserError(f"draft_vocab_size {draft_vocab_size} must lie in [1, {vocab_size}]")
    # stable sort by descending count keeps ascending ids within equal counts
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    return torch.sort(order[:draft_vocab_size]).values


def mappings(selected: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 offsets [K], t2d bool [V]) for ascending selected target ids."""
    d2t = (selected - torch.arange(selected.numel())).to(torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def draft_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """What vLLM does with d2t: target id = draft id + offset (none with the full vocab: the same id)."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


def run(cfg: VocabConfig) -> int:
    out_dir = Path(cfg.out_dir)
    out = StageOutput(out_dir, cfg.overwrite)
    with open_for_output(cfg.data_dir, out) as shard_set:
        if shard_set is None:
            return 0
        vocab_size = shard_set.meta["verifier"]["vocab_size"]
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for ids, mask in iter_part_tokens(shard_set.shards):
            ids = ids.to(torch.int64)
            if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
                raise UserError(f"token id out of range [0, {vocab_size}) in {shard_set.shards}")
            counts += torch.bincount(ids[mask.bool()], minlength=vocab_size)
        selected = select_draft_vocab(counts, cfg.draft_vocab_size)
        d2t, t2d = mappings(selected, vocab_size)
        total = int(counts.sum())
        covered = int(counts[selected].sum())
        coverage = covered / max(total, 1)
        with out.building() as tmp:
            digest = storage.save_safetensors_atomic(
                {"d2t": d2t, "t2d": t2d, "counts": counts}, tmp / MAPPING_FILE
            )
            meta = {
                "stage": STAGE,
                "draft_vocab_size": cfg.draft_vocab_size,
                "vocab_size": vocab_size,
                "loss_tokens": total,
                "covered_loss_tokens": covered,
                "coverage": coverage,
                "distinct_loss_tokens": int((counts > 0).sum()),
                "mapping_sha256": digest,
                **shard_set.made_from(out_dir),
                **provenance(cfg),
            }
            out.publish(tmp, meta)
        log.info(
            "done %s | draft vocab %d of %d | coverage %.4f of %d loss-masked target tokens (%d distinct)",
            out_dir,
            cfg.draft_vocab_size,
            vocab_size,
            coverage,
            total,
            meta["distinct_loss_tokens"],
        )
        return 0


def load_mapping(mapping_dir: Path) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """(meta, d2t, t2d), checksum-verified."""
    from safetensors.torch import load_file

    if not storage.is_complete(mapping_dir):
        raise UserError(f"{mapping_dir}: not a complete vocab mapping; run 02_build_vocab_mapping.py")
    meta = storage.read_json(mapping_dir / storage.META_NAME)
    path = mapping_dir / MAPPING_FILE
    stage = meta.get("stage") if isinstance(meta, dict) else None
    if stage != STAGE or not path.is_file():
        made_by = f"meta.json says stage {stage}" if stage != STAGE else f"no {MAPPING_FILE}"
        raise UserError(
            f"{mapping_dir}: not a vocab mapping ({made_by}); pass the --out-dir of "
            "02_build_vocab_mapping.py as --vocab-mapping-dir"
        )
    if storage.sha256_file(path) != meta.get("mapping_sha256"):
        raise UserError(f"{path}: sha256 mismatch with meta.json (corrupt); rebuild it with --overwrite")
    t = load_file(str(path))
    d2t, t2d = t["d2t"], t["t2d"]
    if (
        d2t.dtype != torch.int64
        or t2d.dtype != torch.bool
        or d2t.numel() != meta["draft_vocab_size"]
        or int(t2d.sum()) != d2t.numel()
    ):
        raise UserError(f"{path}: d2t/t2d have the wrong dtype or size; rebuild it with --overwrite")
    return meta, d2t, t2d
