"""The recipe's schedule scales with the run: warm-up a fraction of it, several validations in it."""

from __future__ import annotations

import json

import pytest
from conftest import read_jsonl

from eagle3_pipeline.training import schedule
from eagle3_pipeline.training.config import TrainConfig


def _validation_steps(total: int, every: int) -> list[int]:
    """The steps at which train.TrainLoop validates: every `every` steps and at the end."""
    return sorted({s for s in range(1, total + 1) if s % every == 0} | {total})


@pytest.mark.parametrize("total_steps", [100, 294, 300, 500, 30000])
def test_default_run_warms_up_at_most_a_tenth_and_validates_at_least_three_times(total_steps):
    cfg = TrainConfig(vocab_mapping_dir="v", out_dir="o")
    warmup = schedule.warmup_steps_for(total_steps, cfg.warmup_ratio, cfg.warmup_steps)
    assert 1 <= warmup <= 0.1 * total_steps
    vals = _validation_steps(total_steps, schedule.every_for(total_steps, cfg.eval_every))
    assert len(vals) >= 3
    saves = schedule.every_for(total_steps, cfg.save_every if cfg.save_every else cfg.eval_every)
    assert saves == schedule.every_for(total_steps, cfg.eval_every)  # every validation is a checkpoint


def test_explicit_warmup_steps_and_cadence_win_over_the_ratios():
    assert schedule.warmup_steps_for(300, 0.02, 100) == 100
    assert schedule.every_for(300, 7) == 7


@pytest.mark.parametrize("kind", schedule.SCHEDULES)
def test_lr_rises_linearly_then_decays_to_the_floor(kind):
    total, warm, floor = 200, 10, 0.1
    f = [schedule.lr_factor(s, warm, total, floor, kind) for s in range(total + 1)]
    assert f[0] == pytest.approx(1 / warm) and f[warm - 1] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(f[: warm - 1], f[1:warm]))
    if kind == "constant":
        assert f[total] == 1.0
    else:
        assert f[total] == pytest.approx(floor)
        assert all(a >= b for a, b in zip(f[warm:], f[warm + 1 :]))


def test_tiny_run_validated_at_least_three_times_and_best_was_a_choice(tiny_run):
    meta = json.loads((tiny_run / "train" / "meta.json").read_text())
    plan = meta["plan"]
    assert plan["warmup_steps"] <= 0.1 * plan["total_steps"]
    best = json.loads((tiny_run / "train" / "checkpoints" / "best.json").read_text())
    ckpt = json.loads(
        (tiny_run / "train" / "checkpoints" / best["checkpoint"] / "checkpoint.json").read_text()
    )
    validated = [k for k in ckpt["history"] if k.startswith("step_")]
    assert len(validated) >= 3
    assert read_jsonl(tiny_run / "train" / "train_log.jsonl")
