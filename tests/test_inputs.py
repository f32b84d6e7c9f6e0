"""Conversations in: the assistant-only loss mask, and bad rows refused one by one, never a traceback."""

from __future__ import annotations

import json

import pytest
from conftest import DATA, extract_args, read_jsonl, run_script, script, shard_of

from eagle3_pipeline.data.conversations import RowRejected, normalize_messages, tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_verifier))


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    row = {
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hi?"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye?"},
            {"role": "assistant", "content": "Goodbye."},
        ]
    }
    _, messages = normalize_messages(row)
    ids, mask = tokenize_conversation(tokenizer, messages, 1024)
    spans, current = [], []
    for tok, m in zip(ids, mask):
        if m:
            current.append(tok)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    assert [tokenizer.decode(s) for s in spans] == ["Hello.<|im_end|>", "Goodbye.<|im_end|>"]
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "Be kind." in unmasked and "Hi?" in unmasked and "Bye?" in unmasked
    assert "Hello" not in unmasked and "Goodbye" not in unmasked


def test_sharegpt_and_openai_rows_give_the_same_sample(tokenizer):
    a = normalize_messages(
        {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    )
    b = normalize_messages(
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    )
    assert tokenize_conversation(tokenizer, a[1], 100) == tokenize_conversation(tokenizer, b[1], 100)


def test_template_that_rewrites_earlier_turns_is_rejected(tokenizer):
    class DropsHistory:
        """A template that renders only the last assistant turn's reasoning, like thinking models."""

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            n = len(messages)
            return "".join(
                f"[{m['role']}{'' if i < n - 1 else '*'}]{m['content']}" for i, m in enumerate(messages)
            )

        def __call__(self, text, add_special_tokens):
            return {"input_ids": [ord(c) for c in text]}

    msgs = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(RowRejected, match="prefix-stable"):
        tokenize_conversation(DropsHistory(), msgs, 100)


def test_bad_input_corpus_every_row_written_or_rejected_with_reason(tiny_verifier, tmp_path):
    expected = json.loads((DATA / "bad_inputs.expected.json").read_text())
    proc = run_script(
        *extract_args(str(tiny_verifier), str(DATA / "bad_inputs.jsonl"), str(tmp_path / "hs")),
        "--max-seq-len",
        str(expected["max_seq_len"]),
        "--samples-per-file",
        "4",
        "--chat-template-kwargs",
        '{"thinking": false}',
    )
    assert "Traceback" not in proc.stderr
    shard = shard_of(tmp_path / "hs")
    meta = json.loads((shard / "meta.json").read_text())
    assert meta["chat_template_kwargs"] == {"thinking": False}  # what 06_evaluate.py will read back
    rejects = {str(r["row"]): r["reason"] for r in read_jsonl(shard / "rejects.jsonl")}
    manifest = json.loads((shard / "manifest.json").read_text())
    written = {str(s["row"]): s["id"] for f in manifest["files"] for s in f["samples"]}
    n_rows = len((DATA / "bad_inputs.jsonl").read_bytes().splitlines())
    assert len(written) + len(rejects) == n_rows == meta["num_rows"]
    assert written == expected["written"]
    assert set(rejects) == set(expected["rejected"])
    for row, fragment in expected["rejected"].items():
        assert fragment in rejects[row], (row, rejects[row])


def test_malformed_json_file_is_one_clear_error(tiny_verifier, tmp_path):
    bad = tmp_path / "data.json"
    bad.write_text('[{"messages": []}, ')
    proc = run_script(
        *extract_args(str(tiny_verifier), str(bad), str(tmp_path / "hs")),
        check=False,
    )
    assert proc.returncode == 2 and str(bad) in proc.stderr and "Traceback" not in proc.stderr


def test_evaluation_data_that_is_missing_is_one_clear_error(tiny_run, tmp_path):
    missing = tmp_path / "held_out.jsonl"
    proc = run_script(
        script("06_evaluate.py"), "--draft-dir", str(tiny_run / "draft"), "--data-path", str(missing),
        "--engine", "sim", "--num-prompts", "1", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and f"{missing}: data not found" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_vllm_environment_without_vllm_is_one_clear_error(tiny_verifier, tmp_path):
    """A worker's environment is probed (vLLM imported, seconds on these CPUs) only when its process dies
    before answering, not on every start: a python without vllm is still named in one line."""
    import sys

    proc = run_script(
        script("00_regenerate.py"), "--verifier-path", str(tiny_verifier), "--data-path",
        str(DATA / "conversations.jsonl"), "--out-dir", str(tmp_path / "r"), "--engine", "vllm",
        "--vllm-python", sys.executable, "--max-new-tokens", "4", check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"vLLM engine unavailable: {sys.executable} cannot import vllm" in proc.stderr, proc.stderr[-2000:]


def test_datasets_folder_is_read_like_jsonl(tiny_verifier, tmp_path):
    import datasets

    rows = read_jsonl(DATA / "conversations.jsonl")[:3]
    ds = datasets.Dataset.from_list(
        [{"id": r["id"], "messages": r["messages"]} for r in rows if "messages" in r]
    )
    ds.save_to_disk(str(tmp_path / "ds"))
    run_script(
        *extract_args(str(tiny_verifier), str(tmp_path / "ds"), str(tmp_path / "hs")),
    )
    meta = json.loads((shard_of(tmp_path / "hs") / "meta.json").read_text())
    assert meta["num_samples"] == len(ds) and meta["num_rejected"] == 0


def test_shard_from_other_layer_ids_or_verifier_is_refused(tiny_run, tiny_llama_verifier, tmp_path):
    conv = str(DATA / "conversations.jsonl")
    run_script(
        *extract_args(str(tiny_run / "verifier"), conv, str(tmp_path / "other_ids")),
        "--aux-layer-ids",
        "1",
        "3",
        "6",
        "--start-row",
        "0",
        "--end-row",
        "2",
    )
    other = shard_of(tmp_path / "other_ids")
    proc = run_script(
        script("02_build_vocab_mapping.py"),
        "--data-dir",
        str(tiny_run / "hidden_states"),
        str(other),
        "--out-dir",
        str(tmp_path / "v"),
        "--draft-vocab-size",
        "64",
        check=False,
    )
    assert proc.returncode == 2 and str(other / "meta.json") in proc.stderr and "aux_layer_ids" in proc.stderr
    # training refuses shards whose layer ids differ from the vocab mapping's source
    proc = run_script(
        script("04_train.py"),
        "--config",
        str(tiny_run / "tiny.toml"),
        "--data-dir",
        str(other),
        "--split-dir",
        "",
        "--out-dir",
        str(tmp_path / "t"),
        "--max-steps",
        "1",
        check=False,
    )
    assert proc.returncode == 2 and "aux_layer_ids" in proc.stderr and "Traceback" not in proc.stderr
    run_script(
        *extract_args(str(tiny_llama_verifier), conv, str(tmp_path / "llama")),
        "--start-row",
        "0",
        "--end-row",
        "2",
    )
    proc = run_script(
        script("03_split_data.py"),
        "--data-dir",
        str(tiny_run / "hidden_states"),
        str(tmp_path / "llama"),
        "--out-dir",
        str(tmp_path / "s"),
        check=False,
    )
    assert proc.returncode == 2 and "another verifier" in proc.stderr


def test_truncate_keeps_a_long_row_and_token_rows_give_several_samples(tiny_verifier, tmp_path):
    from eagle3_pipeline.data.shards import load_sample, open_shards

    long_answer = {"role": "assistant", "content": "A long answer. " * 60}  # 900 bytes: 900 tokens
    long_row = json.dumps({"id": "too-long", "messages": [{"role": "user", "content": "Talk."}, long_answer]})
    token_row = {
        "id": "t",
        "token_samples": [
            {"prompt_ids": [72, 105], "completion_ids": [33, 257]},
            {"prompt_ids": [66, 121, 101], "completion_ids": [46, 257]},  # not an extension: a second sample
        ],
    }
    data = tmp_path / "rows.jsonl"
    data.write_text(long_row + "\n" + json.dumps(token_row) + "\n")
    run_script(
        *extract_args(str(tiny_verifier), str(data), str(tmp_path / "hs")),
        "--max-seq-len",
        "512",
        "--truncate",
        "--samples-per-file",
        "2",
    )
    shard = shard_of(tmp_path / "hs")
    meta = json.loads((shard / "meta.json").read_text())
    assert (meta["num_rows"], meta["num_rows_written"], meta["num_samples"]) == (2, 2, 3)
    assert (meta["num_truncated"], meta["num_rejected"], meta["truncate"]) == (1, 0, True)
    (part,) = json.loads((shard / "manifest.json").read_text())["files"]  # a row's samples share a part
    by_id = {s["id"]: s for s in part["samples"]}
    assert by_id["too-long"]["num_tokens"] == 512 and by_id["too-long"]["truncated_from"] > 512
    assert [by_id["t"]["row"], by_id["t#2"]["row"]] == [1, 1]
    refs = {r.sample_id: r for r in open_shards([str(shard)]).samples}
    second = load_sample(refs["t#2"], ("input_ids", "loss_mask"))
    assert second["input_ids"].tolist() == [66, 121, 101, 46, 257]  # verbatim, never re-rendered
    assert second["loss_mask"].tolist() == [0, 0, 0, 1, 1]


def test_unexpected_error_in_one_row_is_a_reject_and_the_block_goes_on(monkeypatch, tokenizer, caplog):
    from eagle3_pipeline.data import samples
    from eagle3_pipeline.data.conversations import RawRow
    from eagle3_pipeline.data.samples import SampleOptions

    real = samples.row_samples

    def flaky(value, index, tok, opts):
        if index == 1:
            raise ZeroDivisionError("boom")
        return real(value, index, tok, opts)

    monkeypatch.setattr(samples, "row_samples", flaky)
    ok = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}
    raws = [
        RawRow(0, {"id": "x", **ok}),
        RawRow(1, ok),
        RawRow(2, {"id": "x", **ok}),
        RawRow(3, error="empty line"),
    ]
    accepted, rejects = samples.block_samples(raws, tokenizer, SampleOptions(100), {}, "d.jsonl")
    assert [(row, s.sample_id) for row, s in accepted] == [(0, "x")]
    assert rejects == [
        {"row": 1, "reason": "unexpected ZeroDivisionError: boom"},
        {"row": 2, "reason": "duplicate id 'x' (first at row 0)"},
        {"row": 3, "reason": "empty line"},
    ]
    assert "Traceback" in caplog.text  # a bug in this code is visible, not hidden among bad rows
