"""The vLLM serving contract (docs/vllm_contract.md): each silent failure impossible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, draft_spec, run_script, script
from sabotage import SABOTAGES

REFERENCE = REPO.parent / "shared" / "reference" / "aq-medai-kimi-k2-eagle3.config.json"


def kimi_spec():
    """The llama draft configs/kimi_k25.toml names as its alternative, over Kimi-K2.5 (hidden 7168, vocab
    163840, eps 1e-5): the public AQ-MedAI draft's layer (its MLA default: tests/test_mla_draft.py)."""
    import tomllib

    kimi = tomllib.loads((REPO / "configs" / "kimi_k25.toml").read_text())
    aux = tuple(kimi["extract"]["aux_layer_ids"])
    draft_vocab = kimi["vocab"]["draft_vocab_size"]
    train = {**kimi["train"], "draft_arch": "llama", "norm_before_fc": True}
    return draft_spec(7168, 163840, draft_vocab, aux, rms_norm_eps=1e-5, **train)


def test_kimi_draft_on_meta_device_matches_the_public_kimi_draft():
    from eagle3_pipeline.models.draft import build_draft
    from eagle3_pipeline.export_eval.export import expected_shapes, export_config, flat_weights

    spec = kimi_spec()
    with torch.device("meta"):
        model = build_draft(spec)
        d2t = torch.zeros(spec.draft_vocab_size, dtype=torch.int64)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        tensors = flat_weights(dict(model.named_parameters()), d2t, t2d, spec)
    config = export_config(spec, {})
    reference = json.loads(REFERENCE.read_text())
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "draft_vocab_size",
        "vocab_size",
        "architectures",
        "model_type",
        "num_hidden_layers",
    ):
        assert config[key] == reference[key], key
    assert (
        config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        == reference["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        == config["eagle_aux_hidden_state_layer_ids"]
    )
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes == expected_shapes(config)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (8192, 14336)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (8192, 14336)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 8192)
    assert shapes["fc.weight"] == (7168, 21504)
    assert shapes["lm_head.weight"] == (32000, 7168)
    assert shapes["midlayer.mlp.down_proj.weight"] == (7168, 18432)
    assert shapes["d2t"] == (32000,) and tensors["d2t"].dtype == torch.int64
    if spec.norm_before_fc:  # EAGLE-3.1's norm over the three concatenated aux states
        assert shapes["input_norm.weight"] == (21504,) and config["eagle_config"]["norm_before_fc"] is True
    assert "embed_tokens.weight" not in tensors and not any(k.startswith("model.") for k in tensors)


def test_head_dim_never_falls_back_to_hidden_over_heads():
    from eagle3_pipeline.models.draft import build_draft, decoder_config

    spec = kimi_spec()
    assert spec.hidden_size // spec.num_attention_heads == 112
    assert decoder_config(spec, "sdpa").head_dim == 128
    with torch.device("meta"):
        model = build_draft(spec)
    assert model.layers[0].self_attn.q_proj.weight.shape[0] == 64 * 128
    assert model.layers[0].self_attn.head_dim == 128


def test_d2t_offsets_map_each_draft_id_to_its_target_id():
    from eagle3_pipeline.data.vocab import draft_to_target, mappings, select_draft_vocab

    counts = torch.zeros(50, dtype=torch.int64)
    counts[[40, 7, 33, 12, 3]] = torch.tensor([9, 9, 5, 1, 1])  # ties: 40 vs 7, 12 vs 3
    selected = select_draft_vocab(counts, 4)
    assert selected.tolist() == [3, 7, 33, 40]  # 12 loses the tie to 3, output ascending
    d2t, t2d = mappings(selected, 50)
    assert d2t.dtype == torch.int64
    assert draft_to_target(torch.arange(4), d2t).tolist() == [3, 7, 33, 40]
    assert t2d.nonzero().flatten().tolist() == [3, 7, 33, 40]
    assert select_draft_vocab(torch.zeros(10, dtype=torch.int64), 3).tolist() == [0, 1, 2]


def test_export_d2t_is_the_mapping_training_used(tiny_run):
    from safetensors.torch import load_file

    from eagle3_pipeline.data.vocab import draft_to_target

    exported = load_file(str(tiny_run / "draft" / "model.safetensors"))
    mapping = load_file(str(tiny_run / "vocab" / "vocab_mapping.safetensors"))
    targets = draft_to_target(torch.arange(exported["d2t"].numel()), exported["d2t"])
    assert targets.tolist() == mapping["t2d"].nonzero().flatten().tolist()
    assert (exported["d2t"] != 0).any()  # a real mapping, so losing d2t would matter


@pytest.mark.parametrize("fault", sorted(SABOTAGES))
def test_gate_refuses_each_silent_fault(tiny_run, tmp_path, fault):
    bad = SABOTAGES[fault](tiny_run / "draft", tmp_path / fault)
    proc = run_script(script("05_export.py"), "--check", str(bad), check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "export refused" in proc.stderr and "Traceback" not in proc.stderr
    expected = {
        "no_head_dim": "head_dim missing",
        "no_d2t": "d2t missing",
        "aux_ids_shifted": "aux layer ids",
        "norm_flag_dropped": "missing: vLLM would take false",
    }
    assert expected[fault] in proc.stderr


def test_gate_passes_the_good_export(tiny_run):
    proc = run_script(script("05_export.py"), "--check", str(tiny_run / "draft"))
    assert "passes the gate" in proc.stderr


def test_readback_under_vllm_rules_catches_a_missing_head_dim(tiny_run, tmp_path):
    """Even past the static checks, the read-back sees what vLLM would run: narrowed heads, other logits."""
    from eagle3_pipeline.export_eval.export import gate_samples, load_trained, readback_problems

    _, meta, model, vt, _, _ = load_trained(tiny_run / "train", "best")
    samples = gate_samples(meta, 2)
    ok, stats = readback_problems(tiny_run / "draft", model, vt["embed_tokens"], samples, 3)
    assert ok == [] and stats["top1_agreement"] >= 0.98
    bad = SABOTAGES["no_head_dim"](tiny_run / "draft", tmp_path / "nohd")
    problems, stats = readback_problems(bad, model, vt["embed_tokens"], samples, 3)
    assert problems and stats["top1_agreement"] < 0.9


def test_the_gate_reads_a_prefix_of_each_long_sample(tiny_run, monkeypatch):
    """A stored sample is read back on its first GATE_TOKENS tokens (a window's draft: twice its window),
    the same tensors as the stored sample's prefix, and the good export still passes on them."""
    from eagle3_pipeline.data.shards import load_sample, open_shards
    from eagle3_pipeline.export_eval import export

    _, meta, model, vt, _, _ = export.load_trained(tiny_run / "train", "best")
    monkeypatch.setattr(export, "GATE_TOKENS", 24)
    cut = export.gate_samples(meta, 2)
    whole = [load_sample(r) for r in open_shards(meta["shards"], verify=False).samples[:2]]
    assert all(len(w["input_ids"]) > 24 for w in whole) and all(len(c["input_ids"]) == 24 for c in cut)
    for c, w in zip(cut, whole):
        assert c.keys() == w.keys() and all(torch.equal(c[k], w[k][:24]) for k in w)
    assert export.readback_problems(tiny_run / "draft", model, vt["embed_tokens"], cut, 3)[0] == []
    assert export.gate_tokens({"sliding_window": 40}) == 80


def test_wrong_shape_is_refused_before_writing(tiny_run, tmp_path):
    from safetensors.torch import load_file

    from eagle3_pipeline.export_eval.export import static_problems

    config = json.loads((tiny_run / "draft" / "config.json").read_text())
    tensors = load_file(str(tiny_run / "draft" / "model.safetensors"))
    meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    expect = {"draft": meta["draft"], "d2t": tensors["d2t"]}
    assert static_problems(config, tensors, expect) == []
    tensors["midlayer.self_attn.o_proj.weight"] = tensors["midlayer.self_attn.o_proj.weight"][:, :256]
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    problems = static_problems(config, tensors, expect)
    assert any("o_proj" in p and "shape" in p for p in problems)
    assert any("model." in p for p in problems) and any("fc.weight missing" in p for p in problems)


def test_wrong_d2t_offsets_or_dtype_are_refused(tiny_run):
    """A d2t that loads fine but maps one draft id to another target token is caught."""
    from safetensors.torch import load_file

    from eagle3_pipeline.export_eval.export import static_problems

    config = json.loads((tiny_run / "draft" / "config.json").read_text())
    tensors = load_file(str(tiny_run / "draft" / "model.safetensors"))
    meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    expect = {"draft": meta["draft"], "d2t": tensors["d2t"].clone()}
    shifted = dict(tensors, d2t=tensors["d2t"].clone())
    shifted["d2t"][5] += 1
    assert any("d2t differs" in p for p in static_problems(config, shifted, expect))
    as_int32 = dict(tensors, d2t=tensors["d2t"].to(torch.int32))
    assert any("int64" in p for p in static_problems(config, as_int32, expect))


def test_verifier_tensors_load_through_the_index_whatever_the_prefix(tmp_path):
    """Kimi-K2.5 keeps its text weights under `language_model.`; only three tensors are read."""
    from eagle3_pipeline.models.tiny import build_verifier
    from eagle3_pipeline.models.verifier import load_verifier_tensors, verifier_facts

    flat = build_verifier("deepseek_v3", tmp_path / "flat")
    nested = build_verifier("deepseek_v3", tmp_path / "nested", nest_as_kimi=True)
    facts = verifier_facts(Path(nested))
    assert facts.architecture == "KimiK25ForConditionalGeneration" and facts.num_hidden_layers == 8
    a = load_verifier_tensors(flat, False)
    b = load_verifier_tensors(nested, False)
    assert set(a) == set(b) == {"embed_tokens", "norm", "lm_head"}
    for k in a:
        torch.testing.assert_close(a[k], b[k])


def test_nested_kimi_style_verifier_gives_the_same_aux_states(tmp_path):
    """KimiK25ForConditionalGeneration wraps the text model (`text_config`, `language_model.` weights)."""
    from eagle3_pipeline.models.tiny import build_verifier
    from eagle3_pipeline.models.verifier import AuxCapture, find_decoder_layers, load_verifier_model

    states = []
    for nest in (False, True):
        path = build_verifier("deepseek_v3", tmp_path / str(nest), nest_as_kimi=nest)
        model = load_verifier_model(path, torch.float32, trust_remote_code=False)
        capture = AuxCapture(find_decoder_layers(model, 8), [2, 4, 5])
        with torch.no_grad():
            model(input_ids=torch.tensor([[72, 101, 108, 108, 111]]), use_cache=False)
        states.append(capture.pop())
    assert "KimiK25" in type(model).__name__ or "Kimi_K25" in type(model).__name__
    torch.testing.assert_close(states[0][0], states[1][0], rtol=0, atol=0)
    torch.testing.assert_close(states[0][1], states[1][1], rtol=0, atol=0)


def test_serve_line_fits_the_verifier(tmp_path):
    from eagle3_pipeline.export_eval.export import serve_line

    plain, kimi = tmp_path / "llama", tmp_path / "kimi"
    for d in (plain, kimi):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # Kimi-K2.5's config maps its classes to the checkpoint's own code (auto_map), as its tokenizer does
    (kimi / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}})
    )
    line = serve_line(str(plain), tmp_path / "draft", 3)
    assert f"vllm serve {plain} --tensor-parallel-size 1 \\" in line  # no GPU here: 1, no remote code
    assert '"num_speculative_tokens": 3' in line and "--trust-remote-code" not in line
    assert "draft_sample_method" not in line  # vLLM's default, argmax drafting
    draft = tmp_path / "draft"
    line = serve_line(str(kimi), draft, 3, tensor_parallel_size=8, draft_sample_method="probabilistic")
    assert f"vllm serve {kimi} --tensor-parallel-size 8 --trust-remote-code \\" in line
    spec = json.loads(line.split("--speculative-config '")[1].rstrip("'"))
    assert spec == {"method": "eagle3", "model": str(draft.resolve()), "num_speculative_tokens": 3,
                    "draft_sample_method": "probabilistic"}  # fmt: skip
