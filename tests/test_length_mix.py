"""Long samples train whole, in windows at their true positions, and micro-batches mix lengths within the
token budget: every window once an epoch, the same batches for the same seed (length_mix.py)."""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from conftest import shard_of

from eagle3_pipeline.data.length_mix import windows
from eagle3_pipeline.data.packing import micro_batches, pack, window_of
from eagle3_pipeline.data.shards import SampleRef

MAX_SEQ_LEN, BATCH_TOKENS = 1024, 2048
LONG = {"long-a": 2500, "long-b": 5000, "long-c": 1025}  # over max_seq_len: 3, 5 and 2 windows


def _refs() -> list[SampleRef]:
    g = torch.Generator().manual_seed(1)
    short = [SampleRef("s", "p", i, f"short-{i}", int(n)) for i, n in enumerate(torch.randint(20, 600, (120,),
                                                                                             generator=g))]
    return short + [SampleRef("s", "p", 200 + i, k, n) for i, (k, n) in enumerate(LONG.items())]


def _slots(batches: list[list[SampleRef]]) -> dict[str, list[int]]:
    """Per sample id, the shifted slots (packing.pack: slot t learns token t+1) its windows train."""
    out: dict[str, list[int]] = defaultdict(list)
    for batch in batches:
        for r in batch:
            n = min(r.num_tokens, MAX_SEQ_LEN)
            out[r.sample_id] += range(r.start, r.start + n - 1)
    return out


def test_every_long_sample_trains_all_its_slots_once_an_epoch_in_batches_within_the_budget():
    refs = _refs()
    for epoch in (0, 1):
        batches = micro_batches(refs, BATCH_TOKENS, MAX_SEQ_LEN, seed=0, epoch=epoch, batching="mix")
        slots = _slots(batches)
        # every sample, long or short, exactly its num_tokens - 1 slots, each once (old: a long one's first
        # max_seq_len - 1 only)
        assert {r.sample_id: sorted(slots[r.sample_id]) for r in refs} == {
            r.sample_id: list(range(r.num_tokens - 1)) for r in refs
        }
        assert all(sum(r.num_tokens for r in b) <= BATCH_TOKENS for b in batches)
        assert all(r.num_tokens <= MAX_SEQ_LEN for b in batches for r in b)
        # long windows are spread over the epoch, not left to its end
        where = [i for i, b in enumerate(batches) if any(r.sample_id.startswith("long") for r in b)]
        assert where[0] < len(batches) // 2
    shuffled = micro_batches(refs, BATCH_TOKENS, MAX_SEQ_LEN, seed=0, epoch=0)
    assert sorted(map(sorted, _slots(shuffled).values())) == sorted(map(sorted, slots.values()))
    assert len(batches) < len(shuffled)  # best fit leaves less of the budget empty than greedy in order


def test_the_same_seed_and_epoch_give_the_same_batches_and_another_seed_others():
    refs = _refs()

    def order(seed: int, epoch: int) -> list[list[tuple[str, int]]]:
        batches = micro_batches(refs, BATCH_TOKENS, MAX_SEQ_LEN, seed, epoch, batching="mix")
        return [[(r.sample_id, r.start) for r in b] for b in batches]

    assert order(0, 0) == order(0, 0)
    assert order(0, 0) != order(1, 0) and order(0, 0) != order(0, 1)


def test_a_samples_windows_pack_to_exactly_its_own_slots_at_its_true_positions():
    n, h = 25, 3
    g = torch.Generator().manual_seed(0)
    sample = {"input_ids": torch.arange(n), "loss_mask": (torch.rand(n, generator=g) > 0.3).long(),
              "aux_hidden_states": torch.randn(n, 2, h, generator=g),
              "last_hidden_state": torch.randn(n, h, generator=g)}  # fmt: skip
    ref = SampleRef("s", "p", 0, "x", n)
    parts = windows(ref, 8)
    assert [(w.start, w.num_tokens) for w in parts] == [(0, 8), (7, 8), (14, 8), (21, 4)]
    whole = pack([sample], max_seq_len=10**9)
    cut = [pack([window_of(sample, w)], max_seq_len=8) for w in parts]
    for key in ("hidden_states", "input_ids", "verifier_last", "loss_mask", "position_ids"):
        assert torch.equal(torch.cat([c[key] for c in cut], dim=1), whole[key]), key


def test_an_epoch_of_windows_loads_packs_and_counts_every_position_of_the_split(tiny_run, caplog):
    """The training loop's own pieces on the tiny run's shards at max_seq_len 96 (below most samples):
    BatchDataset loads each window, the packed rows hold every position of every sample once at its true
    position, and the epoch's count (epochs.EpochCount, as train.py runs it) agrees and says so."""
    from eagle3_pipeline.data.packing import BatchDataset
    from eagle3_pipeline.data.shards import open_shards
    from eagle3_pipeline.data.split import load_split
    from eagle3_pipeline.training.distributed import Dist
    from eagle3_pipeline.training.epochs import EpochCount, EpochPlan

    train, _ = load_split(tiny_run / "split", open_shards([str(shard_of(tiny_run / "hidden_states"))]).samples)
    assert max(r.num_tokens for r in train) > 96
    batches = micro_batches(train, 1024, 96, seed=0, epoch=0, batching="mix")
    data, count = BatchDataset(batches, 96), EpochCount(EpochPlan(0, batches, 1, 0, 1), 0, 96)
    positions: dict[str, list[int]] = defaultdict(list)
    for i, refs in enumerate(batches):
        row = data[i]
        count.add(refs, row)
        for doc, r in enumerate(refs):
            positions[r.sample_id] += row["position_ids"][row["document_ids"] == doc].tolist()
    assert {r.sample_id: sorted(positions[r.sample_id]) for r in train} == {
        r.sample_id: list(range(r.num_tokens - 1)) for r in train
    }
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        got = count.report(Dist(), torch.device("cpu"))
    assert got["samples"] == len(train) and got["positions"] == sum(r.num_tokens - 1 for r in train)
    windows_made = sum(len(windows(r, 96)) - 1 for r in train)
    assert f"samples {len(train)}, each once" in caplog.text
    assert f"+{windows_made} windows of longer samples" in caplog.text


class CausalServer:
    """Online states as a causal verifier gives them: position t's depend on ids[: t + 1] only."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def states(self, sample_id: str, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.asked.append(len(ids))
        x = torch.tensor(ids, dtype=torch.float64).cumsum(0)
        return x[:, None, None].repeat(1, 3, 4), x[:, None].repeat(1, 4)


def test_online_windows_get_the_rows_of_the_forward_over_their_whole_prefix(tiny_run):
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.data.shards import load_sample, open_shards
    from eagle3_pipeline.training.online import TOKEN_KEYS, OnlineSource

    ref = max(open_shards([str(shard_of(tiny_run / "hidden_states"))]).samples, key=lambda r: r.num_tokens)
    source = OnlineSource.__new__(OnlineSource)  # its client and cache, without servers to reach
    source.cfg, source.client, source.cache = TrainConfig(max_seq_len=32), CausalServer(), None
    tokens = load_sample(ref, TOKEN_KEYS)
    aux, last = CausalServer().states(ref.sample_id, tokens["input_ids"].tolist())
    whole = pack([{**tokens, "aux_hidden_states": aux, "last_hidden_state": last}], max_seq_len=10**9)
    parts = windows(ref, 32)
    cut = [pack([source.sample(w)], max_seq_len=32) for w in parts]
    for key in ("hidden_states", "input_ids", "verifier_last", "loss_mask", "position_ids"):
        assert torch.equal(torch.cat([c[key] for c in cut], dim=1), whole[key]), key
    assert source.client.asked == [w.start + w.num_tokens for w in parts]  # each window's whole prefix
