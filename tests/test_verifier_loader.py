"""The verifier tensors a draft needs, found under Kimi-K2.5's names and a repack's (issue 8)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.verifier import AuxCapture, draft_tensors_of, load_verifier_tensors


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


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_a_verifier_whose_config_ties_its_head_lends_the_embedding_as_lm_head(tmp_path, where):
    """SmolLM2-style checkpoints ship no lm_head: the draft's head rows come from the embedding when the
    verifier's config.json ties them (top level, or Kimi-style under text_config), and stages 04 and 05
    read that from the verifier itself (the shards' contract does not record it)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight"]
    fill = write_checkpoint(tmp_path / "ckpt", names)
    text = {"num_hidden_layers": 1, "hidden_size": 3, "vocab_size": 2, "tie_word_embeddings": True}
    config = text if where == "top" else {"architectures": ["X"], "text_config": text}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    out = draft_tensors_of(tmp_path / "ckpt")
    assert float(out["lm_head"][0, 0]) == float(out["embed_tokens"][0, 0]) == fill["model.embed_tokens.weight"]


def test_an_untied_verifier_without_lm_head_is_an_error_naming_it(tmp_path):
    write_checkpoint(tmp_path / "ckpt", ["model.embed_tokens.weight", "model.norm.weight"])
    (tmp_path / "ckpt" / "config.json").write_text(
        json.dumps({"num_hidden_layers": 1, "hidden_size": 3, "vocab_size": 2, "tie_word_embeddings": False})
    )
    with pytest.raises(UserError, match=r"not found: \['lm_head'\]"):
        draft_tensors_of(tmp_path / "ckpt")


def test_aux_states_from_layers_on_other_devices_come_back_on_the_last_layers():
    """device_map=auto spreads the verifier's layers over the GPUs, each hook keeping its state where its
    layer ran; the batch comes back on the last layer's device. Here "meta" plays the last GPU."""
    layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(4))
    capture = AuxCapture(layers, [1, 3])
    x = torch.arange(12.0).reshape(1, 2, 6)
    for i in range(3):
        layers[i](x + i)
    layers[3].to("meta")(x.to("meta"))
    aux, last = capture.pop_batch()
    assert aux.device.type == "meta" and last.device.type == "meta"
    assert aux.shape == (1, 2, 2, 6) and not capture.states
