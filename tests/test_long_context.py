"""benchmarks/long_context.py's shortcuts against the pipeline's own maths (no long forward): its draft's
first pass attends only from the prompt's last slot on, and its far/near ratio carries both errors."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_tail_first_pass_exact

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tail_first_pass_counts_exactly_what_the_whole_first_pass_counts(tiny_run):
    from eagle3_pipeline.models.reference_draft import ReferenceDraft
    from eagle3_pipeline.models.verifier import draft_tensors_of

    embed = draft_tensors_of(tiny_run / "verifier")["embed_tokens"]
    assert_tail_first_pass_exact(ReferenceDraft(tiny_run / "draft", embed), 256)


def test_far_to_near_ratio_and_its_standard_error():
    lc = _load("long_context")
    buckets = [
        {"context": "0-1k", "mean_acceptance_length": 2.0, "standard_error": 0.1},
        {"context": "16k-32k", "mean_acceptance_length": 1.8, "standard_error": 0.09},
    ]
    r = lc.ratio(buckets, "16k-32k")
    assert r["ratio"] == 0.9
    assert r["standard_error"] == pytest.approx(0.9 * (0.05**2 + 0.05**2) ** 0.5, abs=1e-3)
    assert lc.ratio(buckets[:1], "16k-32k") is None


def test_yarn_verifier_config_reads_as_the_same_yarn_everywhere():
    """real_verifier's --yarn-factor: transformers' Llama config, vLLM's reading (a non-null rope_scaling
    with the top-level rope_theta) and the project's read-back all see yarn x4 over 8,192 positions with
    SmolLM2's own rope_theta, and the positions reach 32,768."""
    from transformers import LlamaConfig

    from benchmarks import real_verifier
    from eagle3_pipeline.core import rope_scaling

    plain = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                        max_position_embeddings=8192).to_dict()  # fmt: skip
    cfg = real_verifier.yarn_config(plain, 4)
    assert cfg["max_position_embeddings"] == 32768
    params = LlamaConfig(**copy.deepcopy(cfg)).rope_parameters  # (it fills rope_theta into what it reads)
    assert (params["rope_type"], params["factor"], params["original_max_position_embeddings"],
            params["rope_theta"]) == ("yarn", 4.0, 8192, 100000.0)  # fmt: skip
    theta, scaling, _ = rope_scaling.served(cfg)
    assert theta == 100000.0 and scaling == rope_scaling.of_verifier(cfg)
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError):
        real_verifier.yarn_config(plain, 1)


def test_speculators_draft_exports_the_yarn_and_window_its_layer_config_trained_with():
    """speculators builds its draft's rotary embedding from the verifier's layer config, so on a yarn
    verifier it trains with yarn: the project's spec of it (what stage 05 exports) carries that scaling,
    on a plain verifier none; and its layer's sliding window when the layer config makes it sliding."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from benchmarks import real_verifier, speculators_baseline

    plain = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, head_dim=64,
                        hidden_size=576, num_attention_heads=9, num_key_value_heads=3)  # fmt: skip
    yarn = LlamaConfig(**real_verifier.yarn_config(plain.to_dict(), 4))

    def spec(tl):
        cfg = SimpleNamespace(transformer_layer_config=tl, eagle_aux_hidden_state_layer_ids=[2, 15, 27],
                              norm_before_residual=False, norm_before_fc=True, fc_norm=False,
                              norm_output=False)  # fmt: skip
        return speculators_baseline.spec_of(SimpleNamespace(config=cfg), torch.arange(8))

    assert spec(plain).rope_scaling is None
    assert spec(yarn).rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 8192}  # fmt: skip
    assert spec(yarn).rope_theta == 100000.0
    # speculators 0.9.0's default layer is sliding (window 2048): exported with it, as trained
    windowed = LlamaConfig(**{**plain.to_dict(), "num_hidden_layers": 1, "layer_types": ["sliding_attention"],
                              "sliding_window": 2048})  # (speculators: a one-layer draft)
    assert spec(windowed).sliding_window == 2048 and spec(plain).sliding_window is None


def test_vllm_agreement_needs_the_traces_outputs_and_equal_counters_in_every_bucket():
    """long_context_smollm2.agreement reads the simulation's buckets (acceptance.by_context) and vLLM's
    (vllm_engine.merge_bucket_results) by the same labels: equal counters and outputs agree; one output
    off the verifier's trace, or one accepted token moved between buckets, does not."""
    from eagle3_pipeline.models.acceptance import by_context
    from eagle3_pipeline.vllm_side.vllm_engine import merge_bucket_results

    lcs = _load("long_context_smollm2")
    # two requests at ~0.4k (2 + 1 drafts, accepted 1 + 0 + 2), one at ~20k (2 drafts, accepted 0 + 1)
    steps = [(437, 1, 1.0), (440, 0, 0.0), (450, 2, 2.0), (20000, 0, 0.0), (20002, 1, 1.0)]
    sim = {"acceptance_by_context": by_context(steps), "accepted_per_pos": [3, 1, 0]}

    def answer(outputs, drafts, accepted, per_pos):
        return {"outputs": outputs, "num_drafts": drafts, "num_draft_tokens": 3 * drafts,
                "num_accepted_tokens": accepted, "accepted_per_pos": per_pos,
                "mean_acceptance_length": 1 + accepted / drafts}  # fmt: skip

    def served(near_accepted=3, far_accepted=1, far_output=(7, 8)):
        return merge_bucket_results(3, [
            ((0, 1024), [0, 1], answer([[1, 2], [3, 4]], 3, near_accepted, [2, 1, 0])),
            ((16384, 32768), [2], answer([list(far_output)], 2, far_accepted, [1, 0, 0])),
        ])  # fmt: skip

    reference = [[1, 2], [3, 4], [7, 8]]
    ok = lcs.agreement(sim, served(), reference)
    assert ok["agree"] and ok["lossless_requests"] == "3/3" and ok["first_mismatch"] is None
    assert list(ok["buckets"]) == ["0-1k", "16k-32k"]
    assert ok["buckets"]["16k-32k"]["vllm"] == {"num_drafts": 2, "num_accepted_tokens": 1}
    off_trace = lcs.agreement(sim, served(far_output=(7, 9)), reference)
    assert not off_trace["agree"] and off_trace["first_mismatch"] == 2
    moved = lcs.agreement(sim, served(near_accepted=4, far_accepted=0), reference)
    assert not moved["agree"] and moved["lossless_requests"] == "3/3"


def test_long_generation_traces_hold_back_the_end_tokens_and_store_p_sparse(tiny_run, tmp_path):
    """A long-generation row's traces never emit a held-back token (its logit -inf at every step, as vLLM's
    min_tokens), with p~ zero there, while the same trace without it does emit it; the stored traces keep
    p~ sparse and read back equal to what was made."""
    from eagle3_pipeline.models.verifier import (AuxCapture, find_decoder_layers, load_verifier_model,
                                                  verifier_facts)  # fmt: skip

    lcs = _load("long_context_smollm2")
    verifier = tiny_run / "verifier"
    facts = verifier_facts(verifier)
    model = load_verifier_model(verifier, torch.float32, False)
    capture = AuxCapture(find_decoder_layers(model, facts.num_hidden_layers), [1, 2, 3])
    prompt, n = [5, 17, 99, 3, 42], 24
    free = lcs.verifier_traces(model, capture, prompt, n, 0)
    held = sorted({int(t) for t in free["greedy"][0][len(prompt):]})[:2]  # tokens the free trace emits
    banned = lcs.verifier_traces(model, capture, prompt, n, 0, tuple(held))
    for st, (seq, aux, probs) in banned.items():
        assert seq.numel() == len(prompt) + n and aux.shape[0] == len(prompt) + n - 1
        assert not set(seq[len(prompt):].tolist()) & set(held), st
        if probs is not None:
            assert probs.shape[0] == n and torch.all(probs[:, held] == 0)

    made, seconds = lcs.cached_traces(tmp_path, "long-generation-24-0", lambda: banned)
    stored = torch.load(tmp_path / lcs.TRACES / "long-generation-24-0.pt")["traces"]["thinking_prob"][2]
    assert stored.is_sparse and stored._nnz() < stored.numel()
    again, again_s = lcs.cached_traces(tmp_path, "long-generation-24-0", lambda: pytest.fail("made twice"))
    assert again_s == seconds
    for st in banned:
        for x, y in zip(banned[st], again[st]):
            assert (x is None and y is None) or torch.equal(x, y)


def test_generation_rows_are_counted_apart_and_keyed_by_their_new_tokens():
    lcs = _load("long_context_smollm2")
    gen = {"kind": "generation", "max_new_tokens": 4096, "target_tokens": 4096, "prompt_tokens": 80}
    doc = {"kind": "document", "target_tokens": 437, "prompt_tokens": 437}
    assert (lcs._new(gen, 64), lcs._new(doc, 64)) == (4096, 64)
    assert (lcs._key(gen, 64), lcs._key(doc, 64)) == ("generation 4096", str(437 + 64 + 3 + 8))
    assert (lcs._group("greedy", gen), lcs._group("greedy", doc)) == ("greedy, generation", "greedy")
    # the cost estimate charges a generation row its own new tokens: 4096 + k one-token forwards a setting
    est = lcs.cost_estimate([0.01, 1.0, 4.0], [gen, doc], 64, 0)
    assert est["generation 4096"] == pytest.approx(80 / 512 * 1.0 + 2 * (4096 + 3) * 0.01, rel=0.05)
    assert est[str(437 + 75)] < est["generation 4096"]
    # a group none of whose rows is measured yet has no buckets and no comparison (the JSON is rewritten
    # after each row)
    one = {"context": "0-1k", "mean_acceptance_length": 1.5, "standard_error": 0.05}
    results = {d: {"greedy": {"acceptance_by_context": {"buckets": [one]}},
                   "greedy, generation": {"acceptance_by_context": {"buckets": []}}}
               for d in ("today", "speculators")}  # fmt: skip
    out = lcs.comparisons(results)
    assert list(out) == ["greedy"] and out["greedy"]["today / speculators"]["0-1k"]["ratio"] == 1.0


def test_kimi_shaped_verifier_takes_its_own_mla_dims_draft_width_and_layers(tiny_run, tmp_path):
    """--verifier kimi-mla: the MLA drafts take the MLA verifier's dims (no SmolLM2 --mla-* flag), the draft
    long_context.py's width and every layer of the three; a work dir of the other verifier is refused; the
    given-rows draft is compared with the draft it adds rows to."""
    import json

    lcs = _load("long_context_smollm2")
    work = tmp_path / "work"
    (work / "verifier").mkdir(parents=True)
    vcfg = json.loads((tiny_run / "verifier" / "config.json").read_text())
    (work / "verifier" / "config.json").write_text(json.dumps(vcfg))
    assert lcs.verifier_kind(work / "verifier") == lcs.KIMI and lcs.aux_layer_ids(work) == [1, 2, 3]
    kimi = lcs.draft_flags("mla+rope+given", vcfg)
    assert kimi == ["--draft-arch", "mla", "--no-norm-before-fc", "--rope-scaling", "verifier"]
    smol = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
            "intermediate_size": 1536}  # fmt: skip
    assert lcs.draft_flags("mla+rope", smol)[:3] == ["--draft-arch", "mla", "--mla-q-lora-rank"]
    assert lcs.draft_flags("mla+rope", smol)[-2:] == ["--rope-scaling", "verifier"]
    assert lcs.draft_flags("today+given", vcfg) == []
    assert lcs.draft_width(vcfg) == {"heads": 4, "kv_heads": 4, "intermediate": 3 * vcfg["hidden_size"]}
    assert lcs.draft_width(smol) == {"heads": 9, "kv_heads": 3, "intermediate": 1536}
    with pytest.raises(SystemExit, match="not smollm2"):
        lcs.build_verifier(work, "smollm2", {}, 1)

    def bucket(al):
        return {"context": "0-1k", "mean_acceptance_length": al, "standard_error": 0.05}

    results = {d: {"greedy": {"acceptance_by_context": {"buckets": [bucket(al)]}}}
               for d, al in (("mla+rope", 1.5), ("mla+rope+given", 1.8), ("speculators", 1.2))}  # fmt: skip
    vs = lcs.comparisons(results)["greedy"]
    assert vs["mla+rope+given / mla+rope"]["0-1k"]["ratio"] == pytest.approx(1.2)
    assert vs["mla+rope+given / speculators"]["0-1k"]["ratio"] == pytest.approx(1.5)
    assert "mla+rope / mla+rope" not in vs and "mla+rope / speculators" in vs


def test_each_rows_draws_follow_its_place_in_the_rows_given_whatever_traces_are_stored(tiny_run, tmp_path):
    """measure() reads stored traces first; a row's seed (its sampled trace's draws, its accept coins) is
    still its place in the rows given, so a run that found some traces stored counts what a run that made
    them all counts (the measurement order followed the store once, and the sampled figures with it)."""
    lcs = _load("long_context_smollm2")
    work = tmp_path / "work"
    work.mkdir()
    (work / "verifier").symlink_to(tiny_run / "verifier")
    rows = [{"id": f"long-document-20-{j}", "kind": "document", "target_tokens": 20, "prompt_tokens": 20,
             "token_samples": [{"prompt_ids": [5 + j, 17, 99, 3, 42] * 4}]} for j in range(3)]  # fmt: skip
    drafts = {"tiny": tiny_run / "draft"}
    made = lcs.measure(work, drafts, rows, 12, 1, lambda _: None)["results"]
    for r in rows[:2]:
        (work / lcs.TRACES / f"{r['id']}.pt").unlink()
    again = lcs.measure(work, drafts, rows, 12, 1, lambda _: None)["results"]

    def counted(results):  # the counters (sums of floats in another order differ in their last bits)
        keys = ("num_drafts", "num_accepted_tokens", "accepted_per_pos")
        return {s: ({k: v[k] for k in keys}, pytest.approx(v["mean_acceptance_length"], rel=1e-12),
                    [(b["num_drafts"], b["num_accepted_tokens"]) for b in v["acceptance_by_context"]["buckets"]])
                for s, v in results["tiny"].items()}  # fmt: skip

    assert counted(again) == counted(made) and made["tiny"]["thinking_prob"]["num_drafts"] > 0
