"""--plan at long samples: the per-GPU peak of one step on a 32k / 128k / 256k sample for Kimi-K2.5's MLA
and llama drafts, the sequence-parallel ranks each needs, and the formula against the measured peak of
real CPU training steps (sizing/long_sample.py)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest
from conftest import REPO, draft_spec, run_script, script, script_env

KIMI = REPO / "configs" / "kimi_k25.toml"

# One real training step per length on the linear-memory path (forward + backward of train_metrics.forward,
# fp32 CPU, kl_div), in a child of its own: its RSS high-water mark (VmHWM, restarted per step through
# /proc/self/clear_refs) above its RSS before the step's batch exists. glibc's mmap threshold is pinned
# (MALLOC_MMAP_THRESHOLD_) so freed tensors go back to the system and RSS follows the live tensors.
CHILD = r"""
import json, sys
import torch
from eagle3_pipeline.models.draft import DraftSpec, build_draft, trainable_names
from eagle3_pipeline.training.kernel_policy import resolve
from eagle3_pipeline.training.train_metrics import Recipe, forward

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

def batch(spec, n):
    H = spec.hidden_size
    return {"hidden_states": torch.randn(1, n, len(spec.aux_layer_ids) * H), "verifier_last": torch.randn(1, n, H),
            "input_ids": torch.randint(0, spec.vocab_size, (1, n)), "position_ids": torch.arange(n)[None],
            "document_ids": torch.zeros(1, n, dtype=torch.long), "loss_mask": torch.ones(1, n, dtype=torch.bool)}

specs, lengths, steps = json.loads(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(1)
out = {}
for name, fields in specs.items():
    spec = DraftSpec(**{**fields, "aux_layer_ids": tuple(fields["aux_layer_ids"])})
    torch.manual_seed(0)
    kern = resolve("blockwise", "chunked", "off", torch.device("cpu"), max(lengths))
    model = build_draft(spec, kern.hf_attn_impl)
    names = set(trainable_names(model, True))
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    recipe, cpu = Recipe(steps, 1.0, "kl_div"), torch.device("cpu")
    forward(model, batch(spec, 16), recipe, cpu, None, kern)[0].backward()  # the gradients exist
    for n in lengths:
        open("/proc/self/clear_refs", "w").write("5")
        base = rss("VmRSS")
        value, _ = forward(model, batch(spec, n), recipe, cpu, None, kern)
        value.backward()
        out[f"{name} {n}"] = rss("VmHWM") - base
    del model
print(json.dumps(out))
"""
LENGTHS = (512, 1024, 2048)
TTT = 3


def _small_specs():
    """A llama (GQA: repeat_kv copies) and an MLA draft, every width distinct so no term hides another."""
    base = {"num_attention_heads": 4, "intermediate_size": 352, "ttt_steps": TTT}
    llama = draft_spec(128, 2000, 1000, (1, 2, 3), num_key_value_heads=2, head_dim=24, **base)
    mla = draft_spec(128, 2000, 1000, (1, 2, 3), draft_arch="mla", norm_before_fc=False, mla_q_lora_rank=48,
                     mla_kv_lora_rank=40, mla_qk_nope_head_dim=20, mla_qk_rope_head_dim=8, mla_v_head_dim=16,
                     **base)  # fmt: skip
    return {"llama": llama, "mla": mla}


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))


def test_formula_matches_the_measured_peak_of_real_cpu_steps():
    from eagle3_pipeline.sizing.long_sample import sample_bytes

    specs = _small_specs()
    env = {**script_env(), "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    args = [json.dumps({k: s.to_json() for k, s in specs.items()}), json.dumps(LENGTHS), str(TTT)]
    done = subprocess.run([sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True,
                          timeout=600, preexec_fn=_cap_memory, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    for name, spec in specs.items():
        for n in LENGTHS:
            predicted = sum(sample_bytes(spec, n, TTT, 4).values())  # fp32: what the CPU step runs
            assert predicted == pytest.approx(measured[f"{name} {n}"], rel=0.15), (name, n, measured)


@pytest.fixture
def kimi_config_only(tmp_path):
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG

    d = tmp_path / "kimi-k2.5"
    d.mkdir()
    cfg = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
           "text_config": KIMI_K25_TEXT_CONFIG}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_kimi_plan_prints_long_samples_with_sequence_parallel_ranks(kimi_config_only, tmp_path):
    from eagle3_pipeline.models.draft import DraftSpec
    from eagle3_pipeline.sizing.gpus import GPUS
    from eagle3_pipeline.sizing.long_sample import RESERVE_BYTES, step_peak

    out = tmp_path / "plan.json"
    proc = run_script(script("04_train.py"), "--config", str(KIMI), "--plan", "--verifier-path",
                      str(kimi_config_only), "--plan-json", str(out))  # fmt: skip
    p = json.loads(out.read_text())
    long = p["long_sample"]
    assert long["lengths"] == [32_768, 131_072, 262_144] and long["compute_bytes"] == 2
    # offline: aux + last states, bf16, derived from Kimi's 3 aux layers and hidden 7168
    assert long["bytes_per_token"] == (3 + 1) * 7168 * 2 == 57_344
    assert long["states"]["131072"]["offline"] == 131_072 * 57_344
    assert set(long["drafts"]) == {"mla", "llama"}
    for name, d in long["drafts"].items():
        spec_json = p["draft"]["spec"] if name == p["draft"]["spec"]["draft_arch"] else None
        for n, at in d["lengths"].items():
            assert f"{name:<6}{int(n):>8,} tokens" in proc.stdout
            peak = at["one_gpu"]["total"]
            assert peak == sum(v for k, v in at["one_gpu"].items() if k != "total")
            for kind, sp in at["sp"].items():
                if spec_json is None or sp is None:
                    continue
                spec = DraftSpec(**{**spec_json, "aux_layer_ids": tuple(spec_json["aux_layer_ids"])})
                draft = p["draft"]
                room = GPUS[kind].memory_bytes - RESERVE_BYTES
                assert step_peak(spec, draft, int(n), 3, 2, sp, 8)["total"] <= room
                if sp > 1:  # the smallest that fits
                    assert step_peak(spec, draft, int(n), 3, 2, sp - 1, 8)["total"] > room
        # longer samples need at least as many ranks; a sample at the largest length fits one GPU
        for kind in GPUS:
            ranks = [d["lengths"][str(n)]["sp"][kind] or 99 for n in long["lengths"]]
            assert ranks == sorted(ranks) and ranks[0] == 1 and ranks[1] > 1
            assert 32_768 <= d["largest_length"][kind] < 131_072
    assert "sp ranks: H200" in proc.stdout and "longest sample on one GPU" in proc.stdout


def test_sequence_parallel_keeps_step0_keys_once_per_forward():
    """With sp > 1 step 0's keys of the whole row are all-gathered once per forward and shared by every TTT
    step (sequence_parallel._Step0Gather): one more TTT step adds the rank's own cache, not the row's keys."""
    from eagle3_pipeline.sizing.long_sample import key_bytes, sample_bytes

    spec = _small_specs()["llama"]
    length, sp = 8192, 8
    P, kb = length // sp, key_bytes(spec, 2)
    more = sample_bytes(spec, length, 4, 2, sp)["keys"] - sample_bytes(spec, length, 3, 2, sp)["keys"]
    assert more == 4 * P * kb  # step 3's cache: the rank's own keys of steps 0..3
    assert sample_bytes(spec, length, 3, 2, sp)["keys"] == (length + (1 + 2 + 3) * P) * kb
    # one process reads step 0's from its own cache, whole, every step
    assert sample_bytes(spec, length, 3, 2, 1)["keys"] == (1 + 2 + 3) * length * kb
