"""The vLLM tier: drafts served by vLLM's real engine (CPU build) beside two tiny verifiers, a Llama
and a DeepSeek-V3 with Kimi-K2.5's MLA latent, and the negative controls.

Needs the environment made by scripts/setup_vllm_cpu.sh (.ci/run always makes it). Without it these
tests are skipped with the reason shown (`pytest -rs`); with EAGLE3_REQUIRE_VLLM=1, as in CI, they fail
instead, so CI can never pass them silently.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, TIER_CONFIGS, run_script, script, vllm_available
from sabotage import SABOTAGES

from eagle3_pipeline.vllm_side import protocol, vllm_engine

OK, WHY = vllm_available()  # probed once per session (conftest)
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM tier skipped: {WHY}", allow_module_level=True)

NUM_PROMPTS, MAX_NEW_TOKENS, K = 6, 64, 3

EXPAND_PROBE = """
import json, torch
from vllm.plugins import load_general_plugins
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
unpatched = cpu_triton_utils._expand_kernel_impl  # vLLM-cpu's own, before the plugin loads
load_general_plugins()
current_platform.register_triton_kernel_overrides()  # what a worker does after loading the plugins
from vllm.v1.sample import rejection_sampler as rs
cu = torch.tensor([3, 6, 8], dtype=torch.int32)
out = {}
for name, x, kw in [("temperature", torch.tensor([0.01, 1.0, 0.0]), dict(replace_from=0, replace_to=1)),
                    ("top_p", torch.tensor([0.95, 1.0, 0.5]), {}),
                    ("top_k", torch.tensor([5, 0, 7], dtype=torch.int32), {})]:
    out[name] = rs.expand_batch_to_tokens(x, cu, 8, **kw).tolist()
    sentinel = torch.full((8,), 7, dtype=x.dtype)
    unpatched(sentinel, x, cu, kw.get("replace_from", 0), kw.get("replace_to", 0))
    out[name + "_unpatched"] = sentinel.tolist()
print("@@" + json.dumps(out))
"""


def test_cpu_plugin_spreads_float_and_int32_sampling_parameters_over_draft_tokens():
    """The rejection sampler's per-token temperature, top_p and top_k (expand_batch_to_tokens) as the
    CPU plugin computes them; vLLM-cpu's own stand-in leaves a float or int32 output untouched."""
    import subprocess

    proc = subprocess.run([str(vllm_engine.default_python()), "-c", EXPAND_PROBE], capture_output=True,
                          text=True, timeout=600, env=vllm_engine._worker_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("@@"))[2:])
    assert out["temperature"] == pytest.approx([0.01] * 3 + [1.0] * 3 + [1.0] * 2)  # greedy 0 -> 1
    assert out["top_p"] == pytest.approx([0.95] * 3 + [1.0] * 3 + [0.5] * 2)
    assert out["top_k"] == [5] * 3 + [0] * 3 + [7] * 2
    for name in ("temperature", "top_p", "top_k"):  # the bug the plugin fixes: nothing written
        assert out[name + "_unpatched"] == [7] * 8, out
GENERATOR_PROBE = """
import torch
from vllm.plugins import load_general_plugins
from vllm.v1.worker.gpu_input_batch import CachedRequestState
def state():
    return CachedRequestState(req_id="r", prompt_token_ids=[1, 2, 3], mm_features=[], sampling_params=None,
                              generator=torch.Generator(device="cpu").manual_seed(7), block_ids=([],),
                              num_computed_tokens=0, output_token_ids=[])
try:
    g = state().generator
    g.set_offset(g.get_offset() - 4)
    print("@@bare rewinds")
except RuntimeError as e:
    print("@@bare", e)
load_general_plugins()
g = state().generator
g.set_offset(g.get_offset() - 4)  # what the runner does after a chunked prefill's discarded draw
expected = torch.rand(4, generator=torch.Generator().manual_seed(7))
print("@@plugin", torch.equal(torch.rand(4, generator=g), expected))
"""


def test_cpu_plugin_lets_a_seeded_request_survive_the_rewind_after_a_chunked_prefill():
    """vLLM rewinds a seeded request's generator after a partial prefill's discarded draw; a CPU
    generator has no offset and the engine dies ("CPU Generator does not use offset", stage 00 at
    temperature 1.0 with a seed on long rows). With the plugin the rewind is a no-op on the same seeded
    stream."""
    import subprocess

    proc = subprocess.run([str(vllm_engine.default_python()), "-c", GENERATOR_PROBE], capture_output=True,
                          text=True, timeout=600, env=vllm_engine._worker_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x[2:] for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert lines == ["bare CPU Generator does not use offset", "plugin True"], proc.stdout[-2000:]


REBIND_PROBE = """
import sys
import llvmlite.binding  # what Kimi-K2.5's fused image processor loads, with numba
from vllm.triton_utils import dispatcher
from eagle3_vllm_cpu import rebind, sampler
name = "vllm.v1.sample.rejection_sampler.expand_kernel"
try:
    dispatcher.register_kernels({name: sampler.expand_kernel_impl})
    print("@@bare registered")
except AttributeError as e:
    print("@@bare", e)
rebind.register()
dispatcher.register_kernels({name: sampler.expand_kernel_impl})
print("@@plugin registered", "llvmlite.binding.ffi" in sys.modules)
"""


def test_cpu_plugin_lets_the_kernel_scan_pass_llvmlite_in_the_process():
    """vLLM's kernel-override scan of every module, as a worker start runs it in a process that has
    loaded numba (an engine in the worker's own process after a Kimi-K2.5 one): bare, it raises on
    llvmlite's function wrappers and the engine does not start; with the plugin it registers, llvmlite
    still loaded."""
    import subprocess

    proc = subprocess.run([str(vllm_engine.default_python()), "-c", REBIND_PROBE], capture_output=True,
                          text=True, timeout=600, env=vllm_engine._worker_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x[2:] for x in proc.stdout.splitlines() if x.startswith("@@")]
    assert lines == ["bare '_lib_fn_wrapper' object has no attribute 'get'", "plugin registered True"], lines


# The two verifiers the tier serves (conftest.TIER_CONFIGS): a tiny Llama, and a tiny DeepSeek-V3 with
# Kimi-K2.5's MLA latent, the code path Kimi takes in vLLM.


@pytest.fixture(scope="module", params=sorted(TIER_CONFIGS))
def tier_run(request, tier_stages) -> Path:
    """scripts/run_tiny.sh's stages on the verifier's config up to its exports (conftest.tier_stages, once
    per session): the trained draft and the untrained (init) one beside it (summary.untrained_dir:
    draft_init), the baseline the tests serve; the tests evaluate them in vLLM and the simulation
    themselves (`trained`)."""
    root = tier_stages(request.param)
    assert (root / "draft_init" / "config.json").is_file()
    return root


@pytest.fixture(scope="module")
def worker(vllm_worker, tier_run):
    """The session's vLLM worker (conftest.vllm_worker) for the tests of a verifier: it rebuilds its engine
    when a request's engine settings (draft, draft_sample_method, ...) change, and reports counters per
    request (the metrics' increase over that request's generate call, vllm_side/worker.py)."""
    yield vllm_worker
    vllm_worker.release()


def generate_in(
    worker, verifier: Path, draft: Path, prompts, samplings=(None,), draft_sample_method: str = "greedy"
) -> list[dict]:
    """vllm_engine.generate_each's requests, one per sampling setting (None: greedy), in `worker`."""
    fields = vllm_engine.generate_fields(
        verifier, draft, prompts, MAX_NEW_TOKENS, K, False, draft_sample_method
    )
    # the shortest engine that leaves speculation alone: the longest request ends near its length limit
    fields["max_model_len"] = protocol.untouched_length(prompts, MAX_NEW_TOKENS, K)
    return [worker.request({**fields, **vllm_engine.sampling_fields(s, len(prompts))}) for s in samplings]


@pytest.fixture(scope="module")
def prompts(tier_run) -> list[list[int]]:
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import build_prompts

    tokenizer = AutoTokenizer.from_pretrained(str(tier_run / "verifier"))
    return build_prompts(tokenizer, CONVERSATIONS, 0, NUM_PROMPTS)


EOS_AT = 5  # the verifier's end token is the 6th token of its greedy answer to the first prompt


@pytest.fixture(scope="module")
def eos_verifier(tier_run, prompts, tmp_path_factory) -> tuple[Path, int]:
    """The tiny Llama verifier with an end token that its greedy answers reach within MAX_NEW_TOKENS
    (config.json and generation_config.json): vLLM's worker decodes past it (ignore_eos), so the
    simulation's trace must too, or `--engine both` calls a lossless run lossy (issue 9)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    src = tier_run / "verifier"
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    ids = list(prompts[0])
    with torch.no_grad():
        for _ in range(EOS_AT + 1):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    eos = ids[-1]
    dst = tmp_path_factory.mktemp("eos") / "verifier"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["eos_token_id"] = eos
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return dst, eos


@pytest.fixture(scope="module")
def trained(tier_run, eos_verifier) -> dict:
    """06_evaluate.py --engine both on the trained export: vLLM and the simulation on the same prompts,
    with a verifier whose end token the answers reach (eos_verifier)."""
    proc = run_script(
        script("06_evaluate.py"),
        "--config",
        str(next(tier_run.glob("tiny_*.toml"))),
        "--verifier-path",
        str(eos_verifier[0]),
        "--engine",
        "both",
        "--num-prompts",
        str(NUM_PROMPTS),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
        "--num-speculative-tokens",
        str(K),
        check=False,
        timeout=1800,
    )
    result = json.loads((tier_run / "draft" / "acceptance_both.json").read_text())
    print(
        f"\ntrained draft: vLLM {result['vllm']['mean_acceptance_length']:.3f} "
        f"per pos {result['vllm']['acceptance_rate_per_pos']} | "
        f"sim {result['sim']['mean_acceptance_length']:.3f} "
        f"per pos {result['sim']['acceptance_rate_per_pos']}"
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return result


def test_vllm_speculation_is_lossless(trained, eos_verifier):
    assert trained["comparison"]["lossless"], trained["comparison"]["first_mismatch"]
    assert trained["vllm"]["num_drafts"] > 0
    # the answers run past the verifier's end token, in vLLM and in the simulation alike
    outputs = trained["vllm"]["outputs"]
    assert outputs[0][EOS_AT] == eos_verifier[1] and all(len(o) == MAX_NEW_TOKENS for o in outputs)


def test_vllm_acceptance_per_position_agrees_with_simulation(trained):
    from eagle3_pipeline.export_eval.evaluate import RATE_TOLERANCE

    diffs = trained["comparison"]["rate_diff_per_pos"]
    assert len(diffs) == K and max(diffs) <= RATE_TOLERANCE, (trained["vllm"], trained["sim"])
    # deep enough to see the deeper positions' bias that an inexact simulation has (issue 9)
    assert trained["vllm"]["acceptance_rate_per_pos"][-1] > 0.4, trained["vllm"]


# On the MLA verifier (Kimi's path; an engine start): the Llama verifier's trained draft shows what it
# accepts in test_vllm_acceptance_per_position_agrees_with_simulation (last position above 0.4)
@pytest.mark.parametrize("tier_run", ["mla"], indirect=True)
def test_trained_draft_accepts_far_more_than_untrained_in_vllm(tier_run, prompts, trained, worker):
    (untrained,) = generate_in(worker, tier_run / "verifier", tier_run / "draft_init", prompts)
    print(f"\nuntrained draft: vLLM {untrained['mean_acceptance_length']:.3f}")
    assert untrained["outputs"] == trained["vllm"]["outputs"]  # lossless whatever the draft
    assert trained["vllm"]["mean_acceptance_length"] > untrained["mean_acceptance_length"] + 1.0


def child_pids(pid: int) -> list[int]:
    return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.parametrize("tier_run", ["mla"], indirect=True)
def test_the_generation_engine_runs_in_the_workers_own_process(tier_run, prompts, worker):
    """vLLM-cpu's generation engine in the session worker's process (vllm_side/cpu.py `in_process`): no
    EngineCore or executor process of its own while it is up, and it serves as those did (the tier's
    lossless and counter tests run on it)."""
    (served,) = generate_in(worker, tier_run / "verifier", tier_run / "draft", prompts[:2])
    assert served["num_drafts"] > 0
    assert child_pids(worker.proc.pid) == []


# A long-context draft: the tier's tiny Llama verifier given yarn positions (factor 4 over 512: 2,048), a
# draft trained with the verifier's scaling on the shipped conversations cut to 128 tokens, served on
# held-out prompts of 320-600 tokens (export_eval/long_prompts.py), 2.5-4.7x its training length and past
# the original 512 positions, where a draft rotated otherwise than vLLM rotates it would show. Trained on
# the given answers: the loss's labels are the verifier's own argmax (04_train's ce), no stage 00 needed.
YARN_SMALL = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
SHORT_TRAIN_TOKENS, LONG_PROMPT_TOKENS = 128, (320, 460, 600)


def short_yarn_draft(llama_verifier: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(the verifier with yarn positions, the draft trained at SHORT_TRAIN_TOKENS by its scaling, exported)"""
    import shutil

    verifier, hs, vocab = tmp_path / "verifier", tmp_path / "hidden_states", tmp_path / "vocab"
    shutil.copytree(llama_verifier, verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, "rope_scaling": YARN_SMALL}, indent=2))
    run_script(script("01_extract_hidden_states.py"), "--verifier-path", str(verifier), "--data-path",
               str(CONVERSATIONS), "--out-dir", str(hs), "--max-seq-len", str(SHORT_TRAIN_TOKENS),
               "--truncate")  # fmt: skip
    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(hs), "--out-dir", str(vocab),
               "--draft-vocab-size", "96")  # fmt: skip
    run_script(script("04_train.py"), "--data-dir", str(hs), "--vocab-mapping-dir", str(vocab), "--out-dir",
               str(tmp_path / "train"), "--rope-scaling", "verifier",
               "--max-seq-len", str(SHORT_TRAIN_TOKENS),
               "--loss-on-all-tokens", "--epochs", "30", "--lr", "1e-3", "--batch-tokens", "1024",
               "--num-attention-heads", "4", "--num-key-value-heads", "4", "--head-dim", "128",
               "--intermediate-size", "512", "--max-position-embeddings", "2048", timeout=1800)  # fmt: skip
    draft = tmp_path / "draft"
    run_script(script("05_export.py"), "--train-dir", str(tmp_path / "train"), "--out-dir", str(draft))
    return verifier, draft


def test_yarn_draft_trained_short_serves_longer_prompts_in_vllm(tiny_llama_verifier, vllm_worker, tmp_path):
    """vLLM-cpu serves the draft past its training length beside a yarn verifier: lossless, and its
    counters equal the simulation's (which reads the export's rope_scaling as vLLM 0.32 does) at every
    depth."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.evaluate import simulate
    from eagle3_pipeline.export_eval.long_prompts import build_rows

    verifier, draft = short_yarn_draft(tiny_llama_verifier, tmp_path)
    assert json.loads((draft / "config.json").read_text())["rope_scaling"] == {**YARN_SMALL}
    tokenizer = AutoTokenizer.from_pretrained(str(verifier))
    rows = build_rows(tokenizer, list(LONG_PROMPT_TOKENS), 1, ("document",))
    prompts = [r["token_samples"][0]["prompt_ids"] for r in rows]
    assert min(map(len, prompts)) > 2 * SHORT_TRAIN_TOKENS
    (served,) = generate_in(vllm_worker, verifier, draft, prompts)
    sim, reference = simulate(verifier, draft, prompts, MAX_NEW_TOKENS, K)
    print(f"\nyarn draft at {[len(p) for p in prompts]} tokens: vLLM {served['mean_acceptance_length']:.3f} "
          f"{served['accepted_per_pos']} of {served['num_drafts']} | sim {sim['mean_acceptance_length']:.3f} "
          f"{sim['accepted_per_pos']} of {sim['num_drafts']}")  # fmt: skip
    assert served["outputs"] == reference  # lossless
    assert (served["num_drafts"], served["accepted_per_pos"]) == (sim["num_drafts"], sim["accepted_per_pos"])
    # drafts accepted at every depth, so equal counters compare rotations that mattered; few, though (AL
    # 1.112, accepted [15, 3, 1] of 170 drafts in both): 30 steps on 9 given answers cut to 128 tokens make
    # a weak draft at any length (simulated AL 1.228 on 4 short conversation prompts), docs/results.md
    assert all(a > 0 for a in served["accepted_per_pos"]), served["accepted_per_pos"]


SAMPLES_PER_PROMPT = 8  # sampled requests per prompt: independent draws, seeds 0..47
THINKING = {"temperature": 1.0, "top_p": 0.95}  # Kimi-K2.5's thinking-mode sampling


@pytest.fixture(scope="module")
def sampled(tier_run, prompts, worker) -> dict:
    """The trained export served at temperature 0.01 and at Kimi's thinking settings in one vLLM engine,
    and the simulation counting over vLLM's outputs at both (06_evaluate --engine both does the same)."""
    from eagle3_pipeline.models.acceptance import Sampling
    from eagle3_pipeline.export_eval.evaluate import simulate

    requests = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    settings = {"cold": Sampling(0.01), "thinking": Sampling(**THINKING)}
    served = generate_in(worker, tier_run / "verifier", tier_run / "draft", requests, list(settings.values()))
    out = {}
    for (name, sampling), vllm in zip(settings.items(), served):
        sim, _ = simulate(tier_run / "verifier", tier_run / "draft", requests, MAX_NEW_TOKENS, K,
                          sampling=sampling, replay=vllm["outputs"])  # fmt: skip
        out[name] = {"vllm": vllm, "sim": sim}
        print(f"\n{name}: vLLM {vllm['mean_acceptance_length']:.3f} per pos {vllm['accepted_per_pos']} of "
              f"{vllm['num_drafts']} | sim over vLLM's outputs: drafts {sim['num_drafts']}, accepted "
              f"{sim['accepted_per_pos']} (+ unshown {sim['unverifiable_per_pos']}), expected "
              f"{[round(x, 1) for x in sim['expected_accepted_per_pos']]} "
              f"(sd {[round(v**0.5, 1) for v in sim['expected_variance_per_pos']]})")  # fmt: skip
    return out


def test_temperature_001_accepts_as_greedy_in_vllm(sampled, trained):
    """With the plugin's expansion fix the sampled path verifies at the request's temperature: at 0.01
    the verifier is all but greedy, so the draft accepts what it accepts greedy (vLLM-cpu without the fix
    on the held-out benchmark: AL 1.10 at 0.01 against 3.09 greedy)."""
    from eagle3_pipeline.export_eval.evaluate import RATE_TOLERANCE

    greedy = trained["vllm"]["acceptance_rate_per_pos"]
    cold = sampled["cold"]["vllm"]["acceptance_rate_per_pos"]
    # one draft in ~100 flipping by a near-tie at temperature 0.01: the greedy tolerance
    assert all(abs(a - b) <= RATE_TOLERANCE for a, b in zip(cold, greedy)), (cold, greedy)


@pytest.mark.parametrize("setting", ["cold", "thinking"])
def test_sampled_acceptance_agrees_with_the_simulation_over_vllms_outputs(sampled, setting):
    from eagle3_pipeline.export_eval.evaluate import compare

    sim, vllm = sampled[setting]["sim"], sampled[setting]["vllm"]
    c = compare(sim, vllm, None)
    assert c["drafts_equal"] and all(c["accepted_settled_per_pos"]), (c, sim, vllm)
    assert c["rates_agree"], (c, sim, vllm)
    # tight enough to see a wrong acceptance rule: at 1.0 / 0.95 the rates are far from greedy's 1.0
    assert max(c["rate_tolerance_per_pos"]) <= 0.06, c


def test_thinking_mode_accepts_less_than_greedy(sampled, trained):
    """The tier verifier is uncertain at temperature 1.0 often enough that sampled acceptance differs
    from greedy: the sampled path is exercised, not a copy of the greedy one."""
    thinking = sampled["thinking"]["vllm"]["mean_acceptance_length"]
    assert thinking < trained["vllm"]["mean_acceptance_length"] - 0.3, thinking


# Two faults are refused by the gate (tests/test_contract.py) but cost nothing measurable here (measured
# on the Llama verifier; not served on either). A dropped norm flag: the Llama verifier's states have
# unit RMS by construction (vLLM 3.870 vs 3.870 without norm_output,
# 3.556 vs 3.550 without norm_before_fc, round 2's KL recipe). Aux ids off by one: with norm_before_fc the
# normed states of neighbouring layers carry the same signal for its next-token rule (vLLM 3.532 vs 3.550;
# simulated 3.505 vs 3.505, 3.537 two layers off). On the draft-quality benchmark's trained verifier they
# are nearly free too (simulated, its defaults, 3.389 served correctly): norm_output dropped 3.392,
# norm_before_fc 3.395, norm_before_residual 3.378, aux ids off by one 3.396. Behind norm_before_residual,
# the flags left scale only, which the next RMSNorm removes; the gate still refuses them as contract breaks.
UNMEASURABLE_HERE = {"norm_flag_dropped", "aux_ids_shifted"}
SERVED_FAULTS = [f for f in sorted(SABOTAGES) if f not in UNMEASURABLE_HERE]


# Served on the MLA verifier only (Kimi's path): the faults are the export's, and the draft exported is the
# same Llama layer on both verifiers; each fault served costs an engine start (about 25 s in CI). On the
# Llama verifier they cost as much (docs/results.md "vLLM tier": head_dim removed 2.477, d2t removed
# 1.000, against 3.660 served correctly; untrained 1.005).
@pytest.mark.parametrize("tier_run", ["mla"], indirect=True)
@pytest.mark.parametrize("fault", SERVED_FAULTS)
def test_sabotaged_export_is_refused_and_accepts_less_in_vllm(
    tier_run, prompts, trained, worker, fault, tmp_path
):
    bad = SABOTAGES[fault](tier_run / "draft", tmp_path / fault)
    gate = run_script(script("05_export.py"), "--check", str(bad), check=False)
    assert gate.returncode == 2 and "export refused" in gate.stderr
    (served,) = generate_in(worker, tier_run / "verifier", bad, prompts)  # vLLM loads it
    print(
        f"\n{fault}: vLLM {served['mean_acceptance_length']:.3f} "
        f"(correct export {trained['vllm']['mean_acceptance_length']:.3f})"
    )
    assert served["outputs"] == trained["vllm"]["outputs"]
    assert served["mean_acceptance_length"] < trained["vllm"]["mean_acceptance_length"] - 0.2


@pytest.mark.parametrize("tier_run", ["mla"], indirect=True)
def test_vllm_regeneration_equals_the_hf_engines_greedy_output(tier_run, tmp_path):
    """Stage 00 through vLLM (one worker session) stores the same token ids as through transformers, on the
    MLA verifier (Kimi's path; the Llama verifier's greedy output in vLLM is the simulation's in
    test_vllm_speculation_is_lossless, and stage 00's handling is the same for both)."""
    outs = {}
    for engine in ("vllm", "hf"):
        run_script(
            script("00_regenerate.py"), "--verifier-path", str(tier_run / "verifier"),
            "--data-path", str(CONVERSATIONS), "--out-dir", str(tmp_path / engine), "--engine", engine,
            "--max-new-tokens", "32", "--rows-per-part", "5", timeout=1800,
        )  # fmt: skip
        outs[engine] = [
            json.loads(x) for x in (tmp_path / engine / "conversations.jsonl").read_text().splitlines()
        ]
        assert json.loads((tmp_path / engine / "meta.json").read_text())["engine"] == engine
    assert [r["token_samples"] for r in outs["vllm"]] == [r["token_samples"] for r in outs["hf"]]
    assert sum(len(r["token_samples"]) for r in outs["vllm"]) >= 10


def test_probabilistic_drafting_agrees_with_the_simulation_in_vllm(tier_run, prompts, sampled, worker):
    """vLLM's draft_sample_method "probabilistic" (the draft's draws tested with min(1, p/q)) at Kimi's
    thinking settings (one more engine per verifier, in its worker): the simulation over vLLM's outputs agrees
    within the noise of two sets of accept tests (evaluate.compare). Measured on the MLA verifier (this
    draft, 48 requests): vLLM 2.255, simulation 2.246; argmax drafting 2.291."""
    from eagle3_pipeline.models.acceptance import Sampling
    from eagle3_pipeline.export_eval.evaluate import compare, simulate

    requests = [p for p in prompts for _ in range(SAMPLES_PER_PROMPT)]
    sampling = Sampling(**THINKING)
    (vllm,) = generate_in(worker, tier_run / "verifier", tier_run / "draft", requests, [sampling],
                          draft_sample_method="probabilistic")  # fmt: skip
    sim, _ = simulate(tier_run / "verifier", tier_run / "draft", requests, MAX_NEW_TOKENS, K,
                      sampling=sampling, replay=vllm["outputs"],
                      draft_sample_method="probabilistic")  # fmt: skip
    print(f"\nprobabilistic drafting: vLLM {vllm['mean_acceptance_length']:.3f} | sim over vLLM's outputs "
          f"{sim['mean_acceptance_length']:.3f}")  # fmt: skip
    c = compare(sim, vllm, None, probabilistic=True)
    assert c["rates_agree"], (c, sim, vllm)
    assert max(c["rate_tolerance_per_pos"]) <= 0.06, c  # tight enough to tell min(1, p/q) from p(x)
    # the draws are the draft's own, not its argmax: the counts differ from the argmax run's
    assert vllm["outputs"] != sampled["thinking"]["vllm"]["outputs"]


WINDOW = 16  # tokens: every tier prompt is longer, and each answer runs MAX_NEW_TOKENS past it


# On the MLA verifier only (Kimi's path: a sliding draft layer beside MLA layers; an engine start). The
# Llama verifier gave the same on 2026-12-06: vLLM and simulation (128, [119, 75, 64]), docs/results.md.
@pytest.mark.parametrize("tier_run", ["mla"], indirect=True)
def test_windowed_draft_is_served_losslessly_as_the_simulation_drafts_it(tier_run, prompts, worker, tmp_path):
    """The trained export with a 16-token window written as vLLM reads it (layer_types + sliding_window,
    export_window.py), served beside the verifier: lossless, and vLLM's drafts and accepted drafts per
    depth equal the simulation's, which drafts within the window (reference_draft.py; training attends
    as that reading does: test_draft_window.py). The same weights simulated without the window count
    otherwise."""
    import shutil

    from eagle3_pipeline.export_eval.evaluate import simulate
    from eagle3_pipeline.export_eval.export_window import window_config_fields

    verifier, windowed = tier_run / "verifier", tmp_path / "windowed"
    shutil.copytree(tier_run / "draft", windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps({**config, **window_config_fields(WINDOW)}))
    assert min(map(len, prompts)) > WINDOW
    (served,) = generate_in(worker, verifier, windowed, prompts)
    sim, reference = simulate(verifier, windowed, prompts, MAX_NEW_TOKENS, K)
    full, _ = simulate(verifier, tier_run / "draft", prompts, MAX_NEW_TOKENS, K)
    counts = {n: (r["num_drafts"], r["accepted_per_pos"]) for n, r in
              (("vllm", served), ("sim", sim), ("sim without the window", full))}  # fmt: skip
    print(f"\nwindow {WINDOW}, prompts {[len(p) for p in prompts]}: (drafts, accepted per depth) {counts}")
    assert served["outputs"] == reference  # lossless
    assert counts["vllm"] == counts["sim"] and sum(served["accepted_per_pos"]) > 0
    assert counts["sim without the window"] != counts["sim"]
