"""What the Kimi-K2.5 verifier's vision tower is given for an image, as vLLM gives it.

vLLM 0.32 (`KimiK25ForConditionalGeneration`, `transformers_utils/processors/kimi_k25_vision_fused.py`):
the chat template renders an image part as `IMAGE_PLACEHOLDER`; the processor replaces its one
`<|media_pad|>` with `image_token_count` copies, one per 2x2 group of 14-pixel patches after the image is
shrunk to the checkpoint's patch limits (never enlarged) and padded to whole groups. `image_pixels` is that
processor's arithmetic (PIL bicubic resize, zero padding, per-channel normalisation, patches in row-major
order). transformers' Kimi_K25ImageProcessor needs torchvision, which this project leaves out (see
requirements.txt); its navit_resize is the same formula.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.core.errors import UserError

# Kimi-K2.5's chat template renders an image part as this, and vLLM's get_placeholder_str says the same
IMAGE_PLACEHOLDER = "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
MEDIA_PAD = "<|media_pad|>"


def draft_input_id_at_image(placeholder_id: int) -> int:
    """The token whose embedding the draft is fed at an image position: the placeholder's, as vLLM serves
    it. vLLM 0.32's proposer (`vllm/v1/spec_decode/llm_base_proposer.py`, the EagleProposer of `eagle.py`)
    hands the draft the multimodal embeddings beside the ids, and both EAGLE-3 draft classes
    (`llama_eagle3.py`, `deepseek_eagle3.py` `embed_input_ids`) ignore them and embed the id; the verifier's
    aux states there come from its forward with the image. SGLang feeds the draft the vision encoder's
    embeddings instead (sglang #23613): a draft trained for one engine does not match the other. The
    token ids written for an image keep this id (data/images.expand_image_tokens), so the draft, which
    embeds its input ids, sees what vLLM feeds it."""
    return placeholder_id


def has_vision_tower(path: Path) -> bool:
    """Whether the checkpoint at `path` sees images: a vision config and the image processor's settings."""
    cfg_file = path / "config.json"
    if not (path / "preprocessor_config.json").is_file() or not cfg_file.is_file():
        return False
    return json.loads(cfg_file.read_text()).get("vision_config") is not None


def processor_settings(path: Path) -> dict[str, Any]:
    """The image processor's settings as a resumable output pins them (`{"media_proc_cfg": ...}`; empty
    for a checkpoint without a vision tower): they set how many tokens each image becomes, so parts
    written under other ones do not belong together."""
    if not has_vision_tower(path):
        return {}
    cfg = json.loads((path / "preprocessor_config.json").read_text()).get("media_proc_cfg")
    return {"media_proc_cfg": cfg}


@dataclass(frozen=True)
class VisionSettings:
    """The image processor's limits, read from the checkpoint's preprocessor_config.json `media_proc_cfg`
    (the keys vLLM's Kimi-K2.5 processor reads)."""

    patch_size: int
    merge_kernel_size: int
    in_patch_limit: int
    patch_limit_on_one_side: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def of_checkpoint(cls, path: Path) -> VisionSettings:
        cfg_file = path / "preprocessor_config.json"
        if not cfg_file.is_file():
            raise UserError(f"{path}: no preprocessor_config.json; image rows need a vision checkpoint")
        cfg = json.loads(cfg_file.read_text()).get("media_proc_cfg")
        if not isinstance(cfg, dict):
            raise UserError(f"{cfg_file}: no media_proc_cfg (not a Kimi-K2.5 image processor)")
        merge = cfg["merge_kernel_size"]
        return cls(
            patch_size=int(cfg["patch_size"]),
            merge_kernel_size=int(merge[0] if isinstance(merge, (list, tuple)) else merge),
            in_patch_limit=int(cfg["in_patch_limit"]),
            patch_limit_on_one_side=int(cfg["patch_limit_on_one_side"]),
            image_mean=tuple(cfg["image_mean"]),
            image_std=tuple(cfg["image_std"]),
        )


@dataclass(frozen=True)
class ResizePlan:
    new_width: int
    new_height: int
    padded_width: int
    padded_height: int
    num_tokens: int


def resize_plan(width: int, height: int, s: VisionSettings) -> ResizePlan:
    """vLLM's navit_resize_image for one image: shrink (never enlarge) to the patch limits, pad to whole
    merge groups; one image token per merged group."""
    p = s.patch_size
    s1 = math.sqrt(s.in_patch_limit / (max(1.0, width // p) * max(1.0, height // p)))
    side = s.patch_limit_on_one_side * p
    scale = min(1.0, s1, side / width, side / height)
    new_w = min(max(1, int(width * scale)), side)
    new_h = min(max(1, int(height * scale)), side)
    factor = s.merge_kernel_size * p
    padded_w = new_w + (factor - new_w % factor) % factor
    padded_h = new_h + (factor - new_h % factor) % factor
    return ResizePlan(new_w, new_h, padded_w, padded_h, (padded_w // factor) * (padded_h // factor))


def image_token_count(image: Any, s: VisionSettings) -> int:
    """How many `<|media_pad|>` tokens the processor expands this image's placeholder to."""
    return resize_plan(*image.size, s).num_tokens


def image_pixels(image: Any, s: VisionSettings) -> tuple[Any, list[int]]:
    """(pixel_values [patches, 3, p, p] float32, grid_thw [1, rows, cols]) as vLLM's processor makes them."""
    import numpy as np
    import torch
    from PIL import Image

    plan = resize_plan(*image.size, s)
    resized = np.asarray(image.resize((plan.new_width, plan.new_height), resample=Image.Resampling.BICUBIC))
    canvas = np.zeros((plan.padded_height, plan.padded_width, 3), dtype=np.uint8)
    canvas[: plan.new_height, : plan.new_width] = resized
    mean, std = np.asarray(s.image_mean, np.float32), np.asarray(s.image_std, np.float32)
    values = (canvas.astype(np.float32) / 255.0 - mean) / std
    p = s.patch_size
    rows, cols = plan.padded_height // p, plan.padded_width // p
    patches = values.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)
    return torch.from_numpy(np.ascontiguousarray(patches)), [1, rows, cols]
