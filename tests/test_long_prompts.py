"""Held-out long prompts (export_eval/long_prompts.py) and stage 06's acceptance by context length."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, read_jsonl, run_script, script


@pytest.fixture(scope="module")
def tokenizer(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_verifier))


def test_long_prompts_have_the_requested_lengths_are_deterministic_and_held_out(tokenizer, tmp_path):
    from eagle3_pipeline.export_eval.evaluate import build_prompts
    from eagle3_pipeline.export_eval.long_prompts import build_rows

    lengths = [300, 1100]
    rows = build_rows(tokenizer, lengths, 2)
    assert rows == build_rows(tokenizer, lengths, 2)  # deterministic
    assert [(r["kind"], r["target_tokens"]) for r in rows] == [
        (kind, n) for kind in ("document", "session", "generation") for n in lengths for _ in range(2)]
    prompts = [r["token_samples"][0]["prompt_ids"] for r in rows]
    assert len({tuple(p) for p in prompts}) == len(prompts)  # no two alike
    for r, ids in zip(rows, prompts):
        assert r["prompt_tokens"] == len(ids)
        if r["kind"] == "generation":  # short: the length is in the generation
            assert len(ids) < 300 and r["max_new_tokens"] == r["target_tokens"]
        else:
            assert r["target_tokens"] - 8 <= len(ids) <= r["target_tokens"], r["id"]
    sessions = [tokenizer.decode(ids) for r, ids in zip(rows, prompts) if r["kind"] == "session"]
    assert sessions[-1].count("<|im_assistant|>") >= 3  # several turns, then the open one
    # nothing of the training conversations: no 40-character piece of any of their messages
    rows_used = read_jsonl(REPO / "tests/data/conversations.jsonl")
    training = [m.get("content") or m.get("value")
                for row in rows_used for m in row.get("messages") or row.get("conversations")]  # fmt: skip
    pieces = {t[i : i + 40] for t in training if t for i in range(0, max(1, len(t) - 39), 10)}
    texts = [tokenizer.decode(ids) for ids in prompts]
    assert pieces and not [p for p in pieces if any(p in t for t in texts)]
    # stage 06 reads the file's prompts as they were built
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert build_prompts(tokenizer, path, 0, len(rows)) == prompts


def test_long_prompts_cli_writes_the_file_and_refuses_lengths_past_the_models_positions(
    tiny_verifier, tmp_path, capsys
):
    from eagle3_pipeline.export_eval.long_prompts import main

    out = tmp_path / "long.jsonl"
    args = ["--tokenizer", str(tiny_verifier), "--per-length", "1", "--kinds", "document", "--out", str(out)]
    assert main([*args, "--lengths", "4096"]) == 2  # the tiny verifier has 2048 positions
    err = capsys.readouterr().err
    assert "error: --lengths 4096" in err and "2048 positions" in err and "Traceback" not in err
    assert not out.exists()
    assert main([*args, "--lengths", "512", "700"]) == 0
    assert [(r["id"], r["prompt_tokens"]) for r in read_jsonl(out)] == [
        ("long-document-512-0", 512), ("long-document-700-0", 700)]  # fmt: skip


def test_stage06_reports_acceptance_per_context_bucket_and_plots_it(tiny_run, tmp_path):
    from eagle3_pipeline.export_eval.long_prompts import build_rows
    from eagle3_pipeline.training.plots import png_series
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_run / "verifier"))
    prompts = tmp_path / "long.jsonl"
    rows = build_rows(tok, [300, 1040], 1, ("document",))
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_script(script("06_evaluate.py"), "--config", str(tiny_run / "tiny.toml"), "--engine", "sim",
               "--data-path", str(prompts), "--num-prompts", "2", "--max-new-tokens", "6",
               "--out-dir", str(tmp_path))  # fmt: skip
    result = json.loads((tmp_path / "acceptance_sim.json").read_text())
    sim = result["sim"]
    buckets = sim["acceptance_by_context"]["buckets"]
    assert [b["context"] for b in buckets] == ["0-1k", "1k-2k"]
    assert sum(b["num_drafts"] for b in buckets) == sim["num_drafts"] > 0
    assert sum(b["num_accepted_tokens"] for b in buckets) == sim["num_accepted_tokens"]
    assert all(1.0 <= b["mean_acceptance_length"] <= 4.0 for b in buckets)
    assert "acceptance_rate_per_pos" in sim and "mean_acceptance_length" in sim  # the old keys stay
    assert png_series(tmp_path / "acceptance_sim.png") == {"sim": 3}
    assert png_series(tmp_path / "acceptance_sim_by_context.png") == {"sim": 2}
