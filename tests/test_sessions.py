"""Long sessions joined from short rows (eagle3_pipeline.data.sessions): what they hold, and that stage 01
extracts them beside the rows and stage 03 keeps each on its rows' side of the split."""

from __future__ import annotations

import argparse
import json
from collections import Counter

from conftest import CONVERSATIONS, extract_args, read_jsonl, run_script, split_sides

from eagle3_pipeline.data import sessions
from eagle3_pipeline.data.samples import conversation_id, sample_id, variant_row_id
from eagle3_pipeline.data.split import is_val

SPLIT_SEED = 2  # on the 10 shipped conversations, val ratio 0.3: conv-002, -008, -009 held out


def members(n: int, tokens: int = 100) -> list[sessions.Member]:
    return [sessions.Member(f"row-{i}", [{"role": "system", "content": f"s{i}"},
                                         {"role": "user", "content": f"q{i}"},
                                         {"role": "assistant", "content": f"a{i}"}], tokens)
            for i in range(n)]  # fmt: skip


def args(**kw) -> argparse.Namespace:
    base = {"passes": 3, "min_tokens": 300, "max_tokens": 1000, "seed": 0, "split_seed": 0, "val_ratio": 0.3,
            "cost_sessions": sessions.COST_SESSIONS, "context_tokens": None}
    return argparse.Namespace(**{**base, **kw})


def test_every_row_joins_a_session_once_a_pass_within_the_length_drawn():
    rows = members(60)
    planned = sessions.plan_sessions(rows, 3, 300, 1000, 0)
    counts = Counter(i for s in planned for i in s)
    # a pass drops at most its last session, when that holds one row
    assert set(counts) <= set(range(60)) and max(counts.values()) == 3
    assert sum(counts.values()) >= 60 * 3 - 3
    assert all(len(s) == len(set(s)) >= 2 and sum(rows[i].tokens for i in s) <= 1000 for s in planned)
    lengths = {len(s) for s in planned}
    assert len(lengths) > 2, f"targets drawn in [300, 1000] give sessions of several sizes, not {lengths}"
    assert planned == sessions.plan_sessions(rows, 3, 300, 1000, 0)
    assert planned != sessions.plan_sessions(rows, 3, 300, 1000, 1)


def test_a_session_keeps_its_rows_side_of_the_split_and_one_system_message():
    rows = members(80)
    for i, m in enumerate(rows):  # rows of different lengths: a session's length is the sum of its rows'
        m.tokens = 50 + i
    built, lengths = sessions.build_sessions(rows, args())
    side_of = {m.row_id: is_val(m.row_id, 0, 0.3) for m in rows}
    tokens = {m.row_id: m.tokens for m in rows}
    assert lengths == [sum(tokens[m] for m in r["session_of"]) for r in built]
    assert {True, False} == {side_of[r["session_of"][0]] for r in built}
    for r in built:
        sides = {side_of[m] for m in r["session_of"]}
        assert len(sides) == 1
        # the ids stage 01 gives its samples (--variant sessions, a second sample) go where its rows go
        first_sample = sample_id(variant_row_id(r["id"], "sessions"), 1)
        assert conversation_id(first_sample) == r["session_of"][0]
        assert is_val(conversation_id(first_sample), 0, 0.3) == sides.pop()
        systems = [m["content"] for m in r["messages"] if m["role"] == "system"]
        assert systems == [f"s{r['session_of'][0].split('-')[1]}"] and r["messages"][0]["role"] == "system"
        assert [m["content"] for m in r["messages"] if m["role"] == "user"] == [
            f"q{m.split('-')[1]}" for m in r["session_of"]]
    assert len({r["id"] for r in built}) == len(built)


def test_a_thinking_session_costs_stage_01_a_sample_per_turn_an_append_only_one_one():
    """Kimi-K2.5's thinking mode erases earlier reasoning, so stage 01 makes every turn of a session a
    sample of its whole context (the cost grows with the turns); instant mode's rendering is append-only:
    one sample, the session itself. The count is stage 01's own (samples.row_samples)."""
    from kimi_fixture import build_kimi_tokenizer

    from eagle3_pipeline.data.samples import SampleOptions, row_samples

    tok = build_kimi_tokenizer()
    rows = [sessions.Member(f"r{i}", [{"role": "user", "content": f"Question {i}?"},
                                      {"role": "assistant", "content": f"Answer {i}.",
                                       "reasoning_content": f"Thinking about {i} at some length."}], 0)
            for i in range(3)]  # fmt: skip
    session = sessions.joined(rows, [0, 1, 2], 0)
    thinking = SampleOptions(1 << 20)
    instant = SampleOptions(1 << 20, chat_template_kwargs={"thinking": False})
    per_turn = [len(smp.input_ids) for smp in row_samples(session, 0, tok, thinking)]
    assert len(per_turn) == 3 and per_turn == sorted(per_turn)
    assert sessions.extracted_tokens(session, tok, thinking, None) == (sum(per_turn), per_turn[-1])
    (whole,) = row_samples(session, 0, tok, instant)
    assert sessions.extracted_tokens(session, tok, instant, None) == (len(whole.input_ids),) * 2
    assert sum(per_turn) > 2 * len(whole.input_ids)
    # with stage 01's context_tokens a turn stores that many context tokens and its own: linear in the turns
    turns = [sum(smp.loss_mask) for smp in row_samples(session, 0, tok, thinking)]
    stored = [t + 1 + 4 for t in turns]  # the slot before the first supervised token, and 4 before it
    assert sessions.extracted_tokens(session, tok, thinking, 4) == (sum(stored), per_turn[-1])
    assert sum(stored) < sum(per_turn)
    first = whole.loss_mask.index(1)  # append-only: one sample, stored from 4 before its first answer's slot
    assert sessions.extracted_tokens(session, tok, instant, 4)[0] == len(whole.input_ids) - (first - 1 - 4)


def test_stage_01s_disk_estimate_counts_what_it_stores_of_a_thinking_session(tmp_path):
    """The free-space check and --plan sample rows (samples.sample_lengths) with stage 01's options: a
    thinking-mode session counts every turn's sample, from context_tokens before its answer; tokenized once
    (no options) it would count the session a single time, far below what stage 01 writes."""
    from kimi_fixture import build_kimi_tokenizer

    from eagle3_pipeline.data.samples import SampleOptions, sample_lengths

    tok = build_kimi_tokenizer()
    rows = [sessions.Member(f"r{i}", [{"role": "user", "content": f"Question {i}?"},
                                      {"role": "assistant", "content": f"Answer {i}.",
                                       "reasoning_content": f"Thinking about {i} at some length."}], 0)
            for i in range(4)]  # fmt: skip
    session = sessions.joined(rows, [0, 1, 2, 3], 0)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(session) + "\n")
    thinking = SampleOptions(1 << 20)
    whole, read = sample_lengths(tok, path, "train", 0, 1, 1 << 20, 8, thinking)
    assert read == 1 and whole == [sessions.extracted_tokens(session, tok, thinking, None)[0]]
    cut, _ = sample_lengths(tok, path, "train", 0, 1, 1 << 20, 8, thinking, 4)
    assert cut == [sessions.extracted_tokens(session, tok, thinking, 4)[0]] and cut[0] < whole[0]
    once, _ = sample_lengths(tok, path, "train", 0, 1, 1 << 20, 8)
    assert whole[0] > 2 * once[0]


def test_the_cost_is_counted_on_every_session_up_to_cost_sessions_then_on_a_seeded_sample_scaled():
    """Counting renders each session as stage 01 does (quadratic in the turns under a thinking template):
    beyond --cost-sessions a seeded sample is counted and scaled to all, and the meta says how many."""
    from kimi_fixture import build_kimi_tokenizer

    tok = build_kimi_tokenizer()

    def session(i: int, words: int) -> dict:
        return {"id": f"r{i}#s:{i}", "messages": [{"role": "user", "content": "Question?"},
                                                 {"role": "assistant", "content": " ".join(["word"] * words),
                                                  "reasoning_content": "Thinking."}]}

    same = [session(i, 30) for i in range(12)]
    varied = [session(i, 5 + 7 * i) for i in range(12)]
    per = [sessions.extracted_tokens(r, tok, sessions.SampleOptions(1 << 20), None)[0] for r in varied]
    exact = sessions.extraction_cost(varied, [], tok, args(cost_sessions=12), {})
    assert exact["counted_sessions"] == 12 and exact["sessions"] == sum(per)
    sampled = sessions.extraction_cost(varied, [], tok, args(cost_sessions=4), {})
    assert sampled == sessions.extraction_cost(varied, [], tok, args(cost_sessions=4), {})  # seeded
    assert sampled["counted_sessions"] == 4 and sampled["sessions"] != exact["sessions"]
    assert min(per) * 12 < sampled["sessions"] < max(per) * 12 and sampled["sessions"] % 3 == 0  # 4 of 12, x3
    assert sampled != sessions.extraction_cost(varied, [], tok, args(cost_sessions=4, seed=1), {})
    assert (sessions.extraction_cost(same, [], tok, args(cost_sessions=4), {})["sessions"]
            == sessions.extraction_cost(same, [], tok, args(cost_sessions=12), {})["sessions"])  # fmt: skip


def test_the_stage_settings_are_the_flag_then_the_config_then_the_stages_default(tmp_path):
    from eagle3_pipeline.data.config import ExtractConfig, SplitConfig

    config = tmp_path / "run.toml"
    config.write_text("[split]\nval_ratio = 0.2\n[extract]\ncontext_tokens = 512\n")
    given = argparse.Namespace(config=config)
    assert sessions.config_setting(given, SplitConfig, "val_ratio", None) == 0.2
    assert sessions.config_setting(given, SplitConfig, "seed", None) == 0
    assert sessions.config_setting(given, ExtractConfig, "context_tokens", None) == 512
    assert sessions.config_setting(given, ExtractConfig, "context_tokens", 8) == 8
    given.config = None
    assert sessions.config_setting(given, SplitConfig, "val_ratio", 0.4) == 0.4
    assert sessions.config_setting(given, SplitConfig, "val_ratio", None) == 0.05  # SplitConfig's own default
    assert sessions.config_setting(given, ExtractConfig, "context_tokens", None) is None


def test_with_the_runs_config_the_rows_and_tokenizer_are_stage_01s(tiny_run, tmp_path, capsys):
    """`--config` alone names what stage 01 would read (scripts/run_kimi_k25.sh runs it so): stage 00's
    conversations under [run] dir and the verifier, each flag still winning; a config naming neither is a
    one-line error."""
    config = tiny_run / "tiny.toml"
    out = tmp_path / "s.jsonl"
    flags = ["--config", str(config), "--max-tokens", "1500", "--min-tokens", "300", "--passes", "2"]
    assert sessions.main([*flags, "--out", str(out)]) == 0
    meta = json.loads(out.with_name(out.name + sessions.META_SUFFIX).read_text())
    regenerated = tiny_run / "regenerated" / "conversations.jsonl"
    assert (meta["data_path"], meta["tokenizer"]) == (str(regenerated), str(tiny_run / "verifier"))
    def answers(rows):
        from eagle3_pipeline.data.conversations import normalize_row

        return {m["content"] for r in rows for m in normalize_row(r).messages if m["role"] == "assistant"}

    joined = answers(read_jsonl(out))  # the verifier's answers (stage 00's), not the given ones
    assert joined and joined <= answers(read_jsonl(regenerated))
    assert not joined & answers(read_jsonl(CONVERSATIONS))
    given = tmp_path / "given.jsonl"
    assert sessions.main([*flags, "--out", str(given), "--data-path", str(CONVERSATIONS)]) == 0
    assert json.loads(given.with_name(given.name + sessions.META_SUFFIX).read_text())["data_path"] == str(
        CONVERSATIONS
    )
    bare = tmp_path / "bare.toml"
    bare.write_text("[split]\nval_ratio = 0.2\n")
    capsys.readouterr()
    assert sessions.main(["--config", str(bare), "--max-tokens", "1500", "--out", str(tmp_path / "x.jsonl")
                          ]) == 2  # fmt: skip
    assert "--data-path is required (or --config with [extract] data_path" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_refused_before_anything_is_written(tiny_run, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    common = ["--data-path", str(CONVERSATIONS), "--tokenizer", str(tiny_run / "verifier"), "--out", str(out)]
    assert sessions.main([*common, "--max-tokens", "4096"]) == 2
    assert "has 2048 positions" in capsys.readouterr().err
    assert sessions.main([*common, "--max-tokens", "1000", "--min-tokens", "2000"]) == 2
    assert "--min-tokens 2000 must be in [2, --max-tokens 1000]" in capsys.readouterr().err
    assert sessions.main([*common, "--max-tokens", "1000", "--min-tokens", "300", "--passes", "0"]) == 2
    assert "--passes 0 and --cost-sessions 1000 must be >= 1" in capsys.readouterr().err
    assert sessions.main(["--data-path", str(CONVERSATIONS), "--tokenizer", str(tiny_run / "verifier"),
                          "--out", str(CONVERSATIONS), "--max-tokens", "1000", "--min-tokens", "300"]) == 2
    assert "write the sessions to a file of their own" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert sessions.main([*common[:-1], str(tmp_path / "a-file" / "s.jsonl"), "--max-tokens", "1000",
                          "--min-tokens", "300"]) == 2  # fmt: skip
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in capsys.readouterr().err
    (tmp_path / "a-file").unlink()
    assert sessions.main([*common[:-1], "/proc/eagle3-none/s.jsonl", "--max-tokens", "1000",
                          "--min-tokens", "300"]) == 2  # a folder the OS refuses, found once they are made
    assert "--out /proc/eagle3-none/s.jsonl: cannot write there (" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_sessions_extract_beside_the_rows_and_split_with_them(tiny_run, tmp_path):
    """The shipped conversations joined (2 passes, 300-1,500 tokens), extracted with --variant sessions into
    a copy of the tiny run's hidden_states at 1,500 tokens: every session whole (none truncated), longer
    than any row, and stage 03 at the sessions' split settings puts each session on its rows' side."""
    import shutil

    from eagle3_pipeline.data.shards import open_shards
    from eagle3_pipeline.data.split import load_split

    root, made, split = tmp_path / "hidden_states", tmp_path / "sessions.jsonl", tmp_path / "split"
    shutil.copytree(tiny_run / "hidden_states", root)
    config = tmp_path / "run.toml"  # stage 03's settings, as the run's config holds them
    config.write_text(f"[split]\nseed = {SPLIT_SEED}\nval_ratio = 0.3\n")
    run_script("-m", "eagle3_pipeline.data.sessions", "--data-path", str(CONVERSATIONS), "--tokenizer",
               str(tiny_run / "verifier"), "--out", str(made), "--passes", "2", "--min-tokens", "300",
               "--max-tokens", "1500", "--config", str(config))  # fmt: skip
    rows = read_jsonl(made)
    meta = json.loads(made.with_name(made.name + sessions.META_SUFFIX).read_text())
    assert meta["sessions"] == len(rows) >= 3 and meta["passes"] == 2
    assert (meta["split_seed"], meta["val_ratio"]) == (SPLIT_SEED, 0.3)
    run_script(*extract_args(tiny_run / "verifier", made, root), "--max-seq-len", "1500",
               "--variant", "sessions")  # fmt: skip
    shard = next(p for p in root.iterdir() if p.name.endswith("_sessions"))
    extracted = json.loads((shard / "meta.json").read_text())
    assert extracted["num_truncated"] == 0 and extracted["num_tokens"] == meta["extracted_tokens"]["sessions"]
    run_script("03_split_data.py", "--data-dir", str(root), "--out-dir", str(split), "--val-ratio", "0.3",
               "--seed", str(SPLIT_SEED))  # fmt: skip
    shard_set = open_shards([str(root)], verify=False)
    train, val = load_split(split, shard_set.samples)
    ours = [s for s in shard_set.samples if s.shard.endswith(shard.name)]
    theirs = [s for s in shard_set.samples if not s.shard.endswith(shard.name)]
    assert len(ours) == len(rows) and min(s.num_tokens for s in ours) > 0
    assert max(s.num_tokens for s in ours) > max(s.num_tokens for s in theirs)
    sides = split_sides(train, val)
    assert all(len(x) == 1 for x in sides.values())
    val_rows = {conversation_id(s.sample_id) for s in val}
    assert val_rows and {"conv-002", "conv-008", "conv-009"} >= val_rows
    for r in rows:  # every row of a session on the side the session is on
        assert len({next(iter(sides[m])) for m in r["session_of"]}) == 1
