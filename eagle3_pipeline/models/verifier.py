"""The verifier: its text config, aux-layer capture with hooks, and the few tensors a draft needs.

Layer ids follow vLLM (`vllm/model_executor/models/llama_eagle3.py` and docs/vllm_contract.md
section 3): id i is the residual stream entering decoder layer i, which is Hugging Face's
`hidden_states[i]` (0 = embedding output). It is captured as the output of decoder layer i-1 with a
forward hook, so only the configured layers are ever held, never all 61.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.core.errors import UserError

log = logging.getLogger("eagle3.verifier")


@dataclass(frozen=True)
class VerifierFacts:
    """What later stages need to know of the verifier, recorded in every meta.json."""

    path: str
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    fingerprint: str | None = None  # verifier_fingerprint, where the stage recording the facts took it


def read_text_config(path: Path) -> dict[str, Any]:
    """config.json of the text model (Kimi-K2.5 nests it under `text_config`)."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise UserError(f"{path}: no config.json; --verifier-path must be a Hugging Face checkpoint folder")
    cfg = json.loads(cfg_file.read_text())
    text = cfg.get("text_config") or cfg
    for key in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if key not in text:
            raise UserError(f"{cfg_file}: no `{key}` in the (text) config")
    return {
        **text,
        "_top_architecture": (cfg.get("architectures") or ["?"])[0],
        "_tie_top": cfg.get("tie_word_embeddings"),
    }


def verifier_facts(path: Path) -> VerifierFacts:
    t = read_text_config(path)
    tie = t.get("tie_word_embeddings", t["_tie_top"])
    return VerifierFacts(
        path=str(path.resolve()),
        architecture=t["_top_architecture"],
        num_hidden_layers=int(t["num_hidden_layers"]),
        hidden_size=int(t["hidden_size"]),
        vocab_size=int(t["vocab_size"]),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(tie) if tie is not None else False,
    )


# What verifier_fingerprint reads of each weight file besides its name, size and safetensors header:
# FINGERPRINT_BLOCKS blocks of FINGERPRINT_BLOCK_BYTES spread evenly over its data (2 MiB a file; all of a
# file smaller than that). Kimi-K2.5's ~64 files of ~9.5 GB: ~130 MB read, not its ~600 GB.
FINGERPRINT_BLOCKS = 8
FINGERPRINT_BLOCK_BYTES = 1 << 18
FINGERPRINT_VERSION = "sampled-sha256/1"  # part of the digest: another way of sampling never matches
# config.json keys that change no hidden state (generation ids, bookkeeping): a verifier copied with another
# eos_token_id is the same verifier
FINGERPRINT_IGNORED = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "transformers_version",
                                 "use_cache", "_name_or_path", "torch_dtype", "dtype"})  # fmt: skip


def verifier_fingerprint(path: Path) -> str:
    """The verifier's identity, recorded by stages 00 and 01 and checked by every stage given a verifier:
    a sha256 over its text config (config.json; Kimi-K2.5's `text_config`; less FINGERPRINT_IGNORED) and,
    for every *.safetensors file, its name, size, header (tensor names, dtypes, shapes, offsets) and a fixed
    sample of its data. Bounded cost, not a full hash: two checkpoints that differ only in bytes outside the
    sampled blocks get the same fingerprint. Other weights of the same config (trained, re-initialised,
    fine-tuned) differ in every block, so they never do; nothing is cached (weights replaced in place)."""
    h = hashlib.sha256(FINGERPRINT_VERSION.encode() + b"\0")
    text = {k: v for k, v in read_text_config(path).items() if k not in FINGERPRINT_IGNORED}
    h.update(json.dumps(text, sort_keys=True).encode() + b"\0")
    for f in sorted(path.glob("*.safetensors")):
        _digest_weight_file(h, f)
    return h.hexdigest()


def _digest_weight_file(h: Any, f: Path) -> None:
    size = f.stat().st_size
    h.update(f"{f.name}\0{size}\0".encode())
    with open(f, "rb") as fh:
        head = fh.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        start = min(8 + header_len, size)
        h.update(head + fh.read(start - len(head)))
        data = size - start
        n = FINGERPRINT_BLOCKS if data > FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK_BYTES else 1
        block = FINGERPRINT_BLOCK_BYTES if n > 1 else data
        for i in range(n):
            fh.seek(start + (data - block) * i // max(n - 1, 1))
            h.update(fh.read(block))


def check_verifier(path: Path, recorded: str | None, where: Path, recorded_path: Path) -> str | None:
    """The fingerprint of the verifier at `path`, refused (UserError naming both) when it differs from the
    one that `where` records of `recorded_path`; an older record without one is named in a warning."""
    if recorded is None:
        log.warning("%s records no verifier fingerprint (made by an older version): %s is not checked "
                    "against the verifier that made it", where, path)  # fmt: skip
        return None
    if not (path / "config.json").is_file():
        raise UserError(
            f"verifier {path}: no config.json there ({where} records {recorded_path}; paths are recorded "
            "relative to the folder of the file recording them, so a folder copied away from its run loses "
            "them): pass the verifier with --verifier-path (stages 01, 04, 06), or run stage 05 where the "
            "training run lies"
        )
    got = verifier_fingerprint(path)
    if got != recorded:
        raise UserError(
            f"verifier {path} (fingerprint {got[:16]}) is not the verifier {where} records: {recorded_path} "
            f"(fingerprint {recorded[:16]}, as it was then), whose states, mapping and draft these are. "
            "Pass that verifier (--verifier-path), or redo the stages from 01_extract_hidden_states.py "
            "with this one"
        )
    return got


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """(2, N//2, N-3): vLLM's default for EAGLE-3 drafts; [2, 30, 58] for Kimi-K2.5's 61 layers."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    if len(ids) < 1 or sorted(set(ids)) != list(ids):
        raise UserError(
            f"aux_layer_ids {ids}: must be strictly ascending (vLLM concatenates them in ascending order)"
        )
    if ids[0] < 1 or ids[-1] > num_layers:
        raise UserError(
            f"aux_layer_ids {ids}: each id must lie in [1, {num_layers}] for a {num_layers}-layer verifier"
        )
    return list(ids)


def load_verifier_model(path: Path, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """The verifier for extraction, spread over all visible GPUs (device_map=auto) when there are any."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if torch.cuda.is_available():
        kwargs["device_map"] = "auto"
    config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except ValueError:
        if getattr(config, "text_config", None) is None:
            raise
        # A multimodal wrapper (KimiK25ForConditionalGeneration): run its text model only.
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(str(path), **kwargs)
    model.eval()
    return model


def find_decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The text decoder's layer list, wherever the wrapper keeps it."""
    candidates = [
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList)
        and name.endswith("layers")
        and len(m) == num_layers
        and "vision" not in name
        and "visual" not in name
    ]
    if len(candidates) != 1:
        raise UserError(
            f"cannot locate the verifier's {num_layers} decoder layers "
            f"(found {len(candidates)} candidate lists)"
        )
    return candidates[0]


class AuxCapture:
    """Forward hooks that keep the outputs of decoder layers (id - 1) for each aux id, plus the last
    layer's output (pre-final-norm), which the teacher needs to rebuild the verifier's logits."""

    def __init__(self, layers: torch.nn.ModuleList, aux_layer_ids: list[int]):
        self.aux_layer_ids = aux_layer_ids
        self.states: dict[int, torch.Tensor] = {}
        self.last_layer_id = len(layers)
        wanted = sorted(set(aux_layer_ids) | {len(layers)})
        self.handles = [layers[i - 1].register_forward_hook(self._hook(i)) for i in wanted]

    def _hook(self, layer_id: int) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            h = output[0] if isinstance(output, tuple) else output
            self.states[layer_id] = h.detach()

        return hook

    def pop_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, T, n_aux, H] aux states, [B, T, H] last hidden state) of the batch just run, on the last
        layer's device (device_map=auto spreads the layers, and so their states, over the GPUs)."""
        last = self.states[self.last_layer_id]
        aux = torch.stack([self.states[i].to(last.device) for i in self.aux_layer_ids], dim=2)
        self.states.clear()
        return aux, last

    def pop(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, n_aux, H], [T, H]) of the single sequence just run."""
        aux, last = self.pop_batch()
        return aux[0], last[0]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map and total_size


def weight_bytes(path: Path) -> int | None:
    """The checkpoint's weight bytes: its index's total_size, else the size of its .safetensors files,
    else None (a folder holding config.json only)."""
    idx = path / INDEX_FILE
    if idx.is_file():
        try:
            total = json.loads(idx.read_text()).get("metadata", {}).get("total_size")
        except ValueError:
            total = None
        if isinstance(total, int) and total > 0:
            return total
    files = sorted(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


def _index(path: Path) -> dict[str, str]:
    """tensor name -> file, from model.safetensors.index.json or the single model.safetensors."""
    idx = path / INDEX_FILE
    if idx.is_file():
        return json.loads(idx.read_text())["weight_map"]
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {k: single.name for k in f.keys()}
    raise UserError(f"{path}: no model.safetensors(.index.json); the verifier must be in safetensors")


# The final norm and heads, whatever the prefix: `language_model.model.norm.weight` in Kimi-K2.5's
# checkpoint, `language_model.norm.weight` in some repacks of it.
_WANTED = {
    "embed_tokens": re.compile(r"(^|\.)embed_tokens\.weight$"),
    "norm": re.compile(r"(^|\.)model\.norm\.weight$|^norm\.weight$|^language_model\.norm\.weight$"),
    "lm_head": re.compile(r"(^|\.)lm_head\.weight$"),
}


def draft_tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """The verifier tensors a draft needs (embed_tokens, final norm, lm_head), a tied lm_head read as the
    embedding when the verifier's own config.json ties them (SmolLM2, Llama-3.2-1B; not Kimi-K2.5)."""
    return load_verifier_tensors(path, verifier_facts(path).tie_word_embeddings)


def load_verifier_tensors(path: Path, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """embed_tokens, final norm and lm_head only: read through the index, never the whole verifier."""
    from safetensors import safe_open

    weight_map = _index(path)
    found: dict[str, str] = {}
    for name in weight_map:
        if "vision" in name or "mm_projector" in name:
            continue
        for key, pattern in _WANTED.items():
            if pattern.search(name):
                if key in found:
                    raise UserError(f"{path}: two tensors match {key}: {found[key]} and {name}")
                found[key] = name
    if "lm_head" not in found and tie_word_embeddings and "embed_tokens" in found:
        found["lm_head"] = found["embed_tokens"]
    missing = sorted(set(_WANTED) - set(found))
    if missing:
        raise UserError(f"{path}: verifier tensors not found: {missing}")
    out = {}
    for key, name in found.items():
        with safe_open(str(path / weight_map[name]), "pt") as f:
            out[key] = f.get_tensor(name)
    return out
