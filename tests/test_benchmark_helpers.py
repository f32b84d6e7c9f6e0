"""The pure helpers of the real-verifier benchmark: sharpness, the standard error of AL, the recipe of a row and
which runs are cached (no model)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    from eagle3_pipeline.core.storage import mark_complete

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
