"""The draft's RoPE scaling ([train] rope_scaling, core/rope_scaling.py): trained with transformers' yarn,
exported as vLLM 0.32 reads it, read back with vLLM's formulas and compared at positions past the
original length, and refused by the gate, naming the key, when the export says otherwise."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_mla_draft import _export, _random_draft, train_cfg

# Kimi-K2.5's text_config rope_scaling, in DeepSeek-V3's legacy form ("type")
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
FAR = torch.tensor([0, 7, 4095, 5000, 70000, 262000])  # past the original 4,096 positions too


def spec(arch: str, rope_scaling: str = "verifier", **train: object):
    """A tiny draft (hidden 256) over a verifier config that carries Kimi-K2.5's yarn."""
    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.models.tiny import tiny_config

    verifier = {**tiny_config("kimi_mla"), "rope_scaling": KIMI_YARN}
    extra = {"norm_before_fc": True, "num_key_value_heads": 2, "head_dim": 64} if arch == "llama" else {}
    cfg = train_cfg(draft_arch=arch, rope_scaling=rope_scaling, rope_theta=1e6, **extra, **train)
    return spec_for_training(cfg, verifier, 96, (2, 4, 5))


def vllm_cos_sin(dim: int, theta: float, table: dict | None, positions: torch.Tensor) -> torch.Tensor:
    """cos | sin [T, dim] by vLLM 0.32's yarn formulas (core/rope_scaling.py, the read-back's)."""
    from eagle3_pipeline.core import rope_scaling

    inv = torch.tensor(rope_scaling.inv_freq(dim, theta, table), dtype=torch.float64)
    ang = positions.double()[:, None] * inv[None]
    f = rope_scaling.cos_sin_factor(table)
    return torch.cat([ang.cos() * f, ang.sin() * f], dim=-1).float()


def draft_cos_sin(model, positions: torch.Tensor) -> torch.Tensor:
    """The training draft's cos | sin (transformers' rotary embedding) [T, dim]: first half of each."""
    x = torch.zeros(1, 1, len(positions))
    cos, sin = model.rotary_emb(x, positions[None])
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


def test_the_setting_resolves_to_the_verifiers_yarn_or_a_table_and_refuses_others():
    from eagle3_pipeline.core import rope_scaling
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.models.tiny import tiny_config
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG

    kimi = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    assert spec("mla").rope_scaling == rope_scaling.canonical(KIMI_YARN, "t") == kimi
    assert rope_scaling.resolve("verifier", KIMI_K25_TEXT_CONFIG)["factor"] == 64.0
    assert rope_scaling.resolve("verifier", tiny_config("deepseek_v3")) is None  # the tiny verifier: plain
    v5 = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e4, "factor": 8,
                              "original_max_position_embeddings": 64}}  # transformers 5's form
    assert rope_scaling.resolve("verifier", v5) == {"rope_type": "yarn", "factor": 8.0,
                                                    "original_max_position_embeddings": 64}  # fmt: skip
    assert spec("mla", "none").rope_scaling is None and "rope_scaling" not in spec("mla", "none").to_json()
    table = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 16}'
    assert spec("llama", table).rope_scaling["factor"] == 4.0
    for bad, named in [("yarn", "--rope-scaling.*none, verifier or a JSON yarn table"),
                       ('{"rope_type": "llama3", "factor": 8}', "rope_type 'llama3' is not supported"),
                       ('{"rope_type": "yarn", "factor": 4}', "needs `original_max_position_embeddings`"),
                       (table[:-1] + ', "mscale": 1}', "both `mscale` and `mscale_all_dim`"),
                       (table[:-1] + ', "truncate": false}', "unknown key.*truncate")]:  # fmt: skip
        with pytest.raises(UserError, match=named):
            train_cfg(rope_scaling=bad)
    llama3 = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(UserError, match="--rope-scaling verifier.*llama3"):
        rope_scaling.resolve("verifier", llama3)


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_the_draft_rotates_with_yarn_as_vllm_does_past_the_original_length(arch):
    """The training draft (transformers' yarn) == vLLM's yarn formulas at Kimi's positions, and not plain
    RoPE there; the MLA layer's softmax scale carries DeepSeek's mscale(64, mscale_all_dim 1) ** 2."""
    from eagle3_pipeline.models.draft import DraftSpec, build_draft

    s = spec(arch)
    assert DraftSpec.from_json(json.loads(json.dumps(s.to_json()))) == s  # meta.json keeps it
    model = build_draft(s)
    dim = s.qk_rope_head_dim if arch == "mla" else s.head_dim
    got = draft_cos_sin(model, FAR)
    # float32 angles (both sides round them so) at 262,000 differ by up to its ulp, 0.016
    torch.testing.assert_close(got, vllm_cos_sin(dim, 1e6, s.rope_scaling, FAR), atol=1e-2, rtol=0)
    plain = vllm_cos_sin(dim, 1e6, None, FAR)
    assert (got[3:] - plain[3:]).abs().max() > 0.5  # past 4,096 positions yarn turns otherwise
    attn = model.layers[0].self_attn
    if arch == "mla":  # DeepSeek-V3: softmax_scale = qk_head_dim ** -0.5 * yarn_get_mscale(64, 1) ** 2
        mscale = 0.1 * 1.0 * math.log(64.0) + 1.0
        assert attn.scaling == pytest.approx((64 + 64) ** -0.5 * mscale**2)
        assert build_draft(spec(arch, "none")).layers[0].self_attn.scaling == pytest.approx((64 + 64) ** -0.5)
    else:
        assert attn.scaling == pytest.approx(s.head_dim**-0.5)  # vLLM's LlamaAttention: no mscale


def _logits(model, aux, ids, pos, ttt_steps=2):
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos,
              ttt_steps=ttt_steps)  # fmt: skip
    hook.remove()
    return captured


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_the_export_read_as_vllm_reads_it_equals_training_past_the_original_length(tmp_path, arch):
    """Logits at positions 0, 900, ... 9900 (past 4,096): training == the read-back of the export; the
    read-back of the same export with another factor or without yarn does not."""
    from eagle3_pipeline.models.reference_mla import read_export

    s = spec(arch)
    model = _random_draft(s)
    d = _export(s, model, tmp_path / "draft")
    assert json.loads((d / "config.json").read_text())["rope_scaling"] == s.rope_scaling
    T = 12
    torch.manual_seed(1)
    aux = torch.randn(1, T, 3 * s.hidden_size)
    ids = torch.randint(0, s.vocab_size, (1, T))
    pos = torch.arange(T)[None] * 900
    want = _logits(model, aux, ids, pos)
    spread = float(want[0].std())
    embed = model.embed_tokens.weight.detach()
    out0, logits0, cache = read_export(d, embed).first_pass(aux[0], ids[0], pos[0])
    torch.testing.assert_close(logits0, want[0][0], atol=2e-3 * spread, rtol=1e-4)
    _, lg, _ = read_export(d, embed).step(out0[5:6], ids[0, 6:7], pos[0, 5:6] + 1, cache.truncate(6))
    torch.testing.assert_close(lg[0], want[1][0, 5], atol=2e-3 * spread, rtol=1e-4)
    config = json.loads((d / "config.json").read_text())
    for edit in ({**s.rope_scaling, "factor": 32.0}, None):
        (d / "config.json").write_text(json.dumps({**config, "rope_scaling": edit}))
        _, other, _ = read_export(d, embed).first_pass(aux[0], ids[0], pos[0])
        assert (other - want[0][0]).abs().max() > 0.05 * spread, edit


def _static(tmp_path, s, model, **changes):
    from safetensors.torch import load_file

    from eagle3_pipeline.export_eval.export import static_problems

    d = _export(s, model, tmp_path / "draft")
    config = {**json.loads((d / "config.json").read_text()), **changes}
    for k in [k for k, v in changes.items() if v is ...]:
        del config[k]
    tensors = load_file(str(d / "model.safetensors"))
    return static_problems(config, tensors, {"draft": s.to_json(), "d2t": model.d2t})


def test_gate_accepts_the_trained_rope_and_refuses_an_edited_one_naming_the_key(tmp_path):
    import re

    s = spec("mla")
    model = _random_draft(s)
    assert _static(tmp_path, s, model) == []
    for change, named in [
        ({"rope_scaling": {**s.rope_scaling, "factor": 32.0}}, r"rope_scaling\.factor 32\.0 != trained 64"),
        ({"rope_scaling": None}, "rope_scaling missing: .*yarn factor 64 over 4096.*plain RoPE"),
        ({"rope_scaling": ...}, "rope_scaling missing"),
        ({"rope_scaling": {**s.rope_scaling, "original_max_position_embeddings": 8192}},
         r"rope_scaling\.original_max_position_embeddings 8192 != trained 4096"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 64}}, "rope_scaling: yarn needs"),
    ]:
        problems = _static(tmp_path, s, model, **change)
        assert any(re.search(named, p) for p in problems), (change, problems)
    plain = spec("llama", "none")
    plain_model = _random_draft(plain)
    assert _static(tmp_path, plain, plain_model) == []
    from eagle3_pipeline.export_eval.export import export_config

    assert export_config(plain, {})["rope_scaling"] is None  # a draft trained with "none": null, as before
    yarn_params = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, **s.rope_scaling}}
    problems = _static(tmp_path, plain, plain_model, **yarn_params)
    assert any("rope_parameters must be null" in p for p in problems), problems
    assert any("rope_scaling must be null" in p
               for p in _static(tmp_path, plain, plain_model, rope_scaling=s.rope_scaling))  # fmt: skip
    other_theta = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e4}}
    assert any("rope_parameters.rope_theta 50000.0 != trained" in p
               for p in _static(tmp_path, plain, plain_model, **other_theta))  # fmt: skip


def test_gate_read_back_runs_past_the_original_length_and_refuses_another_factor(tmp_path):
    """The gate's read-back (readback_problems) adds each sample at spread positions for a yarn draft,
    where an export edited to another factor (the static checks bypassed) no longer reproduces training."""
    from eagle3_pipeline.export_eval.export import readback_problems

    s = spec("mla")
    model = _random_draft(s, seed=2)
    d = _export(s, model, tmp_path / "draft")
    torch.manual_seed(3)
    H = s.hidden_size
    samples = [{"input_ids": torch.randint(0, s.vocab_size, (n,)), "loss_mask": torch.ones(n).bool(),
                "aux_hidden_states": torch.randn(n, 3, H), "last_hidden_state": torch.randn(n, H)}
               for n in (10, 14)]  # fmt: skip
    embed = model.embed_tokens.weight.detach()
    problems, stats = readback_problems(d, model, embed, samples, ttt_steps=2)
    assert problems == [] and stats["positions"] == 2 * ((9 + 8) + (13 + 8))  # as stored, then spread
    config = json.loads((d / "config.json").read_text())
    for edit in ({**s.rope_scaling, "factor": 16.0}, None):  # None: spread as trained all the same
        (d / "config.json").write_text(json.dumps({**config, "rope_scaling": edit}))
        problems, wrong = readback_problems(d, model, embed, samples, ttt_steps=2)
        assert wrong["positions"] == stats["positions"]
        assert any("agrees with the trained draft on" in p for p in problems), problems


def test_a_checkpoint_trained_with_another_rope_is_refused():
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.export_eval.export_rope import check_checkpoint_rope
    from eagle3_pipeline.models.draft import build_draft, rope_parameters_of

    built = rope_parameters_of(build_draft(spec("llama")))
    assert built["rope_type"] == "yarn" and built["factor"] == 64.0 and built["rope_theta"] == 1e6
    check_checkpoint_rope(None, built, "ckpt")  # recorded before the setting existed: nothing to compare
    check_checkpoint_rope(json.loads(json.dumps(built)), built, "ckpt")
    with pytest.raises(UserError, match="ckpt: trained with RoPE .*'default'"):
        check_checkpoint_rope({"rope_type": "default", "rope_theta": 1e6}, built, "ckpt")


def test_stage_04_reads_the_verifiers_yarn_from_its_config_json(tmp_path):
    """rope_scaling "verifier" on a llama draft: stage 04 reads the verifier's (nested, Kimi-style)
    config.json, which the shards' meta.json does not carry."""
    from types import SimpleNamespace

    from eagle3_pipeline.data.shards import ShardSet
    from eagle3_pipeline.models.tiny import tiny_config
    from eagle3_pipeline.training.train import draft_spec

    text = {**tiny_config("kimi_mla"), "rope_scaling": KIMI_YARN}
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["KimiK25"], "text_config": text}))
    verifier = {"path": str(tmp_path), **{k: text[k] for k in ("hidden_size", "vocab_size", "rms_norm_eps")}}
    shard_set = ShardSet([], {"verifier": verifier, "aux_layer_ids": [2, 4, 5]}, [])
    data = SimpleNamespace(shard_set=shard_set, d2t=torch.zeros(96, dtype=torch.long))
    base = {"draft_arch": "llama", "norm_before_fc": True, "num_key_value_heads": 2, "head_dim": 64}
    assert draft_spec(train_cfg(**base, rope_scaling="verifier"), data).rope_scaling["factor"] == 64.0
    assert draft_spec(train_cfg(**base), data).rope_scaling is None  # the default: plain RoPE
