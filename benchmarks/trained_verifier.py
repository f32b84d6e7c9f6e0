"""A small trained DeepSeek-V3 verifier (MLA + MoE) and chat conversations, from text on this machine.

The draft-quality benchmark needs a verifier whose hidden states look like a real model's (trained,
well above a bigram model) and chat data in its style; random or hand-built "predictable" verifiers
make acceptance meaningless. Everything here comes from the Python installation itself: the reference
topics of the language manual (`pydoc_data.topics`) and the docstrings of standard-library modules,
turned into one- and two-turn conversations ("What does X do?" -> its documentation).

MLA shapes follow Kimi-K2.5's latent (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, the only width
vLLM's CPU MLA kernel takes), with `topk_method: noaux_tc` and `scoring_func: sigmoid` like Kimi
(without scoring_func vLLM routes with softmax, silently).

    python -m benchmarks.trained_verifier --out outputs/verifier --quick     # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import random
import sys
import time
from pathlib import Path

from eagle3_pipeline.models.tiny import (
    SPECIAL_TOKENS,
    byte_level_tokenizer,
    save_chat_tokenizer,
    tiny_config,
)

# Standard-library modules whose docstrings make the corpus (sorted: the same text on every machine
# with the same Python).
DOC_MODULES = sorted(
    "abc argparse ast asyncio base64 bisect calendar cmath codecs collections colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch fractions "
    "ftplib functools getopt gettext glob gzip hashlib heapq hmac html http imaplib inspect io ipaddress "
    "itertools json logging lzma mailbox math mimetypes multiprocessing netrc numbers operator optparse "
    "os pathlib pickle pickletools pkgutil platform plistlib poplib pprint profile pstats queue quopri "
    "random re reprlib sched secrets selectors shelve shlex shutil signal smtplib socket sqlite3 ssl stat "
    "statistics string struct subprocess symtable sysconfig tabnanny tarfile tempfile textwrap threading "
    "timeit tokenize tomllib trace traceback turtle typing unittest urllib uuid wave weakref xml zipfile "
    "zipimport zlib".split()
)
QUESTIONS = ["What does {} do?", "Explain {}.", "Tell me about {}.", "How do I use {}?", "Describe {}."]


def documentation_items() -> list[tuple[str, str]]:
    """(name, text) pairs: language reference topics, then module/class/function docstrings."""
    import pydoc_data.topics as topics

    items = [(f"the {name} topic", text.strip()) for name, text in sorted(topics.topics.items())]
    for mod_name in DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # noqa: BLE001 - a module missing from this build is simply skipped
            continue
        if mod.__doc__ and len(mod.__doc__) > 80:
            items.append((f"the {mod_name} module", inspect.cleandoc(mod.__doc__)))
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80 and (inspect.isclass(obj) or inspect.isfunction(obj)):
                items.append((f"{mod_name}.{attr}", doc))
    return items


def _chunks(text: str, max_chars: int) -> list[str]:
    """Paragraph-aligned pieces of at most max_chars characters."""
    out, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > max_chars:
            out.append(cur.strip())
            cur = ""
        cur += para[:max_chars] + "\n\n"
    if cur.strip():
        out.append(cur.strip())
    return out


def conversations(seed: int = 0, max_chars: int = 900) -> list[dict]:
    """Every documentation item as chat rows: one turn per piece, two pieces -> a two-turn row."""
    rng = random.Random(seed)
    rows = []
    for n, (name, text) in enumerate(documentation_items()):
        pieces = _chunks(text, max_chars)
        for i in range(0, len(pieces), 2):
            messages = [
                {"role": "user", "content": rng.choice(QUESTIONS).format(name)},
                {"role": "assistant", "content": pieces[i]},
            ]
            if i + 1 < len(pieces):
                messages += [
                    {"role": "user", "content": "Go on."},
                    {"role": "assistant", "content": pieces[i + 1]},
                ]
            rows.append({"id": f"doc{n:05d}-{i:03d}", "messages": messages})
    rng.shuffle(rows)
    return rows


def splits(rows: list[dict], num_train: int = 400, num_heldout: int = 64) -> dict[str, list[dict]]:
    """Disjoint row sets: the draft's training conversations, held-out prompts, the verifier's own text."""
    return {
        "given": rows[:num_train],
        "heldout": rows[num_train : num_train + num_heldout],
        "verifier": rows[num_train + num_heldout :],
    }


def build_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE trained on the corpus, the chat special tokens first after the merges."""
    from tokenizers import models, pre_tokenizers, trainers

    tok = byte_level_tokenizer(models.BPE())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    save_chat_tokenizer(tok, out_dir)


def verifier_config(vocab_size: int, tok: object, quick: bool) -> dict:
    """The tiny DeepSeek-V3 (MLA + MoE) of models/tiny.py at a trainable size, with Kimi-K2.5's latent
    (kv_lora_rank 512 + qk_rope_head_dim 64 = 576, vLLM CPU MLA's only width) and this tokenizer's ids."""
    hidden, layers = (192, 4) if quick else (256, 4)
    sizes = {"hidden_size": hidden, "intermediate_size": hidden * 3, "moe_intermediate_size": hidden // 2}
    ids = {f"{n}_token_id": getattr(tok, f"{n}_token_id") for n in ("bos", "eos", "pad")}
    # kimi_mla's latent with MoE layers after the first (kimi_mla's are all dense, for vLLM's CPU kernels)
    moe = {"first_k_dense_replace": 1, "routed_scaling_factor": 1.0}
    return {**tiny_config("kimi_mla"), **sizes, **ids, **moe, "vocab_size": vocab_size,
            "num_hidden_layers": layers, "rms_norm_eps": 1e-6}  # fmt: skip


def _token_stream(tok: object, rows: list[dict]) -> list[int]:
    ids: list[int] = []
    for r in rows:
        text = tok.apply_chat_template(r["messages"], tokenize=False)
        ids += tok(text, add_special_tokens=False)["input_ids"]
    return ids


def bigram_accuracy(train_ids: list[int], test_ids: list[int]) -> float:
    """Held-out next-token accuracy of the most frequent successor of each token (trained on train_ids)."""
    from collections import Counter, defaultdict

    succ: dict[int, Counter] = defaultdict(Counter)
    for a, b in zip(train_ids, train_ids[1:]):
        succ[a][b] += 1
    unigram = Counter(train_ids).most_common(1)[0][0]
    best = {a: c.most_common(1)[0][0] for a, c in succ.items()}
    hits = sum(best.get(a, unigram) == b for a, b in zip(test_ids, test_ids[1:]))
    return hits / max(1, len(test_ids) - 1)


def train(
    out_dir: Path, rows: list[dict], heldout: list[dict], quick: bool, threads: int, seed: int = 0,
    resume_phase1: bool = False, config_overrides: dict | None = None, phases: list | None = None,
) -> dict:  # fmt: skip
    """Train the verifier on `rows` for fixed steps and save it; returns its statistics.
    `config_overrides`: config.json keys replaced, `phases`: (steps, peak lr) per phase replaced (another
    benchmark's shape and budget, e.g. yarn positions)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for r in rows for m in r["messages"]]
    vocab_size = 2048
    if not (resume_phase1 and (out_dir / "tokenizer.json").is_file()):
        build_tokenizer(texts, vocab_size, out_dir)
    tok = AutoTokenizer.from_pretrained(str(out_dir))
    cfg_dict = {**verifier_config(len(tok), tok, quick), **(config_overrides or {})}
    config = AutoConfig.for_model(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    config.architectures = cfg_dict["architectures"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    train_ids = torch.tensor(_token_stream(tok, rows))
    test_ids = _token_stream(tok, heldout)
    seq_len, batch = 256, 8
    # Fixed phases of steps (the same verifier on every machine; ~1.2-3 s a step on 2 cores here), each
    # with a fresh AdamW, a 50-step warm-up and a cosine to a tenth, its data order seeded by its index.
    phases = phases or ([(150, 3e-3)] if quick else [(500, 3e-3), (700, 1.5e-3)])
    t0, losses = time.time(), []
    first = 0
    if resume_phase1 and (out_dir / "model.safetensors").is_file():  # continue a finished first phase
        from safetensors.torch import load_file

        model.load_state_dict(_fused_layout(load_file(str(out_dir / "model.safetensors"))))
        first = 1
    model.train()
    for n, (steps, peak_lr) in enumerate(phases):
        if n < first:
            continue
        opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, weight_decay=0.1, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(seed + n)
        for step in range(steps):
            lr = (
                peak_lr
                * min(1.0, (step + 1) / 50)
                * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
            )
            for group in opt.param_groups:
                group["lr"] = lr
            starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch,), generator=g)
            x = torch.stack([train_ids[s : s + seq_len] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.detach()))
            if (step + 1) % 50 == 0:
                print(f"verifier phase {n} step {step + 1} | loss {sum(losses[-50:]) / 50:.3f} | "
                      f"{time.time() - t0:.0f}s", flush=True)  # fmt: skip
    step = sum(p[0] for p in phases)
    model.eval()
    acc = _heldout_accuracy(model, test_ids, seq_len)
    stats = {
        "steps": step,
        "train_seconds": round(time.time() - t0, 1),
        "train_tokens": len(train_ids),
        "final_train_loss": sum(losses[-20:]) / max(1, len(losses[-20:])),
        "heldout_next_token_accuracy": acc,
        "bigram_heldout_next_token_accuracy": bigram_accuracy(train_ids.tolist(), test_ids),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": cfg_dict,
    }
    save_file(
        checkpoint_layout(model.state_dict()), str(out_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    config.save_pretrained(str(out_dir))
    (out_dir / "verifier_stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def _fused_layout(state: dict) -> dict:
    """checkpoint_layout's inverse: per-expert tensors back into transformers' fused parameters."""
    import torch

    out, experts = {}, {}
    for k, v in state.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, name = rest.split(".", 1)
            experts.setdefault(prefix, {}).setdefault(int(e), {})[name] = v
        else:
            out[k] = v
    for prefix, per in experts.items():
        ids = sorted(per)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([per[e]["gate_proj.weight"], per[e]["up_proj.weight"]]) for e in ids]
        )
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj.weight"] for e in ids])
    return out


def checkpoint_layout(state: dict) -> dict:
    """transformers 5 keeps routed experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]); DeepSeek-V3 checkpoints (and vLLM's loader) name them per expert
    (`experts.<e>.gate_proj.weight` ...). Written per expert: both load it."""
    out = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :inter].contiguous()
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].contiguous()
        else:
            out[k] = v.contiguous()
    return out


def _heldout_accuracy(model: object, ids: list[int], seq_len: int) -> float:
    import torch

    hits = total = 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, seq_len):
            x = torch.tensor(ids[s : s + seq_len + 1])
            if len(x) < 2:
                break
            logits = model(input_ids=x[None, :-1], use_cache=False).logits[0]
            hits += int((logits.argmax(-1) == x[1:]).sum())
            total += len(x) - 1
    return hits / max(1, total)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--resume-phase1", action="store_true", help="continue from a saved first phase")
    a = p.parse_args(argv)
    parts = splits(conversations())
    stats = train(
        Path(a.out), parts["verifier"], parts["heldout"], a.quick, a.threads, resume_phase1=a.resume_phase1
    )
    print(json.dumps({k: v for k, v in stats.items() if k != "config"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
