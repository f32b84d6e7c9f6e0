"""Image rows: the tiny Kimi-K2.5 with its vision tower, the image checks, the rendering vLLM serves."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_pipeline.data.images import expand_image_tokens
from eagle3_pipeline.models.vision import VisionSettings, image_pixels, image_token_count
from eagle3_pipeline.models.tiny_vl import load_vl, random_image
from eagle3_pipeline.models.vision import MEDIA_PAD


def _image_prompt(path: Path, image) -> tuple[list[int], int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    parts = [{"type": "text", "text": "look: "}, {"type": "image"}, {"type": "text", "text": " what is it?"}]
    messages = [{"role": "user", "content": parts}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    pad = tok.convert_tokens_to_ids(MEDIA_PAD)
    return expand_image_tokens(ids, pad, [image_token_count(image, VisionSettings.of_checkpoint(path))]), pad


def test_tiny_vl_image_reaches_the_states(tiny_vl_verifier):
    """transformers loads the tiny Kimi-K2.5 offline with every weight used; an 84x56 image becomes
    6 image tokens; the states at and after them differ from the same ids without the image, the states
    before them do not (causal)."""
    image = random_image(84, 56, seed=1)
    ids, pad = _image_prompt(tiny_vl_verifier, image)
    assert ids.count(pad) == 6  # (84 / 28) x (56 / 28) merged 2x2 groups of 14-pixel patches
    pixels, grid = image_pixels(image, VisionSettings.of_checkpoint(tiny_vl_verifier))
    model = load_vl(tiny_vl_verifier)
    x = torch.tensor([ids])
    with torch.no_grad():
        grid_thw = torch.tensor([grid])
        seen = model(input_ids=x, pixel_values=pixels, image_grid_thw=grid_thw, output_hidden_states=True)
        blind = model(input_ids=x, output_hidden_states=True)
    at = (x[0] == pad).nonzero().flatten()
    for layer in (1, 4, len(seen.hidden_states) - 1):
        a, b = seen.hidden_states[layer][0], blind.hidden_states[layer][0]
        assert torch.equal(a[: at[0]], b[: at[0]])
        scale = b[at].norm(dim=-1).mean()
        assert (a[at] - b[at]).norm(dim=-1).min() > 0.1 * scale
        assert (a[at[-1] + 1 :] - b[at[-1] + 1 :]).norm(dim=-1).min() > 1e-3 * scale
