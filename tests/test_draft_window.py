"""A sliding-window Llama draft ([train] sliding_window) trains with the window vLLM serves
(models/draft_window.py): counted from each TTT step's serving index, in every attention path."""

from __future__ import annotations

import pytest
import torch
from conftest import draft_spec
from test_long_memory import DOCS, DRAFT_VOCAB, L, PLAIN_NORMS, _assert_same_step, _row
from test_long_memory import small_chunks  # noqa: F401 (the autouse fixture: 64-token chunks here too)

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models import draft_window, linear_memory
from eagle3_pipeline.models.draft import build_draft
from eagle3_pipeline.training import kernel_policy as kernels
from eagle3_pipeline.training.train_metrics import Recipe, forward

CPU = torch.device("cpu")
TTT = 3
WINDOW = 24  # shorter than three of the row's four documents and than the 64-token test chunks


def _spec(window: int | None):
    return draft_spec(64, 200, DRAFT_VOCAB, (1, 2, 3), num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, intermediate_size=128, rope_theta=1e4, max_position_embeddings=2048,
                      sliding_window=window, **PLAIN_NORMS)  # fmt: skip


def _step(window: int | None, attn: str, windowed_kernels: bool | None = None):
    """(loss, metrics, grads) of one training step (train_metrics.forward) of a draft with this window."""
    torch.manual_seed(0)
    model = build_draft(_spec(window), attn_impl=kernels.HF_ATTN_NAMES[attn])
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=0.3 if p.shape[0] == DRAFT_VOCAB else 0.05)
    windowed = window is not None if windowed_kernels is None else windowed_kernels
    value, metrics = forward(model, _row(), Recipe(TTT, 0.8, "kl_div"), CPU, None,
                             kernels.Kernels(attn, "eager", False, windowed=windowed))  # fmt: skip
    value.backward()
    return value.detach(), metrics, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_windowed_blockwise_attention_gives_the_windowed_dense_loss_and_gradients():
    """Four packed documents, padding, 64-token chunks, window 24, three TTT steps: the blockwise path
    (which skips keys outside the window) equals sdpa under the dense windowed mask, and both differ from
    the full-attention draft (the window does something)."""
    dense = _step(WINDOW, "sdpa")
    _assert_same_step(_step(WINDOW, "blockwise"), dense, 1e-5)
    assert abs(float(dense[0]) - float(_step(None, "sdpa")[0])) > 1e-4


def test_a_window_reaching_every_key_of_every_step_is_full_attention_exactly():
    """Window L + TTT - 1 (no key of the row is out of reach at any step's serving index): the windowed
    training forward equals speculators' own full-attention forward bit for bit."""
    win = _step(L + TTT - 1, "sdpa")
    full = _step(None, "sdpa")
    assert torch.equal(win[0], full[0])
    for name, g in full[2].items():
        assert torch.equal(win[2][name], g), name


def test_the_window_counts_from_each_steps_serving_index_not_speculators_query_index():
    """Step 0's mask is speculators' windowed one; at step s vLLM's draft token sits at row + s, so it
    reaches s fewer old keys than speculators' mask (kv > q - window at every step) lets it see."""
    from speculators.models.eagle3.attention import create_combined_mask_mod
    from speculators.models.eagle3.attention import extend_dense_mask_for_draft_tokens as extend
    from torch.nn.attention.flex_attention import create_mask

    doc = _row()["document_ids"][0]
    theirs = create_mask(create_combined_mask_mod(doc, L, WINDOW), None, None, L, L, device="cpu")
    for step in range(TTT):
        ours = create_mask(draft_window.ttt_mask_mod(doc, L, step, WINDOW), None, None, L, L * (step + 1),
                           device="cpu")  # fmt: skip
        if step == 0:
            assert torch.equal(ours, theirs)
        else:
            theirs = extend(theirs, L)
            extra = theirs[0, 0] & ~ours[0, 0]
            assert not (ours[0, 0] & ~theirs[0, 0]).any()
            q, k = extra.nonzero().unbind(1)
            # only step-0 keys within speculators' window and beyond the served one: per document of n >
            # WINDOW tokens, s keys for each of its n - WINDOW last queries, 1 + .. + s for the s before
            assert (k < L).all() and ((q + step - k >= WINDOW) & (q - k < WINDOW)).all()
            per_doc = [step * (n - WINDOW) + step * (step + 1) // 2 for n in DOCS if n > WINDOW]
            assert int(extra.sum()) == sum(per_doc)


def test_the_blockwise_chunks_read_a_bounded_number_of_keys():
    """With a window the chunks start at most window + TTT keys before their first query: the cost per
    query is constant in the row's length (without one, a chunk reads from its document's start)."""
    doc = torch.zeros(4096, dtype=torch.long)
    windowed = linear_memory.DocumentMask.of(doc, window=256).chunks(512, TTT)
    full = linear_memory.DocumentMask.of(doc).chunks(512, TTT)
    assert max(a - lo for a, _, lo in windowed) <= 256
    assert max(a - lo for a, _, lo in full) == 4096 - 512


def test_a_window_is_refused_for_an_mla_draft_a_parallel_draft_and_flex_and_auto_picks_blockwise():
    with pytest.raises(UserError, match="--sliding-window with --draft-arch mla"):
        draft_spec(64, 200, DRAFT_VOCAB, (1, 2, 3), num_attention_heads=4, draft_arch="mla",
                   mla_q_lora_rank=0, mla_kv_lora_rank=32, mla_qk_nope_head_dim=16, mla_qk_rope_head_dim=8,
                   mla_v_head_dim=24, sliding_window=16, norm_before_fc=False)  # fmt: skip
    with pytest.raises(UserError, match="--sliding-window with --parallel-drafting"):
        draft_spec(64, 200, DRAFT_VOCAB, (1, 2, 3), parallel_drafting=True, sliding_window=16)
    with pytest.raises(UserError, match="sliding_window with attn_impl flex"):
        kernels.resolve("flex", "eager", "off", torch.device("cuda"), 4096, windowed=True)
    for device in ("cpu", "cuda"):  # auto: blockwise, through ttt_forward, uncompiled
        k = kernels.resolve("auto", "eager", "auto", torch.device(device), 4096, windowed=True)
        assert (k.attn_impl, k.linear_memory, k.compile) == ("blockwise", True, False)
        sdpa = kernels.resolve("sdpa", "eager", "auto", torch.device(device), 4096, windowed=True)
        assert sdpa.linear_memory and not sdpa.compile


def _export_spec(window: int | None):
    """A llama draft over the tiny Kimi-latent verifier (hidden 256), windowed or not."""
    from test_mla_draft import train_cfg

    from eagle3_pipeline.models.draft import spec_for_training
    from eagle3_pipeline.models.tiny import tiny_config

    cfg = train_cfg(draft_arch="llama", num_key_value_heads=2, head_dim=64, sliding_window=window)
    return spec_for_training(cfg, tiny_config("kimi_mla"), 96, (2, 4, 5))


def _samples(spec, lengths=(20, 28)) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(3)
    H = spec.hidden_size
    return [{"input_ids": torch.randint(0, spec.vocab_size, (n,)), "loss_mask": torch.ones(n).bool(),
             "aux_hidden_states": torch.randn(n, 3, H), "last_hidden_state": torch.randn(n, H)}
            for n in lengths]  # fmt: skip


def test_the_export_carries_vllms_window_keys_and_the_gate_refuses_another_window(tmp_path):
    """config.json: layer_types [sliding_attention] + sliding_window (none for a full draft); the gate
    refuses, naming the key, a missing, extra or different window and a malformed layer_types."""
    import json

    from safetensors.torch import load_file
    from test_mla_draft import _export, _random_draft

    from eagle3_pipeline.export_eval.export import export_config, static_problems

    s, full = _export_spec(6), _export_spec(None)
    model = _random_draft(s)
    d = _export(s, model, tmp_path / "draft")
    config = json.loads((d / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (["sliding_attention"], 6)
    assert not {"layer_types", "sliding_window"} & set(export_config(full, {}))
    tensors = load_file(str(d / "model.safetensors"))

    def problems(spec, **changes):
        c = {k: v for k, v in {**config, **changes}.items() if v is not ...}
        return static_problems(c, tensors, {"draft": spec.to_json(), "d2t": model.d2t})

    assert problems(s) == []
    for spec, change, named in [
        (s, {"sliding_window": 8}, "sliding_window 8 != trained 6"),
        (s, {"layer_types": ...}, "sliding_window missing: .*6-token window"),
        (s, {"layer_types": ["full_attention"]}, "sliding_window missing"),
        (s, {"layer_types": ["sliding_attention"] * 2}, "layer_types .* must list 1"),
        (full, {}, "vLLM would attend within 6 tokens; the draft was trained with full attention"),
        (full, {"layer_types": ...}, "sliding_window 6 without a sliding layer"),
    ]:
        import re

        assert any(re.search(named, p) for p in problems(spec, **change)), (change, problems(spec, **change))


def test_the_read_back_attends_within_the_window_as_training_did(tmp_path, monkeypatch):
    """The gate's read-back (the export read as vLLM reads it, window included, against the trained
    draft's TTT steps 0 and 1 under the served rule) matches to rounding on samples longer than the
    window; speculators' own forward of the same draft (its window counted from the query) does not, and
    the read-back fails once config.json says another window (the static checks bypassed)."""
    import json

    from test_mla_draft import _export, _random_draft

    from eagle3_pipeline.export_eval import export_window
    from eagle3_pipeline.export_eval.export import readback_problems

    s = _export_spec(6)
    model = _random_draft(s, seed=2)
    d = _export(s, model, tmp_path / "draft")
    embed = model.embed_tokens.weight.detach()
    problems, stats = readback_problems(d, model, embed, _samples(s), ttt_steps=2)
    assert problems == [] and stats["normalised_error"] < 1e-5, (problems, stats)
    with monkeypatch.context() as m:
        m.setattr(export_window, "run_windowed", lambda *a: False)
        _, theirs = readback_problems(d, model, embed, _samples(s), ttt_steps=2)
    assert theirs["normalised_error"] > 1000 * stats["normalised_error"], theirs
    config = json.loads((d / "config.json").read_text())
    for edit in ({"sliding_window": 5}, {"layer_types": ["full_attention"]}):
        (d / "config.json").write_text(json.dumps({**config, **edit}))
        problems, _ = readback_problems(d, model, embed, _samples(s), ttt_steps=2)
        assert any("agrees with the trained draft on" in p for p in problems), (edit, problems)


def test_the_window_is_part_of_the_drafts_spec_and_absent_without_one():
    """meta.json's "draft" (which a resume compares) records the window; a full draft's record is as it
    was before the setting (no key), so older runs resume."""
    from eagle3_pipeline.models.draft import DraftSpec

    assert _spec(16).to_json()["sliding_window"] == 16 and "sliding_window" not in _spec(None).to_json()
    assert DraftSpec.from_json(_spec(16).to_json()) == _spec(16)
    assert _spec(16).to_json() != _spec(32).to_json()
