"""Every number that enters or leaves training is finite: a NaN/Inf hidden state is rejected at extraction,
a non-finite step stops training before it is applied, and the export gate refuses NaN weights or logits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, extract_args, read_jsonl, record_digests, run_script, script, shard_of


def _rehash(shard: Path) -> None:
    """Record a shard's edited part files as if stage 01 had written them (each sample's sha256, the
    files' sha256 and sizes, the manifest's sha256), so only the values themselves are wrong."""
    from safetensors import safe_open

    from eagle3_pipeline.core import storage
    from eagle3_pipeline.data import shards, state_dtype

    manifest = storage.read_json(shard / shards.MANIFEST_FILE)
    for f in manifest["files"]:
        path = shard / f["file"]
        with safe_open(str(path), "pt") as st:
            offsets = st.get_tensor("offsets").tolist()
            for i, smp in enumerate(f["samples"]):
                tokens = slice(offsets[i], offsets[i + 1])
                rows = {k: slice(i, i + 1) if state_dtype.is_per_sample(k) else tokens
                        for k in st.keys() if k != "offsets"}  # fmt: skip
                smp["sha256"] = storage.sha256_tensors({k: st.get_slice(k)[r] for k, r in rows.items()})
        f.update(sha256=storage.sha256_file(path), bytes=path.stat().st_size)
    storage.write_json_atomic(shard / shards.MANIFEST_FILE, manifest)
    meta = storage.read_json(shard / storage.META_NAME)
    meta["manifest_sha256"] = storage.sha256_file(shard / shards.MANIFEST_FILE)
    storage.write_json_atomic(shard / storage.META_NAME, meta)


def _poison_sample(shard: Path, ref) -> None:
    """One token of one sample's aux states set to NaN, the shard re-hashed."""
    import torch
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.data.shards import SHARD_FORMAT

    path = shard / ref.file
    tensors = load_file(str(path))
    tensors["aux_hidden_states"][int(tensors["offsets"][ref.index]) + 1, 0, 0] = float("nan")
    save_file(tensors, str(path), metadata={"format": SHARD_FORMAT})
    _rehash(shard)
    assert torch.isnan(load_file(str(path))["aux_hidden_states"]).sum() == 1


def _all_finite(safetensors_file: Path) -> bool:
    import torch
    from safetensors.torch import load_file

    return all(bool(torch.isfinite(t).all()) for t in load_file(str(safetensors_file)).values()
               if t.is_floating_point())  # fmt: skip


def test_extraction_rejects_rows_whose_states_are_not_finite(tiny_verifier, tmp_path):
    """A verifier whose embedding of byte "Y" is NaN: the rows holding a "Y" give NaN states and are
    rejected with the reason, the other rows are stored, every stored value finite. Stored as fp8, whose
    per-sample scale a NaN turns NaN too: the check reads the values as written."""
    import torch
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.data.shards import load_sample, open_shards

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier, verifier)
    weight_map = json.loads((verifier / "model.safetensors.index.json").read_text())["weight_map"]
    name = next(k for k in weight_map if k.endswith("embed_tokens.weight"))
    tensors = load_file(str(verifier / weight_map[name]))
    tensors[name][ord("Y")] = float("nan")  # byte-level tokenizer: token id = byte
    save_file(tensors, str(verifier / weight_map[name]), metadata={"format": "pt"})
    rows = CONVERSATIONS.read_text().splitlines()[:4]
    with_y = [i for i, line in enumerate(rows) if "Y" in line]
    assert 0 < len(with_y) < len(rows), with_y  # some rows hit, some not

    run_script(*extract_args(verifier, CONVERSATIONS, tmp_path / "hs"), "--end-row", "4",
               "--samples-per-file", "2", "--storage-dtype", "float8_e4m3fn")  # fmt: skip
    shard = shard_of(tmp_path / "hs")
    rejects = read_jsonl(shard / "rejects.jsonl")
    assert [r["row"] for r in rejects] == with_y, rejects
    assert all("NaN or Inf in the verifier's hidden states" in r["reason"] for r in rejects), rejects
    refs = open_shards([str(shard)]).samples
    stored_rows = {s["row"] for f in json.loads((shard / "manifest.json").read_text())["files"]
                   for s in f["samples"]}  # fmt: skip
    assert stored_rows == set(range(len(rows))) - set(with_y)
    for ref in refs:
        sample = load_sample(ref)
        assert all(bool(torch.isfinite(sample[k]).all()) for k in ("aux_hidden_states", "last_hidden_state"))


def _step_refs(tiny_run: Path, shard: Path, step: int) -> list:
    """The samples that step `step` (1-based) of a configs/tiny.toml run trains (one rank, grad_accum 1)."""
    from eagle3_pipeline.core.config import config_from_file
    from eagle3_pipeline.data.packing import micro_batches
    from eagle3_pipeline.data.shards import open_shards
    from eagle3_pipeline.data.split import load_split
    from eagle3_pipeline.training.config import TrainConfig

    cfg = config_from_file(TrainConfig, str(tiny_run / "tiny.toml"))  # split_dir follows from [run] dir
    train_refs, _ = load_split(Path(cfg.split_dir), open_shards([str(shard)]).samples)
    batches = micro_batches(train_refs, cfg.batch_tokens, cfg.max_seq_len, cfg.seed, 0, cfg.batching)
    return batches[step - 1]


def test_a_non_finite_step_stops_training_naming_step_and_samples_and_keeps_the_good_checkpoint(
    tiny_run, tmp_path
):
    shard = tmp_path / "hs" / shard_of(tiny_run / "hidden_states").name
    shutil.copytree(shard_of(tiny_run / "hidden_states"), shard)
    bad = _step_refs(tiny_run, shard, 2)[0]
    _poison_sample(shard, bad)
    out = tmp_path / "t"
    config = str(tiny_run / "tiny.toml")
    # the poisoned shard is other shards (its manifest's sha256): a mapping and split of its own, the same
    # token counts and sample ids, so the same draft vocabulary and the same split
    run_script(script("02_build_vocab_mapping.py"), "--config", config, "--data-dir", str(shard), "--out-dir",
               str(tmp_path / "vocab"))  # fmt: skip
    run_script(script("03_split_data.py"), "--config", config, "--data-dir", str(shard), "--out-dir",
               str(tmp_path / "split"))  # fmt: skip
    args = [
        script("04_train.py"), "--config", config, "--data-dir", str(shard), "--vocab-mapping-dir",
        str(tmp_path / "vocab"), "--split-dir", str(tmp_path / "split"), "--out-dir", str(out),
        "--max-steps", "2", "--save-every", "1", "--log-every", "1", "--val-max-samples", "1",
        "--verifier-path", str(tiny_run / "verifier"),  # the shard copied alone: its relative path is lost
    ]  # fmt: skip
    proc = run_script(*args, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = proc.stderr[-3000:]
    assert "error: step 2: NaN or Inf" in proc.stderr and repr(bad.sample_id) in proc.stderr, said
    assert "kept: " + str(out / "checkpoints" / "step_000001") in proc.stderr, said
    assert f"NaN/Inf states in sample {bad.sample_id!r} (1 in {shard / bad.file})" in proc.stderr, said
    assert "Traceback" not in proc.stderr, said
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_000001"]
    assert (ckpts / "step_000001" / "COMPLETE").exists()
    assert _all_finite(ckpts / "step_000001" / "model.safetensors")
    assert [json.loads(x)["step"] for x in (out / "train_log.jsonl").read_text().splitlines()] == [1]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _train_dir_with(tiny_run: Path, dst: Path, name: str, value: float, first_only: bool) -> str:
    """A copy of the tiny run's train folder whose best checkpoint has `name` set to `value` (one entry or
    all); returns the checkpoint's name."""
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.training import checkpoint

    ckpt = checkpoint.resolve(checkpoint.root_of(tiny_run / "train"), "best")
    shutil.copy(tiny_run / "train" / "meta.json", dst / "meta.json")
    shutil.copytree(ckpt, dst / "checkpoints" / ckpt.name)
    weights = load_file(str(dst / "checkpoints" / ckpt.name / "model.safetensors"))
    if first_only:
        weights[name].view(-1)[0] = value
    else:
        weights[name].fill_(value)
    save_file(weights, str(dst / "checkpoints" / ckpt.name / "model.safetensors"))
    record_digests(dst / "checkpoints" / ckpt.name)  # as if saved so: only the values are wrong
    return ckpt.name


# a NaN weight; a finite weight so large that the logits overflow to Inf (argmax alike on both sides)
POISONS = {
    "nan weight": ("layers.0.self_attn.q_proj.weight", float("nan"), True,
                   "midlayer.self_attn.q_proj.weight: 1 of 262144 values are NaN or Inf"),
    "inf logits": ("norm.weight", 3e38, False, "logits not finite on the gate's"),
}  # fmt: skip


@pytest.mark.parametrize("poison", list(POISONS))
def test_export_gate_refuses_non_finite_weights_or_logits_keeping_the_old_export(tiny_run, tmp_path, poison):
    name, value, first_only, says = POISONS[poison]
    train = tmp_path / "train"
    train.mkdir()
    ckpt = _train_dir_with(tiny_run, train, name, value, first_only)
    out = tmp_path / "draft"
    shutil.copytree(tiny_run / "draft", out)
    before = _tree(out)
    proc = run_script(script("05_export.py"), "--train-dir", str(train), "--out-dir", str(out),
                      "--checkpoint", ckpt, "--overwrite", "--gate-samples", "1", check=False)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "export refused" in proc.stderr and says in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "vllm serve" not in proc.stdout
    assert _tree(out) == before  # the good export untouched; the refused one stays in draft.tmp to read


def test_check_refuses_an_export_folder_holding_a_nan(tiny_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3_pipeline.core import storage

    out = tmp_path / "draft"
    shutil.copytree(tiny_run / "draft", out)
    weights = load_file(str(out / "model.safetensors"))
    weights["fc.weight"][3, 5] = float("inf")
    weights["fc.weight"][7, 1] = float("nan")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    meta = storage.read_json(out / "export_meta.json")  # as if exported so: only the values are wrong
    meta["weights_sha256"] = storage.sha256_file(out / "model.safetensors")
    storage.write_json_atomic(out / "export_meta.json", meta)
    proc = run_script(script("05_export.py"), "--check", str(out), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "fc.weight: 2 of 196608 values are NaN or Inf" in proc.stderr, proc.stderr[-3000:]
