"""Mistakes a user made, each once a traceback or a silent result, now one `error:` line (exit 2) naming the
file or flag and the fix: a shard without its manifest, a part whose safetensors header lost a bit, a folder
that is not a vocab mapping, --max-seq-len 1 and --ttt-steps 50 at stage 04; an empty shard never published
(an overwritten good one kept); a resume with another max_batch_tokens refused; stage 00 rejecting duplicate
ids and assistant-first rows with their true reasons before the verifier runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

from conftest import CONVERSATIONS, extract_args, read_jsonl, run_killed_after, run_script, script, shard_of


def _flip_header_bit(part: Path) -> None:
    """One bit of a tensor's dtype string in the safetensors header ('F32' -> 'F22' ... unparsable)."""
    raw = bytearray(part.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = raw.index(b'"dtype"', 8, 8 + n) + len(b'"dtype":"') + 1
    raw[at] ^= 0x01
    part.write_bytes(bytes(raw))


def _tree_sha(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def _error(proc, *wanted: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for w in wanted:
        assert w in proc.stderr, (w, proc.stderr[-2000:])


def _train(shard: Path, vocab: Path, out: Path, *extra: str) -> list[str]:
    return [script("04_train.py"), "--data-dir", str(shard), "--vocab-mapping-dir", str(vocab),
            "--out-dir", str(out), *extra]  # fmt: skip


def test_broken_shards_and_wrong_folders_are_one_line_errors(tiny_shards, tmp_path):
    shard, vocab = tiny_shards["float32"], tiny_shards["vocab_float32"]
    no_manifest = tmp_path / "no_manifest" / shard.name
    shutil.copytree(shard, no_manifest)
    (no_manifest / "manifest.json").unlink()
    missing = f"{no_manifest / 'manifest.json'}: missing"
    for stage in ("02_build_vocab_mapping.py", "03_split_data.py"):
        _error(run_script(script(stage), "--data-dir", str(no_manifest), "--out-dir", str(tmp_path / stage),
                          check=False), missing)  # fmt: skip
    _error(run_script(*_train(no_manifest, vocab, tmp_path / "t"), check=False), missing)

    flipped = tmp_path / "flipped" / shard.name
    shutil.copytree(shard, flipped)
    part = flipped / "part-00001.safetensors"
    _flip_header_bit(part)
    _error(run_script(*_train(flipped, vocab, tmp_path / "t"), check=False),
           f"{part}: not a readable safetensors file", "re-extract")  # fmt: skip

    split = tmp_path / "split"
    run_script(script("03_split_data.py"), "--data-dir", str(shard), "--out-dir", str(split))
    proc = run_script(*_train(shard, split, tmp_path / "t"), check=False)
    _error(proc, f"{split}: not a vocab mapping (meta.json says stage 03_split_data)", "--vocab-mapping-dir")

    _error(run_script(*_train(shard, vocab, tmp_path / "t", "--max-seq-len", "1"), check=False),
           "--max-seq-len must be >= 2, got 1")  # fmt: skip
    _error(run_script(*_train(shard, vocab, tmp_path / "t", "--ttt-steps", "50"), check=False),
           "--ttt-steps must be in [1, 16], got 50")  # fmt: skip
    assert not (tmp_path / "t").exists()
    assert "[1, 16]" in run_script(script("04_train.py"), "--help").stdout


def test_ttt_steps_above_the_served_k_warn_with_the_memory_they_cost(tiny_shards):
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.sizing.plan import ttt_steps_warning

    base = {"vocab_mapping_dir": str(tiny_shards["vocab_float32"]), "out_dir": "o", "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 32, "intermediate_size": 64}  # fmt: skip
    assert ttt_steps_warning(TrainConfig(**base, ttt_steps=3, served_k=3), 1, False) is None
    warning = ttt_steps_warning(TrainConfig(**base, ttt_steps=6, served_k=3), 1, False)
    assert warning is not None and "--ttt-steps 6 > --served-k 3: steps 4-6" in warning, warning
    unit = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    six, three = (float(x.split()[0]) * unit[x.split()[1]] for x in warning.split("~")[1:])
    assert six > 1.5 * three, warning  # the estimate grows with the steps (their KV most)


def test_an_empty_shard_is_refused_and_an_overwritten_one_kept(tiny_verifier, tiny_shards, tmp_path):
    """--max-seq-len 1 rejects every row: exit 2 with the reasons counted, and the good shard --overwrite
    would have replaced stays byte for byte."""
    root = tmp_path / "hs"
    shutil.copytree(tiny_shards["float32"], root / tiny_shards["float32"].name)
    before = _tree_sha(root)
    args = [*extract_args(tiny_verifier, CONVERSATIONS, root), "--samples-per-file", "4"]
    proc = run_script(*args, "--max-seq-len", "1", "--overwrite", check=False)
    _error(proc, "every one of the 10 rows was rejected", '{"N tokens > max_seq_len N": 10}',
           "no empty shard is published")  # fmt: skip
    assert _tree_sha(root) == before


def test_resume_with_another_max_batch_tokens_is_refused_naming_it(tiny_verifier, tmp_path):
    """Batching changes the states' floats (~3e-6): parts of two batch sizes would not be one run's bytes."""
    args = [*extract_args(tiny_verifier, CONVERSATIONS, "hs"), "--samples-per-file", "4"]
    run_killed_after([*args, "--max-batch-tokens", "256"], tmp_path, "part-00000.json")
    proc = run_script(*args, "--max-batch-tokens", "4096", cwd=tmp_path, check=False)
    _error(proc, "a run with other settings (max_batch_tokens) left it unfinished")
    assert json.loads((shard_of(tmp_path / "hs") / "run.json").read_text())["max_batch_tokens"] == 256


def test_stage_00_rejects_duplicates_and_assistant_first_rows_before_generating(tiny_verifier, tmp_path):
    """Duplicate ids (in the same part and in a part finished before a resume) are rejected before the
    verifier generates, as stage 01 would reject them; an assistant-only row gets its true reason."""
    rows = [("a", "user"), ("b", "assistant"), ("a", "user"), ("c", "user"), ("a", "user"), ("c", "user")]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "messages": ([{"role": "user", "content": f"hi {n}"}]
                    if first == "user" else []) + [{"role": "assistant", "content": "yo"}]}) + "\n"
                    for n, (i, first) in enumerate(rows)))  # fmt: skip
    args = [script("00_regenerate.py"), "--verifier-path", str(tiny_verifier), "--data-path", str(data),
            "--out-dir", "regen", "--engine", "hf", "--max-new-tokens", "3",
            "--rows-per-part", "2"]  # fmt: skip
    run_killed_after(args, tmp_path, "part-00001.jsonl")  # rows 0-3 done: the rerun resumes at row 4
    run_script(*args, cwd=tmp_path)
    reasons = {r["row"]: r["reason"] for r in read_jsonl(tmp_path / "regen" / "rejects.jsonl")}
    assert reasons == {
        1: "no assistant turn after a prompt (an assistant turn that opens the row answers nothing)",
        2: "duplicate id 'a' (first at row 0)",
        4: "duplicate id 'a' (first at row 0)",
        5: "duplicate id 'c' (first at row 3)",
    }
    meta = json.loads((tmp_path / "regen" / "meta.json").read_text())
    assert meta["num_regenerated"] == 2 and meta["dtype"] == "float32" and meta["trust_remote_code"] is False

