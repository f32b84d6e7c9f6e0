"""Experiment trackers for stage 04 behind one setting, `--logger` (TrainConfig.loggers, several allowed).

TensorBoard ships with the project (requirements.txt); wandb, mlflow and trackio are optional and
imported only when named, so a run without them never pays their import. Every tracker plots against
the global optimizer step, so a resumed run continues the same curves:
  tensorboard  <out_dir>/tensorboard/ event files; a resume hides the events past its checkpoint's step
               (SummaryWriter's purge_step), so steps logged again after an interruption show once
  wandb        offline by default (WANDB_MODE=online to upload), files under <out_dir>/wandb, the run id
               kept in <out_dir>/trackers.json and resumed ("allow") under the same id
  mlflow       a local store <out_dir>/mlflow.db (SQLite) and <out_dir>/mlflow-artifacts
               (MLFLOW_TRACKING_URI to use a server), the run id kept in trackers.json, reopened on resume
  trackio      its local project database; the run name is the run folder's, resumed ("allow")
Only rank 0 opens a tracker under torchrun; the others get an empty fan-out.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eagle3_pipeline.core import storage
from eagle3_pipeline.core.errors import UserError

log = logging.getLogger("eagle3.train")

# logger name -> (module imported, pip package that provides it)
KNOWN_LOGGERS = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
STATE_NAME = "trackers.json"  # run ids a resume reopens
PROJECT = os.environ.get("EAGLE3_TRACKER_PROJECT", "eagle3")  # wandb project, mlflow experiment, trackio


def check_loggers(names: list[str]) -> None:
    """Refuse a logger whose package is missing here, before the run does any work (the names are among
    KNOWN_LOGGERS: TrainConfig's `loggers` choices)."""
    for name in names:
        module, package = KNOWN_LOGGERS[name]
        if importlib.util.find_spec(module) is None:
            raise UserError(
                f"logger {name!r} needs the {package} package, which is not installed here: "
                f"pip install {package} (into this environment), or leave {name} out of --logger"
            )


class Sink(Protocol):
    where: str  # for the log line: where its files or its run are

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class Trackers:
    """The chosen trackers as one: log to each, close each. Empty on ranks other than 0."""

    sinks: list[Sink] = field(default_factory=list)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def prefixed(group: str, metrics: dict[str, float]) -> dict[str, float]:
    """Tracker keys such as train/loss, val/acc_0: one panel group per source."""
    return {f"{group}/{k}": float(v) for k, v in metrics.items()}


def open_trackers(
    names: list[str], out_dir: Path, config: dict[str, Any], resume_step: int, rank: int
) -> Trackers:
    """The trackers named, opened to continue from `resume_step` (0: a fresh run); rank 0 only."""
    if rank != 0 or not names:
        return Trackers()
    check_loggers(names)
    state_path = out_dir / STATE_NAME
    state = storage.read_json(state_path) if state_path.exists() and resume_step else {}
    openers = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow, "trackio": _Trackio}
    sinks = [openers[n](out_dir, config, resume_step, state) for n in dict.fromkeys(names)]
    storage.write_json_atomic(state_path, state)  # the openers filled in their run ids
    log.info("trackers | %s", " | ".join(f"{n} {s.where}" for n, s in zip(dict.fromkeys(names), sinks)))
    return Trackers(sinks)


class _TensorBoard:
    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int, state: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(out_dir / "tensorboard")
        # purge_step: the interrupted session's events past the checkpoint it resumes from (steps the
        # resume logs again) are hidden, so each step appears once, from the resumed run
        self.writer = SummaryWriter(self.where, purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class _Wandb:
    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int, state: dict) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")  # no account or network needed; `wandb sync` later
        state.setdefault("wandb", uuid.uuid4().hex[:8])  # wandb ids: short, lowercase alphanumeric
        self.run = wandb.init(
            project=PROJECT, name=out_dir.name, id=state["wandb"], resume="allow", dir=str(out_dir),
            config=config,
        )  # fmt: skip
        self.where = f"{out_dir}/wandb ({os.environ['WANDB_MODE']}, run {state['wandb']})"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int, state: dict) -> None:
        from mlflow.tracking import MlflowClient

        # mlflow 3 refuses its file store ("maintenance mode"): a SQLite file in the run folder instead
        server = os.environ.get("MLFLOW_TRACKING_URI")
        uri = server or f"sqlite:///{(out_dir / 'mlflow.db').resolve()}"
        # without a server, artifacts would land in ./mlruns of whatever folder the run started in
        artifacts = None if server else (out_dir / "mlflow-artifacts").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if "mlflow" not in state:
            exp = self.client.get_experiment_by_name(PROJECT)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(PROJECT, artifacts)
            state["mlflow"] = self.client.create_run(exp_id, run_name=out_dir.name).info.run_id
            self.client.log_dict(state["mlflow"], config, "config.json")
        else:
            self.client.update_run(state["mlflow"], status="RUNNING")
        self.run_id = state["mlflow"]
        self.where = f"{uri} (run {self.run_id})"

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k.replace("/", "_"), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, out_dir: Path, config: dict[str, Any], resume_step: int, state: dict) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=PROJECT, name=out_dir.name, config=config, resume="allow")
        self.where = f"project {PROJECT}, run {out_dir.name} (`trackio show` to look)"

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.trackio.log(metrics, step=step)

    def close(self) -> None:
        self.trackio.finish()
