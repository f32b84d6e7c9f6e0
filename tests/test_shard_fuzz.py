"""Property: a flipped bit anywhere in a shard is refused or harmless, never read as other data. Seeded
random bit flips in the safetensors headers, the tensor bytes, manifest.json and meta.json of real tiny
shards (float32 and fp8), each then read the way stages 02-04 read a shard (open_shards, load_sample of
every sample, iter_part_tokens): either a UserError naming the shard and the flipped file, or exactly the
data of the intact shard (the flip hit bytes nothing reads). A few flips go through the real scripts too."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_script, script

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.shards import iter_part_tokens, load_sample, open_shards

CASES_PER_SHARD = 28  # x 2 shards, about 50 ms each on one CPU thread
TARGETS = ("header", "tensors", "manifest.json", "meta.json")


def _read(shard: Path) -> dict[str, Any]:
    """Everything stages 02-04 take from a shard: the sample list, the contract and the settings recorded in
    meta.json (stage 06 reads chat_template_kwargs), every sample's tensors, the token tensors."""
    shard_set = open_shards([str(shard)])
    settings = json.loads((shard / "run.json").read_text())
    return {
        "samples": [dataclasses.astuple(r) for r in shard_set.samples],
        "contract": shard_set.contract(),
        "settings": {k: shard_set.meta.get(k) for k in (*settings, "hidden_size")},
        "tensors": [load_sample(r) for r in shard_set.samples],
        "tokens": list(iter_part_tokens(shard_set.shards)),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def _span(path: Path, target: str) -> tuple[int, int]:
    """Byte range [start, end) of the target inside the file: the header JSON, or the tensor bytes."""
    if target not in ("header", "tensors"):
        return 0, path.stat().st_size
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    return (8, 8 + n) if target == "header" else (8 + n, path.stat().st_size)


def _cases(shard: Path, seed: int) -> list[tuple[str, int, int]]:
    """(file name, byte offset, bit) per case, seeded; the targets in turn."""
    rng = random.Random(seed)
    parts = sorted(p.name for p in shard.glob("part-*.safetensors"))
    out = []
    for i in range(CASES_PER_SHARD):
        target = TARGETS[i % len(TARGETS)]
        name = rng.choice(parts) if target in ("header", "tensors") else target
        a, b = _span(shard / name, target)
        out.append((name, rng.randrange(a, b), rng.randrange(8)))
    return out


@pytest.mark.parametrize("dtype", ["float32", "float8_e4m3fn"])
def test_a_flipped_bit_is_refused_naming_the_file_or_changes_nothing_read(tiny_shards, tmp_path, dtype):
    shard = tmp_path / tiny_shards[dtype].name
    shutil.copytree(tiny_shards[dtype], shard)
    intact = _read(shard)
    outcomes = {"refused": 0, "unread": 0}
    for name, offset, bit in _cases(shard, seed=1 if dtype == "float32" else 2):
        path = shard / name
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[offset] ^= 1 << bit
        path.write_bytes(bytes(flipped))
        case = f"{name} byte {offset} bit {bit}"
        try:
            got = _read(shard)
        except UserError as e:
            assert str(shard) in str(e) and name in str(e), f"{case}: {e}"
            outcomes["refused"] += 1
        else:
            assert _same(got, intact), f"{case}: read as other data"
            outcomes["unread"] += 1
        finally:
            path.write_bytes(original)
    assert outcomes["refused"] >= CASES_PER_SHARD // 2, outcomes  # most flips hit what is read


def test_flips_through_the_stage_scripts_are_one_line_errors(tiny_shards, tmp_path):
    """Stages 02 and 03 on a shard with a bit flipped in a part's header, in meta.json or in manifest.json:
    exit 2 with one line naming the file, never a traceback."""
    intact = tiny_shards["float32"]
    flips = [("part-00000.safetensors", b'"shape"', "02_build_vocab_mapping.py"),
             ("meta.json", b'"aux_layer_ids"', "03_split_data.py"),
             ("manifest.json", b'"sha256"', "02_build_vocab_mapping.py")]  # fmt: skip
    for n, (name, needle, stage) in enumerate(flips):
        shard = tmp_path / str(n) / intact.name
        shutil.copytree(intact, shard)
        raw = bytearray((shard / name).read_bytes())
        raw[raw.index(needle) + 2] ^= 0x04  # inside the key: the entry is no longer what is read
        (shard / name).write_bytes(bytes(raw))
        proc = run_script(script(stage), "--data-dir", str(shard), "--out-dir", str(tmp_path / f"out{n}"),
                          check=False)  # fmt: skip
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert f"error: {shard}" in proc.stderr and name in proc.stderr, proc.stderr[-2000:]
