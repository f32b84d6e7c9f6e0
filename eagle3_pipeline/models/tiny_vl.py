"""A tiny Kimi-K2.5 with its vision tower, made locally (no downloads), for the image-row tests.

`python -m eagle3_pipeline.models.tiny_vl --out DIR` writes a Kimi-K2.5 (transformers' `kimi_k25`: a
MoonViT vision tower, the patch-merging projector, a DeepSeek-V3 text model) in Hugging Face layout:
config.json, the weights in the original checkpoint's names (what vLLM's KimiK25ForConditionalGeneration
loads; transformers renames them on load), the byte-level tokenizer of models/tiny.py with Kimi-K2.5's media
tokens, a chat template that renders image parts as Kimi-K2.5's does, and one preprocessor_config.json read by
both transformers' Kimi_K25ImageProcessor and vLLM's fused Kimi-K2.5 image processor (`media_proc_cfg`).

The text model is models/tiny.py's predictable verifier (`kimi_mla` by default: dense, the attention latent
vLLM's CPU MLA kernel takes). The vision tower is random; its projector is scaled so an image token's
feature has the size of a text embedding (~N(0, 1) per coordinate), so an image moves the states after it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.models.tiny import CHAT_TEMPLATE, build_tokenizer, predictable_text_model, save_sharded
from eagle3_pipeline.models.vision import IMAGE_PLACEHOLDER, MEDIA_PAD

# Kimi-K2.5's media tokens
VIDEO_PLACEHOLDER = "<|kimi_k25_video_placeholder|>"
MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", MEDIA_PAD, VIDEO_PLACEHOLDER)
PATCH_SIZE = 14
MERGE_KERNEL = 2
# A string content renders as before; a list of parts renders text parts as their text and image parts as
# the placeholder, in order (Kimi-K2.5's template does the same, with its own role markers).
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ m['content'] }}",
    "{%- if m['content'] is string -%}{{ m['content'] }}{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'text' -%}{{ p['text'] }}{%- else -%}" + IMAGE_PLACEHOLDER + "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}",
)
TINY_VISION = dict(
    patch_size=PATCH_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_hidden_layers=2,
    pos_emb_height=16,
    pos_emb_width=16,
    pos_emb_time=4,
    merge_kernel_size=[MERGE_KERNEL, MERGE_KERNEL],
)
# Images are resized to fit these (both processors): a side of at most 16 patches, 256 patches in all,
# so the largest image is 8 x 8 = 64 image tokens.
MAX_SIDE_PATCHES = 16
MAX_PATCHES = 256
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]


def tokenizer_ids(out_dir: Path) -> dict[str, int]:
    """The media tokens' ids in the tokenizer written to out_dir."""
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    return {t["content"]: t["id"] for t in tok["added_tokens"] if t["content"] in MEDIA_TOKENS}


def preprocessor_config() -> dict[str, Any]:
    """Both image processors' settings, equal: transformers' keys at the top, vLLM's under media_proc_cfg."""
    side = MAX_SIDE_PATCHES * PATCH_SIZE
    return {
        "image_processor_type": "Kimi_K25ImageProcessor",
        "processor_class": "Kimi_K25Processor",
        "size": {"max_height": side, "max_width": side},
        "max_patches": MAX_PATCHES,
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_KERNEL,
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "media_proc_cfg": {
            "patch_size": PATCH_SIZE,
            "merge_kernel_size": MERGE_KERNEL,
            "in_patch_limit": MAX_PATCHES,
            "patch_limit_on_one_side": MAX_SIDE_PATCHES,
            "in_patch_limit_each_frame": MAX_PATCHES,
            "in_patch_limit_video": MAX_PATCHES,
            "fixed_output_tokens": None,
            "temporal_merge_kernel_size": 4,
            "image_mean": IMAGE_MEAN,
            "image_std": IMAGE_STD,
        },
    }


def build_vl_verifier(out_dir: Path, text_arch: str = "kimi_mla", seed: int = 0) -> Path:
    """Write the tiny Kimi-K2.5 VL checkpoint to out_dir.

    The weights are written in the original checkpoint's names (`vision_tower.encoder.blocks.N.wqkv`,
    `mm_projector.proj.0`, `language_model.model.layers...`), which vLLM loads as they are and transformers
    converts on load; transformers' own save_pretrained renames the text layers `blocks` on the way back."""
    import torch
    from transformers import Kimi_K25Config

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir, MEDIA_TOKENS, VL_CHAT_TEMPLATE)
    ids = tokenizer_ids(out_dir)
    text_config, text_model = predictable_text_model(text_arch, seed)
    config = Kimi_K25Config(
        text_config=text_config.to_dict(),
        vision_config=TINY_VISION,
        projection_hidden_size=TINY_VISION["hidden_size"],
        image_token_id=ids[MEDIA_PAD],
        video_token_id=ids[VIDEO_PLACEHOLDER],
        vision_start_token_id=ids["<|media_begin|>"],
        vision_end_token_id=ids["<|media_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["KimiK25ForConditionalGeneration"]  # vLLM's class name
    # as Kimi-K2.5's config: vLLM's chat path then hands image parts to the processor as `vision_chunk`
    # items, the one modality its Kimi-K2.5 processor takes
    config.use_unified_vision_chunk = True
    # as Kimi-K2.5's config.json (transformers' Kimi_K25Config names it image_token_id): vLLM's EAGLE-3
    # proposer reads this key of a Kimi-K2.5 verifier to start a draft beside it (llm_base_proposer.py)
    config.media_placeholder_token_id = ids[MEDIA_PAD]
    config.save_pretrained(str(out_dir))
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2))
    state = {"language_model." + k: v.contiguous() for k, v in text_model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 2)
    state.update(vision_weights(TINY_VISION, text_config.hidden_size, g))
    save_sharded(state, out_dir)
    # image features about as large as a text embedding (~1 per coordinate; random init gives ~0.1),
    # so an image moves the states after it as much as text does
    rms = image_feature_rms(out_dir)
    for k in ("mm_projector.proj.2.weight", "mm_projector.proj.2.bias"):
        state[k] = state[k] / rms
    save_sharded(state, out_dir)
    return out_dir


def vision_weights(vision: dict[str, Any], text_hidden: int, g: Any) -> dict[str, Any]:
    """Random MoonViT and projector weights in the original checkpoint's names and shapes."""
    import torch

    h, i, p = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    merged = h * MERGE_KERNEL * MERGE_KERNEL

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=g) * shape[-1] ** -0.5

    out = {
        "vision_tower.patch_embed.proj.weight": rand(h, 3 * p * p).view(h, 3, p, p),
        "vision_tower.patch_embed.proj.bias": torch.zeros(h),
        "vision_tower.patch_embed.pos_emb.weight": rand(vision["pos_emb_height"], vision["pos_emb_width"], h),
        "vision_tower.encoder.final_layernorm.weight": torch.ones(h),
        "vision_tower.encoder.final_layernorm.bias": torch.zeros(h),
        "mm_projector.pre_norm.weight": torch.ones(h),
        "mm_projector.pre_norm.bias": torch.zeros(h),
        "mm_projector.proj.0.weight": rand(merged, merged),
        "mm_projector.proj.0.bias": torch.zeros(merged),
        "mm_projector.proj.2.weight": rand(text_hidden, merged),
        "mm_projector.proj.2.bias": torch.zeros(text_hidden),
    }
    shapes = {"wqkv": (3 * h, h), "wo": (h, h), "mlp.fc0": (i, h), "mlp.fc1": (h, i)}
    for n in range(vision["num_hidden_layers"]):
        block = f"vision_tower.encoder.blocks.{n}."
        for name, shape in shapes.items():
            out[block + name + ".weight"] = rand(*shape)
            out[block + name + ".bias"] = torch.zeros(shape[0])
        for norm in ("norm0", "norm1"):
            out[block + norm + ".weight"] = torch.ones(h)
            out[block + norm + ".bias"] = torch.zeros(h)
    return {k: v.contiguous() for k, v in out.items()}


def load_vl(path: Path) -> Any:
    """transformers' Kimi_K25ForConditionalGeneration from `path`, float32, eval mode; every weight in the
    file used and none missing (a renamed key would otherwise load as random init)."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    model, info = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"{path}: weights do not match the model: {bad}")
    return model.eval()


def image_feature_rms(path: Path) -> float:
    """Root mean square of the image features (projector output) of a random 56x56 image."""
    import torch

    model = load_vl(path)
    with torch.no_grad():
        feats = image_features(model, path, random_image(56, 56, seed=0))
    return float(feats.pow(2).mean().sqrt())


def random_image(width: int, height: int, seed: int) -> Any:
    """An RGB image of uniform random pixels."""
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy())


def image_features(model: Any, path: Path, image: Any) -> Any:
    """The projector's output for one image: one row per image token."""
    import torch

    from eagle3_pipeline.models.vision import VisionSettings, image_pixels

    pixels, grid = image_pixels(image, VisionSettings.of_checkpoint(path))
    out = model.get_image_features(pixels, torch.tensor([grid]))
    return torch.cat(list(out.pooler_output))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="verifier folder to write")
    p.add_argument("--text-arch", choices=["deepseek_v3", "kimi_mla"], default="kimi_mla")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    build_vl_verifier(Path(a.out), a.text_arch, a.seed)
    print(f"tiny Kimi-K2.5 VL verifier ({a.text_arch} text model) written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
