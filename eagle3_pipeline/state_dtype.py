"""How hidden states are stored on disk: bfloat16/float32 as computed, or float8_e4m3fn with row scales.

Kimi-K2.5 stores 4 x 7168 values per token (three aux layers and the teacher state): 57,344 bytes in
bf16. float8_e4m3fn halves that. Each row of each [T, H] slice (one token of one aux layer, or one
token's last hidden state) gets its own float32 scale amax / 448, so a token with a large activation
never costs the resolution of its neighbours (per-token scaling). Stored tensors in a part file:
  aux_hidden_states [N, n_aux, H], last_hidden_state [N, H]            (storage dtype)
  aux_hidden_states_scale [N, n_aux], last_hidden_state_scale [N]       (float32, fp8 only)
The loader (`decode`) hands stages 02-05 float32 tensors, so nothing after stage 01 sees fp8.
"""

from __future__ import annotations

import torch

from eagle3_pipeline.errors import UserError

FP8 = "float8_e4m3fn"
STORAGE_DTYPES = ("auto", "bfloat16", "float32", FP8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec, E4M3: S.1111.110 = 448)
SCALE_BYTES = 4  # float32 scale per stored row
STATE_KEYS = ("aux_hidden_states", "last_hidden_state")
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, FP8: 1}


def resolve_storage_dtype(name: str, compute_dtype: torch.dtype) -> str:
    """The storage dtype's name; `auto` stores what the verifier computed in (the old behaviour)."""
    if name not in STORAGE_DTYPES:
        raise UserError(f"storage_dtype {name!r}: use one of {', '.join(STORAGE_DTYPES)}")
    return str(compute_dtype).removeprefix("torch.") if name == "auto" else name


def bytes_per_token(storage_dtype: str, num_aux_layers: int, hidden_size: int) -> int:
    """Disk bytes of one token's hidden states (aux layers + teacher state), scales included."""
    rows = num_aux_layers + 1
    scales = rows * SCALE_BYTES if storage_dtype == FP8 else 0
    return rows * hidden_size * _BYTES[storage_dtype] + scales


def encode(aux: torch.Tensor, last: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """aux [T, n_aux, H], last [T, H] -> the tensors written for them."""
    if storage_dtype != FP8:
        dt = getattr(torch, storage_dtype)
        return {"aux_hidden_states": aux.to(dt), "last_hidden_state": last.to(dt)}
    out: dict[str, torch.Tensor] = {}
    for key, x in zip(STATE_KEYS, (aux, last)):
        x = x.float()
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero row stays zero
        out[key] = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[key + "_scale"] = scale.squeeze(-1)
    return out


def decode(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stored tensors -> the same dict with aux/last as float32 (fp8) or as stored; scales dropped."""
    out = {k: v for k, v in tensors.items() if not k.endswith("_scale")}
    for key in STATE_KEYS:
        if key in tensors and tensors[key].dtype == torch.float8_e4m3fn:
            out[key] = tensors[key].float() * tensors[key + "_scale"].unsqueeze(-1)
    return out


def stored_keys(storage_dtype: str) -> tuple[str, ...]:
    """Hidden-state tensors in a part file for this storage dtype."""
    return (*STATE_KEYS, *(k + "_scale" for k in STATE_KEYS)) if storage_dtype == FP8 else STATE_KEYS
