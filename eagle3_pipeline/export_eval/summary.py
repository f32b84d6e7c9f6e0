"""The end of a whole run (scripts/run_tiny.sh): one table a person reads at a glance.

The trained draft's simulated acceptance per position on the evaluation prompts next to the untrained
draft's (the same architecture as training initialised it, `05_export.py --checkpoint init`, exported to
`<export out_dir>_init`), and where the export, the plots and the tracker files are. Also draws
acceptance_vs_untrained.png into the export folder.

  python -m eagle3_pipeline.export_eval.summary --config configs/tiny.toml
  python -m eagle3_pipeline.export_eval.summary --config configs/tiny.toml --untrained-dir   # prints that folder
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.export_eval.config import ExportConfig
from eagle3_pipeline.training.config import TrainConfig
from eagle3_pipeline.core.config import config_from_file
from eagle3_pipeline.core.errors import UserError

ACCEPTANCE_NAME = "acceptance_sim.json"  # what `06_evaluate.py --engine sim` writes in the draft folder


def untrained_dir(draft_dir: Path) -> Path:
    """Where run_tiny.sh exports the untrained baseline: beside the draft (tests/test_vllm_tier.py too)."""
    return draft_dir.with_name(draft_dir.name + "_init")


def read_acceptance(draft_dir: Path) -> dict[str, Any]:
    from eagle3_pipeline.core import storage

    path = draft_dir / ACCEPTANCE_NAME
    if not path.is_file():
        raise UserError(f"{path}: missing; run 06_evaluate.py --engine sim --draft-dir {draft_dir} first")
    return storage.read_json(path)


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Rows `label | AL | rate per position` with aligned columns."""
    k = max(len(r["acceptance_rate_per_pos"]) for r in results.values())
    head = f"{'':>10} | {'AL':>6} | " + " ".join(f"{f'pos {p}':>6}" for p in range(k))
    rows = [head]
    for label, r in results.items():
        rates = " ".join(f"{x:6.3f}" for x in r["acceptance_rate_per_pos"])
        rows.append(f"{label:>10} | {r['mean_acceptance_length']:6.3f} | {rates}")
    return rows


def summarize_run(config_path: str) -> list[str]:
    from eagle3_pipeline.training.plots import write_acceptance_plot

    export = config_from_file(ExportConfig, config_path)
    train = config_from_file(TrainConfig, config_path)
    draft = Path(export.out_dir)
    trained = read_acceptance(draft)
    baseline = read_acceptance(untrained_dir(draft))
    results = {"trained": trained["sim"], "untrained": baseline["sim"]}
    ecfg = trained["config"]
    plot = write_acceptance_plot(
        draft / "acceptance_vs_untrained.png",
        results,
        f"simulated acceptance, {trained['num_prompts']} prompts x {trained['max_new_tokens']} tokens, "
        f"k={trained['num_speculative_tokens']}",
    )
    train_dir = Path(train.out_dir)
    lines = [
        f"summary of {config_path}: simulated acceptance at k={trained['num_speculative_tokens']} on "
        f"{trained['num_prompts']} prompts of {ecfg['data_path']} (rows from {ecfg['start_row']}), "
        f"{trained['max_new_tokens']} tokens each",
        *table(results),
        f"export    {draft}  (vLLM: config.json + model.safetensors; 05_export.py printed its serve line)",
        f"plots     {train_dir / 'plots'}/*.png, {plot}",
    ]
    if (train_dir / "tensorboard").is_dir():
        lines.append(f"trackers  tensorboard --logdir {train_dir / 'tensorboard'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True)
    parser.add_argument("--untrained-dir", action="store_true", help="Print the baseline's export folder.")
    args = parser.parse_args(argv)
    try:
        if args.untrained_dir:
            print(untrained_dir(Path(config_from_file(ExportConfig, args.config).out_dir)))
            return 0
        print("\n".join(summarize_run(args.config)))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
