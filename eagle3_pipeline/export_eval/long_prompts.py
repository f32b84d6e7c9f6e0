"""Held-out long prompts for stage 06: acceptance at the context lengths Kimi-K2.5 is served at.

Served contexts reach 20k-200k tokens (agent sessions, thinking mode's long outputs), while the
conversations a draft is trained and evaluated on are a few thousand at most. These prompts are made here,
deterministically, from text that ships with every Python (the standard library's own source files, read
from disk), so no training row holds them and no big file is committed. Three kinds, each cut to a target
length in the verifier's tokens (the rendered serving prompt, chat template included):

  document    a pasted source file (several, joined, when one is too short) and a question about it
  session     a multi-turn session: user turns paste a standard-library function and ask what it does,
              assistant turns answer with its docstring; the last user turn pastes more source to fill
  generation  a short prompt asking for a long text: the length is in the generation, so stage 06 must
              be run with --max-new-tokens at the row's "max_new_tokens" (one value for the whole run)

Each row is a `token_samples` row (the format stage 00 writes and stage 06 reads verbatim: its prompt is
`prompt_ids`), rendered with the chat_template_kwargs given here, which should be the training's. The
`completion_ids` are one end token, a placeholder: these rows are for evaluation, not training.

    python -m eagle3_pipeline.export_eval.long_prompts --tokenizer runs/kimi/verifier \\
        --lengths 2048 8192 32768 131072 --per-length 4 --out data/long_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data.conversations import render_ids, template_kwargs_flag

log = logging.getLogger("eagle3.long_prompts")

KINDS = ("document", "session", "generation")
# Prompts of one kind and length start at different standard-library files: file (i * stride) of the
# sorted list, a stride prime to any plausible number of files so the starts spread over the library.
FILE_STRIDE = 37
SESSION_FILL = 0.875  # a session's whole turns fill this much of the target; a pasted chunk the rest
SKIPPED_TURNS = 20  # functions too long for the room left that a session passes over before it stops
CUT_ROUNDS = 6  # rounds of cutting a text to a rendered length (each moves by the error of the last)
QUESTIONS = (
    "What does the code above do? Go through it function by function.",
    "Find the parts of the code above that could raise an exception, and explain when they do.",
    "Summarise the design of the code above, then suggest three improvements.",
    "Write unit tests for the main functions of the code above.",
)

Render = Callable[[str], list[int]]  # the serving prompt with a given text pasted in
Built = tuple[list[int], list[str]]  # (prompt ids, the standard-library files it holds)


def stdlib_files() -> list[Path]:
    """The standard library's top-level modules, sorted: the same list in any run of one Python."""
    files = sorted(Path(os.__file__).parent.glob("*.py"))
    if not files:
        raise UserError(f"no standard-library sources beside {os.__file__} to build prompts from")
    return files


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def cut_to_length(tokenizer: Any, render: Render, text: str, target: int) -> list[int]:
    """`render(prefix)` for the longest prefix of `text` (in its tokens) whose rendering is at most
    `target` tokens, or as near below as a few rounds find (decoding a cut and re-tokenizing may merge
    tokens at the cut). A rendering longer than `target` even with nothing pasted is a UserError."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    empty = len(render(""))
    if empty > target:
        raise UserError(f"--lengths {target}: the prompt without its pasted text is already {empty} tokens")
    m = min(len(ids), target - empty)
    best: list[int] = render("")
    for _ in range(CUT_ROUNDS):
        rendered = render(tokenizer.decode(ids[:m]))
        if len(rendered) <= target and len(rendered) > len(best):
            best = rendered
        step = target - len(rendered)
        if step == 0 or (step > 0 and m == len(ids)):
            break
        m = max(0, min(len(ids), m + step))
    return best


def joined_sources(tokenizer: Any, start: int, tokens: int) -> tuple[str, list[str]]:
    """Standard-library files from file `start` on (wrapping), joined until they hold `tokens` tokens:
    (text, file names)."""
    files = stdlib_files()
    parts, names, have = [], [], 0
    for j in range(len(files)):
        f = files[(start + j) % len(files)]
        src = read_source(f)
        parts.append(f"# file: {f.name}\n{src}")
        names.append(f.name)
        have += len(tokenizer(src, add_special_tokens=False)["input_ids"])
        if have >= tokens:
            break
    return "\n\n".join(parts), names


def user_render(tokenizer: Any, kwargs: dict[str, Any], history: list[dict[str, str]],
                make: Callable[[str], str]) -> Render:  # fmt: skip
    """The serving prompt of `history` + one user turn `make(text)`."""
    return lambda text: render_ids(
        tokenizer, history + [{"role": "user", "content": make(text)}], True, None, kwargs
    )


def document_prompt(tokenizer: Any, kwargs: dict[str, Any], target: int, i: int) -> Built:
    """A pasted source (files from i * FILE_STRIDE on) and a question, `target` tokens long."""
    text, names = joined_sources(tokenizer, i * FILE_STRIDE, target)
    question = QUESTIONS[i % len(QUESTIONS)]
    make = lambda code: f"Here is Python source code:\n\n```python\n{code}\n```\n\n{question}"  # noqa: E731
    return cut_to_length(tokenizer, user_render(tokenizer, kwargs, [], make), text, target), names


def documented_functions(path: Path) -> list[tuple[str, str]]:
    """(code without its docstring, docstring) of each documented function in a source file, in order."""
    src = read_source(path)
    try:
        tree = ast.parse(src)
    except SyntaxError:  # a test file of the library that is not meant to parse
        return []
    lines = src.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = ast.get_docstring(node)
        if not doc or node.end_lineno is None or node.body[0].end_lineno is None:
            continue
        first, last = node.body[0].lineno, node.body[0].end_lineno  # the docstring's lines
        code = lines[node.lineno - 1 : first - 1] + lines[last : node.end_lineno]
        out.append((textwrap.dedent("\n".join(code)), doc))
    return out


def function_turns(start: int) -> Iterator[tuple[str, list[dict[str, str]]]]:
    """(file name, [user turn, assistant turn]) per documented function, files from `start` on (wrapping)."""
    files = stdlib_files()
    for j in range(len(files)):
        f = files[(start + j) % len(files)]
        for code, doc in documented_functions(f):
            yield f.name, [
                {"role": "user",
                 "content": f"What does this function from `{f.stem}` do?\n\n```python\n{code}\n```"},
                {"role": "assistant", "content": doc},
            ]


def session_prompt(tokenizer: Any, kwargs: dict[str, Any], target: int, i: int) -> Built:
    """User/assistant turns (a function, its docstring) from files i * FILE_STRIDE on, filling
    SESSION_FILL of `target`; a last user turn pastes source to fill the rest. A turn's cost is its
    rendering alone (rendering the whole history per turn would be quadratic in the length)."""
    make = lambda code: f"And this part?\n\n```python\n{code}\n```\n\nWhat does it do?"  # noqa: E731
    history: list[dict[str, str]] = []
    names: list[str] = []
    used, misses = len(user_render(tokenizer, kwargs, [], make)("")), 0
    for name, turn in function_turns(i * FILE_STRIDE):
        cost = len(render_ids(tokenizer, turn, False, None, kwargs))
        if used + cost > target * SESSION_FILL:  # a long function: a shorter one further on may fit
            misses += 1
            if misses > SKIPPED_TURNS:
                break
            continue
        used += cost
        history += turn
        names += [name] if name not in names else []
    while history and len(user_render(tokenizer, kwargs, history, make)("")) > target * SESSION_FILL:
        history = history[:-2]  # a template that adds more per turn than alone: whole turns off the end
    text, more = joined_sources(tokenizer, i * FILE_STRIDE + len(names) + 1, target)
    ids = cut_to_length(tokenizer, user_render(tokenizer, kwargs, history, make), text, target)
    return ids, names + [m for m in more if m not in names]


def generation_prompt(tokenizer: Any, kwargs: dict[str, Any], target: int, i: int) -> Built:
    """A short prompt asking for about `target` tokens of text about one standard-library module."""
    files = stdlib_files()
    f = files[(i * FILE_STRIDE) % len(files)]
    ask = (
        f"Write a long, detailed tutorial on Python's `{f.stem}` module: what it is for, every public "
        f"function and class with a worked example, pitfalls, and a complete example program using it. "
        f"Be thorough: about {target * 3 // 4} words."
    )
    return user_render(tokenizer, kwargs, [], lambda t: t)(ask), [f.name]


BUILDERS = {"document": document_prompt, "session": session_prompt, "generation": generation_prompt}


def build_rows(
    tokenizer: Any,
    lengths: list[int],
    per_length: int,
    kinds: tuple[str, ...] = KINDS,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The prompts as stage-06 rows, per kind, length and index: deterministic for one tokenizer, Python
    and set of arguments."""
    kwargs = chat_template_kwargs or {}
    end = tokenizer.eos_token_id
    rows = []
    for kind in kinds:
        for target in lengths:
            for i in range(per_length):
                ids, names = BUILDERS[kind](tokenizer, kwargs, target, i)
                row: dict[str, Any] = {
                    "id": f"long-{kind}-{target}-{i}",
                    "kind": kind,
                    "target_tokens": target,
                    "prompt_tokens": len(ids),
                    "sources": names,
                }
                if kind == "generation":
                    row["max_new_tokens"] = target
                placeholder = [ids[-1] if end is None else end]
                row["token_samples"] = [{"prompt_ids": ids, "completion_ids": placeholder}]
                rows.append(row)
    return rows


def max_positions(tokenizer_dir: Path) -> int | None:
    """The model's max_position_embeddings where the tokenizer folder is a model's (its config.json)."""
    cfg_path = tokenizer_dir / "config.json"
    if not cfg_path.is_file():
        return None
    cfg = json.loads(cfg_path.read_text())
    value = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get(
        "max_position_embeddings"
    )
    return int(value) if value else None


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Every check before anything is built or written; the parsed chat_template_kwargs."""
    if not (Path(args.tokenizer) / "tokenizer_config.json").is_file():
        raise UserError(
            f"--tokenizer {args.tokenizer}: no tokenizer_config.json (give the verifier's folder)"
        )
    if any(n < 64 for n in args.lengths) or args.per_length < 1:
        raise UserError("--lengths must be >= 64 tokens and --per-length >= 1")
    limit = max_positions(Path(args.tokenizer))
    if limit is not None and max(args.lengths) >= limit:
        raise UserError(
            f"--lengths {max(args.lengths)}: the model in {args.tokenizer} has {limit} positions; give "
            f"lengths below it, with room for stage 06's --max-new-tokens"
        )
    return template_kwargs_flag(args.chat_template_kwargs)


def main(argv: list[str] | None = None) -> int:
    from eagle3_pipeline.core.cli import setup_logging

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer", required=True, help="the verifier's folder: tokenizer, template")
    parser.add_argument("--lengths", type=int, nargs="+", required=True, help="target prompt lengths, tokens")
    parser.add_argument("--per-length", type=int, default=4, help="prompts per kind and length")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--chat-template-kwargs", default="{}", help="JSON, as the training shards used")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="prompts .jsonl: stage 06's --data-path")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        kwargs = check_args(args)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
        rows = build_rows(tok, args.lengths, args.per_length, tuple(args.kinds), kwargs)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        storage.write_bytes_atomic(args.out, "".join(json.dumps(r) + "\n" for r in rows).encode())
    except UserError as e:
        log.error("error: %s", e)
        return 2
    for r in rows:
        log.info("%s: %d prompt tokens (%s)", r["id"], r["prompt_tokens"], ", ".join(r["sources"][:3]))
    log.info("wrote %d prompts to %s", len(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
