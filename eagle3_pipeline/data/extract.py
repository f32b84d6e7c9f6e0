"""Stage 01: verifier hidden states at the aux layers, one resumable shard per row range.

Shard layout (`<out_dir>/rows_<start>-<end>/`):
  part-00000.safetensors  input_ids int32 [N], loss_mask uint8 [N], aux_hidden_states [N, n_aux, H],
                          last_hidden_state [N, H] (pre-final-norm, for the teacher), offsets int64 [n+1],
                          and with fp8 storage one float32 scale per sample and layer (state_dtype.py);
                          a token shard (--storage-dtype none) holds no states (stage 04 gets them online)
  part-00000.json         the part's samples (ids, rows, token counts, sha256 of each sample's bytes, the
                          position of the first token stored when context_tokens cut it), rejects, the
                          file's sha256 and the token tensors' sha256; written last, so a part counts only
                          when its .json exists
  manifest.json, rejects.jsonl, meta.json, COMPLETE   written once every part is done
Parts cover fixed blocks of `samples_per_file` input rows, so a rerun after a crash redoes only the
block that was in flight, and the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.data import parts, shards, state_dtype
from eagle3_pipeline.core import storage
from eagle3_pipeline.core.cli import progress
from eagle3_pipeline.data.config import ExtractConfig
from eagle3_pipeline.core.config import provenance
from eagle3_pipeline.data.conversations import count_rows
from eagle3_pipeline.data.images import ImageTokens
from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.core.output import RUN_FILE, StageOutput
from eagle3_pipeline.data.samples import MAX_REJECTS_LOGGED_PER_PART, Sample, first_supervised, stored_from
from eagle3_pipeline.models.verifier import (
    AuxCapture,
    check_aux_layer_ids,
    check_verifier,
    default_aux_layer_ids,
    find_decoder_layers,
    load_verifier_model,
    verifier_facts,
    verifier_fingerprint,
)
from eagle3_pipeline.models.vision import has_vision_tower, processor_settings

log = logging.getLogger("eagle3.extract")


def shard_name(start: int, end: int, variant: str | None = None) -> str:
    """A shard's folder in out_dir; a --variant's beside the first version's of the same rows."""
    return f"rows_{start:08d}-{end:08d}" + (f"_{variant}" if variant else "")


def run(cfg: ExtractConfig) -> int:
    data_path = Path(cfg.data_path)
    if not data_path.exists():
        raise UserError(f"{data_path}: data not found (--data-path)")
    verifier_path = Path(cfg.verifier_path)
    facts = verifier_facts(verifier_path)
    aux_ids = check_aux_layer_ids(
        cfg.aux_layer_ids or default_aux_layer_ids(facts.num_hidden_layers), facts.num_hidden_layers
    )
    total_rows = count_rows(data_path, cfg.data_split)
    start = cfg.start_row
    end = total_rows if cfg.end_row is None else min(cfg.end_row, total_rows)
    if not 0 <= start < end:
        raise UserError(
            f"row range [{cfg.start_row}, {cfg.end_row}) is empty for {data_path} ({total_rows} rows)"
        )
    if cfg.serve:  # with --engine vllm (ExtractConfig.rule_problem)
        from eagle3_pipeline.vllm_side.extract_vllm import serve

        dtype = state_dtype.resolve_dtype(cfg.dtype)
        return serve(cfg, aux_ids, facts.num_hidden_layers, dtype, _image_pad_id(cfg))
    # every shard records it; a resume of an unfinished shard compares it (_check_resumed_verifier)
    facts = dataclasses.replace(facts, fingerprint=verifier_fingerprint(verifier_path))
    step = cfg.shard_rows or end - start
    ranges = [(a, min(a + step, end)) for a in range(start, end, step)]
    if len(ranges) > 1:
        log.info("%d shards of %d rows in [%d, %d), one verifier load", len(ranges), step, start, end)
    outs = [StageOutput(Path(cfg.out_dir) / shard_name(a, b, cfg.variant), cfg.overwrite) for a, b in ranges]
    to_write = [o for o in outs if o.wanted()]
    with contextlib.ExitStack() as held:
        for out in to_write:  # this process the one writer of each shard it writes, before any work
            held.enter_context(out.lock())
        return _run_shards(cfg, facts, aux_ids, ranges, bool(to_write))


def _run_shards(cfg: ExtractConfig, facts: Any, aux_ids: list[int], ranges: list[tuple[int, int]],
                work: bool) -> int:  # fmt: skip
    loaded: dict[str, Any] = {}  # the verifier (hf: loaded by the first shard with work to do), renderer
    try:
        if work:
            from eagle3_pipeline.data.extract_render import Renderer

            loaded["renderer"] = Renderer(cfg)  # starts now: it loads the tokenizer while the verifier loads
            if cfg.storage_dtype == state_dtype.NO_STATES:  # token shards: no verifier runs
                loaded["engine"] = NoStates()
            elif cfg.engine == "vllm":  # vLLM starts now too, beside this process's own preparation
                loaded["engine"] = _open_engine(cfg, facts, aux_ids, state_dtype.resolve_dtype(cfg.dtype))
        for a, b in ranges:
            # each shard records the settings of its own single-shard run, so both ways write the same bytes
            _run_shard(
                dataclasses.replace(cfg, start_row=a, end_row=b, shard_rows=None), facts, aux_ids, loaded
            )
    finally:
        if "engine" in loaded:
            loaded["engine"].__exit__(None, None, None)
        if "renderer" in loaded:
            loaded["renderer"].close()
    return 0


class NoStates:
    """The engine of token shards (storage dtype "none"): no states, nothing loaded."""

    dtype = None

    def __exit__(self, *exc: Any) -> None:
        pass

    def __call__(self, sequences: list[list[int]], images: Any = None) -> list[tuple[None, None]]:
        return [(None, None)] * len(sequences)


class HfStates:
    """(aux [T, n_aux, H], last [T, H]) per sequence from the transformers verifier in this process."""

    def __init__(self, model: Any, aux_ids: list[int], num_layers: int, max_batch_tokens: int,
                 image_tokens: ImageTokens | None = None):  # fmt: skip
        self.model, self.max_batch_tokens, self.image_tokens = model, max_batch_tokens, image_tokens
        self.dtype = next(model.parameters()).dtype
        self.capture = AuxCapture(find_decoder_layers(model, num_layers), aux_ids)

    def __exit__(self, *exc: Any) -> None:
        self.capture.remove()

    def __call__(
        self, sequences: list[list[int]], images: list[list[str]] | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`images[i]`: the data URLs of sequence i's images; such a sequence runs alone, with its pixels
        (a verifier forward that saw them, as vLLM's does)."""
        seen = [i for i, urls in enumerate(images or []) if urls]
        text = sorted(set(range(len(sequences))) - set(seen))
        results: list[Any] = [None] * len(sequences)
        batched = _forward_batched(
            self.model, self.capture, [sequences[i] for i in text], self.max_batch_tokens
        )
        for i, states in zip(text, batched, strict=True):
            results[i] = states
        for i in seen:
            assert images is not None and self.image_tokens is not None
            pixels = self.image_tokens.model_inputs(images[i], self.model)
            results[i] = _forward_with_images(self.model, self.capture, sequences[i], pixels)
        return results


def _open_engine(cfg: ExtractConfig, facts: Any, aux_ids: list[int], dtype: torch.dtype) -> Any:
    if cfg.engine == "vllm":
        from eagle3_pipeline.vllm_side.extract_vllm import VllmStates

        return VllmStates(cfg, aux_ids, facts.num_hidden_layers, dtype, _image_pad_id(cfg)).__enter__()
    t0 = time.time()
    model = load_verifier_model(Path(cfg.verifier_path), dtype, cfg.trust_remote_code)
    log.info("verifier loaded | %s | %s | %.1fs", cfg.verifier_path, str(dtype).removeprefix("torch."),
             time.time() - t0)  # fmt: skip
    return HfStates(model, aux_ids, facts.num_hidden_layers, cfg.max_batch_tokens, _image_tokens(cfg))


def _image_tokens(cfg: ExtractConfig) -> ImageTokens | None:
    """The verifier's image tokens where its rows' images are taken (data/extract_render.extract_images)."""
    from transformers import AutoTokenizer

    from eagle3_pipeline.data.extract_render import extract_images

    if not has_vision_tower(Path(cfg.verifier_path)):
        return None
    tok = AutoTokenizer.from_pretrained(str(cfg.verifier_path), trust_remote_code=cfg.trust_remote_code)
    return extract_images(cfg, tok)[0]


def _image_pad_id(cfg: ExtractConfig) -> int | None:
    """The vLLM engine's image placeholder id, where the verifier sees its rows' images."""
    images = _image_tokens(cfg)
    return None if images is None else images.pad_id


def _run_shard(cfg: ExtractConfig, facts: Any, aux_ids: list[int], loaded: dict[str, Any]) -> None:
    data_path = Path(cfg.data_path)
    start, end = cfg.start_row, cfg.end_row
    assert end is not None
    dtype = state_dtype.resolve_dtype(cfg.dtype)
    storage_dtype = state_dtype.resolve_storage_dtype(cfg.storage_dtype, dtype)
    shard = Path(cfg.out_dir) / shard_name(start, end, cfg.variant)
    settings = {
        "format": shards.SHARD_FORMAT,
        "verifier": {**asdict(facts), "path": storage.record_path(facts.path, shard)},
        "aux_layer_ids": aux_ids,
        "dtype": str(dtype).removeprefix("torch."),
        "storage_dtype": storage_dtype,
        "data_path": storage.record_path(data_path, shard),
        "data_split": cfg.data_split,
        "row_range": [start, end],
        "max_seq_len": cfg.max_seq_len,
        "samples_per_file": cfg.samples_per_file,
        "chat_template_kwargs": cfg.chat_template_kwargs,  # 06_evaluate.py builds its prompts with these
        "truncate": cfg.truncate,
        "trust_remote_code": cfg.trust_remote_code,  # the checkpoint's own tokenizer code: other ids
        **processor_settings(Path(cfg.verifier_path)),  # an image's token count (none without a vision tower)
    }
    if cfg.engine == "hf" and storage_dtype != state_dtype.NO_STATES:
        # its batches: padding changes the float results (by ~3e-6 on CPU), so a resume with another
        # value would join parts that differ from an uninterrupted run's
        settings["max_batch_tokens"] = cfg.max_batch_tokens
    if cfg.variant is not None:  # its sample ids (samples.variant_row_id): a resume without it is refused
        settings["variant"] = cfg.variant
    if cfg.context_tokens is not None and storage_dtype != state_dtype.NO_STATES:  # what a part stores
        settings["context_tokens"] = cfg.context_tokens
    elif cfg.context_tokens is not None:
        log.info("context_tokens %d: not applied to token shards, which keep every token (online states "
                 "need each sample's whole prefix)", cfg.context_tokens)  # fmt: skip
    if storage_dtype == state_dtype.FP8:  # a resume of an older per-token-scale fp8 shard is refused
        settings["fp8_scales"] = state_dtype.FP8_SCALES
    # (an hf shard's settings are those of the shards written before engines; a token shard has no engine)
    if cfg.engine == "vllm" and storage_dtype != state_dtype.NO_STATES:
        from eagle3_pipeline.vllm_side.extract_vllm import vllm_version

        if "vllm_version" not in loaded:  # the server's when its client
            engine = loaded.get("engine")
            loaded["vllm_version"] = engine.version if engine else vllm_version(cfg.vllm_python)
        settings.update(engine="vllm", vllm_version=loaded["vllm_version"])

    out = StageOutput(shard, cfg.overwrite)
    if out.skip(asides=True):
        return
    if not cfg.overwrite:  # a resume with other settings is refused before the verifier loads
        _check_resumed_verifier(shard, Path(cfg.verifier_path), facts.fingerprint)
        out.same_run(settings)
    blocks = parts.blocks(start, end, cfg.samples_per_file)
    todo = list(enumerate(blocks)) if cfg.overwrite else parts.todo(shard, blocks, shards.part_info_name)
    if todo:  # every check before an overwritten shard moves aside
        if "engine" not in loaded:  # while the renderer loads its tokenizer (nothing written yet)
            loaded["engine"] = _open_engine(cfg, facts, aux_ids, dtype)
        _check_free_space(cfg, shard, loaded["renderer"], todo, len(aux_ids), facts.hidden_size,
                          storage_dtype)  # fmt: skip
    # --overwrite keeps the old shard aside until the new one is complete: a refused (empty) or failed
    # new shard puts it back
    with out.in_place(settings) as started:
        if not started:  # finished by a writer just gone
            return
        log.info(
            "shard %s: rows [%d, %d), %d parts, %d to do, aux layers %s, dtype %s, stored as %s",
            shard, start, end, len(blocks), len(todo), aux_ids, settings["dtype"], storage_dtype,
        )  # fmt: skip
        if todo:
            _extract_parts(shard, todo, storage_dtype, settings.get("context_tokens"), loaded["renderer"],
                           loaded["engine"])  # fmt: skip
        shards.finish_shard(out, len(blocks), settings, provenance(cfg))


def _check_resumed_verifier(shard: Path, verifier: Path, fingerprint: str | None) -> None:
    """The parts an unfinished shard holds came from the verifier its run.json records: another one (by
    fingerprint, wherever it lies) is refused naming both, before anything is loaded or written."""
    run_file = shard / RUN_FILE
    if not run_file.exists():
        return
    recorded = storage.read_json(run_file).get("verifier", {})
    if recorded.get("fingerprint") != fingerprint:
        made_by = storage.recorded_path(recorded.get("path", "?"), shard)
        check_verifier(verifier, recorded.get("fingerprint"), run_file, made_by)


def _check_free_space(
    cfg: ExtractConfig,
    shard: Path,
    renderer: Any,
    todo: list[tuple[int, tuple[int, int]]],
    num_aux: int,
    hidden_size: int,
    storage_dtype: str,
) -> None:
    """Refuse to start when the parts still to write would not fit (tokens per row from a sample); an
    overwritten shard frees nothing before the new one is complete."""
    a0 = todo[0][1][0]
    rows_todo = sum(b - a for _, (a, b) in todo)
    per_row = renderer.tokens_per_row(a0, a0 + rows_todo)
    if per_row is None:
        return
    need = int(rows_todo * per_row * state_dtype.bytes_per_token(storage_dtype, num_aux, hidden_size))
    need += rows_todo * state_dtype.bytes_per_sample(storage_dtype, num_aux)
    free = storage.free_bytes(shard)
    log.info("disk | need ~%s for %d rows | free %s", storage.format_bytes(need), rows_todo,
             storage.format_bytes(free))  # fmt: skip
    if need > free:
        raise UserError(
            f"{shard}: {rows_todo} rows x {per_row:.0f} tokens/row (sampled) x "
            f"{state_dtype.bytes_per_token(storage_dtype, num_aux, hidden_size)} bytes/token "
            f"({storage_dtype}) = {storage.describe_bytes(need)} needed, {storage.describe_bytes(free)} "
            "free; "
            "free space (--overwrite keeps the old shard until the new one is complete), extract a smaller "
            "row range, or store as float8_e4m3fn (--storage-dtype)"
        )


def _seen_ids(shard: Path, todo: list[tuple[int, tuple[int, int]]]) -> dict[int, dict[str, int]]:
    """{part: {sample id: row}} of the finished parts before the last part to do."""
    done: dict[int, dict[str, int]] = {}
    to_do = {n for n, _ in todo}
    for n in range(max(to_do)):
        if n not in to_do:
            info = storage.read_json(shard / shards.part_info_name(n))
            done[n] = {s["id"]: s["row"] for s in info["samples"]}
    return done


def _extract_parts(
    shard: Path,
    todo: list[tuple[int, tuple[int, int]]],
    storage_dtype: str,
    context_tokens: int | None,
    renderer: Any,
    engine: Any,
) -> None:
    """Three stages overlap: a helper process renders and tokenises the parts ahead (extract_render),
    this thread runs the verifier, a writer thread encodes, hashes and writes the part before; parts
    are written in order, one at a time, so a kill loses at most the two in flight."""
    from concurrent.futures import Future, ThreadPoolExecutor

    bar = progress(total=sum(b - a for _, (a, b) in todo), desc="extract", unit="row")
    rows_todo = sum(b - a for _, (a, b) in todo)
    t0, done = time.time(), {"rows": 0, "tokens": 0}

    def written(future: Future) -> None:
        n, (a, b), num_samples, num_rejects, num_tokens = future.result()
        done["rows"] += b - a
        done["tokens"] += num_tokens
        bar.update(b - a)
        elapsed = time.time() - t0
        log.info("part %05d | rows %d-%d | samples %d | rejected %d | tok/s %.0f | eta %.0fs", n, a, b,
                 num_samples, num_rejects, done["tokens"] / max(elapsed, 1e-9),
                 elapsed / done["rows"] * (rows_todo - done["rows"]))  # fmt: skip

    pending: Future | None = None
    try:
        with ThreadPoolExecutor(1, thread_name_prefix="eagle3-write") as writer:
            for n, rows, accepted, rejects in renderer.parts(todo, _seen_ids(shard, todo)):
                images = [smp.images for _, smp in accepted]
                states = engine([smp.input_ids for _, smp in accepted], images) if accepted else []
                if pending is not None:
                    written(pending)
                pending = writer.submit(_store_part, shard, n, rows, accepted, rejects, states, engine.dtype,
                                        storage_dtype, context_tokens)  # fmt: skip
            if pending is not None:
                written(pending)
    finally:
        bar.close()


def _store_part(
    shard: Path,
    n: int,
    rows: tuple[int, int],
    accepted: list[tuple[int, Sample]],
    rejects: list[dict[str, Any]],
    states: list[tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    storage_dtype: str,
    context_tokens: int | None = None,
) -> tuple[int, tuple[int, int], int, int, int]:
    """Part n written: its samples' tokens and encoded states, each from samples.stored_from on (its
    position recorded); a row whose states hold a NaN or Inf (as stored: a cast that overflows counts) is
    rejected whole, since a row's samples stay together."""
    encoded: list[tuple[int, Sample, dict[str, torch.Tensor], int]] = []
    bad: dict[int, str] = {}
    for (row, smp), (aux, last) in zip(accepted, states, strict=True):
        cut = stored_from(smp.loss_mask, context_tokens) if aux is not None else 0
        ids, mask = smp.input_ids[cut:], smp.loss_mask[cut:]
        stored = {
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
        }
        if aux is not None:
            stored.update(state_dtype.encode(aux[cut:].to("cpu", dtype), last[cut:].to("cpu", dtype),
                                             storage_dtype))  # fmt: skip
        found = _non_finite_states(stored)
        if found and row not in bad:  # (the counts in parentheses: rejects group by the words outside)
            bad[row] = (
                "NaN or Inf in the verifier's hidden states, never stored: a draft trained on them turns "
                f"NaN (sample {smp.sample_id!r}: {found})"
            )
        encoded.append((row, smp, stored, cut))
    samples = []
    tensors: dict[str, list[torch.Tensor]] = {}
    for row, smp, stored, cut in encoded:
        if row in bad:
            continue
        for k, v in stored.items():
            tensors.setdefault(k, []).append(v)
        info = {"id": smp.sample_id, "row": row, "num_tokens": len(smp.input_ids) - cut}
        if cut:
            info["position"] = cut  # shards.SampleRef.position
        info["num_loss_tokens"] = int(sum(smp.loss_mask))
        info["first_loss"] = first_supervised(smp.loss_mask) - cut  # shards.SampleRef.first_loss (cut < it)
        info["sha256"] = storage.sha256_tensors(stored)  # checked when the sample is read
        if smp.truncated_from is not None:
            info["truncated_from"] = smp.truncated_from
        samples.append(info)
    for i, (row, why) in enumerate(sorted(bad.items())):
        if i < MAX_REJECTS_LOGGED_PER_PART:
            log.warning("%s row %d: rejected: %s", shard, row, why)
    rejects = sorted([*rejects, *({"row": r, "reason": why} for r, why in bad.items())],
                     key=lambda r: r["row"])  # fmt: skip
    shards.write_part(shard, n, samples, rejects, tensors, rows)
    return n, rows, len(samples), len(rejects), sum(s["num_tokens"] for s in samples)


def _non_finite_states(stored: dict[str, torch.Tensor]) -> str | None:
    """Where a sample's stored states hold a NaN or Inf ("N of M aux_hidden_states values, first at token
    t; ..."), or None when every value is finite."""
    found = []
    for key, t in stored.items():
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t.float())
        count = int(bad.sum())
        if count and key in state_dtype.STATE_KEYS:  # [T, ...]: the first token hit
            first = int(bad.reshape(t.shape[0], -1).any(-1).nonzero()[0, 0])
            found.append(f"{count} of {t.numel()} {key} values, first at token {first}")
        elif count:  # an fp8 scale
            found.append(f"{count} of {t.numel()} {key} values")
    return "; ".join(found) or None


def _forward_with_images(
    model: Any, capture: AuxCapture, ids: list[int], pixels: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [T, n_aux, H], last [T, H]) of one sequence from a forward given its images' pixels."""
    device = next(model.parameters()).device
    with torch.no_grad():
        model(input_ids=torch.tensor([ids], device=device), use_cache=False, **pixels)
    return capture.pop()


def _forward_batched(
    model: Any, capture: AuxCapture, sequences: list[list[int]], max_batch_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux [T, n_aux, H], last [T, H]) per sequence, in input order.

    Sequences run longest first in right-padded batches of at most max_batch_tokens padded tokens (a
    longer sequence runs alone), so similar lengths share a batch and little is padding. Right padding
    leaves the real tokens' states unchanged: attention is causal and positions start at 0 in every row.
    """
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    results: list[Any] = [None] * len(sequences)
    start = 0
    while start < len(order):
        width = len(sequences[order[start]])  # the longest of the batch: sorted descending
        end = start + 1
        while end < len(order) and (end + 1 - start) * width <= max_batch_tokens:
            end += 1
        batch = order[start:end]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
            attention[row, : len(sequences[i])] = 1
        with torch.no_grad():
            model(input_ids=ids.to(device), attention_mask=attention.to(device), use_cache=False)
        aux, last = capture.pop_batch()
        for row, i in enumerate(batch):
            n = len(sequences[i])
            results[i] = (aux[row, :n], last[row, :n])
        start = end
    return results
