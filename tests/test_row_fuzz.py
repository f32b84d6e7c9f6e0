"""Property: stage 01's row path never raises, whatever the rows (issue 8). Generated .jsonl lines (valid,
malformed, odd types and roles, assistant-first, empty, huge, BOM, non-UTF-8, token-id rows) go through
the real reader and `samples.block_samples`, the per-row loop of stage 01: every row comes back written
or rejected with a reason, never both, never as an unexpected error, and every sample is well formed."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kimi_fixture import build_kimi_tokenizer

from eagle3_pipeline.data.conversations import read_rows
from eagle3_pipeline.data.samples import SampleOptions, block_samples

MAX_EXAMPLES = 40  # about 2-4 s per tokenizer on one CPU thread


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    from eagle3_pipeline.models.tiny import build_tokenizer

    tiny_dir = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tokenizer(tiny_dir)
    return {"kimi": build_kimi_tokenizer(), "tiny": AutoTokenizer.from_pretrained(str(tiny_dir))}


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["<think>", "</think>", "<think>r</think>a", "<|im_end|>", "<|im_user|>", " ", "\n"]),
    st.integers(0, 6000).map(lambda n: "long " * n),  # huge: over any max_seq_len used here
)
contents = st.one_of(
    texts,
    st.none(),
    st.integers(),
    st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "audio"]), "text": texts})),
    json_values,
)
roles = (
    st.sampled_from(
        [
            "user",
            "assistant",
            "system",
            "tool",
            "human",
            "gpt",
            "function_call",
            "observation",
            "narrator",
            "ASSISTANT",
        ]
    )
    | json_values
)
tool_calls = st.one_of(
    st.none(),
    json_values,
    st.lists(
        st.fixed_dictionaries(
            {
                "type": st.just("function"),
                "function": st.fixed_dictionaries(
                    {
                        "name": st.sampled_from(["f", "", "get_weather"]) | json_values,
                        "arguments": st.just("{}") | json_values,
                    }
                ),
            },
            optional={"id": st.text(max_size=6) | json_values},
        ),
        max_size=3,
    ),
)
turns = st.fixed_dictionaries(
    {"role": roles, "content": contents},
    optional={
        "reasoning_content": texts | json_values,
        "tool_calls": tool_calls,
        "tool_call_id": json_values,
        "reasoning": texts,
    },
)
words = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=10) | texts
good_turns = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": words}),
    st.fixed_dictionaries(
        {"role": st.just("assistant"), "content": words},
        optional={"reasoning_content": words},
    ),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.none() | words,
            "reasoning_content": words,
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "function": st.fixed_dictionaries(
                            {
                                "name": st.just("get_weather"),
                                "arguments": st.dictionaries(st.text(max_size=3), st.integers()),
                            }
                        )
                    }
                ),
                min_size=1,
                max_size=2,
            ),
        },
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": words}),
    st.fixed_dictionaries({"role": st.just("system"), "content": words}),
)
good_rows = st.fixed_dictionaries(
    {"messages": st.lists(good_turns, min_size=1, max_size=7)},
    optional={"id": st.sampled_from(["a", "b", "a#2", "c"])},
)
good_token_rows = st.fixed_dictionaries(
    {
        "token_samples": st.lists(
            st.fixed_dictionaries(
                {
                    "prompt_ids": st.lists(st.integers(0, 262), min_size=1, max_size=30),
                    "completion_ids": st.lists(st.integers(0, 262), min_size=1, max_size=30),
                }
            ),
            min_size=1,
            max_size=3,
        )
    },
)
token_lists = st.lists(st.integers(-2, 170000) | st.booleans() | json_values, max_size=6)
rows = st.one_of(
    good_rows,
    good_rows,
    good_token_rows,
    json_values,
    st.fixed_dictionaries(
        {"messages": st.lists(turns, max_size=6)},
        optional={"id": st.sampled_from(["a", "b", "a#2"]) | json_values, "tools": json_values},
    ),
    st.fixed_dictionaries(
        {
            "token_samples": st.lists(
                st.fixed_dictionaries({"prompt_ids": token_lists, "completion_ids": token_lists})
                | json_values,
                max_size=3,
            )
            | json_values
        },
        optional={"id": st.sampled_from(["a", "t"])},
    ),
)


def line_of(kind: int, row: object) -> bytes:
    text = json.dumps(row).encode()
    return [text, b"\xef\xbb\xbf" + text, text[: len(text) // 2], b"\xff\xfe" + text, b"", b"  "][kind]


@given(
    lines=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1, 2, 3, 4, 5]), rows), min_size=1, max_size=8),
    max_seq_len=st.sampled_from([16, 64, 4096]),
    truncate=st.booleans(),
    instant=st.booleans(),
)
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)
@pytest.mark.parametrize("name", ["kimi", "tiny"])
def test_every_row_is_written_or_rejected_never_an_exception(
    tokenizers, tmp_path, name, lines, max_seq_len, truncate, instant
):
    tok = tokenizers[name]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(line_of(kind, row) for kind, row in lines) + b"\n")
    opts = SampleOptions(max_seq_len, truncate, {"thinking": False} if instant else {})
    accepted, rejects = block_samples(read_rows(path, 0, 10**9), tok, opts, {}, str(path))
    written = {row for row, _ in accepted}
    rejected = [r["row"] for r in rejects]
    assert len(rejected) == len(set(rejected)) and not written & set(rejected)
    assert written | set(rejected) == set(range(len(lines)))  # written + rejected = rows
    for r in rejects:
        assert isinstance(r["reason"], str) and r["reason"].strip()
        assert not r["reason"].startswith("unexpected"), r  # every bad row has a real reason
    ids = [s.sample_id for _, s in accepted]
    assert len(ids) == len(set(ids))
    for _, s in accepted:
        assert 0 < len(s.input_ids) == len(s.loss_mask) <= max_seq_len and any(s.loss_mask)
        assert all(0 <= t < len(tok) for t in s.input_ids)
        if s.truncated_from is not None:  # only with --truncate, and only what did not fit
            assert truncate and s.truncated_from > max_seq_len == len(s.input_ids)
