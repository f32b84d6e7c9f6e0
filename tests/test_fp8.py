"""fp8 hidden states: bounded rounding, half the bytes on disk, read back dequantised, and a draft trains."""

from __future__ import annotations

import json
import struct

import torch
from conftest import REPO, run_script, script

from eagle3_pipeline.data import state_dtype

# float8_e4m3fn keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself (half an ulp of
# 2^-3); below the smallest normal (2^-6 of the scale) the step is 2^-9, so the error is at most 2^-10.
REL_BOUND = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


def _sample_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-sample scale of each stored layer, broadcastable to x ([T, n_aux, H] or [T, H])."""
    return x.abs().amax(dim=(0, -1), keepdim=True) / state_dtype.FP8_MAX


def test_fp8_round_trip_error_is_within_e4m3_rounding_per_sample_and_layer():
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(64, 3, 256, generator=g) * torch.logspace(-1, 1, 64)[:, None, None]
    aux[5, 1, 7] = 5e3  # a first-token-style massive activation, ~5000x its neighbours' values
    last = torch.zeros(64, 256)  # an all-zero slice stays zero
    stored = state_dtype.encode(aux, last, state_dtype.FP8)
    assert stored["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert stored["aux_hidden_states_sample_scale"].shape == (1, 3)  # one scale per layer of the sample
    assert stored["last_hidden_state_sample_scale"].shape == (1,)
    back = state_dtype.decode(stored)
    assert set(back) == {"aux_hidden_states", "last_hidden_state"}
    err = (back["aux_hidden_states"] - aux).abs()
    bound = torch.maximum(aux.abs() * REL_BOUND, _sample_scale(aux) * SUBNORMAL_ABS) * 1.0001  # fp32 slack
    assert bool((err <= bound).all()), float((err / bound).max())
    assert torch.equal(back["last_hidden_state"], last)
    # the outlier's layer keeps its neighbours' resolution: e4m3's normal range spans 2^-6..448 x scale
    rel = err / aux.abs().clamp_min(1e-30)
    assert float(rel[:, 1].median()) < 0.04 and float(rel[:, 0].median()) < 0.04
    # per token, the error stays a few percent of the token's norm even for tokens 5e4x below the outlier
    token_err = err.norm(dim=-1) / aux.norm(dim=-1)
    assert float(token_err[:, 1].max()) < 0.07 and float(token_err[:, 0].max()) < 0.035


def test_fp8_shards_of_older_versions_with_per_token_scales_still_decode():
    x = torch.randn(10, 2, 16) * 3
    scale = x.abs().amax(-1) / state_dtype.FP8_MAX
    stored = {
        "aux_hidden_states": (x / scale.unsqueeze(-1)).to(torch.float8_e4m3fn),
        "aux_hidden_states_scale": scale,
    }
    back = state_dtype.decode(stored)["aux_hidden_states"]
    assert set(state_dtype.decode(stored)) == {"aux_hidden_states"}
    assert bool(((back - x).abs() <= x.abs() * REL_BOUND + scale.unsqueeze(-1) * SUBNORMAL_ABS).all())


def test_bytes_per_token_halve_for_kimi_shapes():
    # Kimi-K2.5: 3 aux layers + the teacher state, hidden 7168 (contract section 6)
    assert state_dtype.bytes_per_token("bfloat16", 3, 7168) == 4 * 7168 * 2 == 57_344
    assert state_dtype.bytes_per_token("float32", 3, 7168) == 4 * 7168 * 4 == 114_688
    # fp8: 4 x 7168 x 1 byte per token and nothing else; 4 float32 scales once per sample
    assert state_dtype.bytes_per_token(state_dtype.FP8, 3, 7168) == 28_672 == 57_344 // 2
    assert state_dtype.bytes_per_sample(state_dtype.FP8, 3) == 16
    assert state_dtype.bytes_per_sample("bfloat16", 3) == 0


def _tensor_bytes(path) -> dict[str, int]:
    """Bytes of each tensor in a safetensors file, from its header (8-byte length + JSON)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def test_fp8_shards_take_half_the_state_bytes_on_disk_and_load_back_close_to_float32(tiny_shards):
    from eagle3_pipeline.data.shards import load_sample, open_shards

    sets = {dt: open_shards([str(tiny_shards[dt])]) for dt in ("float32", "float8_e4m3fn")}
    meta8 = sets["float8_e4m3fn"].meta
    assert meta8["storage_dtype"] == "float8_e4m3fn" and sets["float32"].meta["storage_dtype"] == "float32"
    assert meta8["fp8_scales"] == "per_sample" and "fp8_scales" not in sets["float32"].meta
    n_aux, H = len(meta8["aux_layer_ids"]), meta8["hidden_size"]
    per_token = {}
    for dt in sets:
        state = scales = tokens = samples = 0
        for part in sorted(tiny_shards[dt].glob("part-*.safetensors")):
            b = _tensor_bytes(part)
            state += sum(b[k] for k in state_dtype.STATE_KEYS)
            scales += sum(v for k, v in b.items() if k.endswith("_scale"))
            tokens += b["input_ids"] // 4
            samples += b["offsets"] // 8 - 1
        per_token[dt] = state / tokens
        assert per_token[dt] == state_dtype.bytes_per_token(dt, n_aux, H)
        assert scales == samples * state_dtype.bytes_per_sample(dt, n_aux)
    assert per_token["float8_e4m3fn"] == state_dtype.bytes_per_token("bfloat16", n_aux, H) / 2
    for r32, r8 in zip(sets["float32"].samples, sets["float8_e4m3fn"].samples):
        a, b = load_sample(r32), load_sample(r8)
        assert torch.equal(a["input_ids"], b["input_ids"])
        for key in ("aux_hidden_states", "last_hidden_state"):
            assert b[key].dtype == torch.float32 and b[key].shape == a[key].shape
            bound = torch.maximum(a[key].abs() * REL_BOUND, _sample_scale(a[key]) * SUBNORMAL_ABS) * 1.001
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
