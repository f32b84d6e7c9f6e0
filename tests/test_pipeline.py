"""The smoke run of every stage, and what each stage's output must hold for the next one."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import CONVERSATIONS, extract_args, read_jsonl, run_script, script, shard_of, split_sides
from safetensors import safe_open
from safetensors.torch import load_file


def test_smoke_training_loss_falls_and_val_acc_rises_above_untrained(tiny_run):
    log = read_jsonl(tiny_run / "train" / "train_log.jsonl")
    assert log[-1]["loss"] < 0.5 * log[0]["loss"], (log[0], log[-1])
    best = json.loads((tiny_run / "train" / "checkpoints" / "best.json").read_text())
    info = json.loads(
        (tiny_run / "train" / "checkpoints" / best["checkpoint"] / "checkpoint.json").read_text()
    )
    untrained, val = info["history"]["untrained"], info["val"]
    assert val["acc_0"] > untrained["acc_0"] + 0.2, (untrained, val)
    assert val["acceptance_length"] > untrained["acceptance_length"]


def test_captured_aux_states_are_hf_hidden_states(tiny_run):
    """id i must be Hugging Face hidden_states[i] (vLLM's convention), the last state pre-final-norm."""
    from transformers import AutoModelForCausalLM

    shard = shard_of(tiny_run / "hidden_states")
    meta = json.loads((shard / "meta.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(tiny_run / "verifier"), dtype=torch.float32).eval()
    with safe_open(str(shard / "part-00000.safetensors"), "pt") as f:
        offsets = f.get_tensor("offsets")
        a, b = int(offsets[0]), int(offsets[1])
        ids = f.get_tensor("input_ids")[a:b].long()
        aux = f.get_tensor("aux_hidden_states")[a:b]
        last = f.get_tensor("last_hidden_state")[a:b]
    with torch.no_grad():
        out = model(input_ids=ids[None], output_hidden_states=True)
    for n, layer_id in enumerate(meta["aux_layer_ids"]):
        torch.testing.assert_close(aux[:, n], out.hidden_states[layer_id][0], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(aux[:, 0], out.hidden_states[meta["aux_layer_ids"][0] + 1][0], atol=1e-3)
    logits = model.lm_head(model.model.norm(last[None]))
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-3)


def test_stage_outputs_carry_what_the_next_stage_reads(tiny_run):
    shard = shard_of(tiny_run / "hidden_states")
    meta = json.loads((shard / "meta.json").read_text())
    for key in (
        "verifier",
        "aux_layer_ids",
        "hidden_size",
        "dtype",
        "num_samples",
        "num_rejected",
        "num_tokens",
        "manifest_sha256",
        "versions",
        "config",
    ):
        assert key in meta, key
    assert meta["aux_layer_ids"] == [2, 4, 5]  # (2, N//2, N-3) for the 8-layer tiny verifier
    manifest = json.loads((shard / "manifest.json").read_text())
    assert sum(len(f["samples"]) for f in manifest["files"]) == meta["num_samples"] == 10
    for f in manifest["files"]:
        assert {"file", "sha256", "bytes", "samples"} <= set(f)
        assert all({"id", "row", "num_tokens", "num_loss_tokens"} <= set(s) for s in f["samples"])
    vocab = json.loads((tiny_run / "vocab" / "meta.json").read_text())
    assert vocab["source"]["aux_layer_ids"] == meta["aux_layer_ids"] and 0 < vocab["coverage"] <= 1
    train = json.loads((tiny_run / "train" / "meta.json").read_text())
    assert train["draft"]["aux_layer_ids"] == meta["aux_layer_ids"]
    assert train["draft"]["head_dim"] == 128 and train["vocab_mapping_sha256"] == vocab["mapping_sha256"]
    export = json.loads((tiny_run / "draft" / "export_meta.json").read_text())
    assert export["readback"]["top1_agreement"] >= 0.98
    acceptance = json.loads((tiny_run / "draft" / "acceptance_sim.json").read_text())
    assert acceptance["sim"]["num_drafts"] > 0


def test_the_given_answers_train_beside_the_regenerated_ones_as_a_variant(tiny_run, tmp_path):
    """The given conversations beside stage 00's regenerations of them: extracted as they are, their ids
    are the regenerated rows' and stage 03 refuses the overlap naming --variant; extracted with --variant
    given into the same out_dir, their shard sits beside the regenerated one and stage 03 and 04's reading
    take both from that one folder, every sample id distinct and both versions of each conversation on one
    side of the split."""
    import shutil

    from eagle3_pipeline.data.samples import conversation_id
    from eagle3_pipeline.data.shards import open_shards
    from eagle3_pipeline.data.split import load_split

    root, plain, split = tmp_path / "hidden_states", tmp_path / "plain", tmp_path / "split"
    shutil.copytree(tiny_run / "hidden_states", root)
    run_script(*extract_args(tiny_run / "verifier", CONVERSATIONS, plain), "--max-seq-len", "1024",
               "--end-row", "2")  # fmt: skip
    refused = run_script(script("03_split_data.py"), "--data-dir", str(root), str(plain), "--out-dir",
                         str(tmp_path / "refused"), check=False)  # fmt: skip
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "shards overlap" in refused.stderr and "--variant NAME" in refused.stderr
    run_script(*extract_args(tiny_run / "verifier", CONVERSATIONS, root), "--max-seq-len", "1024",
               "--variant", "given")  # fmt: skip
    (first, ours_shard) = sorted(p.name for p in root.iterdir())
    assert ours_shard == f"{first}_given"
    assert json.loads((root / ours_shard / "meta.json").read_text())["config"]["variant"] == "given"
    run_script(script("03_split_data.py"), "--data-dir", str(root), "--out-dir", str(split),
               "--val-ratio", "0.3")  # fmt: skip
    shard_set = open_shards([str(root)], verify=False)
    train, val = load_split(split, shard_set.samples)
    ids = [s.sample_id for s in train + val]
    assert len(ids) == len(set(ids)) == len(shard_set.samples)
    ours = {s.sample_id for s in shard_set.samples if s.shard.endswith(ours_shard)}
    assert ours and all("#v:given" in i for i in ours)
    assert {conversation_id(i) for i in ours} == {conversation_id(s.sample_id) for s in shard_set.samples
                                                  if s.sample_id not in ours}  # fmt: skip
    assert val and all(len(x) == 1 for x in split_sides(train, val).values())


def test_missing_meta_field_is_refused_naming_the_file(tiny_run, tmp_path):
    import shutil

    shard = tmp_path / "hs" / shard_of(tiny_run / "hidden_states").name
    shutil.copytree(shard_of(tiny_run / "hidden_states"), shard)
    meta = json.loads((shard / "meta.json").read_text())
    del meta["aux_layer_ids"]
    (shard / "meta.json").write_text(json.dumps(meta))
    proc = run_script(
        script("02_build_vocab_mapping.py"),
        "--data-dir",
        str(shard),
        "--out-dir",
        str(tmp_path / "vocab"),
        "--draft-vocab-size",
        "64",
        check=False,
    )
    assert proc.returncode == 2
    assert "meta.json" in proc.stderr and "aux_layer_ids" in proc.stderr and "Traceback" not in proc.stderr


def test_exported_files_follow_the_vllm_contract(tiny_run):
    config = json.loads((tiny_run / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["head_dim"] == 128 != config["hidden_size"] // config["num_attention_heads"]
    assert (
        config["eagle_aux_hidden_state_layer_ids"]
        == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    )
    train_meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):  # stated as trained
        assert config[flag] is train_meta["draft"][flag]
    assert config["eagle_config"]["norm_before_fc"] is config["norm_before_fc"]
    assert ("input_norm.weight" in load_file(str(tiny_run / "draft" / "model.safetensors"))) is config[
        "norm_before_fc"
    ]
    tensors = load_file(str(tiny_run / "draft" / "model.safetensors"))
    assert not any(k.startswith("model.") or k.endswith(".bias") for k in tensors)
    assert "embed_tokens.weight" not in tensors
    assert (
        tensors["d2t"].dtype == torch.int64
        and tensors["midlayer.self_attn.q_proj.weight"].dtype == torch.bfloat16
    )
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (4 * 128, 2 * 256)


def test_stage_rerun_is_a_logged_skip(tiny_run):
    cfg = str(tiny_run / "tiny.toml")
    for stage in (
        "01_extract_hidden_states.py",
        "02_build_vocab_mapping.py",
        "03_split_data.py",
        "05_export.py",
    ):
        proc = run_script(script(stage), "--config", cfg)
        assert "skip:" in proc.stderr, (stage, proc.stderr[-500:])


def test_help_is_the_manual():
    proc = run_script(script("04_train.py"), "--help")
    assert "Examples:" in proc.stdout and "--head-dim" in proc.stdout and "torchrun" in proc.stdout


def test_unknown_config_key_is_an_error_naming_it(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[vocab]\ndata_dir = ["x"]\nout_dir = "y"\ndraft_vocab_sise = 5\n')
    proc = run_script(script("02_build_vocab_mapping.py"), "--config", str(cfg), check=False)
    assert proc.returncode == 2 and "draft_vocab_sise" in proc.stderr and "Traceback" not in proc.stderr


def test_command_line_overrides_config_file(tmp_path):
    import argparse

    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.core.config import add_config_flags, resolve_config

    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('[train]\nvocab_mapping_dir = "v"\nout_dir = "o"\nlr = 0.5\nepochs = 7\n')
    parser = argparse.ArgumentParser()
    add_config_flags(parser, TrainConfig)
    cfg = resolve_config(TrainConfig, parser.parse_args(["--config", str(cfg_file), "--lr", "0.25"]), "train")
    assert cfg.lr == 0.25 and cfg.epochs == 7 and cfg.head_dim == 128


def test_conversations_file_is_the_shipped_ten():
    assert len(read_jsonl(CONVERSATIONS)) == 10


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_torchrun_ddp_trains_on_two_cpu_ranks(tiny_run, tmp_path, arch):
    """The same script under torchrun (gloo on CPU here, NCCL on GPUs): rank 0 logs and saves. Both
    layers: the MLA draft (configs/kimi_k25.toml's) takes its dims from the tiny MLA verifier, and DDP
    finds every one of its parameters used (else it stops at the first backward)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            str(torchrun),
            "--standalone",  # a free port: the other pytest-xdist worker may run torchrun at the same time
            "--nproc-per-node",
            "2",
            script("04_train.py"),
            "--config",
            str(tiny_run / "tiny.toml"),
            "--out-dir",
            str(tmp_path / "ddp"),
            "--max-steps",
            "3",
            "--save-every",
            "3",
            "--log-every",
            "1",
            *(["--draft-arch", "mla", "--no-norm-before-fc"] if arch == "mla" else []),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[rank 0] step 3/3" in proc.stderr and "[rank 1] step" not in proc.stderr
    assert (tmp_path / "ddp" / "checkpoints" / "step_000003" / "COMPLETE").exists()
    meta = json.loads((tmp_path / "ddp" / "meta.json").read_text())
    assert meta["draft"]["draft_arch"] == arch


def test_batched_extraction_equals_one_sequence_at_a_time(tiny_verifier, tmp_path):
    """Right-padded batches must leave every real token's states as a batch of one computes them."""
    from conftest import DATA

    for name, tokens in (("one", "1"), ("batched", "100000")):
        run_script(
            *extract_args(str(tiny_verifier), str(DATA / "conversations.jsonl"), str(tmp_path / name)),
            "--end-row",
            "6",
            "--samples-per-file",
            "6",
            "--max-batch-tokens",
            tokens,
        )
    one = load_file(str(shard_of(tmp_path / "one") / "part-00000.safetensors"))
    batched = load_file(str(shard_of(tmp_path / "batched") / "part-00000.safetensors"))
    assert torch.equal(one["input_ids"], batched["input_ids"]) and torch.equal(
        one["offsets"], batched["offsets"]
    )
    for key in ("aux_hidden_states", "last_hidden_state"):
        torch.testing.assert_close(one[key], batched[key], rtol=1e-4, atol=1e-4)


def test_sampled_evaluation_writes_expected_acceptance_beside_its_realisation(tiny_run, tmp_path):
    """06_evaluate at Kimi's thinking settings: its own file, expected rates with their standard errors,
    deterministic for a seed; out-of-range sampling settings are refused naming the flag."""
    args = [script("06_evaluate.py"), "--config", str(tiny_run / "tiny.toml"), "--engine", "sim",
            "--num-prompts", "2", "--max-new-tokens", "24", "--temperature", "1.0", "--top-p", "0.95",
            "--samples-per-prompt", "2", "--out-dir", str(tmp_path)]  # fmt: skip
    run_script(*args)
    first = json.loads((tmp_path / "acceptance_sim_t1_p0.95.json").read_text())
    run_script(*args)
    again = json.loads((tmp_path / "acceptance_sim_t1_p0.95.json").read_text())
    sim = first["sim"]
    assert first["num_requests"] == 4 and first["sampling"] == {
        "temperature": 1.0, "top_p": 0.95, "top_k": 0, "seed": 0}  # fmt: skip
    assert sim == again["sim"]  # seeded: the same traces and counts
    assert len(sim["rate_standard_error_per_pos"]) == 3 and sim["num_drafts"] > 0
    assert sim["mean_acceptance_length"] == pytest.approx(1 + sum(sim["expected_accepted_per_pos"]) / sim["num_drafts"])
    for flag, value, why in [("--temperature", "-1", "--temperature must be >= 0"),
                             ("--top-p", "0", "--top-p must be in (0, 1]"),
                             ("--samples-per-prompt", "0", "--samples-per-prompt must be >= 1"),
                             ("--num-speculative-tokens", "0", "--num-speculative-tokens must be >= 1")]:  # fmt: skip
        proc = run_script(*args, flag, value, check=False)
        assert proc.returncode == 2 and why in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-1500:]
