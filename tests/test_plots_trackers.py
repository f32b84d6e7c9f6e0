"""Plots of stage 04 and 06, experiment trackers (--logger), and the run's closing summary."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from conftest import REPO, read_jsonl, run_script, script

from eagle3_pipeline.training.plots import png_series

TRAINING_PLOTS = ("loss", "accuracy", "acceptance_length", "lr")


def _scalars(tb_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (its reader, purged events left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tiny_run_draws_every_plot_with_its_series(tiny_run):
    log = read_jsonl(tiny_run / "train" / "train_log.jsonl")
    meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    validations = sum(1 for k in _history(tiny_run) if k.startswith("step_")) + 1  # + untrained
    series = {name: png_series(tiny_run / "train" / "plots" / f"{name}.png") for name in TRAINING_PLOTS}
    assert series["loss"] == {"train": len(log), "validation": validations}
    assert series["accuracy"] == {"train acc0": len(log), **{f"val acc{s}": validations for s in range(3)}}
    assert series["acceptance_length"] == {"validation": validations}
    assert series["lr"] == {"logged": len(log), "schedule": meta["plan"]["total_steps"] + 1}
    assert png_series(tiny_run / "draft" / "acceptance_sim.png") == {"sim": 3}
    assert png_series(tiny_run / "draft" / "acceptance_vs_untrained.png") == {"trained": 3, "untrained": 3}


def test_tensorboard_events_hold_the_logged_scalars(tiny_run):
    scalars = _scalars(tiny_run / "train" / "tensorboard")
    log = read_jsonl(tiny_run / "train" / "train_log.jsonl")
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in log]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in log], rel=1e-5)
    history = _history(tiny_run)
    val_steps = sorted(int(k.split("_")[1]) for k in history if k.startswith("step_"))
    assert [s for s, _ in scalars["val/acceptance_length"]] == [0, *val_steps]
    assert scalars["val/acc_0"][0][1] == pytest.approx(history["untrained"]["acc_0"], abs=1e-6)
    assert {"train/lr", "train/acc0", "val/loss", "val/cond_2"} <= set(scalars)


def test_tiny_run_ends_with_held_out_acceptance_far_above_untrained(tiny_run):
    """The quick start's promise: regenerated data, held-out prompts, AL >= 2.5 at k = 3 (issue 19)."""
    trained = json.loads((tiny_run / "draft" / "acceptance_sim.json").read_text())
    untrained = json.loads((tiny_run / "draft_init" / "acceptance_sim.json").read_text())
    assert trained["config"]["data_path"].endswith("heldout_prompts.jsonl")
    assert trained["sim"]["mean_acceptance_length"] >= 2.5, trained["sim"]
    assert untrained["sim"]["mean_acceptance_length"] < 1.2, untrained["sim"]
    log = (tiny_run / "run.log").read_text()
    assert "untrained |" in log and "trained |" in log and "plots" in log


def test_resume_continues_plots_and_tensorboard_curves_without_gaps_or_repeats(tiny_run, tmp_path):
    out = tmp_path / "train"
    args = [script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--out-dir", str(out),
            "--eval-every", "2", "--log-every", "1", "--logger", "tensorboard"]  # fmt: skip
    run_script(*args, "--max-steps", "6")
    # as if killed after step 4 was logged but before its checkpoint: checkpoint 2 is the latest complete,
    # the log ends at 4 (a resume must be the same recipe, max_steps included: the same command is rerun;
    # the tracker's events past step 2, up to 6 here, are all purged by the resume)
    for step in (4, 6):
        shutil.rmtree(out / "checkpoints" / f"step_{step:06d}")
    logged = read_jsonl(out / "train_log.jsonl")
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logged if r["step"] <= 4))
    proc = run_script(*args, "--max-steps", "6")
    assert "resumed from" in proc.stderr
    steps = [r["step"] for r in read_jsonl(out / "train_log.jsonl")]
    assert steps == [1, 2, 3, 4, 3, 4, 5, 6]  # the log keeps both; plots and trackers must not
    assert png_series(out / "plots" / "loss.png") == {"train": 6, "validation": 4}  # untrained, 2, 4, 6
    assert png_series(out / "plots" / "lr.png")["schedule"] == 7
    scalars = _scalars(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in scalars["val/acceptance_length"]] == [0, 2, 4, 6]
    resumed = {r["step"]: r["loss"] for r in read_jsonl(out / "train_log.jsonl")}  # later lines win
    assert dict(scalars["train/loss"])[4] == pytest.approx(resumed[4], rel=1e-5)


def test_unknown_logger_is_refused_before_any_work(tmp_path):
    out = tmp_path / "t"
    proc = run_script(script("04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"), "--out-dir",
                      str(out), "--logger", "tensorboard", "tensorbored", check=False)  # fmt: skip
    assert proc.returncode == 2 and "tensorbored" in proc.stderr and "Traceback" not in proc.stderr
    assert "tensorboard, wandb, mlflow, trackio" in proc.stderr
    assert not out.exists()  # nothing read, nothing written (the shards named in the config are absent)


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_tracker_not_installed_is_a_clear_error_naming_the_package(tmp_path, name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    proc = run_script(script("04_train.py"), "--config", str(REPO / "configs" / "tiny.toml"),
                      "--out-dir", str(tmp_path / "t"), "--logger", name, check=False)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"pip install {name}" in proc.stderr


def _history(tiny_run) -> dict:
    ckpts = sorted((tiny_run / "train" / "checkpoints").glob("step_*"))
    return json.loads((ckpts[-1] / "checkpoint.json").read_text())["history"]
