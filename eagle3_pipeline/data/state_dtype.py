"""How hidden states are stored on disk: bfloat16/float32 as computed, or float8_e4m3fn with sample scales.

Kimi-K2.5 stores 4 x 7168 values per token (three aux layers and the teacher state): 57,344 bytes in
bf16. float8_e4m3fn stores exactly half, 28,672: one byte per value and nothing else per token. Each
sample's [T, H] slice of each aux layer, and of the last hidden state, gets one float32 scale amax / 448
(stored per sample, 16 bytes for Kimi: 0.008 bytes/token at 2k tokens). A per-sample scale costs no
resolution where it matters: e4m3 keeps 3 mantissa bits for every value from 2^-6 to 448 times the
scale, so a token whose values are 1/5000 of the sample's largest (a first-token massive activation)
still rounds to within 2^-4 of itself; only values under 3.5e-5 of the sample's amax fall into
subnormals (absolute step 2^-9 of the scale). Stored tensors in a part file of n samples, N tokens:
  aux_hidden_states [N, n_aux, H], last_hidden_state [N, H]                        (storage dtype)
  aux_hidden_states_sample_scale [n, n_aux], last_hidden_state_sample_scale [n]    (float32, fp8 only)
Shards written before per-sample scales (meta.json without "fp8_scales") hold per-token scales
`<key>_scale` [N, n_aux] / [N]; they still load. The loader (`decode`) hands stages 02-05 float32
tensors, so nothing after stage 01 sees fp8. Token shards (storage dtype "none") store no states at all:
stage 04 asks vLLM for them while it trains (online.py).
"""

from __future__ import annotations

import torch

from eagle3_pipeline.data.config import FP8, NO_STATES  # the choices, owned there

FP8_MAX = 448.0  # largest finite float8_e4m3fn value (OCP FP8 spec, E4M3: S.1111.110 = 448)
FP8_SCALES = "per_sample"  # meta.json "fp8_scales" of shards written now; absent = per-token (older)
SCALE_BYTES = 4  # float32 scale per sample and stored layer
STATE_KEYS = ("aux_hidden_states", "last_hidden_state")
SAMPLE_SCALE = "_sample_scale"  # suffix of the per-sample scale tensors (indexed by sample, not token)
TOKEN_SCALE = "_scale"  # suffix of the per-token scales of older shards
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, FP8: 1, NO_STATES: 0}


def resolve_dtype(name: str) -> torch.dtype:
    """The compute dtype of `name`, one of config.EXTRACT_DTYPES (ExtractConfig refuses any other)."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]


def resolve_storage_dtype(name: str, compute_dtype: torch.dtype) -> str:
    """The storage dtype's name (one of config.STORAGE_DTYPES); `auto` stores what the verifier computed in
    (the old behaviour)."""
    return str(compute_dtype).removeprefix("torch.") if name == "auto" else name


def bytes_per_token(storage_dtype: str, num_aux_layers: int, hidden_size: int) -> int:
    """Disk bytes of one token's hidden states (aux layers + teacher state)."""
    return (num_aux_layers + 1) * hidden_size * _BYTES[storage_dtype]


def bytes_per_sample(storage_dtype: str, num_aux_layers: int) -> int:
    """Disk bytes stored once per sample beside its tokens' states: the fp8 scales."""
    return (num_aux_layers + 1) * SCALE_BYTES if storage_dtype == FP8 else 0


def encode(aux: torch.Tensor, last: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """One sample's aux [T, n_aux, H] and last [T, H] -> the tensors written for them (scales [1, ...])."""
    if storage_dtype == NO_STATES:
        return {}
    if storage_dtype != FP8:
        dt = getattr(torch, storage_dtype)
        return {"aux_hidden_states": aux.to(dt), "last_hidden_state": last.to(dt)}
    out: dict[str, torch.Tensor] = {}
    for key, x in zip(STATE_KEYS, (aux, last)):
        x = x.float()
        # one amax per stored layer over the sample's tokens: aux -> [1, n_aux, 1], last -> [1, 1]
        amax = x.abs().amax(dim=(0, -1), keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # an all-zero slice stays zero
        out[key] = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out[key + SAMPLE_SCALE] = scale.reshape(1, -1) if x.dim() == 3 else scale.reshape(1)
    return out


def decode(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One sample's stored tensors -> the same dict with aux/last as float32 (fp8) or as stored."""
    out = {k: v for k, v in tensors.items() if not k.endswith(TOKEN_SCALE)}
    for key in STATE_KEYS:
        if key not in tensors or tensors[key].dtype != torch.float8_e4m3fn:
            continue
        x = tensors[key].float()
        if key + SAMPLE_SCALE in tensors:  # [1, n_aux] or [1]: broadcast over tokens (and hidden)
            scale = tensors[key + SAMPLE_SCALE].reshape(1, *x.shape[1:-1], 1)
        else:  # older shards: one scale per token and layer
            scale = tensors[key + TOKEN_SCALE].unsqueeze(-1)
        out[key] = x * scale
    return out


def is_per_sample(key: str) -> bool:
    """Whether a part-file tensor is indexed by sample (sliced [i:i+1]) rather than by token."""
    return key.endswith(SAMPLE_SCALE)


def stored_keys(storage_dtype: str) -> tuple[str, ...]:
    """Hidden-state tensors in a part file written now for this storage dtype."""
    if storage_dtype == NO_STATES:
        return ()
    return (*STATE_KEYS, *(k + SAMPLE_SCALE for k in STATE_KEYS)) if storage_dtype == FP8 else STATE_KEYS
