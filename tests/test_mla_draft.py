"""The MLA EAGLE-3 draft ([train] draft_arch = "mla"): built from the verifier's MLA dims, trained by
speculators' TTT loop, exported as vLLM 0.32's deepseek_eagle3.py loads it, read back by our own plain
reading of vLLM's maths (models/reference_mla.py), refused by the gate when vLLM would misdetect or misread
it, and sized by --plan (one latent per token)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, assert_tail_first_pass_exact, saved_for_backward_vs_plan

KIMI_MLA = {"q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "v_head_dim": 128}  # fmt: skip  # Kimi-K2.5's config.json (text_config)


def train_cfg(**kw: object):
    from eagle3_pipeline.training.config import TrainConfig

    base = {"vocab_mapping_dir": "v", "out_dir": "o", "draft_arch": "mla", "norm_before_fc": False,
            "num_attention_heads": 4, "intermediate_size": 128, "rope_theta": 10000.0}  # fmt: skip
    return TrainConfig(**{**base, **kw})


KIMI_TRAIN = train_cfg(num_attention_heads=64, intermediate_size=18432)


def tiny_spec(**train: object):
    """An MLA draft over the tiny Kimi-latent verifier (models/tiny.py kimi_mla: hidden 256, latent 576)."""
    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.models.tiny import tiny_config

    verifier = tiny_config("kimi_mla")
    return spec_for_training(train_cfg(**train), verifier, 96, (2, 4, 5))


def test_mla_dims_come_from_the_verifier_unless_train_sets_them():
    spec = tiny_spec()
    assert (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
            spec.v_head_dim) == (128, 512, 64, 64, 64)  # fmt: skip
    assert tiny_spec(mla_kv_lora_rank=256, mla_q_lora_rank=0).kv_lora_rank == 256
    assert tiny_spec(mla_q_lora_rank=0).q_lora_rank == 0
    assert tiny_spec().to_json()["draft_arch"] == "mla"


def test_mla_draft_over_a_llama_verifier_is_refused_naming_the_flag():
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.models.tiny import tiny_config

    with pytest.raises(UserError, match="no `q_lora_rank`.*--mla-q-lora-rank"):
        spec_for_training(train_cfg(), tiny_config("llama"), 96, (2, 4, 5))


def test_mla_draft_with_norm_before_fc_is_refused_before_building():
    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.models.draft import build_draft

    with pytest.raises(UserError, match="--no-norm-before-fc"):
        build_draft(tiny_spec(norm_before_fc=True))


def _random_draft(spec, seed: int = 0):
    """The training model with every tensor random and already bf16-exact, so its export (bf16) holds the
    very weights the model computes with: the read-back can then be compared at fp32 tolerance."""
    from eagle3_pipeline.models.draft import build_draft

    torch.manual_seed(seed)
    model = build_draft(spec, attn_impl="sdpa").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms near 1, projections small
            r = torch.randn_like(p)
            p.copy_((1.0 + 0.2 * r if "norm" in name else 0.05 * r).bfloat16().float())
        if model.d2t is not None:
            keep = torch.randperm(spec.vocab_size)[: spec.draft_vocab_size].sort().values
            model.d2t.copy_(keep - torch.arange(spec.draft_vocab_size))
            model.t2d.zero_()
            model.t2d[keep] = True
    return model


def _export(spec, model, out: Path) -> Path:
    from safetensors.torch import save_file

    from eagle3_pipeline.export_eval.export import export_config, flat_weights

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(export_config(spec, {}), indent=2))
    save_file(flat_weights(dict(model.named_parameters()), model.d2t, model.t2d, spec),
              str(out / "model.safetensors"))  # fmt: skip
    return out


@pytest.mark.parametrize("q_lora", [None, 0], ids=["q_lora", "q_proj"])
def test_training_forward_equals_vllms_reading_of_the_export(tmp_path, q_lora):
    """The trained model's logits at TTT steps 0 and 1 == the export read as vLLM reads it (our plain MLA
    with interleaved RoPE, shared k_pe, latent norm), on random states: fp32 tolerance."""
    from eagle3_pipeline.models.reference_mla import MlaReferenceDraft, read_export

    spec = tiny_spec(mla_q_lora_rank=q_lora, fc_norm=True)
    model = _random_draft(spec)
    ref = read_export(_export(spec, model, tmp_path / "draft"), model.embed_tokens.weight.detach())
    assert isinstance(ref, MlaReferenceDraft)
    T = 12
    torch.manual_seed(1)
    aux = torch.randn(1, T, 3 * spec.hidden_size)
    ids = torch.randint(0, spec.vocab_size, (1, T))
    pos = torch.arange(T)[None]
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, o: captured.append(o.detach()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), position_ids=pos,
              ttt_steps=2)  # fmt: skip
    hook.remove()
    out0, logits0, cache = ref.first_pass(aux[0], ids[0], pos[0])
    spread = float(captured[0].std())
    assert spread > 0.1
    torch.testing.assert_close(logits0, captured[0][0], atol=1e-4 * spread * 10, rtol=1e-4)
    # TTT step 1 at slot t: the draft's carry at t, the token t+1, position t+1, over the first pass's cache
    for t in (0, 5, T - 2):
        _, lg, _ = ref.step(out0[t : t + 1], ids[0, t + 1 : t + 2], pos[0, t : t + 1] + 1,
                            cache.truncate(t + 1))  # fmt: skip
        torch.testing.assert_close(lg[0], captured[1][0, t], atol=1e-3 * spread, rtol=1e-4)


def test_mla_first_pass_from_the_prompts_last_slot_counts_what_the_whole_one_counts(tmp_path):
    """The simulation's first pass from the prompt's last slot (linear in a long prompt) is exact for the
    MLA reading too: its cache entries are the latent path's per-head keys and values."""
    from eagle3_pipeline.models.reference_mla import MlaReferenceDraft, read_export

    spec = tiny_spec()
    model = _random_draft(spec, seed=2)
    ref = read_export(_export(spec, model, tmp_path / "draft"), model.embed_tokens.weight.detach())
    assert isinstance(ref, MlaReferenceDraft)
    assert_tail_first_pass_exact(ref, spec.vocab_size, T=120, prompt_len=90)


def test_the_reference_is_not_the_neox_rope_nor_the_training_classes(tmp_path):
    """Sanity of the comparison above: a neox-style rotation (the llama reading's) gives other logits."""
    from eagle3_pipeline.models import reference_mla

    spec = tiny_spec()
    model = _random_draft(spec, seed=3)
    ref = reference_mla.read_export(_export(spec, model, tmp_path / "d"), model.embed_tokens.weight.detach())
    T = 8
    aux, ids = torch.randn(T, 3 * spec.hidden_size), torch.randint(0, spec.vocab_size, (T,))
    _, good, _ = ref.first_pass(aux, ids, torch.arange(T))
    neox = ReferenceNeox(ref)
    _, bad, _ = neox.first_pass(aux, ids, torch.arange(T))
    assert (good - bad).abs().max() > 1e-3


class ReferenceNeox:
    """The MLA reading with the llama reading's neox rotation swapped in (a test double)."""

    def __init__(self, ref):
        self.ref = ref

    def first_pass(self, aux, ids, pos, query_from=0):
        from eagle3_pipeline.models import reference_mla

        orig = reference_mla.rope_interleaved

        def neox(x, cos, sin):
            d = x.shape[-1]
            perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
            return orig(x[..., perm], cos, sin)

        reference_mla.rope_interleaved = neox
        try:
            return self.ref.first_pass(aux, ids, pos, query_from)
        finally:
            reference_mla.rope_interleaved = orig


def _mla_export_problems(tmp_path, **config_changes):
    from safetensors.torch import load_file

    from eagle3_pipeline.export_eval.export import static_problems

    spec = tiny_spec()
    model = _random_draft(spec)
    d = _export(spec, model, tmp_path / "draft")
    config = {**json.loads((d / "config.json").read_text()), **config_changes}
    for k in [k for k, v in config_changes.items() if v is ...]:
        del config[k]
    tensors = load_file(str(d / "model.safetensors"))
    return static_problems(config, tensors, {"draft": spec.to_json(), "d2t": model.d2t})


def test_mla_export_config_is_what_vllm_detects_as_an_mla_eagle3_draft(tmp_path):
    spec = tiny_spec()
    from eagle3_pipeline.export_eval.export import export_config

    config = export_config(spec, {})
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"  # not kimi_k2 (not MLA to vLLM), not deepseek_v3 (MTP)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["q_lora_rank"]) == (512, 64, 128)
    assert "head_dim" not in config and config["norm_before_fc"] is False
    assert _mla_export_problems(tmp_path) == []


@pytest.mark.parametrize(
    "change, named",
    [
        ({"model_type": "kimi_k2"}, "model_type 'kimi_k2'.*is_deepseek_mla"),
        ({"model_type": "deepseek_v3"}, "model_type 'deepseek_v3'.*MTP"),
        ({"architectures": ["DeepseekV3ForCausalLM"]}, "architectures"),
        ({"kv_lora_rank": ...}, "kv_lora_rank missing"),
        ({"qk_rope_head_dim": 32}, "qk_rope_head_dim 32 != trained 64"),
        ({"q_lora_rank": None}, "q_lora_rank None != trained 128"),
        ({"v_head_dim": 128}, "v_head_dim 128 != trained 64"),
        ({"norm_before_fc": True}, "norm_before_fc true: vLLM's deepseek_eagle3.py has no input_norm"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 64}}, "rope_scaling must be null"),
    ],
)
def test_gate_refuses_an_mla_export_vllm_would_misdetect_or_misread(tmp_path, change, named):
    import re

    problems = _mla_export_problems(tmp_path, **change)
    assert any(re.search(named, p) for p in problems), problems


def test_gate_refuses_mla_tensors_of_other_shapes(tmp_path):
    """A config that passes with tensors of another latent width: named tensor by tensor."""
    from eagle3_pipeline.export_eval.export import static_problems

    spec = tiny_spec()
    model = _random_draft(spec)
    d = _export(spec, model, tmp_path / "draft")
    from safetensors.torch import load_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = tensors[
        "midlayer.self_attn.kv_a_proj_with_mqa.weight"][:-8]  # fmt: skip
    problems = static_problems(json.loads((d / "config.json").read_text()), tensors,
                               {"draft": spec.to_json(), "d2t": model.d2t})  # fmt: skip
    assert problems == ["midlayer.self_attn.kv_a_proj_with_mqa.weight: shape (568, 512) != (576, 512) "
                        "from config.json"]  # fmt: skip


def test_kimi_mla_draft_kv_cache_is_one_latent_per_token():
    """--plan's KV line for Kimi-K2.5's MLA draft: (512 + 64) x 2 B = 1,152 B/token on every rank, beside the
    llama draft's 64 x 128 x 2 x 2 B = 32,768 B (4,096 per rank at TP 8)."""
    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.sizing.kv_cache import draft_kv

    kimi = {"hidden_size": 7168, "vocab_size": 163840, "rms_norm_eps": 1e-5, **KIMI_MLA}
    mla = spec_for_training(KIMI_TRAIN, kimi, 163840, (2, 30, 58))
    kv = draft_kv(mla, tp=8)
    assert (kv["attention"], kv["full"], kv["per_tp_rank"]) == ("mla", 1152, 1152)
    llama = spec_for_training(train_cfg(draft_arch="llama", num_attention_heads=64), kimi, 32000, (2, 30, 58))
    assert (draft_kv(llama, tp=8)["full"], draft_kv(llama, tp=8)["per_tp_rank"]) == (32768, 4096)


def test_kimi_mla_draft_shapes_on_meta_device():
    """The Kimi-K2.5 MLA draft (lightseekorg/kimi-k2.5-eagle3-mla's dims), built on the meta device: every
    exported tensor has the shape vLLM derives from config.json, the fused q_a + kv_a input is 2 x hidden."""
    from eagle3_pipeline.export_eval.export import expected_shapes, export_config, flat_weights
    from eagle3_pipeline.models.draft import build_draft, spec_for_training

    kimi = {"hidden_size": 7168, "vocab_size": 163840, "rms_norm_eps": 1e-5, **KIMI_MLA}
    spec = spec_for_training(KIMI_TRAIN, kimi, 163840, (2, 30, 58))
    with torch.device("meta"):
        model = build_draft(spec)
        tensors = flat_weights(dict(model.named_parameters()), None, None, spec)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes == expected_shapes(export_config(spec, {}))
    a = "midlayer.self_attn."
    assert shapes[a + "q_a_proj.weight"] == (1536, 14336)
    assert shapes[a + "kv_a_proj_with_mqa.weight"] == (576, 14336)
    assert shapes[a + "q_b_proj.weight"] == (64 * 192, 1536)
    assert shapes[a + "kv_b_proj.weight"] == (64 * 256, 512)
    assert shapes[a + "o_proj.weight"] == (7168, 64 * 128)
    assert "d2t" not in shapes  # full vocab, as the public draft


def test_kimi_k25_config_takes_the_mla_draft_as_vllm_reads_it_and_documents_llama():
    """The MLA draft, chosen by the issue-27 rows (docs/real_verifier_benchmark.md), with the one flag
    vLLM's deepseek_eagle3.py cannot read turned off, and Kimi-K2.5's dims (no mla_* set)."""
    import tomllib

    text = (REPO / "configs" / "kimi_k25.toml").read_text()
    train = tomllib.loads(text)["train"]
    assert train["draft_arch"] == "mla" and train["norm_before_fc"] is False
    assert not [k for k in train if k.startswith("mla_")]
    assert 'draft_arch = "llama"' in text and "norm_before_fc = true" in text  # the alternative, named


def test_spec_round_trips_through_json_and_older_specs_read_as_llama():
    from eagle3_pipeline.models.draft import MLA_DIMS, DraftSpec

    spec = tiny_spec()
    assert DraftSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    before = {k: v for k, v in spec.to_json().items() if k not in (*MLA_DIMS, "draft_arch")}
    assert DraftSpec.from_json(before).draft_arch == "llama"  # checkpoints from before draft_arch existed


def test_train_plan_for_a_kimi_mla_draft_matches_hand_computed_numbers(tmp_path):
    """04_train.py --plan on kimi_k25.toml (its MLA draft) over a config-only Kimi-K2.5: the MLA draft's
    parameters by hand and its KV line, one latent of (512 + 64) x 2 B = 1,152 B/token = +1.6% of
    Kimi-K2.5's 70,272 B on every rank, where the llama draft adds 4,096 B/rank at TP 8 and 32,768 B under DP
    attention."""
    from conftest import run_script, script
    from test_plan import FROZEN, KIMI, MLA_TRAINABLE, kimi_config_only

    verifier = kimi_config_only.__wrapped__(tmp_path)
    out = tmp_path / "plan.json"
    proc = run_script(
        script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path", str(verifier),
        "--plan-rows", "600000",
        "--plan-tokens-per-row", "2000", "--plan-json", str(out),
    )  # fmt: skip
    p = json.loads(out.read_text())
    assert p["draft"]["trainable_parameters"] == MLA_TRAINABLE == 896_169_984
    assert p["draft"]["total_parameters"] == MLA_TRAINABLE + FROZEN
    assert p["draft"]["spec"]["draft_arch"] == "mla"
    assert p["draft"]["shapes"]["layers.0.self_attn.kv_a_proj_with_mqa.weight"] == [576, 14336]
    kv = p["kv_cache"]
    assert kv["draft"]["attention"] == "mla"
    assert kv["tp"]["draft"] == kv["dp_attention"]["draft"] == 1152
    assert kv["tp"]["share"] == pytest.approx(1152 / 70_272)  # +1.6%
    assert "draft 1,152 B (1 layer x (512 + 64) x 2 B, MLA latent)" in proc.stdout
    assert "= +1.6% | DP attention: draft 1,152 B vs 70,272 B = +1.6%" in proc.stdout


def test_mla_activation_estimate_matches_what_the_draft_saves_for_backward():
    """The plan's activations + sdpa mask bytes for an MLA draft against what autograd keeps (fp32, CPU,
    sdpa), as test_plan checks the llama draft: within the same 0.9-1.15."""
    spec = dataclasses.replace(tiny_spec(norm_before_residual=False, norm_output=False), vocab_size=320)
    measured, m = saved_for_backward_vs_plan(spec, 1024, 3)
    assert 0.9 <= measured / (m["activations"] + m["attention_mask"]) <= 1.15, (measured, m)
