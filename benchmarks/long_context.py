"""Acceptance against context length on a Kimi-shaped verifier with yarn positions.

Kimi-K2.5 is served to 262,144 positions by yarn (factor 64 over 4,096 original positions) while its
draft trains on a few thousand tokens. This benchmark builds the same situation small: a DeepSeek-V3
verifier (MLA with Kimi's 512 + 64 latent, routed experts, sigmoid routing) trained a little on Python's
own documentation (benchmarks/trained_verifier.py) under yarn factor 64 over 512 original positions, so
its positions reach 32,768; EAGLE-3 drafts trained by this project's recipe (stages 01-05, 04_train's
defaults) on conversations of at most ~1k tokens, once with `--rope-scaling verifier` (the verifier's
yarn) and once with `none` (plain RoPE); then the simulation (models/acceptance.py, the exported drafts
as vLLM reads them) on held-out long prompts (export_eval/long_prompts.py: document and session kinds)
of about 1k, 4k, 8k, 16k and 32k tokens, k = 3, greedy and Kimi's thinking sampling (1.0 / 0.95).

Each cell is one context bucket (acceptance.context_bucket): mean acceptance length and its standard
error over the bucket's verification steps. Sampled cells count the realisation (a draft is accepted
when it equals the token sampled from p~, the law of vLLM's rejection sampler with argmax drafting;
acceptance.py), no expected counts: those need a verifier pass per step over the whole context.

Cost: the verifier's traces are computed once per prompt (prefill with a KV cache, the aux states taken
from the prefill and each decode step) and shared by both drafts and both settings (the sampled trace
decodes from a copy of the prefill's cache); each draft's first pass attends only from the slots the
rounds read (the prompt's last slot on), which is exact (causal) and linear in the context.

    nice -n 5 .venv/bin/python -m benchmarks.long_context --work-dir outputs/long_context --quick \\
        --out docs/results/long_context.json

`--draft-arch mla` trains and measures the MLA draft (configs/kimi_k25.toml's kind) instead, in folders of
its own beside the Llama drafts' (the verifier and shards are shared).
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import RESULTS
from benchmarks.draft_quality import sh

# Kimi-K2.5's text_config rope_scaling (factor 64, beta 32 / 1, mscale = mscale_all_dim = 1) over 512
# original positions instead of 4,096: 32,768 positions on a model these 2 cores can run at that length.
YARN = {"rope_type": "yarn", "factor": 64.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
MAX_POSITIONS = 32768
# trained_verifier.py's quick shape with yarn, cut for these 2 shared cores, where the 32k prefill's cost
# is heads x layers x head dim x T^2: 3 layers, 2 heads of 32 + 32 dims (Kimi: 64 heads of 128 + 64),
# v_head_dim equal to the query's so torch's CPU flash attention takes it (with unequal head dims sdpa
# falls back to the math kernel, whose T x T scores do not fit at 32k); Kimi's 512-wide latent kept.
VERIFIER_SHAPE = {"num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
                  "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 64,
                  "max_position_embeddings": MAX_POSITIONS, "rope_scaling": YARN}  # fmt: skip
AUX_LAYER_IDS = [1, 2, 3]  # every layer of the 3 (EAGLE-3 takes three)
LENGTHS = (1024, 4096, 8192, 16384, 32768)  # target prompt lengths, less ROOM: one bucket each
ROPE_SETTINGS = ("verifier", "none")
# the draft's layer -> 04_train flags: the Llama layer, or the MLA one configs/kimi_k25.toml trains (with the
# verifier's MLA dims, as the pipeline takes them without --mla-* flags; vLLM's MLA draft has no input_norm)
DRAFT_ARCHS = {"llama": [], "mla": ["--draft-arch", "mla", "--no-norm-before-fc"]}
SETTINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "thinking": {"temperature": 1.0, "top_p": 0.95}}
K = 3
# Prompts per length (document, session alternating), new tokens per request, draft epochs and rows; the
# verifier's (steps, peak lr) phases: --quick's 80 steps fit the shared cores but leave it unsharp
# (docs/results.md), the full size takes trained_verifier.py's own 1,200 steps (None).
SIZES = {
    "quick": {"per_length": 3, "max_new": 16, "epochs": 2, "num_train": 160, "verifier_phases": [(80, 3e-3)]},
    "full": {"per_length": 4, "max_new": 48, "epochs": 5, "num_train": 400, "verifier_phases": None},
}


def room(max_new: int) -> int:
    """Tokens kept free after a prompt: the request's new tokens, the last round's k drafts, and a margin
    so that every step of a request stays in its prompt's bucket."""
    return max_new + K + 8


def build_verifier(work: Path, size: dict, threads: int) -> dict[str, Any]:
    """The yarn verifier in <work>/verifier (cached) and the draft's training rows in <work>/given.jsonl."""
    from benchmarks import trained_verifier as tv

    parts = tv.splits(tv.conversations(), num_train=size["num_train"], num_heldout=32)
    given = work / "given.jsonl"
    if not given.exists():
        given.write_text("".join(json.dumps(r) + "\n" for r in parts["given"]))
    stats = work / "verifier" / "verifier_stats.json"
    if not stats.exists():
        phases = size["verifier_phases"]
        tv.train(work / "verifier", parts["verifier"], parts["heldout"], phases is not None, threads,
                 config_overrides=VERIFIER_SHAPE, phases=phases)  # fmt: skip
    return json.loads(stats.read_text())


def train_drafts(work: Path, size: dict, threads: int, arch: str = "llama") -> dict[str, Path]:
    """Stages 01-03 once, then 04_train + 05_export per rope setting (cached): {setting: export dir}.
    `arch`: the draft's layer (DRAFT_ARCHS; the MLA draft takes the verifier's MLA dims)."""
    log, verifier, data = work / "stages.log", work / "verifier", work / "data"
    if not (data / "split").exists():
        sh(["01_extract_hidden_states.py", "--verifier-path", str(verifier), "--data-path",
            str(work / "given.jsonl"), "--out-dir", str(data / "hidden_states"), "--dtype", "float32",
            "--samples-per-file", "64", "--max-seq-len", "1024", "--aux-layer-ids", *map(str, AUX_LAYER_IDS)],
           log, threads)  # fmt: skip
        sh(["02_build_vocab_mapping.py", "--data-dir", str(data / "hidden_states"), "--out-dir",
            str(data / "vocab"), "--draft-vocab-size", "512"], log, threads)  # fmt: skip
        sh(["03_split_data.py", "--data-dir", str(data / "hidden_states"), "--out-dir", str(data / "split"),
            "--val-ratio", "0.05"], log, threads)  # fmt: skip
    hidden = json.loads((verifier / "config.json").read_text())["hidden_size"]
    out = {}
    for rope in ROPE_SETTINGS:
        name = rope if arch == "llama" else f"{arch}_{rope}"  # (llama's folders predate the MLA ones)
        run, draft = work / f"train_{name}", work / f"draft_{name}"
        if not (draft / "config.json").exists():
            sh(["04_train.py", "--data-dir", str(data / "hidden_states"), "--split-dir", str(data / "split"),
                "--vocab-mapping-dir", str(data / "vocab"), "--out-dir", str(run), "--epochs",
                str(size["epochs"]), "--batch-tokens", "1024", "--max-seq-len", "1024", "--dtype", "float32",
                "--num-attention-heads", "4", "--num-key-value-heads", "4", "--intermediate-size",
                str(3 * hidden), "--max-position-embeddings", str(MAX_POSITIONS), "--rope-scaling", rope,
                "--log-every", "50", *DRAFT_ARCHS[arch]], log, threads)  # fmt: skip
            sh(["05_export.py", "--train-dir", str(run), "--out-dir", str(draft)], log, threads)
        out[rope] = draft
    return out


def long_prompt_rows(verifier: Path, size: dict) -> list[dict[str, Any]]:
    """Held-out long prompts (document and session kinds alternating) at each of LENGTHS less room, in
    rounds of one prompt per length, nearest and farthest first: a run cut short (its JSON is rewritten
    after each prompt) still holds the buckets the must-show compares."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.export_eval.long_prompts import build_rows

    tok = AutoTokenizer.from_pretrained(str(verifier))
    per_length = {}
    for target in LENGTHS:
        n = target - room(size["max_new"])
        docs = build_rows(tok, [n], (size["per_length"] + 1) // 2, ("document",))
        sessions = build_rows(tok, [n], size["per_length"] // 2, ("session",))
        per_length[target] = [r for pair in zip(docs, sessions + [None]) for r in pair if r is not None]
    order = sorted(LENGTHS, key=lambda t: (t != min(LENGTHS), -t))  # 1k, 32k, 16k, 8k, 4k
    return [per_length[t][i] for i in range(size["per_length"]) for t in order if i < len(per_length[t])]


def verifier_traces(
    model: Any, capture: Any, prompt: list[int], n_tokens: int, seed: int, settings: dict | None = None,
    keep_probs: bool = False, banned: tuple[int, ...] = (),
) -> dict[str, tuple]:
    """{setting: (prompt + n_tokens new tokens, aux states of every position but the last)} from one
    prefill: greedy, and sampled at the thinking setting from a copy of the prefill's cache (seeded).
    `settings`: {name: temperature and top_p} (default SETTINGS); `keep_probs`: each tuple also holds p~
    at every new token's step [n_tokens, V] (None when greedy), the probabilistic draft's accept test.
    `banned`: token ids never emitted (their logits -inf at every step, as vLLM's `min_tokens` holds back
    the end tokens), so that a generation runs its whole length."""
    from eagle3_pipeline.models.acceptance import Sampling

    ban = torch.tensor(banned, dtype=torch.long)

    def held(logits: torch.Tensor) -> torch.Tensor:
        return logits.index_fill(0, ban, float("-inf")) if banned else logits

    with torch.no_grad():
        pre = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        aux0 = capture.pop()[0].flatten(1)
        out = {}
        for name, s in (settings or SETTINGS).items():
            sampling = Sampling(s["temperature"], s["top_p"], seed=seed)
            gen = torch.Generator().manual_seed(seed)
            cache, logits, tokens, aux = copy.deepcopy(pre.past_key_values), pre.logits[0, -1], [], [aux0]
            probs = []
            for i in range(n_tokens):
                logits = held(logits)
                if keep_probs and not sampling.greedy:
                    probs.append(sampling.probs(logits))
                tok = int(logits.argmax()) if sampling.greedy else int(
                    torch.multinomial(sampling.probs(logits), 1, generator=gen))  # fmt: skip
                tokens.append(tok)
                if i + 1 < n_tokens:
                    step = model(input_ids=torch.tensor([[tok]]), past_key_values=cache, use_cache=True,
                                 logits_to_keep=1)
                    cache, logits = step.past_key_values, step.logits[0, -1]
                    aux.append(capture.pop()[0].flatten(1))
            out[name] = (torch.tensor(prompt + tokens), torch.cat(aux).float())
            if keep_probs:
                out[name] += (torch.stack(probs) if probs else None,)
    return out


def measure(
    work: Path, drafts: dict[str, Path], rows: list[dict], size: dict, threads: int, done: Any = None
) -> dict:
    """The simulation of every draft and setting over the rows: {draft: {setting: summary}}, and costs;
    `done(partial)` after each row, with what the rows so far give (a long run's results survive it)."""
    from eagle3_pipeline.models.acceptance import AcceptanceCounts, simulate_sequence, trace_length
    from eagle3_pipeline.models.reference_mla import read_export
    from eagle3_pipeline.models.verifier import (AuxCapture, find_decoder_layers, load_verifier_model,
                                                  load_verifier_tensors, verifier_facts)  # fmt: skip

    torch.set_num_threads(threads)
    verifier = work / "verifier"
    facts = verifier_facts(verifier)
    embed = load_verifier_tensors(verifier, facts.tie_word_embeddings)["embed_tokens"]
    refs = {rope: read_export(path, embed) for rope, path in drafts.items()}
    model = load_verifier_model(verifier, torch.float32, False)
    aux_ids = next(iter(refs.values())).aux_layer_ids or AUX_LAYER_IDS
    capture = AuxCapture(find_decoder_layers(model, facts.num_hidden_layers), aux_ids)
    counts = {r: {s: AcceptanceCounts(K) for s in SETTINGS} for r in refs}
    cost: dict[str, float] = {}
    for i, row in enumerate(rows):
        prompt = row["token_samples"][0]["prompt_ids"]
        t0 = time.time()
        traces = verifier_traces(model, capture, prompt, trace_length(size["max_new"], K), i)
        t1 = time.time()
        for rope, ref in refs.items():
            for name, (seq, aux) in traces.items():
                simulate_sequence(ref, aux, seq, len(prompt), K, counts[rope][name], size["max_new"])
        key = str(row["target_tokens"] + room(size["max_new"]))
        cost[key] = cost.get(key, 0.0) + time.time() - t0
        print(f"{row['id']}: {len(prompt)} tokens, verifier {t1 - t0:.0f}s, drafts {time.time() - t1:.0f}s",
              flush=True)  # fmt: skip
        if done is not None:
            done(_results(counts, cost, i + 1))
    capture.remove()
    return _results(counts, cost, len(rows))


def _results(counts: dict, cost: dict[str, float], rows_done: int) -> dict:
    return {
        "results": {r: {s: c.summary() for s, c in per.items()} for r, per in counts.items()},
        "seconds_per_length": {k: round(v, 1) for k, v in cost.items()},
        "rows_done": rows_done,
    }


def ratio(buckets: list[dict], far: str, near: str = "0-1k") -> dict[str, float] | None:
    """AL(far) / AL(near) with its standard error (delta method, independent buckets)."""
    by = {b["context"]: b for b in buckets}
    if far not in by or near not in by:
        return None
    a, b = by[far], by[near]
    r = a["mean_acceptance_length"] / b["mean_acceptance_length"]
    rel = sum(((x["standard_error"] or 0.0) / x["mean_acceptance_length"]) ** 2 for x in (a, b)) ** 0.5
    return {"ratio": round(r, 3), "standard_error": round(r * rel, 3)}


def table(results: dict) -> list[str]:
    """Markdown rows: context | per draft and setting, AL ± SE (steps)."""
    cols = [(r, s) for r in results for s in SETTINGS]
    lines = ["| context | " + " | ".join(f"rope {r}, {s}" for r, s in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]  # fmt: skip
    contexts = [b["context"] for b in results[cols[0][0]][cols[0][1]]["acceptance_by_context"]["buckets"]]
    for ctx in contexts:
        cells = []
        for r, s in cols:
            b = {x["context"]: x for x in results[r][s]["acceptance_by_context"]["buckets"]}.get(ctx)
            se = b and b["standard_error"]
            cells.append("-" if b is None else f"{b['mean_acceptance_length']:.3f} ± {se or 0:.3f} "
                                               f"({b['num_drafts']})")  # fmt: skip
        lines.append(f"| {ctx} | " + " | ".join(cells) + " |")
    return lines


def report_of(m: dict, size: dict, stats: dict, rows: list[dict], seconds: dict, threads: int) -> dict:
    far = {r: {s: ratio(v["acceptance_by_context"]["buckets"], "16k-32k") for s, v in per.items()}
           for r, per in m["results"].items()}  # fmt: skip
    return {
        "benchmark": "long_context", "size": size, "k": K, "settings": SETTINGS, "yarn": YARN,
        "verifier": {k: v for k, v in stats.items() if k != "config"},
        "prompts": [{"id": r["id"], "tokens": r["prompt_tokens"]} for r in rows],
        "ratio_16k_32k_to_0_1k": far, **m, "seconds": seconds,
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "threads": threads, "torch_threads": torch.get_num_threads(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", type=Path, required=True, help="verifier, shards, drafts (cached)")
    p.add_argument("--quick", action="store_true", help="3 prompts per length, 16 new tokens, 2 epochs")
    p.add_argument("--per-length", type=int, help="prompts per length (default: the size's)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per request (default: the size's)")
    p.add_argument("--draft-arch", choices=list(DRAFT_ARCHS), default="llama",
                   help="the drafts' layer (mla: the Kimi config's; trains into its own folders)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=RESULTS / "long_context.json",
                   help="results JSON, rewritten after each prompt")
    a = p.parse_args(argv)
    size = dict(SIZES["quick" if a.quick else "full"])
    size.update({k: v for k, v in (("per_length", a.per_length), ("max_new", a.max_new_tokens)) if v})
    a.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    stats = build_verifier(a.work_dir, size, a.threads)
    drafts = train_drafts(a.work_dir, size, a.threads, a.draft_arch)
    t1 = time.time()
    rows = long_prompt_rows(a.work_dir / "verifier", size)

    def write(m: dict) -> dict:
        seconds = {"build": round(t1 - t0, 1), "measure": round(time.time() - t1, 1)}
        report = {"draft_arch": a.draft_arch, **report_of(m, size, stats, rows, seconds, a.threads)}
        if a.out:
            a.out.write_text(json.dumps(report, indent=1) + "\n")
        return report

    report = write(measure(a.work_dir, drafts, rows, size, a.threads, write))
    print("\n".join(table(report["results"])))
    print(json.dumps({k: report[k] for k in ("ratio_16k_32k_to_0_1k", "seconds", "seconds_per_length")},
                     indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
