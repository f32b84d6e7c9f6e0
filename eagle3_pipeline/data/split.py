"""Stage 03: a seeded train/val split by conversation across shards.

A conversation's side is decided by a hash of (seed, conversation id), not by its position, so the split
does not change when shards are added, reordered or re-extracted, and one conversation never lands on
both sides. Each row of the input is one conversation; its first sample's id is the row's `id` (or
row-<n>), later samples of the same row `<id>#2`, `<id>#3`, ... (samples.conversation_id maps them back).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from eagle3_pipeline.core import storage
from eagle3_pipeline.data.config import SplitConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.samples import conversation_id
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.data.shards import SampleRef, open_for_output

log = logging.getLogger("eagle3.split")

SPLIT_FILE = "split.json"


def is_val(conversation_id: str, seed: int, val_ratio: float) -> bool:
    h = hashlib.sha256(f"{seed}:{conversation_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < val_ratio


def split_samples(
    samples: list[SampleRef], seed: int, val_ratio: float
) -> tuple[list[SampleRef], list[SampleRef]]:
    """(train, val) by conversation; val_ratio in [0, 1), as the configs hold it."""
    train = [s for s in samples if not is_val(conversation_id(s.sample_id), seed, val_ratio)]
    val = [s for s in samples if is_val(conversation_id(s.sample_id), seed, val_ratio)]
    if val_ratio > 0 and not val and len({conversation_id(s.sample_id) for s in samples}) > 1:
        # tiny data: hold out at least one conversation, all of its samples
        last = conversation_id(train[-1].sample_id)
        val = [s for s in train if conversation_id(s.sample_id) == last]
        train = [s for s in train if conversation_id(s.sample_id) != last]
    if not train:
        raise UserError(f"val_ratio {val_ratio} leaves no training samples out of {len(samples)}")
    return train, val


def run(cfg: SplitConfig) -> int:
    out_dir = Path(cfg.out_dir)
    out = StageOutput(out_dir, cfg.overwrite)
    with open_for_output(cfg.data_dir, out) as shard_set:
        if shard_set is None:
            return 0
        train, val = split_samples(shard_set.samples, cfg.seed, cfg.val_ratio)
        with out.building() as tmp:
            storage.write_json_atomic(
                tmp / SPLIT_FILE, {"train": [s.sample_id for s in train], "val": [s.sample_id for s in val]}
            )
            meta = {
                "stage": "03_split_data",
                "num_train": len(train),
                "num_val": len(val),
                "train_tokens": sum(s.num_tokens for s in train),
                "val_tokens": sum(s.num_tokens for s in val),
                "split_sha256": storage.sha256_file(tmp / SPLIT_FILE),
                **shard_set.made_from(out_dir),
                **provenance(cfg),
            }
            out.publish(tmp, meta)
        log.info(
            "done %s | train %d conversations (%d tokens) | val %d (%d tokens)",
            out_dir,
            len(train),
            meta["train_tokens"],
            len(val),
            meta["val_tokens"],
        )
        return 0


def load_split(split_dir: Path, samples: list[SampleRef]) -> tuple[list[SampleRef], list[SampleRef]]:
    """The train/val SampleRefs of a split folder; every listed id must exist in the given shards."""
    if not storage.is_complete(split_dir):
        raise UserError(f"{split_dir}: not a complete split; run 03_split_data.py")
    meta = storage.read_json(split_dir / storage.META_NAME)
    if storage.sha256_file(split_dir / SPLIT_FILE) != meta["split_sha256"]:
        raise UserError(f"{split_dir / SPLIT_FILE}: sha256 mismatch with meta.json (corrupt)")
    ids = storage.read_json(split_dir / SPLIT_FILE)
    by_id = {s.sample_id: s for s in samples}
    missing = [i for i in ids["train"] + ids["val"] if i not in by_id]
    if missing:
        raise UserError(
            f"{split_dir}: {len(missing)} sample ids (first {missing[0]!r}) are not in --data-dir; "
            "pass the same shards that 03_split_data.py read"
        )
    return [by_id[i] for i in ids["train"]], [by_id[i] for i in ids["val"]]
