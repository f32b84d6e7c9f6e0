"""Long sessions from short rows: the same conversations joined, so the draft trains at long positions.

Kimi-K2.5 is served to 262,144 positions, and most of what its users pay for is generated far past the few
thousand tokens a chat row holds. A draft trained only on short rows never sees the verifier's states at
long positions, nor its own rotation there. This tool joins the rows of a conversations file (stage 00's
conversations.jsonl, or the given rows) into multi-turn sessions: each of --passes passes takes the rows in
a seeded order and fills one session after another up to a length drawn log-uniformly in [--min-tokens,
--max-tokens]. Stage 01 extracts them beside the rows (`--variant sessions`, `--max-seq-len` at least
--max-tokens), so every answer trains once alone and --passes times deep in a session, its targets the
verifier's at that depth; stage 04 trains a long sample in windows at its true positions (length_mix.py),
so a step costs what it did, and stage 01 extracts 1 + --passes times the rows' tokens.

A session never mixes the two sides of stage 03's split: rows join only rows of their own side (split.is_val
with stage 03's seed and val_ratio: --config's [split], or --split-seed and --val-ratio), and a session's id
is its first row's id marked `#s:<n>`, which samples.conversation_id maps back to that row, so stage 03 puts
the session on its rows' side. A session keeps its first row's system message (templates take one, first);
rows with tools or images stay out (a session has one tool list), as do rows stage 01 would reject; the log
counts each. A session is rendered from its messages, as given rows are (stage 00's verbatim token ids are
per row). Measured: docs/results.md "Long sessions from the same rows".

With --config, the rows and the tokenizer are what stage 01 takes from it (stage 00's conversations, the
verifier), as are its template kwargs and trust_remote_code; scripts/run_kimi_k25.sh runs both commands
(SESSION_TOKENS):

    python -m eagle3_pipeline.data.sessions --config configs/kimi_k25.toml --max-tokens 131072 \
        --out runs/kimi_k25/sessions.jsonl
    python 01_extract_hidden_states.py --config configs/kimi_k25.toml \
        --data-path runs/kimi_k25/sessions.jsonl --variant sessions --max-seq-len 131072
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.cli import progress, setup_logging
from eagle3_pipeline.core.config import load_config_file
from eagle3_pipeline.core.errors import UserError, unwritable
from eagle3_pipeline.data.config import ExtractConfig, SplitConfig
from eagle3_pipeline.data.conversations import (
    RowRejected,
    count_rows,
    normalize_row,
    read_rows,
    render_ids,
    template_kwargs_flag,
)
from eagle3_pipeline.data.samples import (
    SESSION_MARK,
    SampleOptions,
    conversation_id,
    extracted_tokens,
)
from eagle3_pipeline.data.split import is_val
from eagle3_pipeline.models.verifier import read_text_config

log = logging.getLogger("eagle3.sessions")

META_SUFFIX = ".meta.json"  # beside --out: how the sessions were made
PASSES = 4  # times each row joins a session (measured: docs/results.md "Long sessions from the same rows")
COST_SESSIONS = 1000  # sessions rendered as stage 01 renders them to count its cost (beyond: a sample)


@dataclasses.dataclass
class Member:
    row_id: str
    messages: list[dict[str, Any]]
    tokens: int  # the row rendered alone: its length in a session
    extracted: int = 0  # the tokens of its stage-01 samples


def config_setting(a: argparse.Namespace, section: type, name: str, flag: Any) -> Any:
    """A stage's setting as that stage will take it: the flag, else --config's table of `section` (a
    Settings class, which owns the default) as the stage reads it (its [serving] mode's and the layout's
    values under it), else its default."""
    if flag is not None:
        return flag
    table = load_config_file(str(a.config), section.SECTION) if a.config else {}
    if name in table:
        return table[name]
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def stage01_inputs(a: argparse.Namespace) -> dict[str, Any]:
    """--data-path, --tokenizer and --trust-remote-code as stage 01 takes them (from --config when not
    given: stage 00's output, the verifier); the chat_template_kwargs it renders with."""
    for attr, name in (("data_path", "data_path"), ("tokenizer", "verifier_path")):
        value = config_setting(a, ExtractConfig, name, getattr(a, attr))
        if value is None:
            flag = "--" + attr.replace("_", "-")
            raise UserError(f"{flag} is required (or --config with [extract] {name}, or a [regenerate] section: "
                            "stage 00's)")
        setattr(a, attr, Path(value))
    a.trust_remote_code = a.trust_remote_code or config_setting(a, ExtractConfig, "trust_remote_code", None)
    if a.chat_template_kwargs is not None:
        return template_kwargs_flag(a.chat_template_kwargs)
    return config_setting(a, ExtractConfig, "chat_template_kwargs", None)


def read_members(path: Path, tokenizer: Any, opts: SampleOptions, context_tokens: int | None
                 ) -> tuple[list[Member], dict[str, Any]]:  # fmt: skip
    """The rows that can join a session (stage 01 takes them within opts.max_seq_len), each with its
    rendered length; and what was left out: counts per reason, and the first rejected row with its reason."""
    members: list[Member] = []
    left: dict[str, Any] = {"rejected": 0, "tools or images": 0}
    for raw in progress(read_rows(path, 0, count_rows(path)), desc="rows", unit="row"):
        try:
            if raw.error:
                raise RowRejected(raw.error)
            conv = normalize_row(raw.value)
            extracted = extracted_tokens(raw.value, tokenizer, opts, context_tokens)[0]
        except RowRejected as e:
            left["rejected"] += 1
            left.setdefault("first_rejected", f"row {raw.index}: {e}")
            continue
        if conv.tools or conv.images:
            left["tools or images"] += 1
            continue
        row_id = conv.row_id if conv.row_id is not None else f"row-{raw.index}"
        tokens = len(render_ids(tokenizer, conv.messages, False, None, opts.chat_template_kwargs))
        members.append(Member(row_id, conv.messages, tokens, extracted))
    return members, left


def plan_sessions(members: list[Member], passes: int, min_tokens: int, max_tokens: int, seed: int
                  ) -> list[list[int]]:  # fmt: skip
    """Sessions as lists of member indices: per pass a seeded order, each session filled up to a length
    drawn log-uniformly in [min_tokens, max_tokens]; a session of one row is no session and is dropped."""
    rng = random.Random(seed)

    def target() -> float:
        return math.exp(rng.uniform(math.log(min_tokens), math.log(max_tokens)))

    sessions = []
    for _ in range(passes):
        order = list(range(len(members)))
        rng.shuffle(order)
        current, tokens, goal = [], 0, target()
        for i in order:
            if current and tokens + members[i].tokens > goal:
                sessions.append(current)
                current, tokens, goal = [], 0, target()
            current.append(i)
            tokens += members[i].tokens
        sessions.append(current)
    return [s for s in sessions if len(s) > 1]


def joined(members: list[Member], session: list[int], n: int) -> dict[str, Any]:
    """One session row: its first row's id marked, the turns in order, one system message (the first's)."""
    first = members[session[0]]
    messages = list(first.messages)
    for i in session[1:]:
        messages += [m for m in members[i].messages if m["role"] != "system"]
    return {"id": f"{first.row_id}{SESSION_MARK}{n}", "messages": messages,
            "session_of": [members[i].row_id for i in session]}  # fmt: skip


def build_sessions(members: list[Member], a: argparse.Namespace) -> tuple[list[dict[str, Any]], list[int]]:
    """Sessions of each split side's rows apart, numbered in one sequence; and each one's length (the sum of
    its rows' lengths, for the meta)."""
    sides = {False: [], True: []}
    for m in members:
        sides[is_val(conversation_id(m.row_id), a.split_seed, a.val_ratio)].append(m)
    rows, lengths = [], []
    for val, side in sides.items():
        for session in plan_sessions(side, a.passes, a.min_tokens, a.max_tokens, a.seed + int(val)):
            rows.append(joined(side, session, len(rows)))
            lengths.append(sum(side[i].tokens for i in session))
    return rows, lengths


def check_args(a: argparse.Namespace) -> dict[str, Any]:
    """Every check before anything is read or written; the parsed chat_template_kwargs."""
    kwargs = stage01_inputs(a)
    if not (a.tokenizer / "tokenizer_config.json").is_file():
        raise UserError(f"--tokenizer {a.tokenizer}: no tokenizer_config.json (give the verifier's folder)")
    if not a.data_path.exists():
        raise UserError(f"--data-path {a.data_path}: not found")
    if a.passes < 1 or a.cost_sessions < 1:
        raise UserError(f"--passes {a.passes} and --cost-sessions {a.cost_sessions} must be >= 1")
    if not 2 <= a.min_tokens <= a.max_tokens:
        raise UserError(f"--min-tokens {a.min_tokens} must be in [2, --max-tokens {a.max_tokens}] (the shortest "
                        "session's target; its default is 2,048)")
    a.split_seed = config_setting(a, SplitConfig, "seed", a.split_seed)
    a.val_ratio = config_setting(a, SplitConfig, "val_ratio", a.val_ratio)
    a.context_tokens = config_setting(a, ExtractConfig, "context_tokens", a.context_tokens)
    if a.context_tokens is not None and a.context_tokens < 0:
        raise UserError(f"--context-tokens {a.context_tokens} must be >= 0, as stage 01's")
    if not 0 <= a.val_ratio < 1:
        raise UserError(f"--val-ratio {a.val_ratio} must be in [0, 1), as stage 03's")
    limit = read_text_config(a.tokenizer).get("max_position_embeddings")
    if limit is not None and a.max_tokens > limit:
        raise UserError(f"--max-tokens {a.max_tokens}: the model in {a.tokenizer} has {limit} positions")
    if a.out.resolve() == a.data_path.resolve():
        raise UserError(f"--out {a.out} is --data-path: write the sessions to a file of their own")
    existing = next(p for p in (a.out.parent, *a.out.parent.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"--out {a.out}: {existing} is a file, not a folder")
    return kwargs


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-path", type=Path,
                   help="conversations .jsonl / .json / dataset (default: --config's stage 01 input)")
    p.add_argument("--tokenizer", type=Path,
                   help="the verifier's folder: tokenizer, template (default: --config's verifier)")
    p.add_argument("--out", type=Path, required=True, help="sessions .jsonl: stage 01's --data-path")
    p.add_argument("--passes", type=int, default=PASSES, help="times each row joins a session")
    p.add_argument("--min-tokens", type=int, default=2048, help="shortest session target, tokens")
    p.add_argument("--max-tokens", type=int, required=True,
                   help="longest session target, tokens: stage 01's --max-seq-len for the sessions")
    p.add_argument("--seed", type=int, default=0, help="the rows' order and the sessions' lengths")
    p.add_argument("--config", type=Path,
                   help="the run's config: --split-seed and --val-ratio from [split]; --data-path, --tokenizer, "
                        "--context-tokens, --chat-template-kwargs, --trust-remote-code as stage 01 takes them")
    p.add_argument("--split-seed", type=int, help="stage 03's --seed (default: --config's, else stage 03's)")
    p.add_argument("--val-ratio", type=float, help="stage 03's --val-ratio (default: as --split-seed)")
    p.add_argument("--chat-template-kwargs",
                   help="JSON, as stage 01 renders the rows (default: --config's, else {})")
    p.add_argument("--context-tokens", type=int,
                   help="stage 01's --context-tokens, for the printed cost (default: --config's, else all)")
    p.add_argument("--cost-sessions", type=int, default=COST_SESSIONS,
                   help="sessions whose stage-01 samples are counted for the printed cost: all when fewer, "
                        "else a seeded sample of this many, scaled to all")
    p.add_argument("--trust-remote-code", action="store_true", help="(default: --config's [extract])")
    return p


def extraction_cost(rows: list[dict[str, Any]], members: list[Member], tokenizer: Any, a: argparse.Namespace,
                    kwargs: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """What stage 01 extracts for the sessions, against the rows alone; the longest sample, and how many
    sessions hold a sample longer than --max-tokens (rendered joined, a session can exceed the sum).
    Counted on every session up to --cost-sessions, beyond on a seeded sample of that many, scaled (in a
    template that erases reasoning, counting renders every turn's whole context: quadratic in the turns)."""
    opts = SampleOptions(max_seq_len=1 << 40, chat_template_kwargs=kwargs)
    counted = rows
    if len(rows) > a.cost_sessions:
        counted = [rows[i] for i in sorted(random.Random(a.seed).sample(range(len(rows)), a.cost_sessions))]
    per = [extracted_tokens(r, tokenizer, opts, a.context_tokens)
           for r in progress(counted, desc="sessions", unit="session")]  # fmt: skip
    scale = len(rows) / len(counted)
    return {"sessions": round(sum(t for t, _ in per) * scale), "rows": sum(m.extracted for m in members),
            "longest_sample": max(n for _, n in per),
            "over_max_tokens": round(sum(n > a.max_tokens for _, n in per) * scale),
            "counted_sessions": len(counted)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    setup_logging()
    try:
        kwargs = check_args(a)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(a.tokenizer), trust_remote_code=a.trust_remote_code)
        opts = SampleOptions(max_seq_len=a.max_tokens, chat_template_kwargs=kwargs)
        members, left = read_members(a.data_path, tok, opts, a.context_tokens)
        rows, lengths = build_sessions(members, a)
        if not rows:
            raise UserError(f"--data-path {a.data_path}: no session of two rows or more could be made "
                            f"({len(members)} rows usable; left out: {left}; lower --min-tokens or give more "
                            "rows)")
        lengths.sort()
        cost = extraction_cost(rows, members, tok, a, kwargs)
        try:
            a.out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise unwritable(f"--out {a.out}", e) from None
        storage.write_bytes_atomic(a.out, "".join(json.dumps(r) + "\n" for r in rows).encode())
        settings = {k: v for k, v in vars(a).items() if k not in ("out", "chat_template_kwargs")}
        meta = {**{k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
                "chat_template_kwargs": kwargs, "rows": len(members), "left_out": left, "sessions": len(rows),
                "session_tokens": lengths, "extracted_tokens": cost,
                "versions": storage.versions()}  # fmt: skip
        storage.write_json_atomic(a.out.with_name(a.out.name + META_SUFFIX), meta)
    except UserError as e:
        log.error("error: %s", e)
        return 2
    if left["rejected"] or left["tools or images"]:
        log.warning("left out of sessions: %d rows stage 01 rejects at --max-tokens (first: %s), %d with "
                    "tools or images", left["rejected"], left.get("first_rejected"), left["tools or images"])
    if cost["over_max_tokens"]:
        log.warning("%d sessions hold a sample over --max-tokens %d (longest %d): extract them with "
                    "--truncate or --max-seq-len %d", cost["over_max_tokens"], a.max_tokens,
                    cost["longest_sample"], cost["longest_sample"])  # fmt: skip
    counted = "" if cost["counted_sessions"] == len(rows) else f" (scaled from {cost['counted_sessions']})"
    log.info("done %s | rows %d | sessions %d | tokens p50 %d max %d | stage 01 extracts %d tokens for them%s, "
             "%.1fx the rows' %d", a.out, len(members), len(rows), lengths[len(lengths) // 2], lengths[-1],
             cost["sessions"], counted, cost["sessions"] / max(cost["rows"], 1), cost["rows"])  # fmt: skip
    log.info("next: python 01_extract_hidden_states.py --data-path %s --variant sessions --max-seq-len %d",
             a.out, max(a.max_tokens, cost["longest_sample"]))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
