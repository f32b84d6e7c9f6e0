"""What image rows buy: a draft trained on text rows only against one trained on text + image rows.

Kimi-K2.5 is a vision-language model; its draft reads the verifier's states, which after an image depend
on the pixels. This benchmark builds the situation small. The verifier is models/tiny_vl.py's tiny
Kimi-K2.5 (MoonViT tower, projector, DeepSeek-V3 text model with Kimi's attention latent), but its text
model as built is models/tiny.py's hand-made "predictable" one, which continues each token with a fixed
next(x) and all but ignores the image (its greedy output on a held-out image prompt is the same with and
without the pixels). So the text model and projector are first trained a little here (vision tower kept
random and frozen: its features still tell colours and shapes apart): steps alternate a batch of rows of
generated images (PIL shapes in colours, on white or black) whose answers name the colour and shape in
varied phrasings (cross-entropy) and a batch of text rows of Python's documentation (trained_verifier.py)
on which the untrained verifier's distribution is the target (KL), so its text stays what it was. Its
answers to an image then depend on the pixels, and its text prompts keep the predictable chain.

Then the project's recipe on that verifier: stage 00 (--engine hf, Kimi's thinking sampling 1.0 / 0.95:
the verifier writes every answer, so the drafts learn the verifier) on text rows and on image rows (new
images and questions), stage 01 per set, and two drafts (vocab mappings of 128 tokens, every byte the
answers use, so the drafts differ in their rows only) with the same optimizer steps (04_train
--max-steps): A on the text rows only, B on the text + image rows. The
measurement is stage 06's simulation (models/acceptance.py) on held-out image prompts and held-out text
prompts, greedy and sampled at 1.0 / 0.95 (drafts accepted when equal to the token sampled from p~, the
law of vLLM's rejection sampler with argmax drafting), k = 3: mean acceptance length per cell with its
standard error (requests as clusters), and B / A per prompt kind with the paired standard error (both
drafts on the same traces). The verifier's sharpness is reported beside it: its mean top-token
probability and how often the image changes its greedy next token.

    nice -n 5 .venv/bin/python -m benchmarks.image_rows --work-dir outputs/image_rows --threads 1 \\
        --out docs/results/image_rows.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import RESULTS
from benchmarks.draft_quality import al_ratio_standard_error, al_standard_error, sh

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (235, 215, 40),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}  # fmt: skip
SHAPES = ("circle", "square", "triangle", "cross")
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}
IMAGE_SIDE = 56  # 4 x 4 patches of 14: 2 x 2 = 4 image tokens per image
IMAGE_QUESTIONS = ("What is in this image?", "Describe the picture.", "What do you see?",
                   "What shape and colour is this?", "Tell me what the image shows.")  # fmt: skip
# Varied phrasings keep the verifier's answers from being one string per image (a flat-out deterministic
# verifier tells nothing under sampling); the colour and shape words depend on the pixels.
ANSWERS = ("It is a {c} {s}.", "A {c} {s} on {b}.", "I see a {c} {s}.",
           "The image shows a {c} {s} on a {b} background.", "This is a {c} {s}, drawn on {b}.")  # fmt: skip
K = 3
SETTINGS = {"greedy": {"temperature": 0.0, "top_p": 1.0}, "thinking": {"temperature": 1.0, "top_p": 0.95}}
# Rows per set, the verifier's training (steps, lr, batch), the drafts' optimizer steps, new tokens.
SIZE = {"verifier_rows": 600, "verifier_steps": 240, "verifier_lr": 1e-3, "verifier_batch": 8,
        "train_rows": 96, "heldout": 24, "draft_steps": 60, "max_new": 24, "regen_new": 40}  # fmt: skip


def draw(shape: str, colour: str, background: str, rng: random.Random) -> Any:
    """A IMAGE_SIDE-pixel square image of one shape, its size and place jittered."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), BACKGROUNDS[background])
    d = ImageDraw.Draw(img)
    r = rng.randint(14, 22)
    cx, cy = (rng.randint(r + 2, IMAGE_SIDE - r - 2) for _ in range(2))
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        d.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        w = max(3, r // 3)
        d.rectangle((cx - r, cy - w, cx + r, cy + w), fill=fill)
        d.rectangle((cx - w, cy - r, cx + w, cy + r), fill=fill)
    return img


def image_rows(folder: Path, name: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n chat rows, each a question about a new image saved under folder/images (path relative to
    folder) and an answer naming its colour and shape."""
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        c, s, b = rng.choice(list(COLOURS)), rng.choice(SHAPES), rng.choice(list(BACKGROUNDS))
        rel = f"images/{name}-{i:04d}.png"
        draw(s, c, b, rng).save(folder / rel)
        question = [{"type": "text", "text": rng.choice(IMAGE_QUESTIONS) + " "},
                    {"type": "image_url", "image_url": {"url": rel}}]  # fmt: skip
        answer = rng.choice(ANSWERS).format(c=c, s=s, b=b)
        rows.append({"id": f"{name}-{i:04d}", "messages": [{"role": "user", "content": question},
                                                           {"role": "assistant", "content": answer}]})
    return rows


def text_rows(name: str, rows: list[dict], max_chars: int = 160) -> list[dict[str, Any]]:
    """The documentation rows' first turns, their answers cut to max_chars."""
    return [{"id": f"{name}-{i:04d}", "messages": [r["messages"][0], {"role": "assistant",
             "content": r["messages"][1]["content"][:max_chars]}]} for i, r in enumerate(rows)]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_data(work: Path, size: dict) -> dict[str, Path]:
    """The row files (cached): the verifier's training rows, the drafts' text and image rows, held-out
    image and text prompts; disjoint documentation rows and images."""
    from benchmarks import trained_verifier as tv

    data = work / "data"
    files = {k: data / f"{k}.jsonl" for k in ("verifier", "train_text", "train_image", "held_image",
                                                 "held_text")}  # fmt: skip
    if all(f.exists() for f in files.values()):
        return files
    data.mkdir(parents=True, exist_ok=True)
    n, h, v = size["train_rows"], size["heldout"], size["verifier_rows"] // 2
    docs = tv.conversations(max_chars=400)
    verifier = text_rows("vtext", docs[2 * n + h : 2 * n + h + v]) + image_rows(data, "vimage", v, 1)
    random.Random(0).shuffle(verifier)
    write_jsonl(files["verifier"], verifier)
    write_jsonl(files["train_text"], text_rows("text", docs[:n]))
    write_jsonl(files["train_image"], image_rows(data, "image", n, 2))
    write_jsonl(files["held_image"], image_rows(data, "held-image", h, 3))
    write_jsonl(files["held_text"], text_rows("held-text", docs[n : n + h]))
    return files


def _examples(path: Path, verifier: Path) -> list[tuple[list[int], list[int], list[str]]]:
    """(prompt ids with images expanded, answer ids + end token, image data URLs) per row."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.conversations import read_rows
    from eagle3_pipeline.data.images import ImageTokens
    from eagle3_pipeline.data.samples import SampleOptions, first_prompt

    tok = AutoTokenizer.from_pretrained(str(verifier))
    opts = SampleOptions(0, images=ImageTokens.of_verifier(verifier, tok), base_dir=path.parent)
    out = []
    for raw in read_rows(path, 0, 10**9):
        ids, urls = first_prompt(raw.value, tok, opts)
        answer = tok.encode(raw.value["messages"][1]["content"], add_special_tokens=False)
        out.append((ids, answer + [tok.eos_token_id], urls))
    return out


# The verifier's text model and projector, transformers' names -> the checkpoint's (tiny_vl writes the
# original checkpoint's names, which vLLM and this project's loaders read).
TRAINED_PREFIXES = {"model.language_model.": "language_model.model.", "lm_head.": "language_model.lm_head.",
                    "model.mm_projector.in_proj.": "mm_projector.proj.0.",
                    "model.mm_projector.out_proj.": "mm_projector.proj.2.",
                    "model.mm_projector.pre_norm.": "mm_projector.pre_norm."}  # fmt: skip


def checkpoint_name(name: str) -> str | None:
    """The checkpoint's name of a trained parameter, None for the (frozen) vision tower's."""
    for ours, theirs in TRAINED_PREFIXES.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return None


def _batch(examples: list, model: Any, images: Any) -> dict[str, Any]:
    """Right-padded ids, attention mask, labels on the answers only, and the rows' pixels in row order."""
    import torch

    width = max(len(p) + len(a) for p, a, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for r, (p, a, _) in enumerate(examples):
        seq = torch.tensor(p + a)
        ids[r, : len(seq)], mask[r, : len(seq)] = seq, 1
        labels[r, len(p) : len(seq)] = torch.tensor(a)
    urls = [u for _, _, us in examples for u in us]
    pixels = images.model_inputs(urls, model) if urls else {}
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **pixels}


def _step_loss(model: Any, base: Any, batch: dict[str, Any]) -> Any:
    """Image rows: cross-entropy on their answers. Text rows: KL(base || model) on the answer positions,
    the untrained verifier's distribution as the target, which keeps its text model's behaviour."""
    import torch

    if "pixel_values" in batch:
        return model(**batch).loss
    labels = batch.pop("labels")
    at = labels[:, 1:] != -100
    logits = model(**batch).logits[:, :-1][at]
    with torch.no_grad():
        target = base(**batch).logits[:, :-1][at].log_softmax(-1)
    return torch.nn.functional.kl_div(logits.log_softmax(-1), target, log_target=True, reduction="batchmean")


def train_verifier(work: Path, rows: Path, size: dict) -> dict[str, Any]:
    """<work>/verifier (cached): tiny_vl's checkpoint with its text model and projector trained on `rows`,
    steps alternating a batch of image rows and one of text rows (_step_loss; AdamW, cosine decay); its
    statistics."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.images import ImageTokens
    from eagle3_pipeline.models.tiny import save_sharded
    from eagle3_pipeline.models.tiny_vl import build_vl_verifier, load_vl

    out, stats_file = work / "verifier", work / "verifier" / "verifier_stats.json"
    if stats_file.exists():
        return json.loads(stats_file.read_text())
    shutil.rmtree(out, ignore_errors=True)
    base_dir = build_vl_verifier(work / "verifier_base")
    examples = _examples(rows, base_dir)
    pools = [[e for e in examples if e[2]], [e for e in examples if not e[2]]]
    images = ImageTokens.of_verifier(base_dir, AutoTokenizer.from_pretrained(str(base_dir)))
    model, base = load_vl(base_dir).train(), load_vl(base_dir)
    for n, p in model.named_parameters():
        p.requires_grad_(checkpoint_name(n) is not None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=size["verifier_lr"])
    steps, rng, losses = size["verifier_steps"], random.Random(0), ([], [])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    for step in range(steps):
        batch = _batch(rng.sample(pools[step % 2], size["verifier_batch"]), model, images)
        loss = _step_loss(model, base, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses[step % 2].append(loss.item())
    state = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    trained = {checkpoint_name(n): p.detach().contiguous() for n, p in model.named_parameters()}
    state.update({k: v for k, v in trained.items() if k is not None})
    shutil.copytree(base_dir, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_sharded(state, out)
    stats = {"steps": steps, "rows": len(examples), "image_ce_first": losses[0][0],
             "image_ce_last10": sum(losses[0][-10:]) / 10, "text_kl_first": losses[1][0],
             "text_kl_last10": sum(losses[1][-10:]) / 10}  # fmt: skip
    stats_file.write_text(json.dumps(stats, indent=1))
    return stats


def train_drafts(work: Path, files: dict[str, Path], size: dict, threads: int) -> dict[str, Path]:
    """Stages 00-05 (cached): {"A": text-only draft export, "B": text + image draft export}."""
    log, verifier = work / "stages.log", str(work / "verifier")
    hs = {}
    for kind in ("text", "image"):
        regen, hs[kind] = work / f"regen_{kind}", work / "hidden_states" / kind
        if not (regen / "COMPLETE").exists():
            sh(["00_regenerate.py", "--verifier-path", verifier, "--data-path", str(files[f"train_{kind}"]),
                "--out-dir", str(regen), "--engine", "hf", "--max-new-tokens", str(size["regen_new"]),
                "--temperature", "1.0", "--top-p", "0.95", "--max-seq-len", "512"], log, threads)  # fmt: skip
        if not hs[kind].exists():
            sh(["01_extract_hidden_states.py", "--verifier-path", verifier, "--data-path",
                str(regen / "conversations.jsonl"), "--out-dir", str(hs[kind]), "--engine", "hf",
                "--dtype", "float32", "--samples-per-file", "32"], log, threads)  # fmt: skip
    out = {}
    for name, dirs in (("A", [hs["text"]]), ("B", [hs["text"], hs["image"]])):
        split, run, draft = work / f"split_{name}", work / f"train_{name}", work / f"draft_{name}"
        vocab = work / f"vocab_{name}"
        if not (draft / "config.json").exists():
            sh(["02_build_vocab_mapping.py", "--data-dir", *map(str, dirs), "--out-dir", str(vocab),
                "--draft-vocab-size", "128"], log, threads)  # fmt: skip
            sh(["03_split_data.py", "--data-dir", *map(str, dirs), "--out-dir", str(split), "--val-ratio",
                "0.05"], log, threads)  # fmt: skip
            sh(["04_train.py", "--data-dir", *map(str, dirs), "--split-dir", str(split),
                "--vocab-mapping-dir", str(vocab), "--out-dir", str(run), "--epochs", "100", "--max-steps",
                str(size["draft_steps"]), "--batch-tokens", "1024", "--max-seq-len", "512", "--dtype",
                "float32", "--num-attention-heads", "4", "--num-key-value-heads", "4", "--head-dim", "64",
                "--intermediate-size", "512", "--log-every", "25"], log, threads)  # fmt: skip
            sh(["05_export.py", "--train-dir", str(run), "--checkpoint", "latest", "--out-dir", str(draft)],
               log, threads)  # the same optimizer steps for both, not the best validated step
        out[name] = draft
    return out


class Verifier:
    """The trained verifier in this process: its aux states for the drafts, its traces with the pixels."""

    def __init__(self, work: Path, aux_ids: list[int]):
        import torch
        from transformers import AutoTokenizer

        from eagle3_pipeline.data.images import ImageTokens
        from eagle3_pipeline.models.verifier import (AuxCapture, find_decoder_layers, load_verifier_model,
                                                     load_verifier_tensors, verifier_facts)  # fmt: skip

        self.path = work / "verifier"
        facts = verifier_facts(self.path)
        self.tok = AutoTokenizer.from_pretrained(str(self.path))
        self.images = ImageTokens.of_verifier(self.path, self.tok)
        self.model = load_verifier_model(self.path, torch.float32, False)
        self.capture = AuxCapture(find_decoder_layers(self.model, facts.num_hidden_layers), aux_ids)
        self.embed = load_verifier_tensors(self.path, facts.tie_word_embeddings)["embed_tokens"]

    def prompts(self, path: Path, n: int) -> tuple[list[list[int]], list[list[str]]]:
        from eagle3_pipeline.export_eval.evaluate import prompts_with_images

        return prompts_with_images(self.tok, path, 0, n, {}, self.images)

    def pixels(self, urls: list[str]) -> dict[str, Any]:
        return self.images.model_inputs(urls, self.model) if urls else {}

    def sharpness(self, seq: Any, prompt_len: int, urls: list[str]) -> dict[str, list[float]]:
        """Over a trace's new tokens: the top token's probability (temperature 1), whether it holds
        >= 0.95 (p~ at top_p 0.95 is then one token), and (with images) whether the greedy next token
        changes when the forward is not given the pixels."""
        import torch

        with torch.no_grad():
            seen = self.model(input_ids=seq[None], use_cache=False, **self.pixels(urls)).logits[0]
            blind = self.model(input_ids=seq[None], use_cache=False).logits[0] if urls else seen
        self.capture.states.clear()
        at = slice(prompt_len - 1, seq.numel() - 1)
        top = seen[at].softmax(-1).max(-1).values
        changed = (seen[at].argmax(-1) != blind[at].argmax(-1)).float()
        return {"top_prob": top.tolist(), "one_token": (top >= 0.95).float().tolist(),
                "image_changes_next": changed.tolist() if urls else []}  # fmt: skip


def measure_kind(v: Verifier, drafts: dict[str, Any], path: Path, size: dict) -> dict[str, Any]:
    """Both settings on one prompt file: per setting, each draft's cell and B / A; the sharpness."""
    import torch

    from eagle3_pipeline.models.acceptance import (AcceptanceCounts, Sampling, simulate_sequence,
                                                   trace_length, verifier_trace_with_aux,
                                                   verify_pass)  # fmt: skip

    prompts, urls = v.prompts(path, size["heldout"])
    out: dict[str, Any] = {"prompts": len(prompts), "prompts_with_images": sum(map(bool, urls))}
    sharp: dict[str, list[float]] = {"top_prob": [], "one_token": [], "image_changes_next": []}
    for setting, params in SETTINGS.items():
        sampling, counts = Sampling(**params), {n: AcceptanceCounts(K) for n in drafts}
        for i, (p, u) in enumerate(zip(prompts, urls)):
            pixels = v.pixels(u)
            gen = torch.Generator().manual_seed(i)  # request i seeded as stage 06 seeds it (seed 0 + i)
            seq, aux, probs = verifier_trace_with_aux(v.model, v.capture, p, trace_length(size["max_new"], K),
                                                      sampling, gen, pixels)  # fmt: skip
            verify = None if sampling.greedy else verify_pass(v.model, v.capture, sampling, pixels)
            for n, d in drafts.items():
                simulate_sequence(d, aux, seq, len(p), K, counts[n], size["max_new"], probs, verify)
            if setting == "greedy":
                for key, vals in v.sharpness(seq[: len(p) + size["max_new"]], len(p), u).items():
                    sharp[key] += vals
        out[setting] = cells(counts)
    out["sharpness"] = {k: sum(x) / len(x) if x else None for k, x in sharp.items()}
    return out


def cells(counts: dict[str, Any]) -> dict[str, Any]:
    """Per draft: the realised mean acceptance length (a draft counted accepted when equal to the trace's
    token) with its standard error over requests, the expected one beside it (sampled: prod p~);
    then B / A on the same requests with its paired standard error."""
    out: dict[str, Any] = {}
    for n, c in counts.items():
        s = c.summary(sampled=True)
        out[n] = {"mean_acceptance_length": s["sampled_mean_acceptance_length"],
                  "standard_error": al_standard_error(c.per_request),
                  "expected_mean_acceptance_length": s["mean_acceptance_length"],
                  "acceptance_rate_per_pos": s["sampled_acceptance_rate_per_pos"],
                  "num_drafts": s["num_drafts"]}  # fmt: skip
    a, b = counts["A"].per_request, counts["B"].per_request
    out["ratio_B_to_A"] = out["B"]["mean_acceptance_length"] / out["A"]["mean_acceptance_length"]
    out["ratio_standard_error"] = al_ratio_standard_error(b, a)
    return out


def measure(work: Path, files: dict[str, Path], drafts: dict[str, Path], size: dict) -> dict[str, Any]:
    from eagle3_pipeline.models.reference_mla import read_export

    aux_ids = json.loads((drafts["A"] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    v = Verifier(work, aux_ids)
    read = {n: read_export(d, v.embed) for n, d in drafts.items()}
    try:
        return {kind: measure_kind(v, read, files[f"held_{kind}"], size) for kind in ("image", "text")}
    finally:
        v.capture.remove()


def train_steps(work: Path) -> dict[str, Any]:
    """Each draft's planned and last logged optimizer step (the same for both) and training samples."""
    out = {}
    for name in ("A", "B"):
        run = work / f"train_{name}"
        meta = json.loads((run / "meta.json").read_text())
        last = json.loads((run / "train_log.jsonl").read_text().splitlines()[-1])
        out[name] = {"total_steps": meta["plan"]["total_steps"], "last_logged_step": last["step"],
                     "train_samples": meta["num_train"], "last_loss": last["loss"]}  # fmt: skip
    return out


def table(results: dict[str, Any]) -> list[str]:
    lines = ["| prompts | setting | A: text rows | B: text + image rows | B / A |", "|---|---|---|---|---|"]
    for kind in ("image", "text"):
        for setting in SETTINGS:
            c = results[kind][setting]
            lines.append(f"| {kind} | {setting} | {c['A']['mean_acceptance_length']:.3f} ± "
                         f"{c['A']['standard_error']:.3f} | {c['B']['mean_acceptance_length']:.3f} ± "
                         f"{c['B']['standard_error']:.3f} | {c['ratio_B_to_A']:.3f} ± "
                         f"{c['ratio_standard_error']:.3f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", type=Path, required=True, help="verifier, rows, shards, drafts (cached)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--draft-steps", type=int, default=SIZE["draft_steps"],
                   help="each draft's optimizer steps (both the same)")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "image_rows.json")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    size = dict(SIZE, draft_steps=a.draft_steps)
    a.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    files = make_data(a.work_dir, size)
    stats = train_verifier(a.work_dir, files["verifier"], size)
    t1 = time.time()
    drafts = train_drafts(a.work_dir, files, size, a.threads)
    t2 = time.time()
    results = measure(a.work_dir, files, drafts, size)
    seconds = {"verifier": round(t1 - t0, 1), "stages": round(t2 - t1, 1),
               "measure": round(time.time() - t2, 1)}  # fmt: skip
    report = {"size": size, "k": K, "settings": SETTINGS, "verifier": stats,
              "drafts": train_steps(a.work_dir), "results": results, "seconds": seconds,
              "threads": a.threads}  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(table(results)))
    print(json.dumps({k: results[k]["sharpness"] for k in results} | {"seconds": seconds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
