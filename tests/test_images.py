"""Image rows: the tiny Kimi-K2.5 with its vision tower, the image checks, the rendering vLLM serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.data.images import decode_data_url, expand_image_tokens
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


def _png(width: int, height: int, seed: int = 0) -> bytes:
    import io

    buf = io.BytesIO()
    random_image(width, height, seed).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(data).decode()


def _row(*user_parts: dict) -> dict:
    user = {"role": "user", "content": list(user_parts)}
    return {"messages": [user, {"role": "assistant", "content": "A"}]}


def test_image_parts_of_every_kind_are_read_and_kept_as_data_urls(tmp_path):
    """OpenAI image_url (data URL, relative path, file:// URL), input_image and HF `image` parts: each
    image read and kept with the row as a data URL of the file's bytes, text parts in place."""
    from eagle3_pipeline.data.conversations import normalize_row

    png = _png(30, 20)
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png)
    row = _row(
        {"type": "text", "text": "compare "},
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "image_url", "image_url": {"url": "imgs/a.png"}},
        {"type": "input_image", "image_url": f"file://{tmp_path / 'imgs' / 'a.png'}"},
        {"type": "image", "image": "imgs/a.png"},
        {"type": "text", "text": " please"},
    )
    conv = normalize_row(row, base_dir=tmp_path, images=True)
    assert conv.images == [_data_url(png)] * 4
    kinds = [p["type"] for p in conv.messages[0]["content"]]
    assert kinds == ["text", "image_url", "image_url", "image_url", "image_url", "text"]
    text_only = normalize_row({"messages": [{"role": "user", "content": [{"type": "text", "text": "Q"}]},
                                            {"role": "assistant", "content": "A"}]}, images=True)  # fmt: skip
    assert text_only.messages[0]["content"] == "Q" and text_only.images == []


@pytest.mark.parametrize(
    ("part", "reason"),
    [
        ({"type": "image_url", "image_url": {"url": "gone.png"}}, r"turn 0: image file .*gone.png not found"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}, "not valid base64"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawtext"}}, "not base64"),
        ({"type": "image_url", "image_url": {"url": _data_url(b"not an image")}}, "cannot be decoded"),
        ({"type": "image_url", "image_url": {"url": _data_url(_png(40, 40)[:60])}}, "cannot be decoded"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "web URL"),
        ({"type": "image_url", "image_url": {}}, "no image URL or path"),
        ({"type": "video_url", "video_url": {"url": "v.mp4"}}, "only text and images"),
    ],
)
def test_bad_images_reject_the_row_with_a_reason(tmp_path, part, reason):
    from eagle3_pipeline.data.conversations import RowRejected, normalize_row

    with pytest.raises(RowRejected, match=reason):
        normalize_row(_row({"type": "text", "text": "Q"}, part), base_dir=tmp_path, images=True)


def test_the_pixel_cap_and_images_where_they_cannot_be(monkeypatch):
    """An image over the pixel cap, an image in an assistant turn, and an image row where images are not
    taken (stages 00/01 today) are rejected with their reasons."""
    from eagle3_pipeline.data import images
    from eagle3_pipeline.data.conversations import RowRejected, normalize_row

    part = {"type": "image_url", "image_url": {"url": _data_url(_png(30, 20))}}
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 599)
    with pytest.raises(RowRejected, match=r"30x20 = 600 pixels > 599"):
        normalize_row(_row(part), images=True)
    monkeypatch.undo()
    assert len(normalize_row(_row(part), images=True).images) == 1
    row = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": [part]}]}
    with pytest.raises(RowRejected, match="turn 1 .* has an image"):
        normalize_row(row, images=True)
    with pytest.raises(RowRejected, match="image rows need a verifier with a vision tower"):
        normalize_row(_row(part))


def test_rendering_expands_each_image_to_the_processor_token_count(tiny_vl_verifier):
    """The row renders as vLLM renders it for Kimi-K2.5: the template sees `{"type": "image"}` and writes
    the placeholder; each `<|media_pad|>` expands to the image's count (one per 28x28 group after the
    shrink to 16 patches a side / 256 patches; hand-computed below)."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.conversations import normalize_row, render_ids
    from eagle3_pipeline.models.vision import IMAGE_PLACEHOLDER

    settings = VisionSettings.of_checkpoint(tiny_vl_verifier)
    # 28x28: 1; 84x56: 3x2; 29x28 pads to 56x28: 2; 1000x500 shrinks by 224/1000 to 224x112: 8x4
    sizes = {(28, 28): 1, (84, 56): 6, (29, 28): 2, (1000, 500): 32}
    for (w, h), n in sizes.items():
        assert image_token_count(random_image(w, h, 0), settings) == n
    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    urls = [_data_url(_png(w, h)) for w, h in sizes]
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    conv = normalize_row(_row({"type": "text", "text": "Q"}, *parts), images=True)
    ids = render_ids(tok, conv.messages[:1], True)
    assert tok.decode(ids).count(IMAGE_PLACEHOLDER) == 4
    pad = tok.convert_tokens_to_ids(MEDIA_PAD)
    counts = [image_token_count(decode_data_url(u), settings) for u in conv.images]
    full = expand_image_tokens(ids, pad, counts)
    assert full.count(pad) == sum(sizes.values())
    assert len(full) == len(ids) + sum(sizes.values()) - len(sizes)


def test_the_draft_is_fed_the_placeholder_embedding_at_image_positions(tiny_vl_verifier):
    """As vLLM serves an EAGLE-3 draft beside Kimi-K2.5 (models/vision.draft_input_id_at_image): at every
    image position the training forward's input embedding is the `<|media_pad|>` row of embed_tokens, and
    those positions are out of the loss while the assistant's answer is in it."""
    from conftest import draft_spec
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.conversations import normalize_row, tokenize_conversation
    from eagle3_pipeline.data.images import expand_sample
    from eagle3_pipeline.models.draft import build_draft
    from eagle3_pipeline.training.kernel_policy import Kernels
    from eagle3_pipeline.training.train_metrics import Recipe, forward

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    part = {"type": "image_url", "image_url": {"url": _data_url(_png(84, 56))}}
    conv = normalize_row(_row({"type": "text", "text": "what is it?"}, part), images=True)
    ids, mask = tokenize_conversation(tok, conv.messages, 4096)
    pad = tok.convert_tokens_to_ids(MEDIA_PAD)
    counts = [image_token_count(decode_data_url(u), VisionSettings.of_checkpoint(tiny_vl_verifier))
              for u in conv.images]  # fmt: skip
    ids, mask = expand_sample(ids, mask, pad, counts)
    at = [i for i, t in enumerate(ids) if t == pad]
    assert len(at) == 6 and all(mask[i] == 0 for i in at) and sum(mask) >= 2  # "A" + the end token

    spec = draft_spec(64, len(tok), 64, (1, 2, 3), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    model = build_draft(spec, attn_impl="sdpa").eval()
    with torch.no_grad():
        torch.nn.init.normal_(model.embed_tokens.weight)
    fed: list[torch.Tensor] = []
    hook = model.embed_tokens.register_forward_hook(lambda _m, _i, out: fed.append(out.detach()))
    t = len(ids)
    batch = {
        "hidden_states": torch.randn(1, t, 3 * 64), "input_ids": torch.tensor([ids]),
        "verifier_last": torch.randn(1, t, 64), "loss_mask": torch.tensor([mask]).bool(),
        "document_ids": torch.zeros(1, t, dtype=torch.long), "position_ids": torch.arange(t)[None],
    }  # fmt: skip
    try:
        with torch.no_grad():
            kern = Kernels("sdpa", "eager", False)
            forward(model, batch, Recipe(1, 1.0, "kl_div"), torch.device("cpu"), None, kern)
    finally:
        hook.remove()
    placeholder = model.embed_tokens.weight[pad]
    assert torch.equal(fed[0][0, at], placeholder.expand(len(at), -1))
    assert not torch.equal(fed[0][0, at[0] - 1], placeholder)


def test_the_vllm_prompt_of_an_expanded_image_prompt_has_one_placeholder_per_image():
    """vllm_side/images.vision_chunk_inputs: each run of `<|media_pad|>` (the pipeline's expansion) goes to
    vLLM as one placeholder, which vLLM's processor expands again; the images, in order, as `vision_chunk`
    items with the pixels the simulation decodes. A run count that is not the image count is refused, and a
    served expansion other than ours is named with both token counts."""
    import numpy as np

    from eagle3_pipeline.vllm_side.images import expanded_prompt_error, vision_chunk_inputs
    from eagle3_pipeline.vllm_side.protocol import RequestError

    pad, urls = 9, [_data_url(_png(84, 56, seed=1)), _data_url(_png(30, 70, seed=2))]
    ids = [1, 2, *[pad] * 6, 3, *[pad] * 3, 4]
    got = vision_chunk_inputs(ids, urls, pad)
    assert got["prompt_token_ids"] == [1, 2, pad, 3, pad, 4]
    chunks = got["multi_modal_data"]["vision_chunk"]
    assert [(c["type"], c["uuid"]) for c in chunks] == [("image", None)] * 2
    for c, u in zip(chunks, urls, strict=True):
        assert np.array_equal(np.asarray(c["image"]), np.asarray(decode_data_url(u)))
    assert vision_chunk_inputs(ids, [], pad) == {"prompt_token_ids": ids}
    with pytest.raises(RequestError, match="2 image runs of token 9 for 1 images"):
        vision_chunk_inputs(ids, urls[:1], pad)
    with pytest.raises(RequestError, match="not a base64 data URL"):
        vision_chunk_inputs(ids, [urls[0], "/tmp/x.png"], pad)
    assert expanded_prompt_error(0, ids, ids, pad) is None
    served = [1, 2, *[pad] * 11, 3, *[pad] * 5, 4]  # e.g. sent expanded and expanded again
    assert "to [11, 5] tokens, the pipeline to [6, 3]" in expanded_prompt_error(0, ids, served, pad)


def test_a_longer_request_without_max_model_len_asks_for_an_engine_of_its_length(tmp_path):
    """protocol.load_request fills the default max_model_len (max(512, longest prompt + max_new_tokens +
    2 (k + 1))) before the engine key is taken: a worker whose engine a 320-token request sized at 512
    served a later 460-token request of 64 new tokens in it, cut at 512 (found serving one prompt per call)."""
    from eagle3_pipeline.vllm_side.protocol import engine_key, load_request

    def load(prompt_len: int, **fields):
        path = tmp_path / "req.json"
        (tmp_path / "draft").mkdir(exist_ok=True)
        path.write_text(json.dumps({"verifier": str(tmp_path), "draft": str(tmp_path / "draft"),
                                    "num_speculative_tokens": 3, "prompts": [[1] * prompt_len],
                                    "max_new_tokens": 64, **fields}))  # fmt: skip
        return load_request(str(path))

    short, longer = load(320), load(460)
    assert (short["max_model_len"], longer["max_model_len"]) == (512, 460 + 64 + 2 * (3 + 1))
    assert engine_key(short) != engine_key(longer)
    assert engine_key(load(300)) == engine_key(short)  # both fit the default length: one engine
    assert load(460, max_model_len=2048)["max_model_len"] == 2048  # a given one is kept


def test_a_worker_request_with_images_is_checked_and_asks_for_an_engine_that_takes_them(tmp_path):
    """protocol.load_request: images one list per prompt, the image token id given with them, and an
    engine that takes images ("vision", by default where a prompt has one; an engine key of its own)."""
    from eagle3_pipeline.vllm_side.protocol import RequestError, engine_key, load_request

    url = _data_url(_png(28, 28))

    def load(**fields):
        path = tmp_path / "req.json"
        path.write_text(json.dumps({"verifier": str(tmp_path), "prompts": [[1, 9, 2], [3]],
                                    "max_new_tokens": 4, **fields}))  # fmt: skip
        return load_request(str(path))

    text, image = load(), load(images=[[url], []], image_token_id=9)
    assert (text["vision"], image["vision"]) == (False, True)
    assert engine_key(text) != engine_key(image) and engine_key(load(vision=True)) == engine_key(image)
    for bad, why in (({"images": [[url]]}, "one list per prompt"),
                     ({"images": [[url], []]}, "image_token_id"),
                     ({"images": [[url], []], "image_token_id": 9, "vision": False}, "true when prompts")):
        with pytest.raises(RequestError, match=why):
            load(**bad)
