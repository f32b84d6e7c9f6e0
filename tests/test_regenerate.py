"""Stage 00: regenerated turns are exactly the verifier's own greedy output, and survive a SIGKILL."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import CONVERSATIONS, read_jsonl, run_killed_after, run_script, script
from test_resume import _tree_bytes

MAX_NEW = 24


def _rows(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(CONVERSATIONS.read_text().splitlines(keepends=True)[:n]))
    return path


def _args(verifier: Path, data: Path, out: str, rows_per_part: int = 2) -> list[str]:
    return [
        script("00_regenerate.py"), "--verifier-path", str(verifier), "--data-path", str(data),
        "--out-dir", out, "--engine", "hf", "--max-new-tokens", str(MAX_NEW), "--rows-per-part",
        str(rows_per_part),
    ]  # fmt: skip


def _greedy(model, prompt: list[int], n: int, stop: set[int]) -> list[int]:
    """Plain argmax decoding with full forwards (no generate(), no cache): the reference."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt) :]


def test_regenerated_completions_equal_the_verifiers_own_greedy_output(tiny_llama_verifier, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_script(*_args(tiny_llama_verifier, _rows(tmp_path, 4), "regen"), cwd=tmp_path)
    out = read_jsonl(tmp_path / "regen" / "conversations.jsonl")
    from eagle3_pipeline.data.conversations import normalize_messages

    source = [{"messages": normalize_messages(r)[1]} for r in read_jsonl(_rows(tmp_path, 4))]
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_verifier))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_verifier), dtype=torch.float32).eval()
    checked = 0
    for row, src in zip(out, source):
        assistant_turns = [i for i, m in enumerate(src["messages"]) if m["role"] == "assistant"]
        assert [s["turn"] for s in row["token_samples"]] == assistant_turns
        for s in row["token_samples"]:
            # the prompt is the template over the row so far, earlier turns already regenerated
            text = tok.apply_chat_template(
                row["messages"][: s["turn"]], tokenize=False, add_generation_prompt=True
            )
            assert s["prompt_ids"] == tok(text, add_special_tokens=False)["input_ids"]
            assert s["completion_ids"] == _greedy(model, s["prompt_ids"], MAX_NEW, {tok.eos_token_id})
            assert row["messages"][s["turn"]]["content"] == tok.decode(
                s["completion_ids"], skip_special_tokens=True
            )
            checked += 1
        # user and system turns are kept as they were
        assert [m for m in row["messages"] if m["role"] != "assistant"] == [
            m for m in src["messages"][: len(row["messages"])] if m["role"] != "assistant"
        ]
    assert checked >= 4
    meta = json.loads((tmp_path / "regen" / "meta.json").read_text())
    assert meta["engine"] == "hf" and meta["temperature"] == 0.0 and meta["num_regenerated"] == 4
    assert meta["stop_token_ids"] == [tok.eos_token_id]
    lengths = sorted(len(s["completion_ids"]) for r in out for s in r["token_samples"])
    assert meta["completion_length_tokens"]["max"] == lengths[-1] <= MAX_NEW
    assert meta["finish_reasons"]["length"] == sum(n == MAX_NEW for n in lengths)  # the rows cut at the cap


def test_regeneration_killed_then_rerun_is_byte_identical(tiny_llama_verifier, tmp_path):
    data = _rows(tmp_path, 6)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run_script(*_args(tiny_llama_verifier, data, "regen"), cwd=tmp_path / "a")
    run_killed_after(_args(tiny_llama_verifier, data, "regen"), tmp_path / "b", "part-00000.jsonl")
    assert not (tmp_path / "b" / "regen" / "COMPLETE").exists()
    rerun = run_script(*_args(tiny_llama_verifier, data, "regen"), cwd=tmp_path / "b")
    assert "3 parts, 2 to do" in rerun.stderr, rerun.stderr[-1500:]
    assert _tree_bytes(tmp_path / "a" / "regen") == _tree_bytes(tmp_path / "b" / "regen")


def test_regeneration_refuses_to_resume_with_other_settings(tiny_llama_verifier, tmp_path):
    data = _rows(tmp_path, 2)
    run_script(*_args(tiny_llama_verifier, data, "regen", rows_per_part=1), cwd=tmp_path)
    (tmp_path / "regen" / "COMPLETE").unlink()
    proc = run_script(*_args(tiny_llama_verifier, data, "regen", rows_per_part=2), cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "rows_per_part" in proc.stderr and "Traceback" not in proc.stderr


def test_sampled_turns_draw_independently_and_the_same_beside_any_rows(tiny_llama_verifier, tmp_path):
    """At temperature > 0 each turn samples from its own seed (seed, row, turn): two rows with the same
    prompt get different answers (one seed for every request gave every row the same draws step for step,
    so equal prompts got equal answers and rows ended at the same steps), and a row's answer does not depend
    on the rows regenerated beside it (a resume or another part size gives the same bytes)."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.config import RegenerateConfig
    from eagle3_pipeline.data.conversations import RawRow
    from eagle3_pipeline.data.regenerate import (HFGenerator, _conversation, end_token_ids, regenerate_rows,
                                                 turn_seed)  # fmt: skip

    row = json.loads(CONVERSATIONS.read_text().splitlines()[0])
    tok = AutoTokenizer.from_pretrained(str(tiny_llama_verifier))
    cfg = RegenerateConfig(max_new_tokens=16, max_seq_len=512, engine="hf", temperature=1.0, top_p=1.0)
    gen = HFGenerator(tiny_llama_verifier, cfg, end_token_ids(tiny_llama_verifier, tok))

    def answers(indices):
        convs = [(i, _conversation(RawRow(i, {**row, "id": f"r{i}"}), tmp_path, False, "")) for i in indices]
        out, rejects = regenerate_rows(convs, tok, gen, cfg)
        assert not rejects
        return [r["token_samples"] for r in out]

    both = answers([0, 1])
    assert both[0][0]["prompt_ids"] == both[1][0]["prompt_ids"]
    assert both[0][0]["completion_ids"] != both[1][0]["completion_ids"]
    assert answers([1]) == both[1:]
    assert turn_seed(0, 1, 1) == turn_seed(0, 1, 1) and len({turn_seed(s, r, t) for s in (0, 1) for r in (0, 1)
                                                             for t in (1, 3)}) == 8  # fmt: skip
