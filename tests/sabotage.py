"""Copies of a good export with one contract fault each: what vLLM would load without any error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def _copy(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_config(dst: Path, edit) -> None:
    path = dst / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config, indent=2))


def without_head_dim(src: Path, dst: Path) -> Path:
    _copy(src, dst)
    _edit_config(dst, lambda c: c.pop("head_dim"))
    return dst


def without_d2t(src: Path, dst: Path) -> Path:
    _copy(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.pop("d2t")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def aux_ids_shifted(src: Path, dst: Path, by: int = 1) -> Path:
    """Ids in the other convention (SGLang's "output of layer i" is vLLM's i+1): off by one layer."""

    def edit(c: dict) -> None:
        ids = [i + by for i in c["eagle_aux_hidden_state_layer_ids"]]
        c["eagle_aux_hidden_state_layer_ids"] = ids
        c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids

    _copy(src, dst)
    _edit_config(dst, edit)
    return dst


def norm_flag_dropped(src: Path, dst: Path) -> Path:
    """A norm flag the draft was trained with, removed, as a vLLM build older than the flag would read
    the config: it silently defaults to false. Drops the first flag that is true in the export."""

    def edit(c: dict) -> None:
        flag = next(
            f for f in ("norm_output", "norm_before_fc", "fc_norm", "norm_before_residual") if c.get(f)
        )
        c.pop(flag)
        (c.get("eagle_config") or {}).pop(flag, None)

    _copy(src, dst)
    _edit_config(dst, edit)
    return dst


SABOTAGES = {
    "no_head_dim": without_head_dim,
    "no_d2t": without_d2t,
    "aux_ids_shifted": aux_ids_shifted,
    "norm_flag_dropped": norm_flag_dropped,
}
