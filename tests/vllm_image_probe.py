"""Run by the vLLM environment's python (tests/test_vllm_images.py): Kimi-K2.5 served by vLLM on one chat
with an image. Prints one JSON line: the prompt's token ids as vLLM expanded them and the log-probability
vLLM's verifier gives each prompt token (prompt_logprobs), for an image sent as an OpenAI `image_url` part."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MARK = "vllm_image_probe: "  # vLLM prints to stdout too


def main() -> None:
    from vllm import LLM, SamplingParams

    verifier, url, text_before, text_after = sys.argv[1:5]
    llm = LLM(
        model=verifier, dtype="float32", max_model_len=256, enforce_eager=True, seed=0, max_num_seqs=1,
        compilation_config={"custom_ops": ["all", "-rotary_embedding"]},  # the CPU build's MLA rotary fix
        attention_config={"backend": "CPU_MLA"}, limit_mm_per_prompt={"vision_chunk": 1},
    )  # fmt: skip
    parts = [
        {"type": "text", "text": text_before},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": text_after},
    ]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.chat([{"role": "user", "content": parts}], params)[0]
    logprobs = [None] + [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    print(MARK + json.dumps({"prompt_ids": out.prompt_token_ids, "prompt_logprobs": logprobs}), flush=True)


if __name__ == "__main__":
    main()
