"""Rows to training samples that match serving: per-turn contexts, loss masks, length handling.

One entry point, `row_samples`, which stage 01 calls per row; every bad row is a `RowRejected` reason.

What a sample is: for an assistant turn, the context is exactly the prompt the chat template renders to
serve that turn (the turns before it, `add_generation_prompt=True`, the run's `chat_template_kwargs`),
and the supervised tokens (loss mask 1) are exactly what the model generates for it. Samples whose
context starts with the previous sample's whole sequence are merged into one (mask on both turns), so
an append-only template or an agentic tool loop costs one forward, not one per turn. Three methods:
  - append-only templates (the tiny verifiers, Llama-style): one rendering of the conversation, mask by
    prefix renderings (`conversations.tokenize_conversation`): exact there, and cheapest;
  - Kimi-K2.5 (`KimiK25Rules`): its template erases the reasoning of history turns and never renders a
    final answer with its reasoning, so the supervised tokens are built from the turn's parts;
  - any other template that re-renders earlier turns: per turn, context = the serving prompt, supervised =
    what the template renders for the turn after that prompt.
Rows with `token_samples` (written by the regeneration stage, `00_regenerate.py`) are used verbatim:
each `{"prompt_ids", "completion_ids"}` is a context and its supervised tokens, never re-rendered.

Sample ids: the row's `id` (or `row-<index>`) for its first sample, `<id>#2`, `<id>#3`, ... for the
next ones; `conversation_id` maps them back, so a conversation's samples share one side of the split.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_pipeline.data.conversations import (
    NO_VISION_TOWER,
    Conversation,
    NotAppendOnly,
    RawRow,
    RowRejected,
    normalize_messages,
    normalize_row,
    read_rows,
    render_ids,
    row_id_of,
    tokenize_conversation,
)
from eagle3_pipeline.data.images import ImageRejected, ImageTokens, row_image_urls

log = logging.getLogger("eagle3.samples")  # rejected rows of stages 00 and 01

MAX_REJECTS_LOGGED_PER_PART = 5  # the rest are only in rejects.jsonl (600k rows could flood the log)

Pair = tuple[list[int], list[int]]  # (context ids, supervised ids) of one generated turn
Unit = tuple[list[int], list[int]]  # (input_ids, loss_mask) of one sample before length handling


@dataclass
class SampleOptions:
    max_seq_len: int
    truncate: bool = False  # cut a long sample to max_seq_len instead of rejecting the row
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    images: ImageTokens | None = None  # the vision verifier's, where image rows are taken
    no_images_why: str = NO_VISION_TOWER  # why image rows are rejected where they are not
    base_dir: Path | None = None  # relative image paths start here (the data file's folder)
    variant: str | None = None  # another version of conversations extracted already (variant_row_id)


@dataclass
class Sample:
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]
    truncated_from: int | None = None  # length before truncation, when truncated
    images: list[str] = field(default_factory=list)  # data URLs of the images its ids hold, in order


def stored_from(loss_mask: list[int], context_tokens: int | None) -> int:
    """The first token stage 01 stores of a sample: 0, or with `context_tokens` (ExtractConfig) the one that
    many context tokens before the slot whose state predicts its first supervised token (packing.pack:
    slot t learns token t + 1), so every supervised token keeps its slot."""
    if context_tokens is None:
        return 0
    return max(0, first_supervised(loss_mask) - 1 - context_tokens)


def first_supervised(loss_mask: list[int]) -> int:
    """The index of a sample's first supervised token (0 when none is)."""
    return next((i for i, m in enumerate(loss_mask) if m), 0)


def sample_id(row_id: str, n: int) -> str:
    """Id of the row's n-th sample (0-based): `<row id>`, then `<row id>#2`, `<row id>#3`, ..."""
    return row_id if n == 0 else f"{row_id}#{n + 1}"


# A second version of the same conversations (another seed's answers, the given answers beside the
# regenerated ones) is extracted with a variant name (stage 01 --variant): its row ids become
# `<row id>#v:<variant>`, so the two shard sets never share a sample id, and conversation_id maps both to
# one conversation, which the split keeps on one side.
VARIANT_MARK = "#v:"
VARIANT_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# A long session joined from rows (data/sessions.py) has its first row's id and `#s:<n>`: conversation_id
# maps it to that row, whose split side all the session's rows share.
SESSION_MARK = "#s:"


def variant_row_id(row_id: str, variant: str | None) -> str:
    """The row id a sample id starts with: the row's own, or `<row id>#v:<variant>`."""
    return row_id if variant is None else f"{row_id}{VARIANT_MARK}{variant}"


def conversation_id(sample_id: str) -> str:
    """The conversation a sample comes from: its id without trailing `#<n>` suffixes, its variant mark and
    its session mark (a row id that itself ends in `#<digits>` is grouped with its stem, which only puts two
    conversations together)."""
    row = re.sub(rf"{VARIANT_MARK}{VARIANT_NAME.pattern}$", "", re.sub(r"(#\d+)+$", "", sample_id))
    return re.sub(rf"{SESSION_MARK}\d+$", "", row)


def row_samples(row_value: Any, row_index: int, tokenizer: Any, opts: SampleOptions) -> list[Sample]:
    """The training samples of one row (at least one), or RowRejected with the reason."""
    if isinstance(row_value, dict) and row_value.get("token_samples") is not None:
        row_id = row_id_of(row_value)
        units = merge_append_only(token_pairs(row_value["token_samples"], len(tokenizer)))
        urls = _token_row_images(row_value, opts)
    else:
        conv = normalize_row(row_value, opts.base_dir, opts.images is not None, opts.no_images_why)
        row_id = conv.row_id
        units = conversation_units(tokenizer, conv, opts)
        urls = conv.images
        if urls and opts.images is not None:  # one placeholder per image rendered: expanded
            units = [_expand_unit(opts.images, ids, mask, urls) for ids, mask in units]
    base = variant_row_id(row_id if row_id is not None else f"row-{row_index}", opts.variant)
    samples = [Sample(sample_id(base, n), *fitted) for n, fitted in enumerate(fit_length(units, opts))]
    for smp in samples:
        cut = f" (cut at max_seq_len {opts.max_seq_len})" if smp.truncated_from else ""
        smp.images = _images_of(smp.input_ids, urls, opts, f"sample {smp.sample_id!r}{cut}")
    return samples


def _expand_unit(images: ImageTokens, ids: list[int], mask: list[int], urls: list[str]) -> Unit:
    """A rendered sample's ids and loss mask with each image expanded (out of the loss), or RowRejected."""
    try:
        return images.expand_unit(ids, mask, urls)[:2]
    except ImageRejected as e:
        raise RowRejected(str(e)) from None


def _token_row_images(row_value: dict[str, Any], opts: SampleOptions) -> list[str]:
    """The images of a row with token_samples (its messages' image parts), or RowRejected: an image that
    cannot be read, or any image where image rows are not taken."""
    try:
        urls = row_image_urls(row_value, opts.base_dir)
    except ImageRejected as e:
        raise RowRejected(f"messages: {e}") from None
    if urls and opts.images is None:
        raise RowRejected(f"the row has {len(urls)} images: {opts.no_images_why}")
    return urls


def first_prompt(row_value: Any, tokenizer: Any, opts: SampleOptions) -> tuple[list[int], list[str]]:
    """(the serving prompt of the row's first assistant turn, the images it holds), built as stage 01
    builds its contexts (for 06_evaluate.py: the same template settings and image handling as training)."""
    if isinstance(row_value, dict) and row_value.get("token_samples") is not None:
        ids = token_pairs(row_value["token_samples"], len(tokenizer))[0][0]
        return ids, _images_of(ids, _token_row_images(row_value, opts), opts)
    conv = normalize_row(row_value, opts.base_dir, opts.images is not None, opts.no_images_why)
    turns = _supervisable_turns(conv)
    if not turns:
        raise RowRejected("no assistant turn after a user turn")
    rules = KimiK25Rules.detect(tokenizer)
    messages = conv.messages
    kwargs = opts.chat_template_kwargs
    if rules is not None:
        messages = rules.serving_messages(tokenizer, conv, kwargs)
    ids = _render(tokenizer, messages[: turns[0]], True, conv.tools, kwargs)
    urls = Conversation(None, conv.messages[: turns[0]]).images
    if not urls or opts.images is None:
        return ids, []
    expanded = _expand_unit(opts.images, ids, [0] * len(ids), urls)[0]
    return expanded, _images_of(expanded, urls, opts)


def _images_of(ids: list[int], urls: list[str], opts: SampleOptions, where: str = "prompt") -> list[str]:
    """The images an expanded sample holds, checked against their token counts, or RowRejected."""
    if opts.images is None:
        return []
    try:
        return opts.images.images_of(ids, urls)
    except ImageRejected as e:
        raise RowRejected(f"{where}: {e}") from None


def conversation_units(tokenizer: Any, conv: Conversation, opts: SampleOptions) -> list[Unit]:
    kwargs = opts.chat_template_kwargs
    rules = KimiK25Rules.detect(tokenizer)
    if rules is not None:
        pairs = rules.turn_pairs(tokenizer, conv, kwargs)
    else:
        if not _supervisable_turns(conv):
            raise RowRejected("no assistant turn after a user turn (a leading assistant turn has no prompt)")
        try:
            ids, mask = tokenize_conversation(tokenizer, conv.messages, 2**62, conv.tools, kwargs)
            return [(ids, mask)]
        except NotAppendOnly:
            pairs = generic_turn_pairs(tokenizer, conv, kwargs)
    return merge_append_only(pairs)


def _supervisable_turns(conv: Conversation) -> list[int]:
    """Assistant turns with a serving prompt: all but a leading one (nothing to render before it)."""
    return [i for i, m in enumerate(conv.messages) if m["role"] == "assistant" and i > 0]


def _render(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> list[int]:
    try:
        return render_ids(tokenizer, messages, add_generation_prompt, tools, kwargs)
    except Exception as e:  # noqa: BLE001 - a template error is about this row's content
        raise RowRejected(f"chat template failed: {type(e).__name__}: {e}") from None


def _render_text(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, **kw: Any
) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )
    except Exception as e:  # noqa: BLE001 - a template error is about this row's content
        raise RowRejected(f"chat template failed: {type(e).__name__}: {e}") from None


def generic_turn_pairs(tokenizer: Any, conv: Conversation, kwargs: dict[str, Any]) -> list[Pair]:
    """Per assistant turn: (serving prompt, what the template renders for the turn after that prompt)."""
    pairs = []
    for i in _supervisable_turns(conv):
        context = _render(tokenizer, conv.messages[:i], True, conv.tools, kwargs)
        through = _render(tokenizer, conv.messages[: i + 1], False, conv.tools, kwargs)
        if through[: len(context)] != context or len(through) == len(context):
            raise RowRejected(
                f"chat template is not prefix-stable at turn {i} (turn {i} does not render after its "
                "own serving prompt), so its tokens cannot be located"
            )
        pairs.append((context, through[len(context) :]))
    return pairs


class KimiK25Rules:
    """Kimi-K2.5's template (docs/reference.md, Kimi-K2.5 data): serving prompt
    `...<|im_assistant|>assistant<|im_middle|><think>` (thinking, the default) or `...<think></think>`
    (`{"thinking": false}`: instant mode). Every
    assistant turn up to and including the last one without tool calls renders as history with an empty
    `<think></think>`; so a final answer is never rendered with its reasoning, and the generic method would
    supervise `</think>` right after `<think>`. Here a turn's supervised tokens are built from its parts:
    thinking: reasoning + `</think>` + the turn's body (content, tool-call section, `<|im_end|>`) as the
    template renders it; instant: the body. In thinking mode a turn without reasoning is context only
    (Kimi-K2.5 always reasons there: supervising `</think>` first would teach the draft the wrong first
    proposal); in instant mode reasoning is dropped from every turn (the model produced none, and vLLM's
    client sends none back). Detected from the tokenizer: `<|im_assistant|>`, `<|im_middle|>`, `<think>`,
    `</think>` all in its vocabulary.
    """

    TOKENS = ("<|im_assistant|>", "<|im_middle|>", "<think>", "</think>")
    HEADER = "<|im_assistant|>assistant<|im_middle|>"
    EMPTY_THINK = "<think></think>"

    @classmethod
    def detect(cls, tokenizer: Any) -> KimiK25Rules | None:
        to_id = getattr(tokenizer, "convert_tokens_to_ids", None)
        if to_id is None:
            return None
        unk = getattr(tokenizer, "unk_token_id", None)
        try:
            ids = [to_id(t) for t in cls.TOKENS]
        except (KeyError, ValueError, TypeError):  # remote-code tokenizers may raise on unknown tokens
            return None
        return cls() if all(i is not None and i != unk for i in ids) else None

    def is_thinking(self, tokenizer: Any, kwargs: dict[str, Any]) -> bool:
        probe = _render_text(tokenizer, [{"role": "user", "content": "x"}], True, **kwargs)
        if probe.endswith(self.HEADER + self.EMPTY_THINK):
            return False
        if probe.endswith(self.HEADER + "<think>"):
            return True
        raise RowRejected(
            f"the chat template's generation prompt {probe[-60:]!r} is not Kimi-K2.5's "
            f"({self.HEADER}<think> or {self.HEADER}{self.EMPTY_THINK})"
        )

    def serving_messages(
        self, tokenizer: Any, conv: Conversation, kwargs: dict[str, Any]
    ) -> list[dict[str, Any]]:
        if self.is_thinking(tokenizer, kwargs):
            return conv.messages
        return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in conv.messages]

    def turn_pairs(self, tokenizer: Any, conv: Conversation, kwargs: dict[str, Any]) -> list[Pair]:
        thinking = self.is_thinking(tokenizer, kwargs)
        messages = self.serving_messages(tokenizer, conv, kwargs)
        pairs, without_reasoning = [], 0
        for i in _supervisable_turns(conv):
            turn = messages[i]
            reasoning = turn.get("reasoning_content")
            if thinking and not reasoning:
                without_reasoning += 1
                continue
            context = _render(tokenizer, messages[:i], True, conv.tools, kwargs)
            body = self._body(tokenizer, turn, kwargs, i)
            completion = f"{reasoning}</think>{body}" if thinking else body
            pairs.append((context, list(tokenizer(completion, add_special_tokens=False)["input_ids"])))
        if not pairs:
            if without_reasoning:
                raise RowRejected(
                    "thinking mode, but no assistant turn has reasoning (Kimi-K2.5 reasons before every "
                    "answer there): regenerate the row, or use instant mode "
                    "(--chat-template-kwargs '{\"thinking\": false}')"
                )
            raise RowRejected("no assistant turn after a user turn (a leading assistant turn has no prompt)")
        return pairs

    def _body(self, tokenizer: Any, turn: dict[str, Any], kwargs: dict[str, Any], i: int) -> str:
        """The turn's content, tool-call section and end token, as the template renders them: the turn
        alone, without reasoning, renders `HEADER<think></think>` + body (after whatever the template puts
        first, such as a default system prompt)."""
        alone = {k: v for k, v in turn.items() if k != "reasoning_content"}
        text = _render_text(tokenizer, [alone], False, **kwargs)
        prefix = self.HEADER + self.EMPTY_THINK
        start = text.find(prefix)
        if start < 0 or not text.endswith("<|im_end|>"):
            raise RowRejected(f"turn {i} renders as {text[-80:]!r}, not in Kimi-K2.5's assistant format")
        return text[start + len(prefix) :]


def token_pairs(value: Any, vocab_size: int) -> list[Pair]:
    """The (prompt_ids, completion_ids) of a row's `token_samples`, validated."""
    if not isinstance(value, list) or not value:
        raise RowRejected(f"token_samples is {_kind(value)}, expected a non-empty list")
    pairs = []
    for k, s in enumerate(value):
        if not isinstance(s, dict):
            raise RowRejected(f"token_samples[{k}] is {_kind(s)}, expected an object")
        prompt = _token_list(s.get("prompt_ids"), f"token_samples[{k}].prompt_ids", vocab_size)
        completion = _token_list(s.get("completion_ids"), f"token_samples[{k}].completion_ids", vocab_size)
        pairs.append((prompt, completion))
    return pairs


def _token_list(ids: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(ids, list):
        raise RowRejected(f"{name} is {_kind(ids)}, expected a list of token ids")
    if not ids:
        raise RowRejected(f"{name} is empty")
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool):
            raise RowRejected(f"{name} holds {_kind(t)} {t!r}, expected integer token ids")
        if not 0 <= t < vocab_size:
            raise RowRejected(f"{name} holds token id {t}, outside the tokenizer's [0, {vocab_size})")
    return list(ids)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def merge_append_only(pairs: list[Pair]) -> list[Unit]:
    """One sample per pair, except that a pair whose context starts with the previous sample's whole
    sequence extends it (its mask covers both completions). The merged sample is exactly as long as the
    later pair alone, so merging never costs length."""
    units: list[Unit] = []
    for context, completion in pairs:
        if units:
            ids, mask = units[-1]
            if context[: len(ids)] == ids:
                gap = context[len(ids) :]
                ids.extend(gap + completion)
                mask.extend([0] * len(gap) + [1] * len(completion))
                continue
        units.append((context + completion, [0] * len(context) + [1] * len(completion)))
    return units


def fit_length(units: list[Unit], opts: SampleOptions) -> list[tuple[list[int], list[int], int | None]]:
    """Samples within max_seq_len: too long is a rejected row, or with `truncate` the first max_seq_len
    tokens (a sample whose supervised tokens all lie beyond is dropped; the row is rejected if none is
    left)."""
    limit, out = opts.max_seq_len, []
    for ids, mask in units:
        if len(ids) <= limit:
            out.append((ids, mask, None))
        elif not opts.truncate:
            raise RowRejected(f"{len(ids)} tokens > max_seq_len {limit} (--truncate keeps what fits)")
        elif any(mask[:limit]):
            out.append((ids[:limit], mask[:limit], len(ids)))
    if not out:
        raise RowRejected(
            f"{len(units[0][0])} tokens > max_seq_len {limit}, and no supervised token lies within the "
            f"first {limit}"
        )
    return out


# ---- rows in blocks: every row written or rejected (stage 01), token counts (the plan) -----------


def accepted_rows(
    raws: Iterable[RawRow], build: Callable[[RawRow], Any], rejects: list[dict[str, Any]], source: str = ""
) -> Iterator[tuple[int, Any]]:
    """(row index, build(raw)) of every row that builds; no exception escapes for any row: a bad
    row is a reason appended to `rejects`, an unexpected error too (logged with its traceback), so every
    row is written or rejected. The first MAX_REJECTS_LOGGED_PER_PART rejects are logged."""
    line_note = " (line {})" if source.endswith(".jsonl") else ""
    for raw in raws:
        try:
            if raw.error:
                raise RowRejected(raw.error)
            value = build(raw)
        except Exception as e:  # noqa: BLE001 - no row may stop the stage
            reason = str(e) if isinstance(e, RowRejected) else f"unexpected {type(e).__name__}: {e}"
            rejects.append({"row": raw.index, "reason": reason})
            if len(rejects) <= MAX_REJECTS_LOGGED_PER_PART:
                log.warning("%s row %d%s: rejected: %s", source, raw.index, line_note.format(raw.index + 1),
                            reason, exc_info=not isinstance(e, RowRejected))  # fmt: skip
            continue
        yield raw.index, value


def block_samples(
    raws: Iterable[RawRow], tokenizer: Any, opts: SampleOptions, seen: dict[str, int], source: str = ""
) -> tuple[list[tuple[int, Sample]], list[dict[str, Any]]]:
    """([(row index, sample)], rejects) of a block of rows (`accepted_rows`); a sample id seen before is
    a reject. `seen` (sample id -> row) is updated with the accepted samples."""

    def build(raw: RawRow) -> list[Sample]:
        row = row_samples(raw.value, raw.index, tokenizer, opts)
        for s in row:
            if s.sample_id in seen:
                raise RowRejected(f"duplicate id {s.sample_id!r} (first at row {seen[s.sample_id]})")
        return row

    accepted: list[tuple[int, Sample]] = []
    rejects: list[dict[str, Any]] = []
    for index, row in accepted_rows(raws, build, rejects, source):
        for s in row:  # a row's samples stay together, in one part
            seen[s.sample_id] = index
            accepted.append((index, s))
    return accepted, rejects


def extracted_tokens(
    row: Any, tokenizer: Any, opts: SampleOptions, context_tokens: int | None, index: int = 0
) -> tuple[int, int]:
    """(tokens stored, longest sample) of what stage 01 extracts for a row: in a template that erases earlier
    reasoning (Kimi-K2.5's thinking mode) every turn is a sample of its whole context, so a conversation
    of n turns stores about n / 2 times its length, or with `context_tokens` (stage 01's) n times that
    many and a turn; append-only templates one sample, the conversation itself."""
    made = row_samples(row, index, tokenizer, opts)
    stored = sum(len(smp.input_ids) - stored_from(smp.loss_mask, context_tokens) for smp in made)
    return stored, max(len(smp.input_ids) for smp in made)


def sample_lengths(
    tokenizer: Any, data_path: Path, split: str, start: int, end: int, max_seq_len: int, n: int = 64,
    opts: SampleOptions | None = None, context_tokens: int | None = None,
) -> tuple[list[int], int]:
    """(token counts of the accepted rows, rows read) over the first n rows of [start, end). With `opts`
    (stage 01's), a row counts the tokens of the samples stage 01 stores (extracted_tokens: every turn's
    context in a template that erases reasoning, from `context_tokens` before its answer, each image as its
    tokens); without, the row tokenized once."""
    lengths, read = [], 0
    for raw in read_rows(data_path, start, min(end, start + n), split):
        read += 1
        try:
            if raw.error:
                raise RowRejected(raw.error)
            if opts is not None:
                lengths.append(extracted_tokens(raw.value, tokenizer, opts, context_tokens, raw.index)[0])
                continue
            _, messages = normalize_messages(raw.value)
            ids, _ = tokenize_conversation(tokenizer, messages, max_seq_len)
        except (RowRejected, ImageRejected):
            continue
        lengths.append(len(ids))
    return lengths, read


def sample_tokens_per_row(
    tokenizer: Any, data_path: Path, split: str, start: int, end: int, max_seq_len: int, n: int = 64,
    opts: SampleOptions | None = None, context_tokens: int | None = None,
) -> float | None:
    """Mean tokens per input row (a rejected row counts 0) over a sample; None without rows."""
    lengths, read = sample_lengths(tokenizer, data_path, split, start, end, max_seq_len, n, opts,
                                   context_tokens)  # fmt: skip
    return sum(lengths) / read if read else None
