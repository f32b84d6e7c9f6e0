"""Samples into packed micro-batches, shifted the way the draft serves; shared by training and export.

Slot t of a sample gets the verifier's aux states at t, the embedding of token t+1 and RoPE position t,
and learns the verifier's distribution at t+1 (vLLM's EAGLE-3 proposer, docs/vllm_contract.md section 1).
Several samples share one row; document ids keep their attention apart. A sample longer than max_seq_len
trains in windows (length_mix.py), each at its true positions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.data import length_mix
from eagle3_pipeline.data.shards import SampleRef, load_sample

PACKED_KEYS = ("hidden_states", "input_ids", "verifier_last", "loss_mask", "document_ids", "position_ids")
WINDOW_START = "window_start"  # a window's first position in its sequence (window_of): its RoPE offset


def window_of(sample: dict[str, torch.Tensor], ref: SampleRef) -> dict[str, Any]:
    """The tokens of a window (ref.start, ref.num_tokens) of a loaded sample, with its position when that
    is not 0 (a later window, or a sample stored from ref.position on); a whole sample as it is."""
    end = ref.start + ref.num_tokens
    window = sample if ref.start == 0 else {k: v[ref.start : end] for k, v in sample.items()}
    position = ref.position + ref.start
    return {**window, WINDOW_START: position} if position else window


def pack(
    samples: list[dict[str, torch.Tensor]], max_seq_len: int, loss_on_all_tokens: bool = False
) -> dict[str, torch.Tensor]:
    """Shift each sample to (aux_t, token_{t+1}, teacher_{t+1}, mask_{t+1}) and pack them in one row.

    `loss_on_all_tokens` supervises prompt tokens too (the teacher is the verifier's distribution at
    every position, not only where the assistant wrote).
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in PACKED_KEYS}
    for doc, s in enumerate(samples):
        n, start = min(len(s["input_ids"]), max_seq_len), int(s.get(WINDOW_START, 0))
        if n < 2:
            continue
        mask = s["loss_mask"][1:n].bool()
        parts["hidden_states"].append(s["aux_hidden_states"][: n - 1].flatten(1).float())
        parts["input_ids"].append(s["input_ids"][1:n].long())
        parts["verifier_last"].append(s["last_hidden_state"][1:n].float())
        parts["loss_mask"].append(torch.ones_like(mask) if loss_on_all_tokens else mask)
        parts["document_ids"].append(torch.full((n - 1,), doc, dtype=torch.long))
        parts["position_ids"].append(torch.arange(start, start + n - 1))
    return {k: torch.cat(v)[None] for k, v in parts.items()}


def pack_lengths(lengths: list[int], batch_tokens: int, max_seq_len: int) -> list[list[int]]:
    """Greedy packing in the given order: indices of `lengths` per micro-batch of at most batch_tokens
    tokens, each counted at most max_seq_len (the trainer packs longer samples' windows, length_mix.py)."""
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, length in enumerate(lengths):
        n = min(length, max_seq_len)
        if current and used + n > batch_tokens:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


def micro_batches(
    samples: list[SampleRef],
    batch_tokens: int,
    max_seq_len: int,
    seed: int,
    epoch: int,
    batching: str = "shuffle",
) -> list[list[SampleRef]]:
    """One epoch's micro-batches of the samples (longer than max_seq_len: their windows, each once).
    "shuffle": a seeded shuffle packed greedily in that order into micro-batches of at most batch_tokens;
    "mix": length_mix.mixed_batches (best fit by length, fewer and fuller micro-batches)."""
    if batching == "mix":
        return length_mix.mixed_batches(samples, batch_tokens, max_seq_len, seed, epoch)
    samples = length_mix.all_windows(samples, max_seq_len)
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    order = torch.randperm(len(samples), generator=g).tolist()
    packed = pack_lengths([samples[i].num_tokens for i in order], batch_tokens, max_seq_len)
    return [[samples[order[j]] for j in batch] for batch in packed]


ERROR_KEY = "error"  # a batch that could not be read carries only this: the UserError's message


class BatchDataset(torch.utils.data.Dataset):
    """Micro-batch i, loaded and packed (in DataLoader workers when there are any).

    A UserError (a corrupt sample) comes back as `{ERROR_KEY: message}` rather than raised: raised in
    a worker, the DataLoader would re-raise it wrapped in the worker's traceback text.
    `raise_batch_errors` turns it back into the UserError in the training process.
    """

    def __init__(self, batches: list[list[SampleRef]], max_seq_len: int, loss_on_all_tokens: bool = False):
        self.batches = batches
        self.max_seq_len = max_seq_len
        self.loss_on_all_tokens = loss_on_all_tokens

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict[str, Any]:
        try:
            samples = [window_of(load_sample(r), r) for r in self.batches[i]]
        except UserError as e:
            return {ERROR_KEY: str(e)}
        return pack(samples, self.max_seq_len, self.loss_on_all_tokens)


def raise_batch_errors(loader: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The loader's batches; a batch that failed to load stops the run with its UserError."""
    for batch in loader:
        if ERROR_KEY in batch:
            raise UserError(batch[ERROR_KEY])
        yield batch
