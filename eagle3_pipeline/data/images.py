"""Images of conversation rows: read, checked, and turned into the tokens and pixels Kimi-K2.5 sees.

An image part (`image_url`, `input_image`, `image`) names its image by a `data:` URL, a `file://` URL or
a local path (relative paths from the conversations file's folder). Each image is read and decoded here;
an unreadable, missing or oversized one rejects its row with a reason. The row keeps every image as a
`data:` URL of the file's own bytes: stage 00's output rows and anything copied from them carry their
pixels with them (no path that breaks when a run folder moves), and the pixel cap bounds their size.

What the verifier is then given for each image (placeholder, token count, pixels) is models/vision.py.
"""

from __future__ import annotations

import base64
import binascii
import io
import mimetypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.models.vision import (
    MEDIA_PAD,
    VisionSettings,
    draft_input_id_at_image,
    has_vision_tower,
    image_pixels,
    image_token_count,
)

IMAGE_PART_TYPES = ("image_url", "input_image", "image")  # OpenAI chat, OpenAI responses, HF processors
# 40 megapixels: above any camera or screenshot a chat sends (a 4K screen is 8.3 MP), below Pillow's own
# decompression-bomb limit (89 MP), and small enough that one decoded RGB image (120 MB) cannot exhaust
# a data worker. Kimi-K2.5 shrinks every image to its patch limit anyway; more pixels add nothing.
MAX_IMAGE_PIXELS = 40_000_000


class ImageRejected(Exception):
    """This image cannot be used; the message says why (its row is rejected with it)."""


def image_ref(part: dict[str, Any]) -> str:
    """The URL or path an image part names, in any of the accepted shapes."""
    kind = part["type"]
    value: Any = part.get("image_url" if kind == "input_image" else kind)  # the Responses API's key
    if kind == "image" and value is None:
        value = part.get("url", part.get("path"))
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise ImageRejected(f"{kind} part has no image URL or path")
    return value


def read_image_bytes(ref: str, base_dir: Path | None) -> bytes:
    """The bytes of the image `ref` names: a data URL's payload or a local file's contents."""
    if ref.startswith("data:"):
        header, sep, payload = ref.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageRejected("data URL is not base64 (`data:image/png;base64,...`)")
        try:
            return base64.b64decode(payload, validate=True)
        except binascii.Error as e:
            raise ImageRejected(f"data URL is not valid base64 ({e})") from None
    parsed = urlparse(ref)
    if parsed.scheme in ("http", "https"):
        raise ImageRejected(f"image {ref[:80]!r} is a web URL: download it and give a local path or data URL")
    path = Path(unquote(parsed.path)) if parsed.scheme == "file" else Path(ref)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ImageRejected(f"image file {path} not found")
    return path.read_bytes()


def checked_image(data: bytes) -> Any:
    """The decoded RGB image, or ImageRejected: not an image, truncated, or over MAX_IMAGE_PIXELS."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ImageRejected(
                    f"image is {width}x{height} = {width * height} pixels > {MAX_IMAGE_PIXELS} (the cap: "
                    "Kimi-K2.5 shrinks it to its patch limit anyway); downscale it"
                )
            probe.load()
            image = probe.convert("RGB")
            image.info["format"] = probe.format  # what the row's data URL names
            return image
    except ImageRejected:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        # Pillow names the unidentified stream by its address: the reason must read the same in every run
        # (a rerun writes the same rejects.jsonl bytes)
        why = "cannot identify image file" if isinstance(e, UnidentifiedImageError) else e
        raise ImageRejected(f"image cannot be decoded ({type(e).__name__}: {why})") from None


def load_part_image(part: dict[str, Any], base_dir: Path | None) -> str:
    """An image part's image, read and checked, as a data URL of the file's bytes (what the row keeps)."""
    data = read_image_bytes(image_ref(part), base_dir)
    image = checked_image(data)
    mime = mimetypes.types_map.get("." + str(image.info["format"]).lower(), "application/octet-stream")
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def row_image_urls(row: dict[str, Any], base_dir: Path | None) -> list[str]:
    """The images of a row's `messages` in order, read and checked, as data URLs (a row with
    `token_samples`, whose messages are for people: only their image parts are read)."""
    urls = []
    for m in row.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        for p in content if isinstance(content, list) else []:
            if isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES:
                urls.append(load_part_image(p, base_dir))
    return urls


def decode_data_url(url: str) -> Any:
    """The RGB image of a data URL kept with a row (checked already when the row was read)."""
    return checked_image(read_image_bytes(url, None))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as vLLM hands them to the chat template: each image part as `{"type": "image"}`
    (vLLM's chat parser keeps the pixels aside; Kimi-K2.5's template renders the part as the placeholder).
    Messages without images are returned as they are."""
    if not any(isinstance(m.get("content"), list) for m in messages):
        return messages
    return [
        {**m, "content": [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]}
        if isinstance(m.get("content"), list) else m
        for m in messages
    ]  # fmt: skip


def expand_image_tokens(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Each `<|media_pad|>` in `ids` repeated as often as its image needs (the processor's replacement);
    each image position holds the id the draft is fed there (models/vision.draft_input_id_at_image)."""
    found = ids.count(pad_id)
    if found != len(counts):
        raise ImageRejected(f"the rendering has {found} image placeholders for {len(counts)} images")
    at_image = draft_input_id_at_image(pad_id)
    out: list[int] = []
    todo = iter(counts)
    for t in ids:
        out.extend([at_image] * next(todo) if t == pad_id else [t])
    return out


def expand_sample(
    ids: list[int], mask: list[int], pad_id: int, counts: list[int]
) -> tuple[list[int], list[int]]:
    """A tokenized sample's ids and loss mask with each image expanded: image positions are out of the
    loss (mask 0; their next token is an image token, which the model never generates)."""
    out_ids = expand_image_tokens(ids, pad_id, counts)
    todo = iter(counts)
    out_mask: list[int] = []
    for t, m in zip(ids, mask, strict=True):
        out_mask.extend([0] * next(todo) if t == pad_id else [m])
    return out_ids, out_mask


def image_runs(ids: list[int], image_id: int) -> list[int]:
    """The lengths of the runs of `image_id` in `ids`: one run per expanded image (media tokens frame
    each image, so two images never form one run)."""
    runs: list[int] = []
    for i, t in enumerate(ids):
        if t == image_id:
            if i and ids[i - 1] == image_id:
                runs[-1] += 1
            else:
                runs.append(1)
    return runs


@dataclass(frozen=True)
class ImageTokens:
    """A vision verifier's images as tokens and pixels: its processor's limits and placeholder id."""

    settings: VisionSettings
    pad_id: int

    @classmethod
    def of_verifier(cls, path: Path, tokenizer: Any) -> ImageTokens | None:
        """The verifier's, or None when it has no vision tower (its image rows are rejected)."""
        if not has_vision_tower(path):
            return None
        pad_id = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
        if not isinstance(pad_id, int) or pad_id == tokenizer.unk_token_id or pad_id < 0:
            raise UserError(f"{path}: the tokenizer has no {MEDIA_PAD} token, which stands for an image's "
                            "tokens; image rows need Kimi-K2.5's tokenizer")  # fmt: skip
        return cls(VisionSettings.of_checkpoint(path), pad_id)

    def counts(self, urls: list[str]) -> list[int]:
        return [image_token_count(decode_data_url(u), self.settings) for u in urls]

    def expand_unit(
        self, ids: list[int], mask: list[int], urls: list[str]
    ) -> tuple[list[int], list[int], list[str]]:
        """A rendered sample (one placeholder per image, the row's images from the first) expanded:
        (ids, mask with image positions out of the loss, the images it holds)."""
        used = urls[: ids.count(self.pad_id)]
        out_ids, out_mask = expand_sample(ids, mask, self.pad_id, self.counts(used))
        return out_ids, out_mask, used

    def images_of(self, ids: list[int], urls: list[str]) -> list[str]:
        """The images an already expanded sample holds (the row's first ones), checked run by run against
        their token counts: ids written for other images, or another processor, reject the row."""
        runs = image_runs(ids, draft_input_id_at_image(self.pad_id))
        used = urls[: len(runs)]
        if len(runs) > len(urls) or runs != self.counts(used):
            raise ImageRejected(
                f"the token ids hold image runs of {runs} tokens, the row's images need {self.counts(used)}"
            )
        return used

    def model_inputs(self, urls: list[str], model: Any = None) -> dict[str, Any]:
        """What the transformers verifier takes beside the ids: pixel_values (in `model`'s dtype, on its
        device, when given) and image_grid_thw."""
        import torch

        pixels = [image_pixels(decode_data_url(u), self.settings) for u in urls]
        values, grid = torch.cat([p for p, _ in pixels]), torch.tensor([g for _, g in pixels])
        if model is not None:
            first = next(model.parameters())
            values, grid = values.to(first.device, first.dtype), grid.to(first.device)
        return {"pixel_values": values, "image_grid_thw": grid}
