"""A Kimi-K2.5-style tokenizer and chat template for tests, written from the facts listed in issue 8.

Not a copy of Kimi's files: a byte-level BPE with no merges (every byte one token, ids 0-255), unused
filler entries up to Kimi's vocabulary size 163840, and the control tokens at Kimi-K2.5's ids. The
im_* tokens and [BOS]/[EOS] are special; <think>, </think> and the tool-call tokens are added tokens
that are not special. Both kinds are matched in any text, like Kimi's tokenizer does. The template
follows the published behaviour:
  user       <|im_user|>user<|im_middle|>...<|im_end|>
  assistant  <|im_assistant|>assistant<|im_middle|><think>R</think>A[tool-call section]<|im_end|>
             with an empty <think></think> for every assistant turn up to and including the last one
             without tool calls ("history": reasoning erased)
  system     <|im_system|>system<|im_middle|>...<|im_end|>
  tool       <|im_system|>tool<|im_middle|>## Return of {tool_call_id}\n...<|im_end|>
  tools      <|im_system|>tool_declare<|im_middle|>{declaration}<|im_end|> first
  generation <|im_assistant|>assistant<|im_middle|><think>, or ...<think></think> with thinking=false
"""

from __future__ import annotations

from pathlib import Path

KIMI_VOCAB_SIZE = 163840
SPECIAL = {  # special tokens: control tokens
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    "<|im_middle|>": 163601,
    "[PAD]": 163839,  # a reserved slot; Kimi's pad id is not part of the facts, any unused id will do
}
ADDED = {  # added tokens that are not "special"
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<think>": 163606,
    "</think>": 163607,
}
IDS = {**SPECIAL, **ADDED}

CHAT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- set ns = namespace(last_history=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' and not m.get('tool_calls') -%}{%- set ns.last_history = loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 <= ns.last_history -%}<think></think>"
    "{%- else -%}<think>{{ m.get('reasoning_content') or '' }}</think>{%- endif -%}"
    "{{ m['content'] or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>"
    "{%- for c in m['tool_calls'] -%}<|tool_call_begin|>{{ c['id'] }}<|tool_call_argument_begin|>"
    "{{ c['function']['arguments'] }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def build_kimi_tokenizer(out_dir: Path | None = None):
    """The tokenizer (saved to `out_dir` when given, so AutoTokenizer can load it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle3_pipeline.models.tiny import byte_to_char

    vocab = {ch: b for b, ch in byte_to_char().items()}
    by_id = {i: t for t, i in IDS.items()}
    for i in range(256, KIMI_VOCAB_SIZE):  # fillers: multi-character, so no byte sequence reaches them
        vocab[by_id.get(i, f"<|unused_{i}|>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]"
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def ids_of(text_pieces: list[str | int]) -> list[int]:
    """Expected ids: strings are byte tokens (UTF-8), ints are control-token ids as they stand."""
    out: list[int] = []
    for piece in text_pieces:
        if isinstance(piece, int):
            out.append(piece)
        else:
            out.extend(piece.encode("utf-8"))
    return out
