"""Stage 00 at Kimi-K2.5's thinking lengths: reasoning kept in the row as Kimi serves it, a turn cut at
max_new_tokens marked and kept whole up to the cap, the length spread summarised."""

from __future__ import annotations

from kimi_fixture import IDS, build_kimi_tokenizer

from eagle3_pipeline.data.config import RegenerateConfig
from eagle3_pipeline.data.conversations import normalize_row
from eagle3_pipeline.data.regenerate import length_summary, regenerate_rows, render_prompt
from eagle3_pipeline.data.samples import SampleOptions, row_samples

END = IDS["<|im_end|>"]


class ScriptedVerifier:
    """Answers each prompt with the next scripted completion (text, cut at the budget like a real engine)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tok, self.texts, self.budgets = tokenizer, list(texts), []

    def generate(self, prompts, max_new, seeds):
        out = []
        for _, n in zip(prompts, max_new):
            self.budgets.append(n)
            ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [END]
            out.append((ids[:n], "stop" if len(ids) <= n else "length"))
        return out


def test_thinking_turns_keep_reasoning_and_a_cut_turn_is_reasoning_marked_length():
    tok = build_kimi_tokenizer()
    conv = normalize_row({"id": "r", "messages": [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "old"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "old"}]})  # fmt: skip
    long_reasoning = "step " * 200  # 1,000 byte tokens: cut at the cap below
    verifier = ScriptedVerifier(tok, ["think first</think>A1", long_reasoning + "</think>A2"])
    cfg = RegenerateConfig(max_new_tokens=600, max_seq_len=4096)
    rows, rejects = regenerate_rows([(0, conv)], tok, verifier, cfg)
    assert not rejects and verifier.budgets == [600, 600]
    row = rows[0]
    first, cut = row["messages"][1], row["messages"][3]
    assert first == {"role": "assistant", "content": "A1", "reasoning_content": "think first"}
    # cut inside its reasoning: all of it is reasoning (old: the reasoning became the answer's content)
    assert cut == {"role": "assistant", "content": "", "reasoning_content": long_reasoning[:600]}
    assert [s["finish_reason"] for s in row["token_samples"]] == ["stop", "length"]
    assert len(row["token_samples"][1]["completion_ids"]) == 600  # kept whole up to the cap
    # turn 2's prompt renders turn 1 as Kimi's history (reasoning erased), as served
    assert tok.decode(row["token_samples"][1]["prompt_ids"]).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>"
        "<|im_user|>user<|im_middle|>q2<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )
    assert row["token_samples"][1]["prompt_ids"] == render_prompt(tok, normalize_row(row), 3, {})[0]
    # stage 01 supervises the generated ids verbatim, reasoning included
    samples = row_samples(row, 0, tok, SampleOptions(max_seq_len=4096))
    supervised = [t for s in samples for t, m in zip(s.input_ids, s.loss_mask) if m]
    assert supervised == [t for s in row["token_samples"] for t in s["completion_ids"]]


def test_length_summary_is_nearest_rank():
    assert length_summary(list(range(1, 101))) == {"p50": 50, "p90": 90, "max": 100}
    assert length_summary([7]) == {"p50": 7, "p90": 7, "max": 7}
    assert length_summary([]) == {"p50": 0, "p90": 0, "max": 0}
