"""Rows to samples as Kimi-K2.5 serves them (issue 8): exact token lists with a Kimi-style tokenizer built
from the facts in the issue (tests/kimi_fixture.py), token-id rows, other templates, length handling."""

from __future__ import annotations

import json

import pytest
from conftest import split_sides
from kimi_fixture import IDS, build_kimi_tokenizer, ids_of

from eagle3_pipeline.data.conversations import RowRejected, normalize_row
from eagle3_pipeline.data.samples import (
    KimiK25Rules,
    SampleOptions,
    conversation_id,
    first_prompt,
    row_samples,
    sample_id,
)

USER, ASSISTANT, SYSTEM = IDS["<|im_user|>"], IDS["<|im_assistant|>"], IDS["<|im_system|>"]
MIDDLE, END = IDS["<|im_middle|>"], IDS["<|im_end|>"]
THINK, UNTHINK = IDS["<think>"], IDS["</think>"]
SECTION, SECTION_END = IDS["<|tool_calls_section_begin|>"], IDS["<|tool_calls_section_end|>"]
CALL, ARGS, CALL_END = (
    IDS["<|tool_call_begin|>"],
    IDS["<|tool_call_argument_begin|>"],
    IDS["<|tool_call_end|>"],
)
INSTANT = {"thinking": False}


@pytest.fixture(scope="module")
def kimi():
    return build_kimi_tokenizer()


def user(text):
    return [USER, "user", MIDDLE, text, END]


def prompt():  # the thinking-mode generation prompt
    return [ASSISTANT, "assistant", MIDDLE, THINK]


def history(text):  # an assistant turn rendered as history: reasoning erased
    return [ASSISTANT, "assistant", MIDDLE, THINK, UNTHINK, text, END]


def expect(*segments):
    """(input_ids, loss_mask) from (pieces, supervised) segments."""
    ids, mask = [], []
    for pieces, supervised in segments:
        t = ids_of(pieces)
        ids += t
        mask += [supervised] * len(t)
    return ids, mask


def as_pairs(samples):
    return [(s.input_ids, s.loss_mask) for s in samples]


def serving_prompt(tok, row, turn, **kw):
    """What vLLM renders to serve `turn`: the turns before it and the generation prompt."""
    conv = normalize_row(row)
    text = tok.apply_chat_template(
        conv.messages[:turn], tools=conv.tools, tokenize=False, add_generation_prompt=True, **kw
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def context_of(sample):
    return sample.input_ids[: sample.loss_mask.index(1)]


def samples(tok, row, max_seq_len=4096, **kw):
    return row_samples(row, 0, tok, SampleOptions(max_seq_len, chat_template_kwargs=kw))


def test_fixture_detected_as_kimi_and_tiny_template_is_not(kimi, tmp_path):
    from transformers import AutoTokenizer

    from eagle3_pipeline.models.tiny import build_tokenizer

    build_tokenizer(tmp_path)
    assert KimiK25Rules.detect(kimi) is not None
    assert KimiK25Rules.detect(AutoTokenizer.from_pretrained(str(tmp_path))) is None
    assert len(kimi) == 163840 and kimi.convert_tokens_to_ids("</think>") == 163607


def test_reasoning_content_is_supervised_after_the_thinking_prompt(kimi):
    row = {
        "id": "r",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "reasoning_content": "Greet."},
        ],
    }
    (s,) = samples(kimi, row)
    assert (s.input_ids, s.loss_mask) == expect(
        (user("Hi") + prompt(), 0), (["Greet.", UNTHINK, "Yo", END], 1)
    )
    assert s.sample_id == "r" and context_of(s) == serving_prompt(kimi, row, 1)


@pytest.mark.parametrize(
    "assistant",
    [
        {"content": "<think>Greet.</think>Yo"},
        {"content": "Yo", "reasoning": "Greet."},
        {"content": "Yo", "thinking": "Greet."},
        {"content": "Greet.</think>Yo"},  # the opening tag was the template's
    ],
    ids=["inline", "reasoning", "thinking", "inline-close-only"],
)
def test_inline_think_and_reasoning_aliases_give_the_same_sample(kimi, assistant):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", **assistant}]}
    (s,) = samples(kimi, row)
    assert (s.input_ids, s.loss_mask) == expect(
        (user("Hi") + prompt(), 0), (["Greet.", UNTHINK, "Yo", END], 1)
    )


@pytest.mark.parametrize(
    "assistant",
    [
        {"content": "<think>\nGreet.\n</think>\n\nYo"},
        {"content": "  \n<think>\nGreet.\n</think>\n\nYo"},  # an export's indent before the prompt's tag
        {"content": "\nGreet.\n</think>\n\nYo"},
        {"content": "\n\nYo", "reasoning_content": "\nGreet.\n"},
        {"content": "\n\nYo", "thinking": "\nGreet.\n"},
    ],
    ids=["inline", "inline-indented", "inline-close-only", "reasoning_content", "thinking"],
)
def test_newlines_around_reasoning_are_kept_as_generated(kimi, assistant):
    """Kimi-K2.5's template strips neither side of `</think>` (issue 18; until then these newlines were
    stripped, which trained the draft on tokens the model never generated): every form gives the same
    sample, the newlines supervised; only whitespace before `<think>` goes (the prompt ends with it)."""
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", **assistant}]}
    (s,) = samples(kimi, row)
    assert (s.input_ids, s.loss_mask) == expect(
        (user("Hi") + prompt(), 0), (["\nGreet.\n", UNTHINK, "\n\nYo", END], 1)
    )


def rendered(tok, messages, add_generation_prompt, tools=None):
    text = tok.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tok(text, add_special_tokens=False)["input_ids"]


def test_reasoning_ending_in_newline_and_content_starting_with_two_trains_on_the_templates_tokens(kimi):
    """A turn the template renders with its reasoning (a tool call with no final answer after it): the
    sample is the template's own rendering of the conversation, its mask exactly the tokens after the
    serving prompt; a later turn's context holds the earlier answer's newlines, as a client replays them."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    tool_turn = {
        "role": "assistant", "reasoning_content": "Look it up.\n", "content": "\n\nChecking.",
        "tool_calls": [call],
    }  # fmt: skip
    row = {"tools": TOOLS, "messages": [{"role": "user", "content": "Weather?"}, tool_turn]}
    (s,) = samples(kimi, row)
    messages = normalize_row(row).messages
    assert messages[1]["reasoning_content"] == "Look it up.\n" and messages[1]["content"] == "\n\nChecking."
    whole, context = rendered(kimi, messages, False, TOOLS), rendered(kimi, messages[:1], True, TOOLS)
    assert s.input_ids == whole
    assert s.loss_mask == [0] * len(context) + [1] * (len(whole) - len(context))
    assert kimi.decode(whole[len(context) :]).startswith("Look it up.\n</think>\n\nChecking.")

    answer = {"role": "assistant", "reasoning_content": "Greet.\n", "content": "\n\nHello."}
    row = {"messages": [{"role": "user", "content": "Hi"}, answer, {"role": "user", "content": "Again"},
                        {**answer, "content": "\n\nHello again."}]}  # fmt: skip
    first, second = samples(kimi, row)
    messages = normalize_row(row).messages
    assert context_of(second) == rendered(kimi, messages[:3], True)
    assert context_of(second) == ids_of(
        user("Hi") + history("\n\nHello.") + user("Again") + prompt()
    )
    assert first.input_ids[len(context_of(first)) :] == ids_of(["Greet.\n", UNTHINK, "\n\nHello.", END])


def test_multi_turn_each_turn_gets_its_serving_prompt_with_earlier_reasoning_erased(kimi):
    row = {
        "id": "mt",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
        ],
    }
    first, second = samples(kimi, row)
    system = [SYSTEM, "system", MIDDLE, "Be brief.", END]
    assert (first.input_ids, first.loss_mask) == expect(
        (system + user("Q1") + prompt(), 0), (["R1", UNTHINK, "A1", END], 1)
    )
    assert (second.input_ids, second.loss_mask) == expect(
        (system + user("Q1") + history("A1") + user("Q2") + prompt(), 0), (["R2", UNTHINK, "A2", END], 1)
    )
    assert [first.sample_id, second.sample_id] == ["mt", "mt#2"]
    assert {conversation_id(first.sample_id), conversation_id(second.sample_id)} == {"mt"}
    assert context_of(first) == serving_prompt(kimi, row, 2)
    assert context_of(second) == serving_prompt(kimi, row, 4)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_ROW = {
    "id": "tools",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,  # a tool-calling turn without text
            "reasoning_content": "Look it up.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
            ],
        },
        {"role": "tool", "content": "snow"},  # answers the open call: its id is filled in
        {"role": "assistant", "content": "Snow.", "reasoning_content": "Report."},
    ],
}


def test_tool_calls_results_and_tools_render_as_kimi_and_the_tool_loop_is_one_sample(kimi):
    (s,) = samples(kimi, TOOL_ROW)
    declare = [SYSTEM, "tool_declare", MIDDLE, json.dumps(TOOLS), END]
    call = [SECTION, CALL, "functions.get_weather:0", ARGS, '{"city": "Oslo"}', CALL_END, SECTION_END, END]
    result = [SYSTEM, "tool", MIDDLE, "## Return of functions.get_weather:0\nsnow", END]
    assert (s.input_ids, s.loss_mask) == expect(
        (declare + [SYSTEM, "system", MIDDLE, "S", END] + user("Weather?") + prompt(), 0),
        (["Look it up.", UNTHINK] + call, 1),
        (result + prompt(), 0),
        (["Report.", UNTHINK, "Snow.", END], 1),
    )
    # both contexts are exactly what vLLM renders to serve those turns
    second_context = s.input_ids[: len(s.loss_mask) - len(ids_of(["Report.", UNTHINK, "Snow.", END]))]
    assert context_of(s) == serving_prompt(kimi, TOOL_ROW, 2)
    assert second_context == serving_prompt(kimi, TOOL_ROW, 4)


def test_template_with_a_default_system_prompt_still_gives_exact_samples():
    tok = build_kimi_tokenizer()
    default = "You are Kimi."
    tok.chat_template = (
        "{%- if not messages or messages[0]['role'] != 'system' -%}"
        "<|im_system|>system<|im_middle|>" + default + "<|im_end|>{%- endif -%}" + tok.chat_template
    )
    row = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "reasoning_content": "Greet."},
        ]
    }
    (s,) = samples(tok, row)
    assert (s.input_ids, s.loss_mask) == expect(
        ([SYSTEM, "system", MIDDLE, default, END] + user("Hi") + prompt(), 0),
        (["Greet.", UNTHINK, "Yo", END], 1),
    )


def test_instant_mode_supervises_no_reasoning_and_prompts_end_with_empty_think(kimi):
    (s,) = samples(kimi, TOOL_ROW, **INSTANT)
    declare = [SYSTEM, "tool_declare", MIDDLE, json.dumps(TOOLS), END]
    instant = [ASSISTANT, "assistant", MIDDLE, THINK, UNTHINK]
    call = [SECTION, CALL, "functions.get_weather:0", ARGS, '{"city": "Oslo"}', CALL_END, SECTION_END, END]
    result = [SYSTEM, "tool", MIDDLE, "## Return of functions.get_weather:0\nsnow", END]
    assert (s.input_ids, s.loss_mask) == expect(
        (declare + [SYSTEM, "system", MIDDLE, "S", END] + user("Weather?") + instant, 0),
        (call, 1),
        (result + instant, 0),
        (["Snow.", END], 1),
    )
    assert context_of(s) == serving_prompt(kimi, TOOL_ROW, 2, **INSTANT)


def test_instant_mode_multi_turn_is_append_only_so_one_sample(kimi):
    row = {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
        ]
    }
    (s,) = samples(kimi, row, **INSTANT)
    instant = [ASSISTANT, "assistant", MIDDLE, THINK, UNTHINK]
    assert (s.input_ids, s.loss_mask) == expect(
        (user("Q1") + instant, 0), (["A1", END], 1), (user("Q2") + instant, 0), (["A2", END], 1)
    )


def test_thinking_mode_turn_without_reasoning_is_context_not_a_target(kimi):
    row = {
        "messages": [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
        ]
    }
    (s,) = samples(kimi, row)
    assert (s.input_ids, s.loss_mask) == expect(
        (user("Q1") + history("A1") + user("Q2") + prompt(), 0), (["R2", UNTHINK, "A2", END], 1)
    )
    with pytest.raises(RowRejected, match="thinking mode, but no assistant turn has reasoning"):
        samples(kimi, {"messages": row["messages"][:2]})


def test_assistant_first_row_keeps_later_turns(kimi):
    row = {
        "messages": [
            {"role": "assistant", "content": "Welcome"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo", "reasoning_content": "R"},
        ]
    }
    (s,) = samples(kimi, row)
    assert (s.input_ids, s.loss_mask) == expect(
        (history("Welcome") + user("Hi") + prompt(), 0), (["R", UNTHINK, "Yo", END], 1)
    )
    with pytest.raises(RowRejected, match="no assistant turn after a user turn"):
        samples(kimi, {"messages": [{"role": "assistant", "content": "x", "reasoning_content": "r"}]})


def test_sharegpt_function_call_and_observation_are_tool_turns(kimi):
    sharegpt = {
        "tools": json.dumps(TOOLS),  # ShareGPT exports keep declarations as a string
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}),
            },
            {"from": "observation", "value": "snow"},
            {"from": "gpt", "value": "Snow."},
        ],
    }
    conv = normalize_row(sharegpt)
    assert conv.tools == TOOLS
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[1]["tool_calls"][0]["id"] == "functions.get_weather:0"
    assert conv.messages[2]["tool_call_id"] == "functions.get_weather:0"
    (s,) = samples(kimi, sharegpt, **INSTANT)
    two_calls = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "functions.a:0", "function": {"name": "a", "arguments": "{}"}},
            {"function": {"name": "b", "arguments": "{}"}},
        ],
    }
    conv = normalize_row(
        {
            "messages": [
                {"role": "user", "content": "Q"},
                two_calls,
                {"role": "tool", "tool_call_id": "functions.a:0", "content": "1"},
                {"role": "tool", "content": "2"},
                {"role": "assistant", "content": "A"},
            ]
        }
    )
    assert [m.get("tool_call_id") for m in conv.messages[2:4]] == ["functions.a:0", "functions.b:1"]
    assert "## Return of functions.get_weather:0\nsnow" in kimi.decode(s.input_ids)


@pytest.mark.parametrize(
    "turn, reason",
    [
        ({"role": "assistant", "content": "<think>open"}, "never closes it"),
        ({"role": "assistant", "content": "<think>a</think>b", "reasoning_content": "c"}, "both in"),
        ({"role": "assistant", "content": "x", "reasoning": "a", "thinking": "b"}, "several keys"),
        ({"role": "assistant", "content": None}, "is empty"),
        ({"role": "assistant", "content": "<think> </think>\n"}, "is empty"),
        (
            {"role": "assistant", "content": "x", "tool_calls": [{"function": {"arguments": "{}"}}]},
            "function name",
        ),
        ({"role": "tool", "content": "orphan"}, "no open tool call"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}, "image rows need a verifier with a vision tower"),
    ],
)
def test_bad_turns_are_rejected_with_a_reason(kimi, turn, reason):
    row = {"messages": [{"role": "user", "content": "Q"}, turn, {"role": "assistant", "content": "A"}]}
    with pytest.raises(RowRejected, match=reason):
        samples(kimi, row, **INSTANT)


def test_token_rows_are_used_verbatim_and_append_only_ones_merge(kimi):
    row = {
        "id": "gen",
        "messages": "ignored: for humans only",
        "generation": {"model": "kimi-k2.5"},
        "token_samples": [
            {"prompt_ids": [1, 2], "completion_ids": [3, 4]},
            {"prompt_ids": [1, 2, 3, 4, 5], "completion_ids": [6]},  # extends the first: merged
            {"prompt_ids": [1, 9], "completion_ids": [7, 163607]},  # does not: its own sample
        ],
    }
    first, second = samples(kimi, row)
    assert (first.input_ids, first.loss_mask) == ([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 0, 1])
    assert (second.input_ids, second.loss_mask) == ([1, 9, 7, 163607], [0, 0, 1, 1])
    assert [first.sample_id, second.sample_id] == ["gen", "gen#2"]
    assert first_prompt(row, kimi, SampleOptions(0)) == ([1, 2], [])


@pytest.mark.parametrize(
    "token_samples, reason",
    [
        ([], "non-empty list"),
        ("1 2 3", "expected a non-empty list"),
        ([[1, 2]], r"token_samples\[0\] is list"),
        ([{"prompt_ids": [1], "completion_ids": []}], r"completion_ids is empty"),
        ([{"prompt_ids": [1], "completion_ids": [-1]}], "token id -1"),
        (
            [{"prompt_ids": [1], "completion_ids": [163840]}],
            r"token id 163840, outside the tokenizer's \[0, 163840\)",
        ),
        ([{"prompt_ids": [1, True], "completion_ids": [2]}], "holds bool True"),
        ([{"prompt_ids": [1, 2.0], "completion_ids": [2]}], "holds float"),
        ([{"completion_ids": [2]}], "prompt_ids is null"),
    ],
)
def test_token_rows_with_bad_ids_are_rejected_with_a_reason(kimi, token_samples, reason):
    with pytest.raises(RowRejected, match=reason):
        samples(kimi, {"id": "x", "token_samples": token_samples})


def test_long_sample_rejected_or_truncated_to_what_fits(kimi):
    row = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A", "reasoning_content": "r" * 100},
        ]
    }
    (full,) = samples(kimi, row)
    n = len(full.input_ids)
    with pytest.raises(RowRejected, match=rf"{n} tokens > max_seq_len 40"):
        samples(kimi, row, max_seq_len=40)
    (cut,) = row_samples(row, 0, kimi, SampleOptions(40, truncate=True))
    assert cut.input_ids == full.input_ids[:40] and cut.loss_mask == full.loss_mask[:40]
    assert cut.truncated_from == n and sum(cut.loss_mask) == 40 - len(context_of(full))
    with pytest.raises(RowRejected, match="no supervised token lies within the first 5"):
        row_samples(row, 0, kimi, SampleOptions(5, truncate=True))


class ErasesOldReasoning:
    """A template (Qwen3-like) that shows reasoning only on assistant turns after the last user turn:
    not append-only, but every turn renders after its own serving prompt. One character per token."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        out = ""
        for i, m in enumerate(messages):
            think = f"({m['reasoning_content']})" if i > last_user and m.get("reasoning_content") else ""
            out += f"[{m['role'][0]}]{think}{m['content']}."
        return out + ("[a]" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}


def test_other_non_append_only_template_gets_one_sample_per_turn():
    row = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "b", "reasoning_content": "r"},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d", "reasoning_content": "s"},
        ]
    }
    first, second = samples(ErasesOldReasoning(), row)

    def chars(s):
        return [ord(c) for c in s]

    assert (first.input_ids, first.loss_mask) == (chars("[u]q.[a](r)b."), [0] * 8 + [1] * 5)
    # turn 1 (the [a] in front of b) is re-rendered without its reasoning in turn 3's prompt
    assert (second.input_ids, second.loss_mask) == (chars("[u]q.[a]b.[u]c.[a](s)d."), [0] * 18 + [1] * 5)


def test_samples_of_one_row_land_on_one_side_of_the_split():
    from eagle3_pipeline.data.shards import SampleRef
    from eagle3_pipeline.data.split import split_samples

    refs = [
        SampleRef("s", "p", i, f"conv-{c}{'' if n == 0 else f'#{n + 1}'}", 10)
        for i, (c, n) in enumerate((c, n) for c in range(40) for n in range(3))
    ]
    train, val = split_samples(refs, seed=0, val_ratio=0.3)
    sides = split_sides(train, val)
    assert len(sides) == 40 and all(len(s) == 1 for s in sides.values()) and val and train
    # tiny data: the conversation held out is held out whole
    train, val = split_samples(refs[:6], seed=0, val_ratio=0.01)
    assert [r.sample_id for r in val] == ["conv-1", "conv-1#2", "conv-1#3"]


def test_a_variants_samples_are_its_own_ids_and_the_same_conversation():
    """A second version of the same rows (stage 01 --variant): sample ids `<row id>#v:<variant>`, later
    samples `#2` after it; each maps back to its row's conversation, which the split keeps on one side
    with the first version's samples."""
    from eagle3_pipeline.data.samples import variant_row_id
    from eagle3_pipeline.data.shards import SampleRef
    from eagle3_pipeline.data.split import split_samples

    assert variant_row_id("conv-3", None) == "conv-3"
    assert variant_row_id("conv-3", "given") == "conv-3#v:given"
    assert conversation_id("conv-3#v:given") == conversation_id("conv-3#v:seed1#2") == "conv-3"
    assert conversation_id("conv-3#v:") == "conv-3#v:" and conversation_id("a@b.com") == "a@b.com"
    ids = [sample_id(variant_row_id(f"conv-{c}", v), n) for c in range(40) for v in (None, "given")
           for n in range(2)]  # fmt: skip
    assert len(set(ids)) == len(ids) == 160
    refs = [SampleRef("s", "p", i, x, 10) for i, x in enumerate(ids)]
    train, val = split_samples(refs, seed=0, val_ratio=0.3)
    sides = split_sides(train, val)
    assert len(sides) == 40 and all(len(s) == 1 for s in sides.values()) and val and train
    held_out = {conversation_id(r.sample_id) for r in val}
    assert all(sum(conversation_id(r.sample_id) == c for r in val) == 4 for c in held_out)  # both versions
