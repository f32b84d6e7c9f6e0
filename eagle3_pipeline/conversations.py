"""Conversation rows in, (input_ids, loss_mask) out; a bad row becomes a reason, never a traceback.

Accepted rows: OpenAI `{"messages": [{"role", "content"}]}` and ShareGPT
`{"conversations": [{"from", "value"}]}` (role/content inside `conversations` works too), optional `id`.
Sources: .jsonl (one row per line), .json (a list of rows), or a folder saved by `datasets`.
The loss mask marks assistant tokens only, every assistant turn of a multi-turn conversation, found by
rendering the chat template up to each turn, so it works for any template (no `{% generation %}` needed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.errors import UserError

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
}


class RowRejected(Exception):
    """This row cannot become a sample; the message is the reason written to rejects.jsonl."""


@dataclass
class RawRow:
    index: int  # 0-based position in the source (line number - 1 for .jsonl)
    value: Any = None  # parsed JSON value, or None when `error` is set
    error: str | None = None


@dataclass
class Sample:
    row_index: int
    sample_id: str
    input_ids: list[int]
    loss_mask: list[int]


def count_rows(path: Path, split: str = "train") -> int:
    if path.is_dir():
        return len(_load_dataset(path, split))
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    return len(_load_json_list(path))


def read_rows(path: Path, start: int, end: int, split: str = "train") -> Iterator[RawRow]:
    """Rows [start, end) of a source; unreadable rows come back with `error` set."""
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
        rows = json.loads(path.read_bytes().decode("utf-8"))
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


def normalize_messages(row: Any) -> tuple[str | None, list[dict[str, str]]]:
    """(id, [{"role", "content"}]) of a row, or RowRejected with the reason."""
    if not isinstance(row, dict):
        raise RowRejected(f"row is {type(row).__name__}, expected an object")
    row_id = row.get("id")
    if row_id is not None and not isinstance(row_id, (str, int)):
        raise RowRejected(f"id has type {type(row_id).__name__}, expected string or integer")
    turns = row.get("messages", row.get("conversations"))
    if turns is None:
        raise RowRejected("no `messages` or `conversations` field")
    if not isinstance(turns, list):
        raise RowRejected(f"turns are {type(turns).__name__}, expected a list")
    if not turns:
        raise RowRejected("no turns")
    messages = []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowRejected(f"turn {n} is {type(turn).__name__}, expected an object")
        role = turn.get("role", turn.get("from"))
        content = turn.get("content", turn.get("value"))
        if not isinstance(role, str):
            raise RowRejected(f"turn {n} has no role")
        if role.lower() not in ROLE_ALIASES:
            raise RowRejected(f"turn {n} has unknown role {role!r} (known: {sorted(ROLE_ALIASES)})")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise RowRejected(f"turn {n} has non-text content parts")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RowRejected(f"turn {n} content is {type(content).__name__}, expected a string")
        if not content.strip():
            raise RowRejected(f"turn {n} ({role}) is empty")
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowRejected("no assistant turn")
    return (None if row_id is None else str(row_id)), messages


def _render_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_conversation(
    tokenizer: Any, messages: list[dict[str, str]], max_seq_len: int
) -> tuple[list[int], list[int]]:
    """Template the conversation; mask = 1 on the tokens of every assistant turn (its end token too)."""
    try:
        ids = _render_ids(tokenizer, messages, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001 - a template error is about this row's content
        raise RowRejected(f"chat template failed: {type(e).__name__}: {e}") from None
    if len(ids) > max_seq_len:
        raise RowRejected(f"{len(ids)} tokens > max_seq_len {max_seq_len}")
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_ids(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render_ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise RowRejected(
                f"chat template is not prefix-stable at turn {i} (it re-renders earlier "
                "turns), so assistant tokens cannot be located"
            )
        for t in range(len(before), len(through)):
            mask[t] = 1
    if not any(mask):
        raise RowRejected("the chat template left no assistant tokens")
    return ids, mask
