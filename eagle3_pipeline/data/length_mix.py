"""Long samples in windows, and micro-batches that mix lengths within the token budget.

Windows: a sample longer than max_seq_len trains in consecutive windows of max_seq_len tokens that overlap
by one token, so that each of its shifted slots (packing.pack: slot t learns token t+1) is trained exactly
once an epoch, at its true RoPE position. A window is valid EAGLE-3 data: its aux and last states are the
verifier's from the forward over the whole sample (stage 01 extracts every sample whole, up to its own
max_seq_len; online states are requested for the sample's prefix through the window's end), so the
inputs and targets are what serving sees; only the draft's own attention starts at the window (its
earlier keys are out of reach), which is the price of bounding the micro-batch. A window whose targets
all come before the sample's first supervised token (SampleRef.first_loss) is not trained: it would run at
a loss of 0 by the mask. In a template that re-renders earlier turns (Kimi-K2.5's thinking mode) each turn
is a sample of its whole context with only its own tokens supervised, so without this a long conversation
would train n / 2 times its length in windows of which all but the last few teach nothing.

Batches ("mix"): each epoch's windows are shuffled with the seed, cut into groups of about
GROUP_BATCHES micro-batches' tokens, and each group is packed best-fit-decreasing: the longest windows
open micro-batches and the short ones fill what they leave, so no micro-batch exceeds batch_tokens (a
window alone may, up to max_seq_len, when max_seq_len > batch_tokens), fewer tokens of budget are left
empty than with greedy packing in shuffled order, and each micro-batch mixes one or a few long windows
with short samples. The epoch's micro-batches are then shuffled, so the long ones are spread over the
epoch, never left to its end. Every window once an epoch; the same seed and epoch give the same batches.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from eagle3_pipeline.data.shards import SampleRef

GROUP_BATCHES = 64  # micro-batches packed together: enough choice to fill them, still a local shuffle


def window_starts(num_tokens: int, max_seq_len: int) -> list[tuple[int, int]]:
    """(start, tokens) of a sample's windows: [k (M-1), k (M-1) + M), M = max_seq_len; itself if it fits."""
    if num_tokens <= max_seq_len:
        return [(0, num_tokens)]
    return [(a, min(max_seq_len, num_tokens - a)) for a in range(0, num_tokens - 1, max_seq_len - 1)]


def windows(ref: SampleRef, max_seq_len: int) -> list[SampleRef]:
    """The sample itself when it fits, else its windows (window_starts) from the first whose targets reach
    its first supervised token on (a window [a, a + n) learns tokens a + 1 .. a + n - 1)."""
    if ref.num_tokens <= max_seq_len:
        return [ref]
    starts = window_starts(ref.num_tokens, max_seq_len)
    return [dataclasses.replace(ref, start=a, num_tokens=n) for a, n in starts if a + n - 1 >= ref.first_loss]


def first_window(ref: SampleRef) -> bool:
    """Whether `ref` is the first window `windows` trains of its sample (the one before it, ending at its
    start, learns only tokens before the first supervised one)."""
    return ref.start == 0 or ref.start < ref.first_loss


def all_windows(samples: list[SampleRef], max_seq_len: int) -> list[SampleRef]:
    return [w for ref in samples for w in windows(ref, max_seq_len)]


def best_fit_decreasing(units: list[SampleRef], batch_tokens: int) -> list[list[SampleRef]]:
    """Longest first, each into the micro-batch with the least room that still holds it (a new one if
    none does); ties keep the given order. Room is kept sorted, so a group packs in n log n."""
    batches: list[list[SampleRef]] = []
    room: list[tuple[int, int]] = []  # (tokens left, batch index), sorted
    for u in sorted(units, key=lambda r: -r.num_tokens):
        at = bisect.bisect_left(room, (u.num_tokens, -1))
        if at < len(room):
            left, b = room.pop(at)
        else:
            left, b = batch_tokens, len(batches)
            batches.append([])
        batches[b].append(u)
        if left - u.num_tokens > 0:
            bisect.insort(room, (left - u.num_tokens, b))
    return batches


def mixed_batches(
    samples: list[SampleRef], batch_tokens: int, max_seq_len: int, seed: int, epoch: int
) -> list[list[SampleRef]]:
    """One epoch's micro-batches: windows shuffled, packed best-fit-decreasing per group, order shuffled."""
    units = all_windows(samples, max_seq_len)
    g = torch.Generator().manual_seed(seed * 100003 + epoch)
    shuffled = [units[i] for i in torch.randperm(len(units), generator=g).tolist()]
    batches: list[list[SampleRef]] = []
    group: list[SampleRef] = []
    tokens, group_tokens = 0, GROUP_BATCHES * batch_tokens
    for u in shuffled:
        group.append(u)
        tokens += u.num_tokens
        if tokens >= group_tokens:
            batches += best_fit_decreasing(group, batch_tokens)
            group, tokens = [], 0
    batches += best_fit_decreasing(group, batch_tokens)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]
