"""Stage 01's samples rendered and tokenised by a helper process, ahead of the verifier's forward.

Chat templates (three renders per assistant turn) and tokenising are Python work the size of the
forward's on small verifiers; in the stage's own process they would wait for the GIL beside the forward
(and its writer thread). One helper process per run, started first (it imports transformers and loads
the tokenizer while the stage loads the verifier), samples the rows for the disk check and renders the
parts of every shard in order, `DEPTH` ahead, with the same `seen` ids a serial run would have (the
samples of every part before, finished parts included): the samples, and every byte written, are those
of a serial run. It stops when the stage's process goes, even at SIGKILL.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_pipeline.data.config import ExtractConfig
from eagle3_pipeline.core.errors import UserError

DEPTH = 2  # parts rendered ahead of the forward (memory: their token ids only)


# token shards' states come later from `vllm serve` (training/online.py), whose completions requests carry
# token ids only: the pixels reach the verifier in stage 01's forward (either engine) only
IMAGES_NEED_STATES = ("image rows need stored states (a --storage-dtype other than none): token shards' "
                      "online states are requested with token ids only")  # fmt: skip


def extract_images(cfg: ExtractConfig, tokenizer: Any) -> tuple[Any, str]:
    """(ImageTokens or None, why image rows are rejected): a verifier with a vision tower sees its rows'
    images in either engine's forward (vLLM's given them as `vision_chunk` inputs); token shards (states
    from vLLM online) take none."""
    from eagle3_pipeline.data.conversations import NO_VISION_TOWER
    from eagle3_pipeline.data.images import ImageTokens
    from eagle3_pipeline.data.state_dtype import NO_STATES

    images = ImageTokens.of_verifier(Path(cfg.verifier_path), tokenizer)
    if images is None:
        return None, NO_VISION_TOWER
    if cfg.storage_dtype == NO_STATES:
        return None, IMAGES_NEED_STATES
    return images, ""


def _serve(jobs: Any, out: Any, cfg: ExtractConfig, level: int, parent: int) -> None:
    """The helper process: answers ("estimate", ...) and ("render", ...) jobs until ("stop",)."""

    def put(item: Any) -> None:
        while True:
            try:
                out.put(item, timeout=1.0)
                return
            except queue.Full:
                if os.getppid() != parent:  # the stage is gone (killed): stop too
                    os._exit(0)

    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the stage's to handle; it stops this process
    try:
        from transformers import AutoTokenizer

        from eagle3_pipeline.core.cli import setup_logging
        from eagle3_pipeline.data.conversations import read_rows
        from eagle3_pipeline.data.samples import SampleOptions, block_samples, sample_tokens_per_row
        from eagle3_pipeline.data.state_dtype import NO_STATES

        setup_logging(logging.getLevelName(level))
        tokenizer = AutoTokenizer.from_pretrained(
            str(cfg.verifier_path), trust_remote_code=cfg.trust_remote_code
        )
        data = Path(cfg.data_path)
        opts = SampleOptions(cfg.max_seq_len, cfg.truncate, cfg.chat_template_kwargs,
                             base_dir=data if data.is_dir() else data.parent,
                             variant=cfg.variant)  # fmt: skip
        opts.images, opts.no_images_why = extract_images(cfg, tokenizer)
        stored_context = None if cfg.storage_dtype == NO_STATES else cfg.context_tokens  # what a part stores
    except BaseException as e:  # noqa: BLE001 - said in the stage's process
        put(("error", isinstance(e, UserError), f"{type(e).__name__}: {e}"))
        return
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                os._exit(0)
            continue
        try:
            if job[0] == "stop":
                return
            if job[0] == "estimate":
                start, end = job[1:]
                per_row = sample_tokens_per_row(tokenizer, data, cfg.data_split, start, end, cfg.max_seq_len,
                                                opts=opts, context_tokens=stored_context)  # fmt: skip
                put(("estimate", per_row))
                continue
            _, todo, done = job
            seen: dict[str, int] = {}
            blocks = dict(todo)
            for n in range(max(blocks) + 1):
                if n in done:
                    seen.update(done[n])
                elif n in blocks:
                    a, b = blocks[n]
                    rows = read_rows(data, a, b, cfg.data_split)
                    put(("part", n, *block_samples(rows, tokenizer, opts, seen, cfg.data_path)))
            put(("end",))
        except BaseException as e:  # noqa: BLE001 - said in the stage's process
            put(("error", isinstance(e, UserError), f"{type(e).__name__}: {e}"))


class Renderer:
    """The helper process of one stage-01 run (`close()` it)."""

    def __init__(self, cfg: ExtractConfig):
        # forked at the start of the run, before this process runs any torch op (no thread pools yet, no
        # CUDA context); the child runs none either, and skips the interpreter start and torch's import
        ctx = multiprocessing.get_context("fork")
        self.jobs, self.out = ctx.Queue(), ctx.Queue(maxsize=DEPTH)
        args = (self.jobs, self.out, cfg, logging.getLogger().level, os.getpid())
        self.proc = ctx.Process(target=_serve, args=args, name="eagle3-render", daemon=True)
        self.proc.start()

    def _get(self) -> tuple:
        while True:
            try:
                item = self.out.get(timeout=5.0)
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the render process exited (code {self.proc.exitcode})") from None
                continue
            if item[0] == "error":
                raise (UserError if item[1] else RuntimeError)(f"rendering the samples: {item[2]}")
            return item

    def tokens_per_row(self, start: int, end: int) -> float | None:
        """samples.sample_tokens_per_row over rows [start, end) of the run's data."""
        self.jobs.put(("estimate", start, end))
        return self._get()[1]

    def parts(
        self, todo: list[tuple[int, tuple[int, int]]], done: dict[int, dict[str, int]]
    ) -> Iterator[tuple[int, tuple[int, int], list, list]]:
        """(n, rows, accepted, rejects) = block_samples of each part to do, in order; `done` maps each
        finished part before the last to do to its samples' {id: row}."""
        blocks = dict(todo)
        self.jobs.put(("render", todo, done))
        while True:
            item = self._get()
            if item[0] == "end":
                return
            _, n, accepted, rejects = item
            yield n, blocks[n], accepted, rejects

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()  # (also when a part is still being rendered: nothing to keep)
        self.proc.join(timeout=30)
