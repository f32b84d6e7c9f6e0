"""Training kernels (eagle3_pipeline/training/kernel_policy.py): flex attention computes what sdpa computes on packed
documents at every TTT step, padding changes nothing, auto picks the CPU path, memory figures are
the sizes of the tensors speculators builds, and a run records its choice in meta.json."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import draft_spec

from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.models.draft import build_draft
from eagle3_pipeline.core.errors import UserError

TTT = 3
PLAIN_NORMS = dict(norm_before_residual=False, norm_before_fc=False, fc_norm=False, norm_output=False)
SPEC = draft_spec(64, 200, 50, (1, 2, 3), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=128, rope_theta=1e4, max_position_embeddings=2048,
                  **PLAIN_NORMS)  # fmt: skip
DOC_LENGTHS = (100, 120, 17, 63)  # 300 tokens: four documents, a row that is not a multiple of 128
CPU = torch.device("cpu")
SDPA_EAGER = kernels.Kernels("sdpa", "eager", False)


def _packed_row(lengths: tuple[int, ...] = DOC_LENGTHS, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch as packing.pack() makes it: several documents in one row with document and position ids."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    h = SPEC.hidden_size
    return {
        "hidden_states": torch.randn(1, t, 3 * h, generator=g),
        "input_ids": torch.randint(0, SPEC.vocab_size, (1, t), generator=g),
        "verifier_last": torch.randn(1, t, h, generator=g),
        "loss_mask": torch.rand(1, t, generator=g) < 0.8,
        "document_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
    }


def _drafts(*attn: str) -> list:
    """Drafts with the same random weights (every tensor, the verifier's too), one per attention."""
    torch.manual_seed(0)
    models = [build_draft(SPEC, attn_impl=a) for a in attn]
    with torch.no_grad():
        for p in models[0].parameters():
            torch.nn.init.normal_(p, std=0.05)
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    for m in models:
        m.eval()
    return models


def _forward_per_step(model, batch: dict[str, torch.Tensor], k: kernels.Kernels, loss: str = "kl_div"):
    """(logits of every TTT step, loss, metrics) of one no-grad forward through train_metrics.forward."""
    from eagle3_pipeline.training.train_metrics import Recipe, forward

    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach()))
    try:
        with torch.no_grad():
            value, metrics = forward(model, batch, Recipe(TTT, 1.0, loss), CPU, None, k)
    finally:
        hook.remove()
    assert len(logits) == TTT
    return logits, value, metrics


def test_flex_forward_equals_sdpa_at_every_ttt_step_on_packed_documents():
    sdpa, flex = _drafts("sdpa", "simple_flex_attention")
    batch = _packed_row()
    t = batch["input_ids"].shape[1]
    flex_k = kernels.resolve("flex", "eager", "off", CPU, t, needs_backward=False)
    assert flex_k.pad_multiple == 128
    ref_logits, ref_loss, ref_metrics = _forward_per_step(sdpa, batch, SDPA_EAGER)
    flex_logits, flex_loss, flex_metrics = _forward_per_step(flex, batch, flex_k)
    assert flex_logits[0].shape[1] == 384  # padded to a multiple of flex's block
    for step in range(TTT):
        ref, got = ref_logits[step][0], flex_logits[step][0, :t]
        assert ref.abs().max() > 0.05  # the comparison is not between two near-zero tensors
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"TTT step {step}")
    torch.testing.assert_close(flex_loss, ref_loss, atol=1e-6, rtol=1e-5)
    for key, ref in ref_metrics.items():
        torch.testing.assert_close(flex_metrics[key].float(), ref.float(), atol=1e-6, rtol=1e-5, msg=key)


def test_the_documents_do_not_see_each_other_under_either_attention():
    """Changing the last document's inputs must leave the first documents' logits alone (both paths)."""
    batch = _packed_row()
    other = {k: v.clone() for k, v in batch.items()}
    first = sum(DOC_LENGTHS[:-1])
    other["hidden_states"][:, first:] += 1.0
    other["input_ids"][:, first:] = (other["input_ids"][:, first:] + 1) % SPEC.vocab_size
    sdpa, flex = _drafts("sdpa", "simple_flex_attention")
    flex_k = kernels.resolve("flex", "eager", "off", CPU, first, needs_backward=False)
    for model, k in ((sdpa, SDPA_EAGER), (flex, flex_k)):
        a, _, _ = _forward_per_step(model, batch, k)
        b, _, _ = _forward_per_step(model, other, k)
        # TTT step s feeds token t+1+s, so the last s positions of the previous document read the next one
        for step in range(TTT):
            torch.testing.assert_close(a[step][0, : first - step - 1], b[step][0, : first - step - 1])
            assert not torch.allclose(a[step][0, first:], b[step][0, first:])


def _block_mask_as_dense(block_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """The token pairs a block-sparse flex kernel visits: full blocks, and partial blocks where mask_mod."""
    bq, bkv = block_mask.BLOCK_SIZE
    q_blocks = block_mask.kv_num_blocks.shape[-1]
    kv_blocks = -(-kv_len // bkv)

    def blocks(num, idx) -> torch.Tensor:
        out = torch.zeros(q_blocks, max(kv_blocks, int(idx.shape[-1])), dtype=torch.bool)
        if num is not None:
            for i in range(q_blocks):
                out[i, idx[0, 0, i, : num[0, 0, i]]] = True
        return out

    full = blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    partial = blocks(block_mask.kv_num_blocks, block_mask.kv_indices)
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    mod = block_mask.mask_mod(torch.tensor(0), torch.tensor(0), q, kv)
    return full[q // bq, kv // bkv] | (partial[q // bq, kv // bkv] & mod)


@pytest.mark.parametrize("pad", [False, True])
def test_flex_block_mask_equals_the_dense_mask_at_every_step_only_on_block_multiples(pad):
    """speculators' extend_mask_for_draft_tokens appends the diagonal as whole blocks: exact when the row
    is a multiple of 128 (what kernels pads to), missing pairs otherwise (why it pads)."""
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
        extend_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    batch = _packed_row()
    if pad:
        batch = kernels.pad_batch(
            batch, kernels.padded_length(300, kernels.Kernels("flex", "eager", False, 128))
        )
    doc = batch["document_ids"][0]
    t = doc.numel()
    mod = create_combined_mask_mod(doc, t)
    block = create_block_mask(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    dense = create_mask(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    missing = []
    for step in range(TTT):
        assert dense.shape[-1] == t * (step + 1)
        missing.append(int((_block_mask_as_dense(block, t, t * (step + 1)) != dense[0, 0]).sum()))
        block = extend_mask_for_draft_tokens(block)
        dense = extend_dense_mask_for_draft_tokens(dense, t)
    if pad:
        assert missing == [0] * TTT
    else:
        assert missing[0] == 0 and all(m > 0 for m in missing[1:]), missing


def test_padding_to_a_bucket_leaves_the_loss_and_metrics_unchanged():
    (sdpa,) = _drafts("sdpa")
    batch = _packed_row()
    bucketed = kernels.resolve("sdpa", "eager", "on", CPU, 1000)
    assert bucketed.length_buckets == (256, 512, 768, 1024)
    assert kernels.padded_length(300, bucketed) == 512
    _, loss, metrics = _forward_per_step(sdpa, batch, SDPA_EAGER)
    # the bucketed kernels' padding, with the plain (uncompiled) forward
    plain_padded = kernels.Kernels("sdpa", "eager", False, 128, bucketed.length_buckets)
    logits, padded_loss, padded_metrics = _forward_per_step(sdpa, batch, plain_padded)
    assert logits[0].shape[1] == 512
    torch.testing.assert_close(padded_loss, loss, atol=1e-6, rtol=1e-5)
    assert metrics.keys() == padded_metrics.keys()
    for key in metrics:
        torch.testing.assert_close(padded_metrics[key].float(), metrics[key].float(), atol=1e-6, rtol=1e-5)
    assert float(metrics["full_acc_0_total"]) == float(batch["loss_mask"].sum())


def test_pad_batch_marks_padding_as_no_document_and_no_loss():
    batch = _packed_row((5, 3))
    out = kernels.pad_batch(batch, 12)
    assert out["document_ids"][0].tolist() == [0] * 5 + [1] * 3 + [-1] * 4
    assert not out["loss_mask"][0, 8:].any() and out["hidden_states"][0, 8:].abs().sum() == 0
    assert all(v.shape[1] == 12 for v in out.values())
    assert kernels.pad_batch(batch, 8) is batch
    with pytest.raises(ValueError):
        kernels.pad_batch(batch, 4)


def test_auto_picks_sdpa_eager_and_no_compile_on_cpu():
    k = kernels.resolve("auto", "auto", "auto", CPU, 8192)
    assert k == kernels.Kernels("sdpa", "eager", False, 1, ())
    assert k.to_json() == {
        "attn_impl": "sdpa", "loss_impl": "eager", "compile": False, "pad_multiple": 1, "length_buckets": []
    }  # fmt: skip
    assert k.hf_attn_impl == "sdpa"
    assert kernels.padded_length(1000, k) == 1000  # the CPU path never pads: resumes stay bitwise


def test_auto_on_cuda_is_flex_fused_compiled_where_triton_is(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    k = kernels.resolve("auto", "auto", "auto", cuda, 16384)
    assert (k.attn_impl, k.loss_impl, k.compile, k.hf_attn_impl) == (
        "flex",
        "fused",
        True,
        "simple_flex_attention",
    )
    assert k.length_buckets == (4096, 8192, 12288, 16384)
    assert kernels.padded_length(9000, k) == 12288 and kernels.padded_length(17000, k) == 17024
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert kernels.resolve("sdpa", "auto", "off", cuda, 16384).loss_impl == "eager"
    with pytest.raises(UserError, match="Triton"):
        kernels.resolve("auto", "fused", "auto", cuda, 16384)
    with pytest.raises(UserError, match="flex needs compile"):  # uncompiled flex materialises all scores
        kernels.resolve("flex", "eager", "off", cuda, 16384)
    assert kernels.resolve("sdpa", "eager", "off", cuda, 16384).pad_multiple == 1


def test_cpu_refuses_what_cannot_train_there():
    with pytest.raises(UserError, match="no backward on CPU"):
        kernels.resolve("flex", "auto", "auto", CPU, 8192)
    with pytest.raises(UserError, match="CUDA and Triton"):
        kernels.resolve("auto", "fused", "auto", CPU, 8192)
    # an unknown name never reaches resolve: TrainConfig refuses it when built (test_config_validation.py)


def test_compile_off_binds_the_uncompiled_forward():
    (model,) = _drafts("sdpa")
    kernels.set_compile(model, SDPA_EAGER)
    cls_forward = type(model).forward
    assert model.forward.__func__ is getattr(cls_forward, "_torchdynamo_orig_callable", cls_forward)


def test_export_loads_the_draft_with_the_uncompiled_forward_where_speculators_compiled_it(
    tiny_run, monkeypatch
):
    """On a CUDA machine speculators' import compiles Eagle3DraftModel.forward (dynamic shapes); export's
    gate runs CPU tensors through it and must not build inductor graphs for them. Compiled here as it is
    there (torch.compile of the class function), the loaded draft's forward is the function under it."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3_pipeline.export_eval import export

    plain = Eagle3DraftModel.forward
    monkeypatch.setattr(Eagle3DraftModel, "forward", torch.compile(plain))
    assert Eagle3DraftModel.forward._torchdynamo_orig_callable is plain
    model = export.load_trained(tiny_run / "train", "latest")[2]
    assert isinstance(model, Eagle3DraftModel) and model.forward.__func__ is plain


def test_attention_memory_terms_are_the_sizes_of_the_masks_speculators_builds():
    from speculators.models.attention import create_float_mask
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    t, heads = 256, 4
    doc = torch.repeat_interleave(torch.arange(2), torch.tensor([100, 156]))
    mod = create_combined_mask_mod(doc, t)
    for impl, make in (("sdpa", create_mask), ("eager", create_float_mask)):
        masks = [make(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")]
        for _ in range(TTT):  # core.py widens after every step, the last one included
            masks.append(extend_dense_mask_for_draft_tokens(masks[-1], t))
        last_two = sum(m.numel() * m.element_size() for m in masks[-2:])
        assert kernels.attention_extra_terms(impl, t, TTT, heads, 2)["masks"] == last_two, impl
    block = create_block_mask(mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    flex_masks = kernels.attention_extra_terms("flex", t, TTT, heads, 2)["masks"]
    assert flex_masks >= 2 * t * t + block.kv_indices.numel() * block.kv_indices.element_size()
    # at the Kimi row (16384 tokens, 3 steps, 64 heads, bf16) sdpa holds gigabytes, flex far less
    kimi = {i: kernels.attention_extra_bytes(i, 16384, 3, 64, 2) for i in ("flex", "sdpa", "eager")}
    assert kimi["sdpa"] == 16384**2 * (7 + 12)
    assert kimi["flex"] * 5 < kimi["sdpa"] < kimi["eager"] / 10
    assert kimi == {i: sum(kernels.attention_extra_terms(i, 16384, 3, 64, 2).values()) for i in kimi}


def test_training_records_its_kernels_in_meta_json(tiny_run):
    meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    assert meta["kernels"] == {
        "attn_impl": "sdpa", "loss_impl": "eager", "compile": False, "pad_multiple": 1, "length_buckets": []
    }  # fmt: skip
    assert meta["config"]["attn_impl"] == "auto" and meta["config"]["compile"] == "auto"


def test_flex_training_on_cpu_is_refused_before_any_work(tiny_run, tmp_path):
    from conftest import run_script, script

    proc = run_script(
        script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir", str(tmp_path / "t"),
        "--attn-impl", "flex", "--max-steps", "1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "no backward on CPU" in proc.stderr, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "t").exists()


def train_kernels_bench():
    """benchmarks/train_kernels.py as a module."""
    from benchmarks import train_kernels

    return train_kernels


def test_mfu_counts_exactly_the_pairs_speculators_mask_allows():
    from speculators.models.eagle3.attention import (
        create_combined_mask_mod,
        extend_dense_mask_for_draft_tokens,
    )
    from torch.nn.attention.flex_attention import create_mask

    bench = train_kernels_bench()
    lengths = bench.doc_lengths(bench.TINY)
    assert sum(lengths) == bench.TINY.batch_tokens and len(lengths) > 2
    t = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = create_mask(create_combined_mask_mod(doc, t), B=None, H=None, Q_LEN=t, KV_LEN=t, device="cpu")
    allowed = 0
    for _ in range(TTT):
        allowed += int(mask.sum())
        mask = extend_dense_mask_for_draft_tokens(mask, t)
    assert bench.attended_pairs(lengths, TTT) == allowed


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_mfu_counts_every_matmul_weight_of_the_draft_layer_it_times(arch):
    """The FLOP count's layer weights are the built draft's layer-0 matrices, for either layer kind (Kimi's
    MLA dims and the tiny ones), and the MLA row is timed on an MLA draft."""
    from eagle3_pipeline.models.draft import build_draft

    bench = train_kernels_bench()
    for size in (bench.TINY, bench.KIMI):
        shape = bench.with_arch(size, arch)
        with torch.device("meta"):
            model = build_draft(bench.spec_of(shape))
        layer = dict(model.layers[0].named_parameters())
        assert bench.layer_weights(shape) == sum(p.numel() for p in layer.values() if p.dim() == 2)
        assert ("self_attn.kv_a_proj_with_mqa.weight" in layer) == (arch == "mla")
    if arch == "mla":  # Kimi-K2.5's own dims: 64 heads x (nope 128 + rope 64 + v 128) x 2 per pair
        assert bench.with_arch(bench.KIMI, "mla").mla == (1536, 512, 128, 64, 128)
        assert bench.pair_flops(bench.with_arch(bench.KIMI, "mla")) == 2 * 64 * (128 + 64 + 128)


def test_train_kernels_benchmark_writes_its_rows_and_the_speculators_ratio(tmp_path):
    from conftest import run_script

    out = tmp_path / "bench.json"
    run_script(
        "-m", "benchmarks.train_kernels", "--tiny", "--warmup", "0", "--steps", "1", "--out", str(out),
        "--only", "sdpa+eager", "speculators Trainer (sdpa+eager)", timeout=600,
    )  # fmt: skip
    res = json.loads(out.read_text())
    rows = {r["row"]: r for r in res["rows"]}
    assert set(rows) == {"sdpa+eager", "speculators Trainer (sdpa+eager)"}
    assert all("error" not in r and r["step_s"] > 0 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["sdpa+eager"]["speedup_vs_sdpa_eager"] == 1.0
    ratio = rows["sdpa+eager"]["step_s"] / rows["speculators Trainer (sdpa+eager)"]["step_s"]
    assert res["project_vs_speculators_step_ratio"] == pytest.approx(ratio)
    assert res["machine"]["speculators"] == "0.9.0" and res["machine"]["threads"] >= 1
    assert res["step_flops"] > 0 and res["attention_extra_gib"]["sdpa"] > res["attention_extra_gib"]["flex"]
    # the MLA draft (--arch mla): its own rows, no speculators row (speculators trains no MLA draft)
    run_script("-m", "benchmarks.train_kernels", "--tiny", "--arch", "mla", "--warmup", "0", "--steps", "1",
               "--out", str(out), timeout=600)  # fmt: skip
    res = json.loads(out.read_text())
    assert res["shape"]["mla"] == [32, 32, 16, 16, 16]
    rows = train_kernels_bench().rows_for(torch.device("cpu"))
    assert [r["row"] for r in res["rows"]] == [label for label, k, _ in rows if k is not None]
    assert all("error" not in r and r["step_s"] > 0 for r in res["rows"])
    assert "project_vs_speculators_step_ratio" not in res


def test_the_ce_loss_is_cross_entropy_on_the_verifiers_argmax_over_the_supervised_positions():
    (model,) = _drafts("sdpa")
    batch = _packed_row()
    logits, loss, _ = _forward_per_step(model, batch, SDPA_EAGER, "ce")
    _, kl, _ = _forward_per_step(model, batch, SDPA_EAGER, "kl_div")
    with torch.no_grad():
        targets = model.verifier_lm_head(model.verifier_norm(batch["verifier_last"]))
    expected = torch.tensor(0.0)
    for s, step_logits in enumerate(logits):  # step s predicts position s ahead (align_for_step)
        n = step_logits.shape[1] - s
        labels = targets[0, s:].argmax(-1)
        mask = batch["loss_mask"][0, s:].float()
        ce = torch.nn.functional.cross_entropy(step_logits[0, :n], labels, reduction="none")
        expected = expected + (ce * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected, atol=1e-4, rtol=1e-5)
    assert abs(float(loss) - float(kl)) > 1e-3  # the setting reaches the loss


def test_a_json_loss_is_the_weighted_sum_of_its_terms():
    (model,) = _drafts("sdpa")
    batch = _packed_row()
    parts = {name: float(_forward_per_step(model, batch, SDPA_EAGER, name)[1]) for name in ("kl_div", "ce")}
    _, mixed, _ = _forward_per_step(model, batch, SDPA_EAGER, '{"kl_div": 0.25, "ce": 0.75}')
    assert float(mixed) == pytest.approx(0.25 * parts["kl_div"] + 0.75 * parts["ce"], rel=1e-5)


def test_an_unknown_loss_is_refused_before_any_data_is_read(tiny_run, tmp_path):
    from conftest import run_script, script

    proc = run_script(
        script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir", str(tmp_path / "t"),
        "--loss", "mse", "--max-steps", "1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "--loss must be one of" in proc.stderr, proc.stderr
    assert "got 'mse'" in proc.stderr and "kl_div" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "t").exists()


def test_state_noise_is_relative_to_each_tokens_rms_seeded_and_touches_only_the_aux_states():
    from eagle3_pipeline.training.train_metrics import with_state_noise

    batch = _packed_row()
    batch["hidden_states"][0, :100] *= 50.0  # tokens of very different scale
    noisy = with_state_noise(batch, 0.1, seed=7)
    delta = noisy["hidden_states"] - batch["hidden_states"]
    ratio = delta.pow(2).mean(-1).sqrt() / batch["hidden_states"].pow(2).mean(-1).sqrt()
    # 0.1 x RMS at every token, whatever its scale
    assert 0.08 < float(ratio.min()) and float(ratio.max()) < 0.12
    assert torch.equal(with_state_noise(batch, 0.1, seed=7)["hidden_states"], noisy["hidden_states"])
    assert not torch.equal(with_state_noise(batch, 0.1, seed=8)["hidden_states"], noisy["hidden_states"])
    assert all(noisy[k] is batch[k] for k in batch if k != "hidden_states")


def test_a_full_vocabulary_draft_takes_the_verifiers_head_and_maps_ids_to_themselves():
    """draft_vocab_size == vocab_size (for probabilistic drafting): speculators keeps no d2t/t2d then;
    attaching the verifier's tensors and mapping ids must still work (both used to raise)."""
    import dataclasses

    from eagle3_pipeline.models.draft import attach_verifier_tensors, build_draft
    from eagle3_pipeline.data.vocab import draft_to_target, mappings

    spec = dataclasses.replace(SPEC, draft_vocab_size=SPEC.vocab_size)
    model = build_draft(spec)
    assert model.d2t is None
    g = torch.Generator().manual_seed(0)
    v, h = SPEC.vocab_size, SPEC.hidden_size
    tensors = {"embed_tokens": torch.randn(v, h, generator=g), "lm_head": torch.randn(v, h, generator=g),
               "norm": torch.ones(h)}  # fmt: skip
    d2t, t2d = mappings(torch.arange(v), v)
    attach_verifier_tensors(model, tensors, t2d, d2t)
    assert torch.equal(model.lm_head.weight, tensors["lm_head"])
    ids = torch.tensor([0, 7, v - 1])
    assert torch.equal(draft_to_target(ids, model.d2t), ids)
    assert torch.equal(draft_to_target(ids, d2t), ids)  # the full mapping is the identity too
    _, value, _ = _forward_per_step(model, _packed_row(), SDPA_EAGER, "tv")
    assert torch.isfinite(value)
