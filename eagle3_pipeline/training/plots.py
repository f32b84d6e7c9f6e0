"""PNG plots of a training run (stage 04) and of an acceptance measurement (stage 06), with matplotlib.

Stage 04 writes `<out_dir>/plots/`: loss.png (train loss per log interval, validation loss), accuracy.png
(validation acc_s per TTT position, train acc0), acceptance_length.png (validation, untrained at step 0)
and lr.png (the planned schedule and the logged values), all against the global optimizer step. They are
drawn from train_log.jsonl and the validation history the checkpoints carry, so a resumed run redraws
them whole: a log line written twice (after the last checkpoint of an interrupted run, then again by
the resume) counts once, the later one.
Stage 06 writes acceptance_<engine>.png beside its JSON: accepted rate per draft position; and
acceptance_<engine>_by_context.png: mean acceptance length per context bucket (log2 axis), +- its error.
Each PNG names what it holds in its metadata ("Series": JSON {label: number of points}), for the tests
and for anyone checking a plot without looking at it.

Redraw a finished run: python -m eagle3_pipeline.training.plots runs/tiny/train
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.training import checkpoint
from eagle3_pipeline.core import storage
from eagle3_pipeline.training import schedule

PLOTS_DIR = "plots"
Series = dict[str, tuple[list[float], list[float]]]  # label -> (x, y)


def read_train_log(path: Path) -> list[dict[str, Any]]:
    """The log lines by step, the last one written for each step (a resume rewrites what it redoes)."""
    by_step: dict[int, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


def validation_points(history: dict[str, Any]) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of each validation, the untrained one at step 0, sorted by step."""
    points = [(0, history["untrained"])] if "untrained" in history else []
    points += [(int(k.split("_")[1]), v) for k, v in history.items() if k.startswith("step_")]
    return sorted(points, key=lambda p: p[0])


def lr_curve(meta: dict[str, Any]) -> tuple[list[float], list[float]]:
    """The learning rate after each optimizer step as the scheduler computes it (schedule.py)."""
    plan, recipe = meta["plan"], meta["recipe"]
    steps = list(range(plan["total_steps"] + 1))
    lrs = [
        recipe["lr"]
        * schedule.lr_factor(s, plan["warmup_steps"], plan["total_steps"], recipe["min_lr_ratio"],
                             recipe["lr_schedule"])
        for s in steps
    ]  # fmt: skip
    return [float(s) for s in steps], lrs


def training_series(train_dir: Path, history: dict[str, Any]) -> dict[str, Series]:
    """What each stage-04 plot shows: {plot name: {label: (steps, values)}}."""
    logged = read_train_log(train_dir / "train_log.jsonl")
    vals = validation_points(history)
    vsteps = [float(s) for s, _ in vals]
    positions = sorted(int(k.split("_")[1]) for k in (vals[0][1] if vals else {}) if k.startswith("acc_"))
    lsteps = [float(r["step"]) for r in logged]
    out: dict[str, Series] = {
        "loss": {"train": (lsteps, [r["loss"] for r in logged])},
        "accuracy": {"train acc0": (lsteps, [r["acc0"] for r in logged])},
        "acceptance_length": {},
        "lr": {"logged": (lsteps, [r["lr"] for r in logged])},
    }
    if vals:
        out["loss"]["validation"] = (vsteps, [v["loss"] for _, v in vals])
        for p in positions:
            out["accuracy"][f"val acc{p}"] = (vsteps, [v[f"acc_{p}"] for _, v in vals])
        out["acceptance_length"]["validation"] = (vsteps, [v["acceptance_length"] for _, v in vals])
    meta_path = train_dir / storage.META_NAME
    if meta_path.exists():
        out["lr"]["schedule"] = lr_curve(storage.read_json(meta_path))
    return out


TRAINING_PLOTS = {  # name -> (title, y label, log scale)
    "loss": ("loss (train per log interval, validation)", "loss", True),
    "accuracy": ("accuracy per draft position (acc_s: positions 0..s all right)", "accuracy", False),
    "acceptance_length": ("validation acceptance length (1 + sum of acc_s over served_k)", "tokens", False),
    "lr": ("learning rate", "lr", False),
}


def write_training_plots(train_dir: Path, history: dict[str, Any]) -> list[Path]:
    """Draw the four stage-04 plots into <train_dir>/plots/ (replacing older ones); their paths."""
    out_dir = train_dir / PLOTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, series in training_series(train_dir, history).items():
        title, ylabel, log_y = TRAINING_PLOTS[name]
        paths.append(line_plot(out_dir / f"{name}.png", title, "optimizer step", ylabel, series, log_y))
    return paths


def line_plot(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Series,
    log_y: bool = False,
) -> Path:
    """Lines per series; validations (a few points, far apart) and logged lr values get markers."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    for label, (x, y) in series.items():
        style = "o" if label == "logged" else "o-" if label.startswith("val") else "-"
        ax.plot(x, y, style, label=label, markersize=3)
    if log_y and all(v > 0 for _, ys in series.values() for v in ys):
        ax.set_yscale("log")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, {k: len(x) for k, (x, _) in series.items()})


def write_acceptance_plot(path: Path, results: dict[str, dict[str, Any]], title: str) -> Path:
    """Bars of the accepted rate per draft position, one group per result (an engine, or trained vs
    untrained), each labelled with its mean acceptance length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    width = 0.8 / max(1, len(results))
    for n, (label, summary) in enumerate(results.items()):
        rates = summary["acceptance_rate_per_pos"]
        xs = [p + (n - (len(results) - 1) / 2) * width for p in range(len(rates))]
        bars = ax.bar(xs, rates, width, label=f"{label}: AL {summary['mean_acceptance_length']:.3f}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    k = max(len(s["acceptance_rate_per_pos"]) for s in results.values())
    ax.set_xticks(range(k), [f"position {p}" for p in range(k)])
    ax.set(title=title, ylabel="accepted / drafts", ylim=(0, 1.05))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, {k: len(s["acceptance_rate_per_pos"]) for k, s in results.items()})


def by_context_plot_path(acceptance_png: Path) -> Path:
    """acceptance_<engine>[...]_by_context.png beside acceptance_<engine>[...].png."""
    return acceptance_png.with_name(acceptance_png.stem + "_by_context.png")


def write_acceptance_by_context_plot(path: Path, results: dict[str, dict[str, Any]], title: str) -> Path:
    """Mean acceptance length against context length, one line per result (its
    "acceptance_by_context" buckets, acceptance.by_context), each bucket at its geometric middle on a log2
    axis (the first, from 0, at half its end) with +- one standard error."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    series, ticks = {}, {}
    for label, summary in results.items():
        buckets = summary.get("acceptance_by_context", {}).get("buckets", [])
        if not buckets:  # (no drafts, or a result without buckets): no line
            continue
        xs = [(b["context_min"] * b["context_max"]) ** 0.5 or b["context_max"] / 2 for b in buckets]
        ys = [b["mean_acceptance_length"] for b in buckets]
        errs = [b["standard_error"] or 0.0 for b in buckets]
        ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=label)
        ticks.update({x: b["context"] for x, b in zip(xs, buckets)})
        series[label] = len(buckets)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [ticks[x] for x in sorted(ticks)], fontsize=7)
    ax.minorticks_off()
    ax.set(title=title, xlabel="context (prompt + generated tokens) at the verification step",
           ylabel="mean acceptance length")  # fmt: skip
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    return _save(fig, path, series)


def png_series(path: Path) -> dict[str, int]:
    """The "Series" a plot of this module recorded in its PNG metadata: {label: points}."""
    from PIL import Image

    with Image.open(path) as img:
        img.verify()  # raises on a truncated or corrupt PNG
    with Image.open(path) as img:
        return json.loads(img.text["Series"])


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a training box
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, series: dict[str, int]) -> Path:
    """Write to a temporary name and rename, so a reader never sees half a PNG."""
    plt = _pyplot()
    tmp = path.with_name(path.name + ".tmp")
    fig.tight_layout()
    fig.savefig(tmp, format="png", metadata={"Series": json.dumps(series)})
    plt.close(fig)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Redraw the plots of a stage-04 run folder.")
    parser.add_argument("train_dir", type=Path)
    args = parser.parse_args(argv)
    ckpt = checkpoint.latest(checkpoint.root_of(args.train_dir))
    history = storage.read_json(ckpt / "checkpoint.json").get("history", {}) if ckpt else {}
    for p in write_training_plots(args.train_dir, history):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
