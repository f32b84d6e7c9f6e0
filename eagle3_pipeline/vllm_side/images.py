"""A token prompt with images as vLLM 0.32 takes it for Kimi-K2.5 (run inside vLLM's environment: the
standard library, vLLM and its PIL).

The pipeline's prompts hold each image already expanded: a run of `<|media_pad|>` ids, one per image token
(models/vision.py's count, the ids the simulation and the states see). vLLM's Kimi-K2.5 processor
(`model_executor/models/kimi_k25.py`, a `PromptReplacement` of the single `<|media_pad|>` by the image's
token count) always expands the prompt it is given, also a token prompt: a prompt sent expanded would grow
a second time. So each run goes to vLLM as one placeholder, beside its image as a `vision_chunk` item (the
only modality vLLM's Kimi-K2.5 takes); vLLM's expansion then gives back the pipeline's ids, which the
worker checks (`expanded_prompt_error`).
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from eagle3_pipeline.vllm_side.protocol import RequestError


def decode_image(url: str) -> Any:
    """The RGB image of a `data:...;base64,` URL, as the pipeline's rows keep images."""
    from PIL import Image

    header, sep, payload = url.partition(",")
    if not url.startswith("data:") or not sep or not header.endswith(";base64"):
        raise RequestError(f"image {url[:60]!r} is not a base64 data URL")
    try:
        with Image.open(io.BytesIO(base64.b64decode(payload, validate=True))) as img:
            return img.convert("RGB")
    except (binascii.Error, OSError, ValueError) as e:
        raise RequestError(f"image {url[:60]!r} cannot be decoded ({type(e).__name__}: {e})") from None


def collapse_image_runs(ids: list[int], pad_id: int) -> tuple[list[int], list[int]]:
    """(ids with each run of `pad_id` as one `pad_id`, the runs' lengths): media tokens frame each
    image, so one run is one image."""
    out: list[int] = []
    runs: list[int] = []
    for i, t in enumerate(ids):
        if t == pad_id and i and ids[i - 1] == pad_id:
            runs[-1] += 1
            continue
        if t == pad_id:
            runs.append(1)
        out.append(t)
    return out, runs


def vision_chunk_inputs(prompt_ids: list[int], image_urls: list[str], pad_id: int) -> dict[str, Any]:
    """The vLLM prompt (a TokensPrompt dict) of `prompt_ids`, whose images (`image_urls`, data URLs in
    order) are expanded to runs of `pad_id`: one placeholder per image, the images as vLLM's
    `vision_chunk` items. Without images, the ids alone."""
    if not image_urls:
        return {"prompt_token_ids": list(prompt_ids)}
    ids, runs = collapse_image_runs(list(prompt_ids), pad_id)
    if len(runs) != len(image_urls):
        raise RequestError(f"the prompt holds {len(runs)} image runs of token {pad_id} for "
                           f"{len(image_urls)} images")  # fmt: skip
    chunks = [{"type": "image", "image": decode_image(u), "uuid": None} for u in image_urls]
    return {"prompt_token_ids": ids, "multi_modal_data": {"vision_chunk": chunks}}


def expanded_prompt_error(i: int, sent: list[int], served: list[int] | None, pad_id: int) -> str | None:
    """Why vLLM's expansion of prompt `i` differs from the pipeline's (None when equal): another image
    token count means the image processor's settings differ from those the prompts were made with."""
    if served is None or list(served) == list(sent):
        return None
    ours, theirs = collapse_image_runs(list(sent), pad_id)[1], collapse_image_runs(list(served), pad_id)[1]
    return (f"prompt {i}: vLLM expanded its images to {theirs} tokens, the pipeline to {ours} (the "
            "image processor's settings differ from the verifier's preprocessor_config.json?)")  # fmt: skip


def request_prompts(req: dict[str, Any]) -> list[dict[str, Any]]:
    """A checked request's prompts as vLLM takes them (protocol.load_request: "images", "image_token_id")."""
    urls = req.get("images") or [[] for _ in req["prompts"]]
    return [vision_chunk_inputs(p, u, req.get("image_token_id", -1)) for p, u in zip(req["prompts"], urls)]


def check_served_prompts(req: dict[str, Any], served: list[list[int] | None]) -> None:
    """RequestError unless vLLM's prompt ids (its expansion of the images) are the request's."""
    for i, (sent, got) in enumerate(zip(req["prompts"], served, strict=True)):
        why = expanded_prompt_error(i, sent, got, req.get("image_token_id", -1))
        if why is not None:
            raise RequestError(why)
