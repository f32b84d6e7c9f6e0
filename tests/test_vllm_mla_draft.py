"""The vLLM tier for the MLA draft ([train] draft_arch = "mla"): trained on the tiny DeepSeek-V3 verifier with
Kimi-K2.5's MLA latent (configs/tiny_mla.toml), exported as Eagle3DeepseekV2ForCausalLM and served by vLLM's
real engine (CPU build): greedy output equal to the verifier's own on every prompt, the simulation's
counters equal to vLLM's, and at Kimi's thinking settings (1.0 / 0.95, probabilistic drafting) the
acceptance within the tier's tolerance of the simulation over vLLM's outputs.

The session's worker and one engine for the whole file, built with probabilistic drafting: vLLM drafts a batch of
greedy requests by the draft's argmax all the same (`_sample_draft_tokens` in
vllm/v1/spec_decode/llm_base_proposer.py returns `_greedy_sample` when `sampling_metadata.all_greedy`), so
the greedy requests are drafted as with draft_sample_method "greedy" and one engine start is saved. Needs scripts/setup_vllm_cpu.sh's environment, as tests/test_vllm_tier.py (same skip rules).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import DATA, run_script, script, vllm_available

from eagle3_pipeline.vllm_side import vllm_engine

OK, WHY = vllm_available()
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM tier skipped: {WHY}", allow_module_level=True)

NUM_PROMPTS, MAX_NEW_TOKENS, K = 6, 64, 3
SAMPLES_PER_PROMPT = 8  # sampled requests per prompt at thinking settings: seeds 0..47
THINKING = {"temperature": 1.0, "top_p": 0.95}


# The MLA draft's [train] settings beside the tier's tiny_mla.toml: dims from the verifier (q_lora 128,
# latent 512 + rope 64, nope 64, v 64), no norm_before_fc (vLLM's deepseek_eagle3.py has no input_norm),
# The tier config's 20 epochs (validation AL 3.95 by epoch 17 of 40, measured).
MLA_FLAGS = ("--draft-arch", "mla", "--no-norm-before-fc")


@pytest.fixture(scope="module")
def mla_run(tier_stages) -> Path:
    """An MLA draft trained on the vLLM tier's tiny MLA run (its shards, vocabulary and split:
    conftest.tier_stages) and exported; a folder with `verifier` and `draft` beside each other (06 is the
    tests below)."""
    base = tier_stages("mla")
    cfg = str(base / "tiny_mla.toml")
    root = base / "mla_draft"
    root.mkdir()
    (root / "verifier").symlink_to(base / "verifier")
    run_script(script("04_train.py"), "--config", cfg, "--out-dir", str(root / "train"), *MLA_FLAGS,
               timeout=1800)  # fmt: skip
    run_script(script("05_export.py"), "--config", cfg, "--train-dir", str(root / "train"), "--out-dir",
               str(root / "draft"), timeout=1800)  # fmt: skip
    return root


@pytest.fixture(scope="module")
def worker(vllm_worker, mla_run):
    yield vllm_worker  # the session's (conftest.vllm_worker), its engine stopped after this file
    vllm_worker.release()


@pytest.fixture(scope="module")
def prompts(mla_run) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import build_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(mla_run / "verifier"))
    return build_prompts(tokenizer, DATA / "conversations.jsonl", 0, NUM_PROMPTS)


def serve(worker, run: Path, prompts, sampling=None) -> dict:
    """The requests in the file's one engine (probabilistic drafting: argmax for an all-greedy batch)."""
    fields = vllm_engine.generate_fields(
        run / "verifier", run / "draft", prompts, MAX_NEW_TOKENS, K, False, "probabilistic"
    )
    return worker.request({**fields, **vllm_engine.sampling_fields(sampling, len(prompts))})


def test_mla_export_is_the_config_vllm_detects_as_an_mla_eagle3_draft(mla_run):
    config = json.loads((mla_run / "draft" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert config["model_type"] == "deepseek_v2"
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    meta = json.loads((mla_run / "draft" / "export_meta.json").read_text())
    assert meta["draft"]["draft_arch"] == "mla" and meta["readback"]["top1_agreement"] >= 0.98


def test_vllm_serves_the_mla_draft_losslessly_with_the_simulations_counters(mla_run, prompts, worker):
    """Greedy: vLLM's output token for token the verifier's own greedy output (the simulation's, fp32),
    and vLLM's drafts and accepted counts per position exactly the simulation's (greedy drafting: the
    argmax an all-greedy batch is drafted by)."""
    from eagle3_pipeline.export_eval.evaluate import compare, simulate

    vllm = serve(worker, mla_run, prompts)
    sim, reference = simulate(mla_run / "verifier", mla_run / "draft", prompts, MAX_NEW_TOKENS, K)
    print(f"\nMLA draft, greedy: vLLM {vllm['mean_acceptance_length']:.3f} per pos "
          f"{vllm['accepted_per_pos']} of {vllm['num_drafts']} | sim {sim['mean_acceptance_length']:.3f} "
          f"{sim['accepted_per_pos']} of {sim['num_drafts']}")  # fmt: skip
    c = compare(sim, vllm, reference)
    assert c["lossless"], c["first_mismatch"]
    assert (vllm["num_drafts"], vllm["accepted_per_pos"]) == (sim["num_drafts"], sim["accepted_per_pos"])
    assert vllm["mean_acceptance_length"] > 2.0, vllm  # trained: far above an untrained draft's ~1


def test_mla_draft_at_thinking_settings_agrees_with_the_simulation_in_vllm(mla_run, prompts, worker):
    """Kimi's thinking mode (1.0 / 0.95) with probabilistic drafting, the way it is served: the simulation
    over vLLM's outputs agrees within the noise of two sets of accept tests (evaluate.compare), the
    tolerance tests/test_vllm_tier.py holds the llama draft to."""
    from eagle3_pipeline.export_eval.evaluate import compare, simulate
    from eagle3_pipeline.models.acceptance import Sampling

    requests = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    sampling = Sampling(**THINKING)
    vllm = serve(worker, mla_run, requests, sampling)
    sim, _ = simulate(mla_run / "verifier", mla_run / "draft", requests, MAX_NEW_TOKENS, K, sampling=sampling,
                      replay=vllm["outputs"], draft_sample_method="probabilistic")  # fmt: skip
    print(f"\nMLA draft, thinking + probabilistic: vLLM {vllm['mean_acceptance_length']:.3f} | sim over "
          f"vLLM's outputs {sim['mean_acceptance_length']:.3f}")  # fmt: skip
    c = compare(sim, vllm, None, probabilistic=True)
    assert c["rates_agree"], (c, sim, vllm)
    assert max(c["rate_tolerance_per_pos"]) <= 0.06, c
