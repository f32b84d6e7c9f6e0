"""Stage 00: regenerate the assistant turns of conversations with the verifier itself.

A draft learns the distribution it will be asked to predict at serving time: the verifier's own
output. Public EAGLE-3 drafts (the EAGLE-3 paper; every public Kimi-K2.5 draft) train on responses
the verifier regenerated; on the draft-quality benchmark it is the largest single lever (docs/results.md).

Per row, the assistant turns are regenerated in order: turn i's prompt is the chat template rendered
over the row up to i (earlier assistant turns already regenerated, the user turns kept) with the
generation prompt, and its completion is what the verifier generates, up to and including its end
token. Each row keeps the regenerated text in `messages` (for people and templates) and the exact
token ids in `token_samples` ([{turn, prompt_ids, completion_ids, finish_reason}]), which stage 01
uses verbatim, never re-rendered.

Output (`<out_dir>/`): part-00000.jsonl ... (blocks of `rows_per_part` input rows, each written
atomically: the unit of resume), run.json (settings a resume must match), then conversations.jsonl
(all parts in order: stage 01's --data-path), rejects.jsonl, meta.json and COMPLETE.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from eagle3_pipeline.data import parts
from eagle3_pipeline.core import storage
from eagle3_pipeline.core.cli import progress
from eagle3_pipeline.data.config import RegenerateConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.data.conversations import (
    NO_VISION_TOWER,
    Conversation,
    RawRow,
    RowRejected,
    count_rows,
    normalize_row,
    read_rows,
    render_ids,
)
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import StageOutput
from eagle3_pipeline.data.images import ImageRejected, ImageTokens
from eagle3_pipeline.data.samples import accepted_rows
from eagle3_pipeline.models.verifier import read_text_config, verifier_fingerprint
from eagle3_pipeline.models.vision import has_vision_tower, processor_settings

log = logging.getLogger("eagle3.regenerate")

OUTPUT_NAME = "conversations.jsonl"
# How a sampled turn is seeded (run.json: a resume of a run seeded otherwise is refused): each turn draws from
# its own generator seeded by (--seed, row, turn), so rows sample independently, and a turn's answer is the
# same whichever part, batch or resume it runs in. One seed shared by every request would give every row the
# same random draws step for step (vLLM's per-request generator, torch's global one): answers correlated
# across the data set, e.g. most rows ending at the same steps.
TURN_SEEDS = "sha256(seed:row:turn)"
# why a row gives no regenerated turn
NO_PROMPTED_TURN = "no assistant turn after a prompt (an assistant turn that opens the row answers nothing)"
NO_TURN_FITS = "no assistant turn whose prompt fits max_seq_len"


def resolve_engine(name: str, vllm_python: str | None) -> str:
    from eagle3_pipeline.vllm_side import vllm_engine

    if name != "auto":
        return name
    ok, _ = vllm_engine.available(vllm_python)
    return "vllm" if ok else "hf"


def end_token_ids(verifier_path: Path, tokenizer: Any) -> list[int]:
    """The ids that end a turn: the tokenizer's eos and the checkpoint's generation_config eos."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = verifier_path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if not ids:
        raise UserError(f"{verifier_path}: no eos token id in the tokenizer or generation_config.json")
    return sorted(ids)


def hf_dtype() -> Any:
    """The transformers generator's compute dtype: bfloat16 on CUDA, float32 on CPU."""
    import torch

    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def engine_settings(engine: str, vllm_python: str | None) -> dict[str, Any]:
    """What of the engine changes the generated tokens besides the flags (a resume must match it, or its
    parts would differ from an uninterrupted run's): transformers' compute dtype; vLLM's version, dtype
    and tensor-parallel size (the floats of its kernels, hence greedy ties and sampled tokens)."""
    if engine == "hf":
        return {"dtype": str(hf_dtype()).removeprefix("torch.")}
    import torch

    from eagle3_pipeline.vllm_side.extract_vllm import vllm_version
    from eagle3_pipeline.vllm_side.vllm_engine import gpu_engine_fields

    return {**gpu_engine_fields(torch.cuda.device_count()), "vllm_version": vllm_version(vllm_python)}


class HFGenerator:
    """Batch-of-one generation with transformers (the CPU fallback; exact greedy)."""

    def __init__(self, verifier_path: Path, cfg: RegenerateConfig, stop_ids: list[int]):
        import torch

        from eagle3_pipeline.models.verifier import load_verifier_model

        self.model = load_verifier_model(verifier_path, hf_dtype(), cfg.trust_remote_code)
        self.cfg, self.stop_ids = cfg, stop_ids

    def __enter__(self) -> HFGenerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def generate(
        self, prompts: list[list[int]], max_new: list[int], seeds: list[int],
        image_inputs: list[dict[str, Any]] | None = None,
    ) -> list[tuple[list[int], str]]:  # fmt: skip
        """Each prompt's completion, sampled with its own seed (turn_seed); `image_inputs[i]`: its
        pixel_values and image_grid_thw, or None."""
        import torch
        from transformers import GenerationConfig

        device = next(self.model.parameters()).device
        out = []
        for i, (prompt, n) in enumerate(zip(prompts, max_new)):
            pixels = (image_inputs[i] if image_inputs else None) or {}
            sample = self.cfg.temperature > 0
            gen = GenerationConfig(
                max_new_tokens=n,
                do_sample=sample,
                temperature=self.cfg.temperature if sample else None,
                top_p=self.cfg.top_p if sample else None,
                eos_token_id=self.stop_ids,
                pad_token_id=self.stop_ids[0],
            )
            torch.manual_seed(seeds[i])  # generate() draws from the global generator
            with torch.no_grad():
                ids = self.model.generate(
                    torch.tensor([prompt], device=device), generation_config=gen, **pixels
                )
            completion = ids[0, len(prompt) :].tolist()
            finish = "stop" if completion and completion[-1] in self.stop_ids else "length"
            out.append((completion, finish))
        return out

    def image_inputs(self, images: ImageTokens, urls: list[str]) -> dict[str, Any]:
        """What `generate` takes for a prompt's images: their pixels, in the model's dtype and device."""
        return images.model_inputs(urls, self.model)


class VLLMGenerator:
    """One vLLM worker session for the whole run: the verifier loads once."""

    def __init__(self, verifier_path: Path, cfg: RegenerateConfig, stop_ids: list[int]):
        from eagle3_pipeline.vllm_side.vllm_engine import WorkerSession

        self.session = WorkerSession(cfg.vllm_python)
        self.verifier, self.cfg, self.stop_ids = verifier_path, cfg, stop_ids
        self.vision = has_vision_tower(verifier_path)  # its engine takes images, from the first request

    def __enter__(self) -> VLLMGenerator:
        self.session.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.session.__exit__(*exc)

    def image_inputs(self, images: ImageTokens, urls: list[str]) -> tuple[int, list[str]]:
        """What `generate` takes for a prompt's images: the worker sends the data URLs to vLLM."""
        return images.pad_id, urls

    def generate(
        self, prompts: list[list[int]], max_new: list[int], seeds: list[int],
        image_inputs: list[Any] | None = None,
    ) -> list[tuple[list[int], str]]:  # fmt: skip
        """Each prompt's completion, sampled with its own seed (turn_seed: one vLLM generator per request);
        `image_inputs[i]`: (the id of its image tokens, its images) or None."""
        from eagle3_pipeline.vllm_side.vllm_engine import image_fields

        out: list[tuple[list[int], str]] = [([], "")] * len(prompts)
        pad = next((x[0] for x in image_inputs or [] if x), None)
        images = None if pad is None else (pad, [x[1] if x else [] for x in image_inputs or []])
        for n in sorted(set(max_new)):  # one request per distinct budget (usually one)
            idx = [i for i, m in enumerate(max_new) if m == n]
            res = self.session.request(
                {
                    **image_fields(images, idx),
                    "vision": self.vision,  # one engine for text and image prompts
                    "verifier": str(self.verifier),
                    "draft": None,
                    "prompts": [prompts[i] for i in idx],
                    "max_new_tokens": n,
                    "max_model_len": self.cfg.max_seq_len,  # capped at the verifier's max positions
                    "ignore_eos": False,
                    "stop_token_ids": self.stop_ids,
                    "temperature": self.cfg.temperature,
                    "top_p": self.cfg.top_p,
                    "seed": self.cfg.seed,  # the engine's
                    "seeds": [seeds[i] for i in idx],
                    "trust_remote_code": self.cfg.trust_remote_code,
                }
            )
            for i, ids, finish in zip(idx, res["outputs"], res["finish_reasons"]):
                out[i] = (list(ids), finish)
        return out


def render_prompt(
    tokenizer: Any, conv: Conversation, turn: int, kwargs: dict[str, Any], images: ImageTokens | None = None
) -> tuple[list[int], list[str]]:
    """(the serving prompt of assistant turn `turn`, the images it holds): what vLLM renders for the turns
    before it, each image's placeholder expanded to its token count as vLLM's processor expands it. The
    images are those the expansion used, so the verifier is given exactly one image per placeholder."""
    ids = render_ids(tokenizer, conv.messages[:turn], True, conv.tools, kwargs)
    if images is None:
        return ids, []
    before = Conversation(conv.row_id, conv.messages[:turn]).images
    if not before:
        return ids, []
    expanded, _, used = images.expand_unit(ids, [0] * len(ids), before)
    return expanded, used


def assistant_message(text: str, thinking: bool = False) -> dict[str, Any]:
    """A regenerated turn as a message: reasoning before `</think>` split out (the generation prompt of a
    thinking template ends with `<think>`), so that later prompts render it as the template does history.
    `thinking` (the prompt opened `<think>`) and no `</think>`: the turn was cut at max_new_tokens inside its
    reasoning, so the text is reasoning and the answer is empty (vLLM's reasoning parser returns it so)."""
    reasoning, sep, answer = text.partition("</think>")
    if sep:
        return {
            "role": "assistant",
            "content": answer,
            "reasoning_content": reasoning.removeprefix("<think>"),
        }
    if thinking:
        return {"role": "assistant", "content": "", "reasoning_content": text.removeprefix("<think>")}
    return {"role": "assistant", "content": text}


def opens_thinking(tokenizer: Any, prompt: list[int]) -> bool:
    """Whether the generation prompt ends with `<think>` (a thinking template: the completion reasons)."""
    return tokenizer.decode(prompt[-4:], skip_special_tokens=False).endswith("<think>")


def turn_seed(seed: int, row: int, turn: int) -> int:
    """The sampling seed of one turn (TURN_SEEDS): 63 bits of sha256 over (seed, row index, turn index)."""
    digest = hashlib.sha256(f"{seed}:{row}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def length_summary(lengths: list[int]) -> dict[str, int]:
    """p50 / p90 / max of completion lengths in tokens (nearest rank), for the log and meta.json."""
    if not lengths:
        return {"p50": 0, "p90": 0, "max": 0}
    s = sorted(lengths)
    n = len(s)
    return {"p50": s[(n + 1) // 2 - 1], "p90": s[(9 * n + 9) // 10 - 1], "max": s[-1]}  # ceil(q n)-th


def regenerate_rows(
    rows: list[tuple[int, Conversation]],
    tokenizer: Any,
    generator: Any,
    cfg: RegenerateConfig,
    images: ImageTokens | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(regenerated rows, rejects): all rows of a block advance one assistant turn per generate call;
    `images`: the vision verifier's, whose rows' images are given to the generator with each prompt."""
    kwargs = cfg.chat_template_kwargs or {}
    state = [{"row": r, "conv": conv, "samples": [], "turn": _next(conv.messages, 1)} for r, conv in rows]
    rejects: list[dict[str, Any]] = []
    unanswerable = {s["row"] for s in state if s["turn"] is None}  # its only assistant turn opens it
    while True:
        pending, prompts, budgets, seeds, pixels = [], [], [], [], []
        for s in state:
            if s["turn"] is None:
                continue
            try:
                prompt, urls = render_prompt(tokenizer, s["conv"], s["turn"], kwargs, images)
            except ImageRejected as e:  # its rendering does not hold its images: the row is rejected
                s["rejected"] = f"turn {s['turn']}: {e}"
                s["turn"] = None
                continue
            room = cfg.max_seq_len - len(prompt)
            if room < 2:  # no room for a reply: the row ends before this turn
                s["conv"].messages = s["conv"].messages[: s["turn"]]
                s["turn"] = None
                continue
            pending.append(s)
            prompts.append(prompt)
            budgets.append(min(cfg.max_new_tokens, room))
            seeds.append(turn_seed(cfg.seed, s["row"], s["turn"]))
            pixels.append(generator.image_inputs(images, urls) if images and urls else None)
        if not pending:
            break
        extra = {"image_inputs": pixels} if any(pixels) else {}  # text-only generators take no images
        completions = generator.generate(prompts, budgets, seeds, **extra)
        for s, prompt, (completion, finish) in zip(pending, prompts, completions):
            i, msgs = s["turn"], s["conv"].messages
            text = tokenizer.decode(completion, skip_special_tokens=True)
            msgs[i] = assistant_message(text, opens_thinking(tokenizer, prompt))
            s["samples"].append(
                {"turn": i, "prompt_ids": prompt, "completion_ids": completion, "finish_reason": finish}
            )
            s["turn"] = _next(msgs, i + 1)
    out = []
    for s in state:
        conv = s["conv"]
        if "rejected" in s:
            rejects.append({"row": s["row"], "reason": s["rejected"]})
            continue
        if not s["samples"]:
            reason = NO_PROMPTED_TURN if s["row"] in unanswerable else NO_TURN_FITS
            rejects.append({"row": s["row"], "reason": reason})
            continue
        while conv.messages and conv.messages[-1]["role"] != "assistant":
            conv.messages.pop()  # trailing user turns have no regenerated answer
        row: dict[str, Any] = {"id": conv.row_id, "messages": conv.messages}
        if conv.tools:
            row["tools"] = conv.tools
        out.append({**row, "token_samples": s["samples"]})
    return out, rejects


def _next(messages: list[dict[str, str]], start: int) -> int | None:
    return next((i for i in range(start, len(messages)) if messages[i]["role"] == "assistant"), None)


def run(cfg: RegenerateConfig) -> int:
    data_path, verifier_path, out_dir = Path(cfg.data_path), Path(cfg.verifier_path), Path(cfg.out_dir)
    if not data_path.exists():
        raise UserError(f"{data_path}: data not found (--data-path)")
    out = StageOutput(out_dir, cfg.overwrite)
    if out.skip(asides=True):
        return 0
    with out.lock():  # the one writer of out_dir, before any work
        return _regenerate(cfg, data_path, verifier_path, out)


def _regenerate(cfg: RegenerateConfig, data_path: Path, verifier_path: Path, out: StageOutput) -> int:
    from transformers import AutoTokenizer

    out_dir = out.out_dir
    tokenizer = AutoTokenizer.from_pretrained(str(verifier_path), trust_remote_code=cfg.trust_remote_code)
    engine = resolve_engine(cfg.engine, cfg.vllm_python)
    images = ImageTokens.of_verifier(verifier_path, tokenizer)  # None: image rows rejected, NO_VISION_TOWER
    stop_ids = end_token_ids(verifier_path, tokenizer)
    total = count_rows(data_path, cfg.data_split)
    max_positions = read_text_config(verifier_path).get("max_position_embeddings") or cfg.max_seq_len
    if cfg.max_seq_len > max_positions:
        log.info(
            "max_seq_len %d capped at the verifier's max_position_embeddings %d",
            cfg.max_seq_len,
            max_positions,
        )
        cfg = dataclasses.replace(cfg, max_seq_len=int(max_positions))
    settings = {
        "data_path": storage.record_path(data_path, out_dir),
        "verifier_path": storage.record_path(verifier_path, out_dir),
        "verifier_fingerprint": verifier_fingerprint(verifier_path),
        "engine": engine,
        "stop_token_ids": stop_ids,
        "turn_seeds": TURN_SEEDS,
        **engine_settings(engine, cfg.vllm_python),
        **processor_settings(verifier_path),  # an image's token count (none for a text-only verifier)
        # trust_remote_code: the checkpoint's own tokenizer code instead of transformers' (other ids)
        **{k: getattr(cfg, k) for k in ("max_new_tokens", "max_seq_len", "temperature", "top_p", "seed",
                                         "rows_per_part", "data_split", "chat_template_kwargs",
                                         "trust_remote_code")},
    }  # fmt: skip
    with out.in_place(settings) as started:  # the old output stays until the new one is complete
        if not started:  # finished by a writer just gone
            return 0
        blocks = parts.blocks(0, total, cfg.rows_per_part)
        todo = parts.todo(out_dir, blocks, _part)
        log.info(
            "regenerate %s: %d rows, %d parts, %d to do, engine %s",
            data_path,
            total,
            len(blocks),
            len(todo),
            engine,
        )
        if todo:
            gen_cls = VLLMGenerator if engine == "vllm" else HFGenerator
            with gen_cls(verifier_path, cfg, stop_ids) as generator:
                _run_parts(cfg, out_dir, blocks, todo, tokenizer, generator, images)
        _finish(cfg, out, blocks, settings, total)
    return 0


def _conversation(raw: RawRow, base_dir: Path, images: bool, no_images_why: str) -> Conversation:
    """The row normalised; its images read (relative paths from the data file's folder) when taken."""
    conv = normalize_row(raw.value, base_dir, images, no_images_why)
    conv.row_id = conv.row_id if conv.row_id is not None else f"row-{raw.index}"
    return conv


def _part(n: int) -> str:
    return f"part-{n:05d}.jsonl"


def _ids_of_part(path: Path, rows: tuple[int, int]) -> dict[str, int]:
    """{row id: row} of a finished part file (its regenerated rows follow its rejects, rows in order)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line]
    rejected = {obj["rejected"]["row"] for obj in lines if "rejected" in obj}
    written = [obj["id"] for obj in lines if "rejected" not in obj]
    return dict(zip(written, (r for r in range(*rows) if r not in rejected), strict=True))


def _run_parts(
    cfg: RegenerateConfig,
    out_dir: Path,
    blocks: list,
    todo: list,
    tokenizer: Any,
    generator: Any,
    images: ImageTokens | None,
) -> None:
    bar = progress(total=sum(b - a for _, (a, b) in todo), desc="regenerate", unit="row")
    t0, done_rows, done_tokens = time.time(), 0, 0
    data_path = Path(cfg.data_path)
    base_dir = data_path if data_path.is_dir() else data_path.parent  # relative image paths start here
    seen: dict[str, int] = {}  # row id -> row over the parts before: a duplicate is a reject, as in stage 01
    to_do, read_up_to = {n for n, _ in todo}, 0

    def unique(raw: RawRow) -> Conversation:
        conv = _conversation(raw, base_dir, images is not None, NO_VISION_TOWER)
        if conv.row_id in seen:  # rejected before the verifier spends time on it
            raise RowRejected(f"duplicate id {conv.row_id!r} (first at row {seen[conv.row_id]})")
        seen[conv.row_id] = raw.index
        return conv

    try:
        for n, (a, b) in todo:
            for m in range(read_up_to, n):  # a resume: the ids of the finished parts before are taken
                if m not in to_do:
                    seen.update(_ids_of_part(out_dir / _part(m), blocks[m]))
            read_up_to = n + 1
            rejects: list[dict[str, Any]] = []
            raws = read_rows(Path(cfg.data_path), a, b, cfg.data_split)
            rows = list(accepted_rows(raws, unique, rejects, cfg.data_path))
            out, more = regenerate_rows(rows, tokenizer, generator, cfg, images)
            rejects += more
            lines = [json.dumps({"rejected": r}) for r in sorted(rejects, key=lambda r: r["row"])]
            lines += [json.dumps(r) for r in out]
            storage.write_bytes_atomic(out_dir / _part(n), ("\n".join(lines) + "\n").encode())
            done_rows += b - a
            done_tokens += sum(len(s["completion_ids"]) for r in out for s in r["token_samples"])
            bar.update(b - a)
            elapsed = time.time() - t0
            log.info(
                "part %05d | rows %d-%d | regenerated %d | rejected %d | new tok/s %.0f",
                n, a, b, len(out), len(rejects), done_tokens / max(elapsed, 1e-9),
            )  # fmt: skip
    finally:
        bar.close()


def _finish(cfg: RegenerateConfig, out: StageOutput, blocks: list, settings: dict[str, Any],
            total: int) -> None:  # fmt: skip
    out_dir, rows, rejects = out.out_dir, [], []
    for n in range(len(blocks)):
        for line in (out_dir / _part(n)).read_text().splitlines():
            obj = json.loads(line)
            (rejects.append(obj["rejected"]) if "rejected" in obj else rows.append(line))
    parts.check_every_row(out_dir, len(rows), len(rejects), total)
    storage.write_bytes_atomic(out_dir / OUTPUT_NAME, ("\n".join(rows) + "\n").encode() if rows else b"")
    parts.write_rejects(out_dir, rejects)
    finishes: dict[str, int] = {}
    lengths: list[int] = []
    for line in rows:
        for s in json.loads(line)["token_samples"]:
            finishes[s["finish_reason"]] = finishes.get(s["finish_reason"], 0) + 1
            lengths.append(len(s["completion_ids"]))
    tokens, spread = sum(lengths), length_summary(lengths)
    out.finish(
        {
            "stage": "00_regenerate",
            **settings,
            "num_rows": total,
            "num_regenerated": len(rows),
            "num_rejected": len(rejects),
            "completion_tokens": tokens,
            "finish_reasons": finishes,  # "length": cut at max_new_tokens (or at max_seq_len's room)
            "completion_length_tokens": spread,
            "output": OUTPUT_NAME,
            "sha256": storage.sha256_file(out_dir / OUTPUT_NAME),
            **provenance(cfg),
        },
    )
    log.info(
        "done %s | rows %d | regenerated %d | rejected %d | completion tokens %d | finish %s",
        out_dir, total, len(rows), len(rejects), tokens, json.dumps(finishes),
    )  # fmt: skip
    log.info(
        "completion lengths | turns %d | p50 %d | p90 %d | max %d tokens | cut at the cap (finish "
        "\"length\") %d of %d: raise max_new_tokens if many are",
        len(lengths), spread["p50"], spread["p90"], spread["max"], finishes.get("length", 0), len(lengths),
    )  # fmt: skip
