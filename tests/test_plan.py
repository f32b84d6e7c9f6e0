"""--plan: the numbers a run needs, from config.json alone, checked against hand computation; and real
runs that would not fit on the disk refuse to start, with the numbers."""

from __future__ import annotations

import json
import math
import tomllib

import pytest
from conftest import CONVERSATIONS, REPO, draft_spec, run_script, saved_for_backward_vs_plan, script

KIMI = REPO / "configs" / "kimi_k25.toml"
# kimi_k25.toml's llama alternative (its default is the MLA draft, tests/test_mla_draft.py): the EAGLE-3
# Llama layer of the public Kimi drafts, whose figures these tests compute by hand
LLAMA = ("--draft-arch", "llama", "--norm-before-fc")
H, V, VD = 7168, 163840, 32000  # Kimi-K2.5 hidden, vocab (contract section 6); draft vocab (kimi_k25.toml)


@pytest.fixture
def kimi_config_only(tmp_path):
    """A Kimi-K2.5-shaped verifier folder holding config.json only (contract section 6): no weights."""
    d = tmp_path / "kimi-k2.5"
    d.mkdir()
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG as text

    assert (text["hidden_size"], text["vocab_size"]) == (H, V)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# The draft by hand (contract section 2): fc 7168 x 21504, q/k/v 8192 x 14336, o 7168 x 8192,
# gate/up/down 18432 x 7168, four RMSNorm weights of 7168 (input, hidden, post-attention, final), and
# the EAGLE-3.1 input_norm over the three concatenated aux states (21504; norm_before_fc, the default),
# and the draft lm_head 32000 x 7168 (trained by default).
TRAINABLE = 7168 * 21504 + 3 * 8192 * 14336 + 7168 * 8192 + 3 * 18432 * 7168 + 4 * 7168 + 3 * 7168 + VD * H
FROZEN = V * H + VD * H + H  # embed_tokens, verifier_lm_head, verifier_norm
# kimi_k25.toml's MLA draft by hand: Kimi-K2.5's MLA dims over the 2 x hidden input (q_a, q_a_layernorm, q_b,
# kv_a, kv_a_layernorm, kv_b, o), no input_norm (norm_before_fc off); fc, mlp, 4 norms, lm_head as above
MLA_ATTENTION = 1536 * 14336 + 1536 + 64 * 192 * 1536 + 576 * 14336 + 512 + 64 * 256 * 512 + H * 64 * 128
MLA_TRAINABLE = H * 3 * H + MLA_ATTENTION + 3 * 18432 * H + 4 * H + VD * H


def kimi_train_plan(verifier, tmp_path):
    """04_train.py --plan for kimi_k25.toml's llama draft at the public Kimi drafts' scale (600k rows x
    2,000 tokens, 200k tokens/s): its stdout and the plan JSON."""
    out = tmp_path / "plan.json"
    proc = run_script(
        script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path", str(verifier),
        *LLAMA, "--plan-rows", "600000", "--plan-tokens-per-row", "2000", "--plan-tokens-per-second",
        "200000", "--plan-json", str(out),
    )  # fmt: skip
    return proc, json.loads(out.read_text())


def test_train_plan_for_kimi_matches_hand_computed_numbers(kimi_config_only, tmp_path):
    proc, p = kimi_train_plan(kimi_config_only, tmp_path)
    assert TRAINABLE == 961_572_864 + 21_504 + 229_376_000
    assert p["draft"]["trainable_parameters"] == TRAINABLE
    assert p["draft"]["total_parameters"] == TRAINABLE + FROZEN
    assert p["aux_layer_ids"] == [2, 30, 58]
    assert p["draft"]["shapes"]["layers.0.self_attn.q_proj.weight"] == [8192, 14336]
    # 4 stored states (3 aux + teacher) x 7168 x bytes per value; fp8 keeps 4 float32 scales per sample
    assert p["bytes_per_token"] == {"float32": 114_688, "bfloat16": 4 * 7168 * 2, "float8_e4m3fn": 4 * 7168}
    assert p["bytes_per_token"]["bfloat16"] == 57_344 and p["bytes_per_token"]["float8_e4m3fn"] == 28_672
    assert p["bytes_per_sample"] == {"float32": 0, "bfloat16": 0, "float8_e4m3fn": 16}
    tokens = 600_000 * 2000
    assert p["disk"]["bfloat16"] == tokens * (57_344 + 5)  # + input_ids int32 and loss_mask uint8
    assert p["disk"]["float8_e4m3fn"] == tokens * (28_672 + 5) + 600_000 * 16
    m = p["memory_per_gpu"]
    assert (m["gradients"], m["ddp_buckets"], m["adamw_states"]) == (
        4 * TRAINABLE,
        4 * TRAINABLE,
        8 * TRAINABLE,
    )
    assert 0 <= m["weights"] - 4 * (TRAINABLE + FROZEN) - (VD * 8 + V) < 1024  # + d2t int64, t2d bool, rope
    train = tomllib.loads(KIMI.read_text())["train"]
    T = max(train["batch_tokens"], train["max_seq_len"])  # kimi_k25.toml's packed row (ttt_steps 3)
    # sdpa: boolean masks, the last two alive together (T^2 (2 x 3 + 1)), and the additive bf16 masks
    # [T, (s+1)T] kept for backward at each step
    assert m["attention_mask_by_impl"]["sdpa"] == T * T * (2 * 3 + 1) + 2 * T * T * (1 + 2 + 3)
    assert m["attention_mask_by_impl"]["flex"] < 2.1 * T * T  # the transient dense mask + block indices
    # on the GPUs it plans for, auto trains with flex (kernel_policy.resolve on CUDA)
    assert m["mask_impl"] == "flex" and m["total"] == m["total_by_impl"]["flex"]
    # steps: 1% held out by stage 03, batch_tokens // 2000 rows per micro-batch, 8 GPUs, 10 epochs
    micro = math.ceil(600_000 * 0.99 / (train["batch_tokens"] // 2000))
    assert p["steps"] == {
        "micro_batches_per_epoch": micro,
        "steps_per_epoch": math.ceil(micro / 8),  # the last step takes the remainder (epochs.py)
        "total_steps": math.ceil(micro / 8) * 10,
        "data_parallel": 8,  # sequence_parallel 1: every GPU trains its own rows
    }
    assert p["seconds"] == pytest.approx(tokens * 0.99 * 10 / 200_000)
    assert f"trainable {TRAINABLE:,}" in proc.stdout and "57,344 B/token" in proc.stdout
    # KV cache per token, bf16: Kimi-K2.5's MLA latent 61 x (512 + 64) x 2, replicated on every TP rank;
    # the draft's 1 layer x 2 (k, v) x 64 kv heads x 128 x 2, its heads sharded over TP 8 (--plan-gpus)
    kv = p["kv_cache"]
    assert kv["tensor_parallel_size"] == 8 and kv["verifier"]["attention"] == "mla"
    assert kv["dp_attention"]["verifier"] == kv["tp"]["verifier"] == 61 * (512 + 64) * 2 == 70_272
    assert kv["dp_attention"]["draft"] == 2 * 64 * 128 * 2 == 32_768
    assert kv["tp"]["draft"] == 32_768 // 8 == 4_096
    assert kv["tp"]["share"] == pytest.approx(4_096 / 70_272)  # +5.8%
    assert kv["dp_attention"]["share"] == pytest.approx(32_768 / 70_272)  # +46.6%
    assert kv["dp_attention"]["tokens_kept"] == pytest.approx(70_272 / (70_272 + 32_768))
    assert "verifier 70,272 B (61 layers x (512 + 64) x 2 B, MLA latent) | draft 32,768 B" in proc.stdout
    assert "TP8: draft 4,096 B/rank vs verifier 70,272 B/rank" in proc.stdout
    assert "= +5.8% | DP attention: draft 32,768 B vs 70,272 B = +46.6%" in proc.stdout


def _tiny_plan(tmp_path, text, serve_tp):
    from eagle3_pipeline.sizing.options import PlanOptions
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.sizing.plan import Tokens, build, render

    d = tmp_path / "verifier"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["X"], "model_type": "x", **text}))
    section = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())["train"]  # 4 kv heads x 128
    p = build(d, [1, 2, 3], "float32", TrainConfig(**section), 96, Tokens(None, None, None, "none"),
              PlanOptions(), tmp_path, serve_tp=serve_tp)  # fmt: skip
    return p["kv_cache"], render(p)


@pytest.mark.parametrize("tp", [2, 4])
def test_kv_cache_numbers_come_from_the_verifier_config(tmp_path, tp):
    """Two small verifiers, by hand: the numbers are the config's, not Kimi-K2.5's."""
    base = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8, "vocab_size": 320}
    kv, text = _tiny_plan(tmp_path, {**base, "num_key_value_heads": 2}, tp)  # GQA, head_dim 256 / 8 = 32
    assert kv["verifier"]["full"] == 6 * 2 * 2 * 32 * 2 == 1536
    # TP 2: one kv head per rank; TP 4: fewer heads than ranks, so each rank keeps one (vLLM replicates)
    assert kv["tp"]["verifier"] == 6 * 2 * 1 * 32 * 2 == 768
    assert kv["dp_attention"]["draft"] == 1 * 2 * 4 * 128 * 2 == 2048
    assert kv["tp"]["draft"] == 2 * (4 // tp) * 128 * 2
    assert kv["tp"]["share"] == pytest.approx(kv["tp"]["draft"] / 768)
    assert kv["dp_attention"]["share"] == pytest.approx(2048 / 1536)
    assert "verifier 1,536 B (6 layers x 2 x 2 kv heads x 32 x 2 B)" in text
    assert f"TP{tp}: draft {kv['tp']['draft']:,} B/rank vs verifier 768 B/rank (kv heads sharded)" in text
    mla = {**base, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "num_hidden_layers": 3}
    kv, text = _tiny_plan(tmp_path, mla, tp)
    assert kv["verifier"]["full"] == kv["tp"]["verifier"] == 3 * (32 + 16) * 2 == 288  # not sharded
    assert "verifier 288 B (3 layers x (32 + 16) x 2 B, MLA latent)" in text
    assert f"+{2048 / 288:.1%}" in text


def test_kv_cache_tensor_parallel_size_is_the_exports_else_plan_gpus(tmp_path):
    from eagle3_pipeline.sizing.options import PlanOptions
    from eagle3_pipeline.sizing.plan import _serve_tp

    toml = tmp_path / "c.toml"
    toml.write_text("[export]\nserve_tensor_parallel_size = 4\n")
    assert _serve_tp(str(toml), PlanOptions(plan_gpus=8)) == 4
    toml.write_text("[export]\nserve_tensor_parallel_size = 0\n")  # 0: the GPUs visible when exporting
    assert _serve_tp(str(toml), PlanOptions(plan_gpus=2)) == 2
    assert _serve_tp(str(KIMI), PlanOptions()) == 8


def test_extract_plan_runs_from_config_json_alone(kimi_config_only, tmp_path):
    out = tmp_path / "plan.json"
    base = [script("01_extract_hidden_states.py"), "--config", str(KIMI), "--plan", "--verifier-path",
            str(kimi_config_only), "--data-path", str(CONVERSATIONS), "--plan-json", str(out)]  # fmt: skip
    proc = run_script(*base)
    p = json.loads(out.read_text())
    assert p["tokens"]["num_rows"] == 10 and p["tokens"]["total"] is None  # no tokenizer next to config.json
    assert "--plan-tokens-per-row" in p["tokens"]["source"] and "aux layer ids [2, 30, 58]" in proc.stdout
    proc = run_script(*base, "--plan-tokens-per-row", "3000", "--storage-dtype", "float8_e4m3fn")
    p = json.loads(out.read_text())
    assert p["storage_dtype"] == "float8_e4m3fn"
    assert p["disk"]["float8_e4m3fn"] == 10 * 3000 * (28_672 + 5) + 10 * 16
    assert "float8_e4m3fn 28,672 B/token + 16 B/sample" in proc.stdout
    assert p["draft"]["trainable_parameters"] == MLA_TRAINABLE  # the config's [train] draft


def test_extract_plan_measures_the_tokens_the_extraction_writes(tiny_verifier, tiny_shards, tmp_path):
    out = tmp_path / "plan.json"
    run_script(
        script("01_extract_hidden_states.py"), "--config", str(REPO / "configs" / "tiny.toml"), "--plan",
        "--verifier-path", str(tiny_verifier), "--data-path", str(CONVERSATIONS), "--plan-json", str(out),
    )  # fmt: skip
    p = json.loads(out.read_text())
    meta = json.loads((tiny_shards["float32"] / "meta.json").read_text())
    assert p["tokens"]["total"] == meta["num_tokens"] and p["tokens"]["num_rows"] == meta["num_rows"]
    assert p["disk"]["float32"] == meta["num_tokens"] * (4 * 256 * 4 + 5)


def test_train_plan_counts_the_steps_training_runs(tiny_shards, tmp_path):
    args = [
        script("04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"),
        "--data-dir", str(tiny_shards["float32"]), "--split-dir", "", "--val-ratio", "0.2",
        "--vocab-mapping-dir", str(tiny_shards["vocab_float32"]), "--out-dir", str(tmp_path / "t"),
    ]  # fmt: skip
    run_script(*args, "--plan", "--plan-gpus", "1", "--plan-json", str(tmp_path / "plan.json"))
    assert not (tmp_path / "t").exists()  # --plan runs nothing
    run_script(*args, "--max-steps", "1")
    planned = json.loads((tmp_path / "plan.json").read_text())["steps"]
    trained = json.loads((tmp_path / "t" / "meta.json").read_text())["plan"]
    assert planned["steps_per_epoch"] == trained["steps_per_epoch"]
    epochs = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())["train"]["epochs"]
    assert planned["total_steps"] == trained["steps_per_epoch"] * epochs


def test_runs_that_would_not_fit_refuse_to_start_with_the_numbers(
    tiny_verifier, tiny_shards, tmp_path, monkeypatch
):
    from eagle3_pipeline.data import extract
    from eagle3_pipeline.core import storage
    from eagle3_pipeline.training import train
    from eagle3_pipeline.data.config import ExtractConfig
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.core.errors import UserError

    monkeypatch.setattr(storage, "free_bytes", lambda path: 1000)
    cfg = ExtractConfig(
        verifier_path=str(tiny_verifier), data_path=str(CONVERSATIONS), out_dir=str(tmp_path / "hs")
    )
    with pytest.raises(
        UserError,
        match=r"rows_00000000-00000010: 10 rows x \d+ tokens/row .* needed, 1.00 KB "
        r"\(1,000 bytes\) free",
    ):
        extract.run(cfg)
    assert not list((tmp_path / "hs").rglob("part-*"))
    section = tomllib.loads((REPO / "configs" / "tiny.toml").read_text())["train"]
    tcfg = TrainConfig(**{
        **section, "data_dir": [str(tiny_shards["float32"])], "split_dir": None,
        "vocab_mapping_dir": str(tiny_shards["vocab_float32"]), "out_dir": str(tmp_path / "t"),
    })  # fmt: skip
    with pytest.raises(
        UserError,
        match=r"checkpoints: 3 \+ 2 checkpoints x .* needed, "
        r"1.00 KB \(1,000 bytes\) free",
    ):
        train.run(tcfg)
    assert not (tmp_path / "t" / "checkpoints").exists()


def test_activation_and_mask_estimate_matches_what_a_tiny_draft_saves_for_backward():
    """The plan's activations + sdpa attention bytes (kernel_policy's) against the bytes autograd really
    keeps (fp32, CPU, sdpa): every tensor saved for backward during the TTT forward, counted once per
    storage, weights excluded. Measured 0.998x the estimate at T=1024; a formula missing the growing mask or
    the K/V cache would be off by more than the 15% allowed."""
    plain = dict(norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False)
    spec = draft_spec(256, 320, 96, (2, 4, 5), num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                      intermediate_size=512, rope_theta=1e6, max_position_embeddings=4096,
                      **plain)  # fmt: skip
    measured, m = saved_for_backward_vs_plan(spec, 1024, 3)
    assert 0.9 <= measured / (m["activations"] + m["attention_mask"]) <= 1.15, (measured, m)
    assert measured > 1.15 * m["activations"]  # the mask is a real part of it at this T


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("attn_impl", ["auto", "sdpa", "flex", "eager"])
def test_plan_attention_memory_is_what_the_trainers_kernel_policy_resolves_and_counts(cuda, attn_impl):
    """The plan cannot drift from the trainer (issue 16): its attention bytes are kernel_policy's for the
    implementation kernel_policy.resolve picks on that device, at the plan's packed row and TTT steps."""
    import torch

    from eagle3_pipeline.training import kernel_policy
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.sizing.plan import draft_report, memory_per_gpu

    settings = dict(batch_tokens=4096, max_seq_len=2048, ttt_steps=4, dtype="bfloat16", attn_impl=attn_impl)
    cfg = TrainConfig(**settings)
    spec = draft_spec(256, 320, 96, (1, 2, 3), **settings)
    m = memory_per_gpu(spec, draft_report(spec, False), cfg, 8, cuda=cuda)
    device = torch.device("cuda" if cuda else "cpu")
    if attn_impl == "flex" and not cuda:  # the trainer refuses it (no backward on CPU): nothing to compare
        with pytest.raises(Exception, match="no backward on CPU"):
            kernel_policy.resolve(attn_impl, "eager", "auto", device, cfg.batch_tokens)
        return
    resolved = kernel_policy.resolve(attn_impl, "eager", "auto", device, cfg.batch_tokens).attn_impl
    assert m["mask_impl"] == resolved
    heads = spec.num_attention_heads
    assert m["attention_mask"] == kernel_policy.attention_extra_bytes(resolved, 4096, 4, heads, 2)
    rest = m["total_by_impl"]["sdpa"] - m["attention_mask_by_impl"]["sdpa"]  # the same but for attention
    assert m["total"] - m["attention_mask"] == rest


def test_colocation_plan_says_per_gpu_kind_whether_the_trainer_fits_beside_the_server(
    kimi_config_only, tmp_path
):
    """A Kimi-sized checkpoint (its safetensors index's total_size: 640 GB, 80 GB per GPU at TP 8) beside
    the trainer of kimi_k25.toml: no room for a max_seq_len prefill's KV cache on an H200, room on a
    B200; the producers must deliver the trainer's tokens/s of bf16 states."""
    from eagle3_pipeline.sizing import colocation

    weights = 640 * 10**9
    (kimi_config_only / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": weights}, "weight_map": {}})
    )
    proc, p = kimi_train_plan(kimi_config_only, tmp_path)
    c, trainer = p["colocation"], int(p["memory_per_gpu"]["total"])
    assert c["server_weights_per_gpu"] == weights // 8 and c["trainer_per_gpu"] == trainer
    kv = 61 * (512 + 64) * 2  # Kimi-K2.5's MLA latent per token, on every TP rank
    for name, memory in [("H200", 143_771 * 2**20), ("B200", 183_359 * 2**20)]:
        room = memory - weights // 8 - colocation.SERVER_RESERVE_BYTES - trainer - colocation.MARGIN_BYTES
        g = c["gpus"][name]
        assert (g["kv_room"], g["kv_tokens"]) == (room, max(0, room) // kv)
        utilization = (memory - trainer - colocation.MARGIN_BYTES) / memory
        assert g["gpu_memory_utilization"] == pytest.approx(utilization)
    prefill = tomllib.loads(KIMI.read_text())["train"]["max_seq_len"]
    assert c["prefill_tokens"] == prefill  # kimi_k25.toml's [train] max_seq_len
    assert not c["gpus"]["H200"]["fits"] and c["gpus"]["B200"]["fits"]
    assert c["producer_bytes_per_second"] == 200_000 * 57_344
    assert f"H200 150.75 GB: KV cache 0 B = 0 tokens: DOES NOT FIT a {prefill:,}-token prefill" in proc.stdout
    assert "producers     200,000 tokens/s of states keep the trainer busy: 11.47 GB/s" in proc.stdout
    # a config-only folder: the server's share is unknown, and the plan says so instead of guessing
    (kimi_config_only / "model.safetensors.index.json").unlink()
    proc = run_script(script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path",
                      str(kimi_config_only), "--plan-rows", "10", "--plan-tokens-per-row", "2")  # fmt: skip
    assert "co-location   ? (the verifier folder has no safetensors" in proc.stdout
    assert "producers     ? tokens/s of states" in proc.stdout


def test_serving_speedup_lines_are_the_stated_cost_model_for_kimi(kimi_config_only, tmp_path):
    """The serving cost model (sizing/speedup.py) for kimi_k25.toml's llama draft beside Kimi-K2.5 at TP 8, by
    hand: a decode step reads the bf16 dense weights, the INT4 routed experts its tokens touch (uniform
    routing) and the KV cache, at 80% of the HBM bandwidth, plus 40 us per layer; break-even AL and the
    speedup at --plan-al 2.88 follow; a config without the MoE sizes says what it lacks."""
    from eagle3_pipeline.sizing import speedup

    out = tmp_path / "plan.json"
    proc = run_script(script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path",
                      str(kimi_config_only), *LLAMA, "--plan-rows", "10", "--plan-tokens-per-row", "2",
                      "--plan-al", "2.88", "--plan-json", str(out))  # fmt: skip
    r = json.loads(out.read_text())["speedup"]
    assert (r["k"], r["gpus"], r["context"], r["parallel"]) == (3, 8, 2048, False)
    attn = H * 1536 + 1536 * 64 * 192 + H * 576 + 512 * 64 * 256 + 64 * 128 * H
    dense = 61 * attn + 3 * H * 18432 + 60 * (3 * H * 2048 + H * 384) + V * H
    expert_bytes = 3 * H * 2048 * (0.5 + 2 / 32)
    draft = TRAINABLE  # every trained tensor is exported and read per draft forward (norms included)

    def forward(params_bytes, experts, tokens, batch, kv_per_token, layers, gpu):
        touched = 384 * (1 - (1 - 8 / 384) ** tokens) if experts else 0
        memory = (params_bytes + experts * touched * expert_bytes) / 8 + batch * 2048 * kv_per_token
        return memory / (gpu * 0.8) + layers * 40e-6  # memory-bound at these sizes (checked below)

    for name, bw in [("H200", 4.8e12), ("B200", 8.0e12)]:
        for b in (1, 16, 64):
            s = r["by_gpu"][name][str(b)]
            base = forward(dense * 2, 60, b, b, 70272, 61, bw)
            verify = forward(dense * 2, 60, 4 * b, b, 70272, 61, bw)
            d = forward(draft * 2, 0, 4 * b, b, 4096, 1, bw) + 2 * forward(draft * 2, 0, b, b, 4096, 1, bw)
            assert s["base_s"] == pytest.approx(base, rel=1e-9)
            assert s["verify_s"] == pytest.approx(verify, rel=1e-9)
            assert s["draft_s"] == pytest.approx(d, rel=1e-9)
            assert s["break_even_al"] == pytest.approx((verify + d) / base)
            assert s["speedup"] == pytest.approx(2.88 * base / (verify + d))
            assert s["tokens_per_second"] == pytest.approx(b * 2.88 / (verify + d))
    h16 = r["by_gpu"]["H200"]["16"]
    assert f"batch 16: break-even AL {h16['break_even_al']:.2f}, at AL 2.88 {h16['speedup']:.2f}x" in proc.stdout
    # a parallel draft's plan counts one draft forward per step
    proc = run_script(script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path",
                      str(kimi_config_only), "--plan-rows", "10", "--plan-tokens-per-row", "2",
                      *LLAMA, "--parallel-drafting", "--plan-json", str(out))  # fmt: skip
    rp = json.loads(out.read_text())["speedup"]
    assert rp["parallel"] and "k=3 (parallel drafting, 1 draft forward)" in proc.stdout
    assert rp["by_gpu"]["H200"]["16"]["draft_s"] < r["by_gpu"]["H200"]["16"]["draft_s"]
    # parallel drafting: one draft forward instead of k, so less draft time at k = 8
    text = json.loads((kimi_config_only / "config.json").read_text())["text_config"]
    v = speedup.verifier_model(text, 70272)
    dm = speedup.draft_model({"lm_head.weight": [32000, H], "fc.weight": [H, 3 * H]}, 4096, 64, 128)
    gpu = speedup.GPUS["H200"]
    assert speedup.draft_seconds(dm, 8, True, 16, 2048, gpu, 8) < speedup.draft_seconds(dm, 8, False, 16, 2048, gpu, 8)
    for b in (1, 16, 64):  # compute stays below memory for Kimi at these batches (the hand model above)
        tokens = 4 * b
        active = dense + 60 * 8 * 3 * H * 2048
        flops = 2 * active * tokens + tokens * 2048 * 61 * 2 * 64 * (2 * 512 + 64)
        assert flops / (8 * 989e12 * 0.5) < speedup.forward_seconds(v, tokens, b, 2048, gpu, 8) - 61 * 40e-6
    # a verifier config without the MoE sizes: the line says which field is missing
    del text["moe_intermediate_size"]
    (kimi_config_only / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text,
                                                              "architectures": ["X"]}))  # fmt: skip
    proc = run_script(script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path",
                      str(kimi_config_only), "--plan-rows", "10", "--plan-tokens-per-row", "2")  # fmt: skip
    assert "speedup       ? (the verifier's config.json has no 'moe_intermediate_size')" in proc.stdout


def test_train_plan_steps_count_sequence_parallel_groups_not_gpus(tiny_shards, tmp_path):
    """Under sequence parallelism the trainer deals micro-batches by data-parallel rank (a group of sp ranks
    trains one row): 2 GPUs in one group of 2 run the steps of 1 GPU."""
    args = [
        script("04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"),
        "--data-dir", str(tiny_shards["float32"]), "--split-dir", "", "--val-ratio", "0.2",
        "--vocab-mapping-dir", str(tiny_shards["vocab_float32"]), "--out-dir", str(tmp_path / "t"),
        "--attn-impl", "blockwise", "--loss-impl", "chunked", "--plan",
    ]  # fmt: skip
    plans = {}
    for gpus, sp in ((1, 1), (2, 1), (2, 2)):
        out = tmp_path / f"plan{gpus}{sp}.json"
        run_script(*args, "--plan-gpus", str(gpus), "--sequence-parallel", str(sp), "--plan-json", str(out))
        plans[gpus, sp] = json.loads(out.read_text())["steps"]
    assert plans[2, 1]["steps_per_epoch"] < plans[1, 1]["steps_per_epoch"]  # the data is dealt over 2
    assert plans[2, 2]["steps_per_epoch"] == plans[1, 1]["steps_per_epoch"]
    assert plans[2, 2]["data_parallel"] == 1


def test_train_plan_steps_count_the_windows_of_samples_longer_than_max_seq_len():
    """Samples longer than max_seq_len train in windows (length_mix.py), every token once an epoch: the
    plan's estimate from sampled lengths counts the micro-batches the trainer packs of them."""
    from eagle3_pipeline.data import packing
    from eagle3_pipeline.data.shards import SampleRef
    from eagle3_pipeline.sizing import plan
    from eagle3_pipeline.training.config import TrainConfig

    lengths = [1000, 250, 40, 3000, 90, 700] * 5
    cfg = TrainConfig(max_seq_len=100, batch_tokens=200, val_ratio=0.0, epochs=1)
    refs = [SampleRef("s", "f", i, str(i), n) for i, n in enumerate(lengths)]
    trained = len(packing.micro_batches(refs, cfg.batch_tokens, cfg.max_seq_len, 0, 0))
    for tokens in (plan.Tokens(len(lengths), sum(lengths) / len(lengths), lengths, "test"),
                   plan.Tokens(10, 1000, None, "test")):  # fmt: skip
        planned = plan.steps(cfg, tokens, 1)["micro_batches_per_epoch"]
        want = trained if tokens.lengths else len(packing.micro_batches(refs[:1] * 10, 200, 100, 0, 0))
        assert abs(planned - want) <= 0.1 * want, (planned, want)
