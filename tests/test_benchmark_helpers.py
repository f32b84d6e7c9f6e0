"""The pure helpers of the real-verifier benchmark: sharpness, the standard error of AL, the recipe of a row and
which runs are cached (no model)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import pytest
import torch


def _load(name: str):
    return importlib.import_module(f"benchmarks.{name}")


def test_sharpness_is_the_mean_top_probability_over_every_position_of_every_trace():
    rv = _load("real_verifier")
    a = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.4, 0.2]])  # tops 0.7, 0.4
    b = torch.tensor([[0.1, 0.0, 0.9]])  # top 0.9: a trace of one token weighs one position, not half
    assert math.isclose(rv.mean_top_probability([a, b]), (0.7 + 0.4 + 0.9) / 3, rel_tol=1e-6)


def test_al_standard_error_treats_requests_as_clusters():
    dq = _load("draft_quality")
    # every request accepts at the same rate: AL is known without error
    assert dq.al_standard_error([(10, [5, 3]), (20, [10, 6])]) == 0.0
    # two requests, 10 steps each, 8 and 2 accepted: rate 0.5, residuals +3 / -3 -> sqrt(2 * 18) / 20
    assert math.isclose(dq.al_standard_error([(10, [8, 0]), (10, [1, 1])]), math.sqrt(36) / 20)
    assert dq.al_standard_error([(10, [3, 2])]) == math.inf  # one request: no spread to estimate


def test_project_recipe_takes_the_given_rows_mode_when_asked():
    dq = _load("draft_quality")
    # the served modes' recipes on their regenerations; 04_train's defaults on the given rows
    assert dq.project_recipe("project", "regenerated_t1") == ("project_thinking", ["--loss", "kl_div"])
    assert dq.project_recipe("project", "regenerated") == ("project_greedy", ["--loss", "ce"])
    assert dq.project_recipe("project", "given") == ("project", [])
    # --given-recipe thinking: the thinking recipe on the given rows, in a run folder of its own
    modes = {**dq.RECIPE_MODE, "given": "thinking"}
    assert dq.project_recipe("project", "given", modes) == ("project_thinking", ["--loss", "kl_div"])
    assert dq.project_recipe("project", "regenerated", modes) == ("project_greedy", ["--loss", "ce"])


def test_a_run_is_cached_only_when_its_last_checkpoint_is_complete(tmp_path):
    dq = _load("draft_quality")
    from eagle3_pipeline.core.storage import COMPLETE_MARKER

    def mark_complete(folder):  # what a finished checkpoint holds (core/output.py writes it)
        (folder / COMPLETE_MARKER).write_bytes(b"")

    ckpts = tmp_path / "checkpoints"
    assert not dq.finished(tmp_path, 72)  # nothing trained
    (ckpts / "step_000072").mkdir(parents=True)
    assert not dq.finished(tmp_path, 72)  # being written: no COMPLETE marker yet
    (ckpts / "step_000064").mkdir()
    mark_complete(ckpts / "step_000064")
    assert not dq.finished(tmp_path, 72)  # an earlier step only
    mark_complete(ckpts / "step_000072")
    assert dq.finished(tmp_path, 72)
    assert not dq.finished(tmp_path, 80)  # a longer run resumes


def test_a_cached_speculators_run_of_other_steps_is_refused_not_reused(tmp_path):
    dq = _load("draft_quality")
    from eagle3_pipeline.core.storage import COMPLETE_MARKER

    def mark_complete(folder):  # what a finished checkpoint holds (core/output.py writes it)
        (folder / COMPLETE_MARKER).write_bytes(b"")

    run = tmp_path / "runs" / "speculators"
    (run / "checkpoints" / "step_000048").mkdir(parents=True)
    mark_complete(run / "checkpoints" / "step_000048")
    log = tmp_path / "log"
    assert dq.speculators_run(tmp_path, "speculators", 48, log, 1) == run  # the same steps: cached
    with pytest.raises(SystemExit, match=r"speculators.*no complete step-288 checkpoint"):
        dq.speculators_run(tmp_path, "speculators", 288, log, 1)
    assert not log.exists()  # nothing was started


def _run_dir(tmp_path: Path, name: str, spec) -> Path:
    import json

    d = tmp_path / name
    d.mkdir()
    (d / "meta.json").write_text(json.dumps({"draft": spec.to_json()}))
    return d


def test_cost_columns_count_forwards_and_kv_by_the_drafts_kind(tmp_path):
    """Issue 27's columns beside a row's AL: 1 draft forward per step for a parallel draft, k for a
    sequential one; the KV bytes per token of the draft as trained (bf16): 2 x kv heads x head_dim x 2 for
    the Llama layer, (kv_lora + rope) x 2 for the MLA latent."""
    from conftest import draft_spec

    dc = _load("draft_cost")
    llama = draft_spec(576, 49152, 8192, (2, 15, 27), num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64)  # fmt: skip
    mla = draft_spec(576, 49152, 8192, (2, 15, 27), num_attention_heads=9, draft_arch="mla",
                     norm_before_fc=False, mla_q_lora_rank=128, mla_kv_lora_rank=64, mla_qk_nope_head_dim=64,
                     mla_qk_rope_head_dim=32, mla_v_head_dim=64)  # fmt: skip
    par = draft_spec(576, 49152, 8192, (2, 15, 27), num_attention_heads=9, num_key_value_heads=3,
                     head_dim=64, parallel_drafting=True, parallel_k=8)  # fmt: skip
    for name, spec, forwards, kv in [("seq", llama, 5, 2 * 3 * 64 * 2), ("mla", mla, 5, (64 + 32) * 2),
                                     ("par", par, 1, 2 * 3 * 64 * 2)]:  # fmt: skip
        cost = dc.row_cost(_run_dir(tmp_path, name, spec), 5, None)
        assert (cost["draft_forwards_per_step"], cost["draft_kv_bytes_per_token"]) == (forwards, kv), name
        assert cost["kimi_speedup"] is None
    # Kimi's drafts of those kinds: the MLA latent (512 + 64) x 2 on every rank, Llama's 64 kv heads of 128
    # sharded over TP 8
    assert dc.row_cost(tmp_path / "mla", 3, None)["kimi_draft_kv_bytes_per_token_per_rank"] == 576 * 2
    assert dc.row_cost(tmp_path / "seq", 3, None)["kimi_draft_kv_bytes_per_token_per_rank"] == 8 * 2 * 128 * 2


def test_kimi_speedup_is_the_cost_models_at_the_rows_al_and_k(tmp_path):
    """The speedup column is speedup.py's AL x t(decode) / (t(verify k+1) + t(draft)) for the Kimi draft of
    the row's kind; a parallel draft's cheaper step shows at equal AL; the cells' k comes from their key."""
    from eagle3_pipeline.sizing import speedup
    from eagle3_pipeline.sizing.kimi import KIMI_K25_TEXT_CONFIG

    dc = _load("draft_cost")
    assert dc.BATCH_SIZES == speedup.BATCH_SIZES
    spec, draft, kv = dc.kimi_draft("llama", False)
    v = speedup.verifier_model(KIMI_K25_TEXT_CONFIG, kv["verifier"]["per_tp_rank"])
    d = speedup.draft_model(draft["shapes"], kv["draft"]["per_tp_rank"], spec.num_attention_heads, spec.head_dim)
    s = speedup.step(v, d, 8, False, 16, speedup.DEFAULT_CONTEXT, speedup.GPUS["H200"], 8)
    got = dc.kimi_speedup("llama", False, 8, 2.5)["H200"][16]
    assert math.isclose(got, 2.5 * s["base_s"] / (s["verify_s"] + s["draft_s"]), rel_tol=1e-12)
    assert dc.kimi_speedup("llama", True, 8, 2.5)["H200"][16] > got  # one draft forward instead of 8
    assert dc.kimi_draft("llama", True)[0].parallel and dc.kimi_draft("mla", False)[0].draft_arch == "mla"
    # each kind as kimi_k25.toml names it, whatever the file's default: llama with its input norm, MLA without
    llama, mla = dc.kimi_draft("llama", False)[0], dc.kimi_draft("mla", False)[0]
    assert llama.norm_before_fc and not mla.norm_before_fc
    from conftest import draft_spec

    run = _run_dir(tmp_path, "seq", draft_spec(576, 49152, 8192, (2, 15, 27), num_attention_heads=9,
                                          num_key_value_heads=3))
    cells = dc.cell_costs(run, {"thinking_prob/k8": {"mean_acceptance_length": 2.5},
                                "thinking_prob/k3": {"mean_acceptance_length": 1.2}})  # fmt: skip
    assert cells["thinking_prob/k8"]["draft_forwards_per_step"] == 8
    assert cells["thinking_prob/k8"]["kimi_speedup"]["H200"][16] == got
    assert cells["thinking_prob/k3"]["kimi_speedup"] == dc.kimi_speedup("llama", False, 3, 1.2)


def test_paired_al_difference_keeps_what_two_drafts_share_on_the_same_requests():
    dq = _load("draft_quality")
    a = [(10, [8, 0]), (10, [1, 1])]  # rate 0.5; the first request accepts far more than the second
    # a draft compared with itself differs by exactly 0 whatever the spread between requests
    assert dq.al_difference_standard_error(a, a) == 0.0
    # the same per-request spread shifted by one accepted token each: the difference is known without error,
    # though each AL alone has a standard error of 0.3
    b = [(10, [9, 0]), (10, [2, 1])]
    assert math.isclose(dq.al_standard_error(a), 0.3)
    assert dq.al_difference_standard_error(a, b) < 1e-12
    # against a draft with no spread, the difference carries a's whole spread: its standard error alone
    c = [(10, [3, 0]), (10, [3, 0])]
    assert math.isclose(dq.al_difference_standard_error(a, c), dq.al_standard_error(a))


def test_paired_al_ratio_standard_error_is_the_jackknifes_over_requests():
    """The delta-method SE of AL(a) / AL(b) on the same requests against the jackknife over requests
    (leave one request out of both drafts), on 300 random requests where a and b share most of their
    spread; and a ratio of a draft to itself has no error."""
    dq = _load("draft_quality")
    g = torch.Generator().manual_seed(0)
    a, b = [], []
    for _ in range(300):
        d, shared = int(torch.randint(5, 40, (1,), generator=g)), float(torch.rand(1, generator=g))
        a.append((d, [int(d * min(1.0, shared + 0.2 * float(torch.rand(1, generator=g)))), 0]))
        b.append((d, [int(d * shared * 0.8), 0]))

    def al(x):
        return 1 + sum(r[1][0] for r in x) / sum(r[0] for r in x)

    def ratio(x, y):
        return al(x) / al(y)

    n = len(a)
    loo = [ratio(a[:i] + a[i + 1 :], b[:i] + b[i + 1 :]) for i in range(n)]
    mean = sum(loo) / n
    jackknife = ((n - 1) / n * sum((v - mean) ** 2 for v in loo)) ** 0.5
    got = dq.al_ratio_standard_error(a, b)
    assert 0.95 < got / jackknife < 1.05, (got, jackknife)  # measured 0.999
    r = ratio(a, b)  # the two drafts' SEs as if independent: what pairing removes
    unpaired = r * ((dq.al_standard_error(a) / al(a)) ** 2 + (dq.al_standard_error(b) / al(b)) ** 2) ** 0.5
    assert got < 0.7 * unpaired
    assert dq.al_ratio_standard_error(a, a) < 1e-12


def test_mla_row_takes_an_mla_verifiers_own_dims_and_names_them():
    dq = _load("draft_quality")
    smollm2 = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9}
    kimi_latent = {"model_type": "deepseek_v3", "hidden_size": 192, "q_lora_rank": 128, "kv_lora_rank": 512,
                   "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64}  # fmt: skip
    # a verifier without MLA: the SmolLM2 row, name and flags as its reports were made with
    name, flags = dq.mla_row(smollm2)
    assert name == "MLA draft (q_lora 128, kv_lora 64, nope 64, rope 32, v 64)" == dq.MLA_ROW
    assert flags == ["--draft-arch", "mla", "--mla-q-lora-rank", "128", "--mla-kv-lora-rank", "64",
                     "--mla-qk-nope-head-dim", "64", "--mla-qk-rope-head-dim", "32", "--mla-v-head-dim", "64",
                     "--no-norm-before-fc"]  # fmt: skip
    # an MLA verifier: no --mla-* flag (04_train then takes the verifier's), the row says which dims
    name, flags = dq.mla_row(kimi_latent)
    assert name == "MLA draft (the verifier's: q_lora 128, kv_lora 512, nope 64, rope 64, v 64)"
    assert flags == ["--draft-arch", "mla", "--no-norm-before-fc"]
    # q_lora_rank null (a plain q_proj): 0, as models/draft.mla_dims resolves it
    assert "q_lora 0," in dq.mla_row({**kimi_latent, "q_lora_rank": None})[0]
    # the ablation rows: the MLA row swapped in its place, every other row and the order unchanged
    rows = dq.ablation_rows(kimi_latent)
    assert list(rows) == [name if n == dq.MLA_ROW else n for n in dq.ABLATIONS]
    assert all(rows[n] == x for n, x in dq.ABLATIONS.items() if n != dq.MLA_ROW)
    assert dq.ablation_rows(smollm2) == dq.ABLATIONS


def test_only_the_data_sets_a_run_trains_on_are_regenerated_and_extracted():
    dq = _load("draft_quality")
    assert dq.needed_datasets(dq.HEADLINE, None, False, False) == ["given", "regenerated", "regenerated_t1"]
    assert dq.needed_datasets(["project/regenerated_t1"], "regenerated_t1", False, False) == ["regenerated_t1"]
    assert dq.needed_datasets(["speculators/given"], "regenerated", False, False) == ["given", "regenerated"]
    assert dq.needed_datasets(["project/given"], None, True, True) == ["given", "regenerated", "regenerated_t1"]


def test_joined_data_sets_keep_their_parts_in_order_with_unique_ids(tmp_path):
    dq = _load("draft_quality")
    # the default rows stay the three data sets; x2 is asked for, and then regenerates seeds 0 and 1 only
    assert not any(r.endswith("/regenerated_t1x2") for r in dq.HEADLINE)
    assert dq.needed_datasets(["project/regenerated_t1x2"], None, False, False) == ["regenerated_t1x2"]
    assert dq.thinking_dir(tmp_path, 0) == tmp_path / "data/regenerated_t1"
    assert [dq.thinking_seeds(ds) for ds in dq.DATASETS] == [[], [], [0], [0, 1], [0, 1, 2, 3], [0]]
    for seed in (0, 1):
        d = dq.thinking_dir(tmp_path, seed)
        d.mkdir(parents=True)
        rows = [{"id": f"r{i}", "messages": [{"role": "assistant", "content": f"seed {seed} row {i}"}]}
                for i in range(3)]  # fmt: skip
        (d / "conversations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert dq.data_source(tmp_path, "regenerated_t1") == tmp_path / "data/regenerated_t1/conversations.jsonl"
    joined = [json.loads(x) for x in dq.data_source(tmp_path, "regenerated_t1x2").read_text().splitlines()]
    assert [r["id"] for r in joined] == ["r0#s0", "r1#s0", "r2#s0", "r0#s1", "r1#s1", "r2#s1"]
    assert [r["messages"][0]["content"] for r in joined][2:4] == ["seed 0 row 2", "seed 1 row 0"]
    assert not list((tmp_path / "data").glob("*.tmp"))
    # the given rows beside the seed-0 answers, given first
    (tmp_path / "data/given.jsonl").write_text(json.dumps({"id": "g0", "messages": []}) + "\n")
    mixed = dq.data_source(tmp_path, "given_regenerated_t1").read_text().splitlines()
    assert [json.loads(x)["id"] for x in mixed] == ["g0#given", "r0#s0", "r1#s0", "r2#s0"]
    wanted = ["speculators/given_regenerated_t1"]
    assert dq.needed_datasets(wanted, None, False, False) == ["given_regenerated_t1"]


def test_only_ablations_takes_a_whole_name_alone_and_a_prefix_for_all_it_begins():
    dq = _load("draft_quality")
    rows = {**dq.ABLATIONS, dq.SPECULATORS_PEAGLE_ROW: []}
    parallel = [n for n in rows if n.startswith("parallel drafting")]
    assert len(parallel) == 3  # the row and its two variants
    assert list(dq.only_ablations(rows, ["parallel drafting"])) == parallel
    assert list(dq.only_ablations(rows, [dq.PARALLEL_ROW, "MLA draft"])) == [dq.MLA_ROW, dq.PARALLEL_ROW]
    assert dq.only_ablations(rows, None) == rows
