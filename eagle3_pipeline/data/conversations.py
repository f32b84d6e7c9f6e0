"""Conversation rows in, normalised for the chat template; a bad row becomes a reason, never a traceback.

Accepted rows: OpenAI `{"messages": [{"role", "content", ...}], "tools": [...]}` and ShareGPT
`{"conversations": [{"from", "value"}]}` (role/content inside `conversations` works too), optional `id`.
Sources: .jsonl (one row per line; a UTF-8 BOM is ignored), .json (a list of rows), or a folder saved
by `datasets`. What generation needs is kept: reasoning, tool calls, tool results and the
row's tool declarations; see `normalize_row`. Rows become training samples in samples.py.
`tokenize_conversation` is the single-sample method for append-only templates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.images import IMAGE_PART_TYPES, ImageRejected, load_part_image, template_messages

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system turn
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy role of a function result
    "observation": "tool",  # ShareGPT tool result
    "function_call": "function_call",  # ShareGPT: an assistant tool call, its value the call as JSON
}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # vLLM/DeepSeek, OpenRouter, others
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
OTHER_MEDIA_PART_TYPES = ("video", "video_url", "audio", "input_audio")  # refused: images only
UTF8_BOM = "\ufeff"
# why an image row is rejected where images are not taken
NO_VISION_TOWER = "image rows need a verifier with a vision tower (preprocessor_config.json, vision_config)"


class RowRejected(Exception):
    """This row cannot become a sample; the message is the reason written to rejects.jsonl."""


@dataclass
class RawRow:
    index: int  # 0-based position in the source (line number - 1 for .jsonl)
    value: Any = None  # parsed JSON value, or None when `error` is set
    error: str | None = None


@dataclass
class Conversation:
    row_id: str | None
    messages: list[dict[str, Any]]  # OpenAI message dicts, as chat templates read them
    tools: list[dict[str, Any]] | None = None  # the row's tool declarations, passed to the template

    @property
    def images(self) -> list[str]:
        """The row's images as data URLs, in the order the template renders them."""
        return [p["image_url"]["url"] for m in self.messages if isinstance(m["content"], list)
                for p in m["content"] if p["type"] == "image_url"]  # fmt: skip


def _require(path: Path) -> None:
    if not path.exists():
        raise UserError(f"{path}: data not found (--data-path)")


def count_rows(path: Path, split: str = "train") -> int:
    _require(path)
    if path.is_dir():
        return len(_load_dataset(path, split))
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    return len(_load_json_list(path))


def read_rows(path: Path, start: int, end: int, split: str = "train") -> Iterator[RawRow]:
    """Rows [start, end) of a source; unreadable rows come back with `error` set."""
    _require(path)
    if path.is_dir():
        ds = _load_dataset(path, split)
        for i in range(start, min(end, len(ds))):
            yield RawRow(i, ds[i])
        return
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for i, line in enumerate(f):
                if i >= end:
                    break
                if i >= start:
                    yield _parse_line(i, line)
        return
    rows = _load_json_list(path)
    for i in range(start, min(end, len(rows))):
        yield RawRow(i, rows[i])


def _parse_line(index: int, line: bytes) -> RawRow:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRow(index, error=f"not UTF-8 ({e.reason} at byte {e.start})")
    text = text.removeprefix(UTF8_BOM)  # editors on Windows start files with one
    if not text.strip():
        return RawRow(index, error="empty line")
    try:
        return RawRow(index, json.loads(text))
    except json.JSONDecodeError as e:
        return RawRow(index, error=f"malformed JSON: {e.msg} (column {e.colno})")


def _load_json_list(path: Path) -> list[Any]:
    if not path.is_file():
        raise UserError(f"{path}: data file not found")
    try:
        rows = json.loads(path.read_bytes().decode("utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(
            f"{path}: not a valid UTF-8 JSON file ({e}); use .jsonl to have bad rows rejected one by one"
        ) from None
    if not isinstance(rows, list):
        raise UserError(f"{path}: expected a JSON list of conversation rows")
    return rows


def _load_dataset(path: Path, split: str) -> Any:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise UserError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{path}: no split {split!r}; it has {sorted(ds)} (set --data-split)")
        ds = ds[split]
    return ds


def row_id_of(row: dict[str, Any]) -> str | None:
    row_id = row.get("id")
    if row_id is not None and (not isinstance(row_id, (str, int)) or isinstance(row_id, bool)):
        raise RowRejected(f"id has type {type(row_id).__name__}, expected string or integer")
    return None if row_id is None else str(row_id)


def normalize_row(
    row: Any, base_dir: Path | None = None, images: bool = False, no_images_why: str = NO_VISION_TOWER
) -> Conversation:
    """The row as the chat template needs it (OpenAI message dicts plus the row's `tools`), or RowRejected.

    Kept per turn: `content` (a string; text parts joined; with `images`, a turn with image parts keeps
    its parts in order, each image read (relative paths from `base_dir`), checked and kept as an OpenAI
    `image_url` part with a data URL: data/images.py), `reasoning_content` (from `reasoning_content`,
    `reasoning`, `thinking`, or a leading inline `<think>R</think>` in an assistant's content;
    both texts exactly as given, whitespace where they meet included),
    `tool_calls` (OpenAI form, arguments as a JSON string, ids `functions.<name>:<n>` when missing, the
    form Kimi-K2.5 writes), `tool_call_id` and `name` of tool results. ShareGPT `function_call` turns
    become assistant tool calls, `observation` turns tool results. Null fields count as absent (a
    `datasets` folder fills missing keys with None). Without `images`, an image part rejects the row
    with `no_images_why`.
    """
    if not isinstance(row, dict):
        raise RowRejected(f"row is {type(row).__name__}, expected an object")
    row_id = row_id_of(row)
    turns = row.get("messages", row.get("conversations"))
    if turns is None:
        raise RowRejected("no `messages` or `conversations` field")
    if not isinstance(turns, list):
        raise RowRejected(f"turns are {type(turns).__name__}, expected a list")
    if not turns:
        raise RowRejected("no turns")
    tools = _tools(row.get("tools"))
    messages: list[dict[str, Any]] = []
    calls = _CallIds()
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowRejected(f"turn {n} is {type(turn).__name__}, expected an object")
        role = turn.get("role") if turn.get("role") is not None else turn.get("from")
        if not isinstance(role, str):
            raise RowRejected(f"turn {n} has no role")
        if role.lower() not in ROLE_ALIASES:
            raise RowRejected(f"turn {n} has unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
        kind = ROLE_ALIASES[role.lower()]
        raw_content = turn.get("content") if turn.get("content") is not None else turn.get("value")
        if kind == "function_call":  # ShareGPT: the call itself is the value, as JSON
            message = {"role": "assistant", "content": "", "tool_calls": [_sharegpt_call(n, raw_content)]}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
                message = {**messages.pop(), "tool_calls": message["tool_calls"]}
            calls.assign(n, message)
            messages.append(message)
            continue
        content = _content(n, raw_content, base_dir, images, no_images_why)
        if isinstance(content, list) and kind == "assistant":
            raise RowRejected(f"turn {n} ({role}) has an image: the model generates text only")
        message = {"role": kind, "content": content}
        if kind == "assistant":
            _assistant_fields(n, turn, message)
            calls.assign(n, message)
            said = message["content"] + message.get("reasoning_content", "")
            if not (said.strip() or "tool_calls" in message):
                raise RowRejected(f"turn {n} ({role}) is empty")
        elif kind == "tool":
            call_id = turn.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise RowRejected(f"turn {n} tool_call_id is {type(call_id).__name__}, expected a string")
            message["tool_call_id"] = calls.answer(n, call_id)
            name = turn.get("name")
            if isinstance(name, str):
                message["name"] = name
        elif isinstance(content, str) and not content.strip():
            raise RowRejected(f"turn {n} ({role}) is empty")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowRejected("no assistant turn")
    return Conversation(row_id, messages, tools)


def normalize_messages(row: Any) -> tuple[str | None, list[dict[str, Any]]]:
    """(id, messages) of a row, or RowRejected with the reason (see normalize_row)."""
    conv = normalize_row(row)
    return conv.row_id, conv.messages


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if isinstance(tools, str):  # some ShareGPT exports store the declarations as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RowRejected(f"tools is a string that is not JSON ({e.msg})") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowRejected(f"tools is {type(tools).__name__}, expected a list of objects")
    return tools or None


def _content(
    n: int, content: Any, base_dir: Path | None, images: bool, no_images_why: str
) -> str | list[dict[str, Any]]:
    """A turn's content: a string, or (images read and checked) its text and image_url parts in order."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowRejected(f"turn {n} content is {type(content).__name__}, expected a string")
    parts: list[dict[str, Any]] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in OTHER_MEDIA_PART_TYPES:
            raise RowRejected(f"turn {n} has {kind} content: only text and images are supported")
        if kind in IMAGE_PART_TYPES:
            parts.append(_image_part(n, p, base_dir, images, no_images_why))
        elif kind == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        else:
            raise RowRejected(f"turn {n} has non-text content parts")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image_part(
    n: int, part: dict[str, Any], base_dir: Path | None, images: bool, no_images_why: str
) -> dict[str, Any]:
    if not images:
        raise RowRejected(f"turn {n} has {part['type']} content: {no_images_why}")
    try:
        return {"type": "image_url", "image_url": {"url": load_part_image(part, base_dir)}}
    except ImageRejected as e:
        raise RowRejected(f"turn {n}: {e}") from None


def _assistant_fields(n: int, turn: dict[str, Any], message: dict[str, Any]) -> None:
    """reasoning_content and tool_calls of an assistant turn, in place."""
    given = [k for k in REASONING_KEYS if turn.get(k) is not None]
    if len(given) > 1:
        raise RowRejected(f"turn {n} has reasoning under several keys: {given}")
    reasoning = turn[given[0]] if given else None
    if reasoning is not None and not isinstance(reasoning, str):
        raise RowRejected(f"turn {n} {given[0]} is {type(reasoning).__name__}, expected a string")
    content = message["content"]
    # inline reasoning: `<think>R</think>A`, or `R</think>A` where the template wrote the opening tag
    # (DeepSeek-R1-style exports)
    if content.lstrip().startswith(THINK_OPEN) or (THINK_CLOSE in content and THINK_OPEN not in content):
        if reasoning is not None:
            raise RowRejected(f"turn {n} has reasoning both in {given[0]} and inline in <think>")
        reasoning, content = _split_inline(n, content)
    if THINK_OPEN in content or THINK_CLOSE in content:
        raise RowRejected(f"turn {n} has {THINK_OPEN} or {THINK_CLOSE} inside its answer")
    # Both texts as given, newlines at the seam included: Kimi-K2.5's template renders
    # `<think>R</think>A` and strips neither side (Qwen3's template strips them itself), so
    # `R\n</think>\n\nA` is what the model generated and what a client replays: vLLM's kimi_k2 reasoning
    # parser (thinking: DeepSeekR1ReasoningParser) partitions the output at `</think>` and strips nothing
    # (vllm/reasoning/basic_parsers.py, BaseThinkingReasoningParser.extract_reasoning).
    message["content"] = content
    if reasoning:  # "" renders as no reasoning: `<think></think>`
        message["reasoning_content"] = reasoning
    raw_calls = turn.get("tool_calls")
    if raw_calls is None and isinstance(turn.get("function_call"), dict):  # legacy OpenAI form
        raw_calls = [{"type": "function", "function": turn["function_call"]}]
    if raw_calls is not None:
        if not isinstance(raw_calls, list):
            raise RowRejected(f"turn {n} tool_calls is {type(raw_calls).__name__}, expected a list")
        if raw_calls:
            message["tool_calls"] = [_tool_call(n, c) for c in raw_calls]


def _split_inline(n: int, content: str) -> tuple[str, str]:
    """(reasoning, answer) of `<think>R</think>A` or `R</think>A`, split at the first `</think>`, both as
    written. Only whitespace before `<think>` is dropped: the serving prompt ends with `<think>` (Kimi-K2.5,
    Qwen3, DeepSeek-R1), so the model generates nothing before it; that is an export's formatting."""
    text = content.lstrip()
    opens = text.startswith(THINK_OPEN)
    inner, sep, rest = (text[len(THINK_OPEN) :] if opens else content).partition(THINK_CLOSE)
    if not sep:
        raise RowRejected(f"turn {n} opens {THINK_OPEN} in its content and never closes it")
    return inner, rest


def _tool_call(n: int, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise RowRejected(f"turn {n} has a tool call that is {type(call).__name__}, expected an object")
    fn = call.get("function", call)  # {"function": {"name", "arguments"}} or flat {"name", "arguments"}
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RowRejected(f"turn {n} has a tool call without a function name")
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, (dict, list)):  # the API sends arguments as a JSON string
        args = json.dumps(args, ensure_ascii=False)
    if not isinstance(args, str):
        raise RowRejected(f"turn {n} tool call arguments are {type(args).__name__}, expected JSON")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise RowRejected(f"turn {n} tool call id is {type(call_id).__name__}, expected a string")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if call_id:
        out["id"] = call_id
    return out


def _sharegpt_call(n: int, value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise RowRejected(f"turn {n} function_call is not JSON ({e.msg})") from None
    return _tool_call(n, value)


class _CallIds:
    """Tool-call ids of a conversation: missing ones become `functions.<name>:<k>`, k counting every
    call so far (the form Kimi-K2.5 generates); a tool result without an id answers the oldest open call."""

    def __init__(self) -> None:
        self.count = 0
        self.open: list[str] = []

    def assign(self, n: int, message: dict[str, Any]) -> None:
        if "tool_calls" not in message:
            return
        self.open = []
        for call in message["tool_calls"]:
            call.setdefault("id", f"functions.{call['function']['name']}:{self.count}")
            self.count += 1
            self.open.append(call["id"])

    def answer(self, n: int, call_id: str | None) -> str:
        if call_id is not None:
            if call_id in self.open:
                self.open.remove(call_id)
            return call_id
        if not self.open:
            raise RowRejected(f"turn {n} is a tool result without tool_call_id and no open tool call")
        return self.open.pop(0)


def template_kwargs_flag(text: str) -> dict[str, Any]:
    """A tool's --chat-template-kwargs (JSON) as the template takes it, or a UserError saying why not."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"--chat-template-kwargs: not JSON ({e})") from None
    if not isinstance(kwargs, dict):
        raise UserError("--chat-template-kwargs must be a JSON object, e.g. '{\"thinking\": true}'")
    return kwargs


def render_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The template's rendering of `messages`, tokenized as vLLM tokenizes a chat prompt (the special
    tokens are in the text, none added)."""
    extra: dict[str, Any] = dict(template_kwargs or {})
    if tools:
        extra["tools"] = tools
    text = tokenizer.apply_chat_template(
        template_messages(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class NotAppendOnly(RowRejected):
    """The template re-renders earlier turns, so one rendering cannot hold every turn's tokens."""


def tokenize_conversation(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    max_seq_len: int,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Template the conversation; mask = 1 on the tokens of every assistant turn (its end token too).

    Exact for append-only templates: turn i's serving prompt (turns before it plus the generation
    prompt) is then a prefix of the whole rendering. A leading assistant turn has no prompt (a template
    cannot render an empty conversation) and stays unsupervised context.
    """
    try:
        ids = render_ids(tokenizer, messages, False, tools, template_kwargs)
        if len(ids) > max_seq_len:
            raise RowRejected(f"{len(ids)} tokens > max_seq_len {max_seq_len}")
        mask = [0] * len(ids)
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or i == 0:
                continue
            before = render_ids(tokenizer, messages[:i], True, tools, template_kwargs)
            through = render_ids(tokenizer, messages[: i + 1], False, tools, template_kwargs)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise NotAppendOnly(
                    f"chat template is not prefix-stable at turn {i} (it re-renders earlier "
                    "turns), so assistant tokens cannot be located"
                )
            for t in range(len(before), len(through)):
                mask[t] = 1
    except RowRejected:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is about this row's content
        raise RowRejected(f"chat template failed: {type(e).__name__}: {e}") from None
    if not any(mask):
        raise RowRejected("the chat template left no assistant tokens")
    return ids, mask
