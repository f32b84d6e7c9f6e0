"""The verifier tensors a draft needs, found under Kimi-K2.5's names and a repack's (issue 8)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.verifier import load_verifier_tensors


def write_checkpoint(path, names):
    """A sharded checkpoint whose tensor i is filled with i, so each lookup can be told apart."""
    path.mkdir()
    tensors = {name: torch.full((2, 3), float(i)) for i, name in enumerate(names)}
    half = len(names) // 2
    index = {"metadata": {}, "weight_map": {}}
    for n, part in enumerate((names[:half], names[half:])):
        fname = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname))
        index["weight_map"].update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return {name: i for i, name in enumerate(names)}


OTHERS = [
    "language_model.model.layers.0.input_layernorm.weight",
    "language_model.model.layers.0.self_attn.kv_a_layernorm.weight",
    "vision_tower.encoder.final_layernorm.weight",
    "vision_tower.norm.weight",
    "mm_projector.norm.weight",
]


@pytest.mark.parametrize("norm", ["language_model.model.norm.weight", "language_model.norm.weight"])
def test_kimi_names_and_repacked_norm_name_are_found(tmp_path, norm):
    names = ["language_model.model.embed_tokens.weight", norm, "language_model.lm_head.weight", *OTHERS]
    fill = write_checkpoint(tmp_path / "ckpt", names)
    out = load_verifier_tensors(tmp_path / "ckpt", tie_word_embeddings=False)
    assert float(out["norm"][0, 0]) == fill[norm]
    assert float(out["embed_tokens"][0, 0]) == fill["language_model.model.embed_tokens.weight"]
    assert float(out["lm_head"][0, 0]) == fill["language_model.lm_head.weight"]


def test_missing_norm_is_an_error_naming_it(tmp_path):
    names = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight", *OTHERS]
    write_checkpoint(tmp_path / "ckpt", names)
    with pytest.raises(UserError, match=r"not found: \['norm'\]"):
        load_verifier_tensors(tmp_path / "ckpt", tie_word_embeddings=False)
