"""fp8 hidden states: bounded rounding, half the bytes on disk, read back dequantised, and a draft trains."""

from __future__ import annotations

import json
import struct

import torch
from conftest import REPO, run_script, script

from eagle3_pipeline import state_dtype

# float8_e4m3fn keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself (half an ulp of
# 2^-3); below the smallest normal (2^-6 of the scale) the step is 2^-9, so the error is at most 2^-10.
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def test_fp8_round_trip_error_is_within_e4m3_rounding_per_row():
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(64, 3, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None, None]
    aux[5, 1, 7] = 1e4  # one outlier: only its own row's scale may suffer
    last = torch.randn(64, 256, generator=g) * 50
    last[9] = 0.0  # an all-zero row stays zero
    stored = state_dtype.encode(aux, last, state_dtype.FP8)
    assert stored["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["aux_hidden_states_scale"].shape == (64, 3)
    assert stored["last_hidden_state_scale"].shape == (64,)
    back = state_dtype.decode(stored)
    for x, key in ((aux, "aux_hidden_states"), (last, "last_hidden_state")):
        scale = stored[key + "_scale"].unsqueeze(-1)
        err = (back[key] - x).abs()
        bound = torch.maximum(x.abs() * REL_BOUND, scale * SUBNORMAL_ABS) * 1.0001  # fp32 division slack
        assert bool((err <= bound).all()), float((err / bound).max())
    assert torch.equal(back["last_hidden_state"][9], torch.zeros(256))
    # per-row scales: the outlier's neighbours (same token, other layers; other tokens) keep their precision
    rel = (back["aux_hidden_states"] - aux).abs() / aux.abs().clamp_min(1e-30)
    assert float(rel[5, 0].median()) < 0.05 and float(rel[4, 1].median()) < 0.05


def test_bytes_per_token_halve_for_kimi_shapes():
    # Kimi-K2.5: 3 aux layers + the teacher state, hidden 7168 (contract section 6)
    assert state_dtype.bytes_per_token("bfloat16", 3, 7168) == 4 * 7168 * 2 == 57_344
    assert state_dtype.bytes_per_token("float32", 3, 7168) == 4 * 7168 * 4 == 114_688
    # fp8: 4 x 7168 x 1 = 28,672 bytes of states + 4 float32 scales = 16 bytes
    assert state_dtype.bytes_per_token(state_dtype.FP8, 3, 7168) == 28_672 + 16 == 28_688
    assert 28_672 / 57_344 == 0.5 and 28_688 / 57_344 < 0.5003


def _tensor_bytes(path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header (8-byte length + JSON)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_fp8_shards_take_half_the_state_bytes_on_disk_and_load_back_close_to_float32(tiny_shards):
    from eagle3_pipeline.shards import load_sample, open_shards

    sets = {dt: open_shards([str(tiny_shards[dt])]) for dt in ("float32", "float8_e4m3fn")}
    meta8 = sets["float8_e4m3fn"].meta
    assert meta8["storage_dtype"] == "float8_e4m3fn" and sets["float32"].meta["storage_dtype"] == "float32"
    n_aux, H = len(meta8["aux_layer_ids"]), meta8["hidden_size"]
    state_keys = set(state_dtype.stored_keys(state_dtype.FP8))
    per_token = {}
    for dt in sets:
        state = tokens = 0
        for part in sorted(tiny_shards[dt].glob("part-*.safetensors")):
            b = _tensor_bytes(part)
            state += sum(v for k, v in b.items() if k in state_keys)
            tokens += b["input_ids"] // 4
        per_token[dt] = state / tokens
        assert per_token[dt] == state_dtype.bytes_per_token(dt, n_aux, H)
    bf16 = state_dtype.bytes_per_token("bfloat16", n_aux, H)
    assert per_token["float8_e4m3fn"] - (n_aux + 1) * 4 == bf16 / 2  # states: half of bf16, plus scales
    for r32, r8 in zip(sets["float32"].samples, sets["float8_e4m3fn"].samples):
        a, b = load_sample(r32), load_sample(r8)
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in ("aux_hidden_states", "last_hidden_state"):
            assert b[key].dtype == torch.float32 and b[key].shape == a[key].shape
            scale = a[key].abs().amax(-1, keepdim=True) / state_dtype.FP8_MAX
            bound = torch.maximum(a[key].abs() * REL_BOUND, scale * SUBNORMAL_ABS) * 1.001
            assert bool(((b[key] - a[key]).abs() <= bound).all()), key


def test_shards_of_different_storage_dtypes_are_refused_together(tiny_shards, tmp_path):
    proc = run_script(
        script("03_split_data.py"), "--data-dir", str(tiny_shards["float32"]),
        str(tiny_shards["float8_e4m3fn"]), "--out-dir", str(tmp_path / "s"), check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "storage_dtype" in proc.stderr, proc.stderr[-1500:]


def test_a_draft_trains_on_fp8_shards_through_dataloader_workers(tiny_shards, tmp_path):
    out = tmp_path / "train"
    run_script(
        script("04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"),
        "--data-dir", str(tiny_shards["float8_e4m3fn"]), "--split-dir", "", "--val-ratio", "0.2",
        "--vocab-mapping-dir", str(tiny_shards["vocab_float8_e4m3fn"]), "--out-dir", str(out),
        "--max-steps", "40", "--eval-every", "40", "--log-every", "5", "--num-workers", "1",
    )  # fmt: skip
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < 0.5 * log[0]["loss"], (log[0], log[-1])
    best = json.loads((out / "checkpoints" / "best.json").read_text())
    ckpt = json.loads((out / "checkpoints" / best["checkpoint"] / "checkpoint.json").read_text())
    assert ckpt["val"]["acc_0"] > ckpt["history"]["untrained"]["acc_0"]
