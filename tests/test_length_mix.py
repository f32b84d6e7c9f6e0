"""Long samples train whole, in windows at their true positions, and micro-batches mix lengths within the
token budget: every window once an epoch, the same batches for the same seed (length_mix.py)."""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest
import torch
from conftest import shard_of

from eagle3_pipeline.data.length_mix import first_window, windows
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

    # supervised from token 17 on (a turn after its context): the window learning tokens 8-14 is not
    # trained, and the ones kept hold every supervised slot once, as the whole sample does
    sample["loss_mask"][:17] = 0
    late = SampleRef("s", "p", 0, "x", n, first_loss=17)
    kept = windows(late, 8)
    assert [(w.start, w.num_tokens) for w in kept] == [(14, 8), (21, 4)] and first_window(kept[0])
    assert not first_window(kept[1]) and first_window(parts[0]) and not first_window(parts[1])
    whole = pack([sample], max_seq_len=10**9)
    cut = [pack([window_of(sample, w)], max_seq_len=8) for w in kept]
    slots = whole["loss_mask"][0].bool()
    for key in ("hidden_states", "input_ids", "verifier_last", "position_ids"):
        got = torch.cat([c[key][0][c["loss_mask"][0].bool()] for c in cut])
        assert torch.equal(got, whole[key][0][slots]), key


def test_an_epoch_of_windows_loads_packs_and_counts_every_position_of_the_split(tiny_run, caplog):
    """The training loop's own pieces on the tiny run's shards at max_seq_len 96 (below most samples):
    BatchDataset loads each window, the packed rows hold every position of every sample once at its true
    position from its first window with a supervised target on, and the epoch's count (epochs.EpochCount,
    as train.py runs it) agrees and says so."""
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
    first = {r.sample_id: windows(r, 96)[0].start for r in train}  # those before learn no supervised token
    assert {r.sample_id: sorted(positions[r.sample_id]) for r in train} == {
        r.sample_id: list(range(first[r.sample_id], r.num_tokens - 1)) for r in train
    }
    with caplog.at_level(logging.INFO, logger="eagle3.train"):
        got = count.report(Dist(), torch.device("cpu"))
    assert got["samples"] == len(train)
    assert got["positions"] == sum(r.num_tokens - 1 - first[r.sample_id] for r in train)
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
    assert 0 < parts[0].start < ref.first_loss  # the windows before learn only the prompt: not trained
    cut = [pack([source.sample(w)], max_seq_len=32) for w in parts]
    for key in ("hidden_states", "input_ids", "verifier_last", "loss_mask", "position_ids"):
        assert torch.equal(torch.cat([c[key] for c in cut], dim=1), whole[key][:, parts[0].start :]), key
    assert source.client.asked == [w.start + w.num_tokens for w in parts]  # each window's whole prefix


def test_a_sample_stored_from_its_context_trains_every_supervised_slot_as_the_whole_sample(
    tiny_verifier, tmp_path
):
    """Stage 01 --context-tokens 16: the verifier runs each sample whole, and what is stored starts 16 tokens
    before the slot of the first supervised token, at its true position (the manifest's "position"): every
    stored tensor is the whole extraction's from there, and packed, every supervised slot holds the same
    inputs, targets and position as in the whole sample (the draft trains the same slots); a context shorter
    than that is stored whole. Stage 04 refuses such shards where it needs every token."""
    import json
    import random

    from conftest import extract_args, run_script, script

    from eagle3_pipeline.core.errors import UserError
    from eagle3_pipeline.data.shards import load_sample, open_shards
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.training.train import open_data

    g = random.Random(0)

    def ids(n: int) -> list[int]:
        return [g.randrange(32, 250) for _ in range(n)]

    rows = [{"id": "document", "token_samples": [{"prompt_ids": ids(300), "completion_ids": ids(20)}]},
            {"id": "turns", "token_samples": [{"prompt_ids": ids(40), "completion_ids": ids(10)},
                                              {"prompt_ids": ids(120), "completion_ids": ids(15)}]},
            {"id": "short", "token_samples": [{"prompt_ids": ids(5), "completion_ids": ids(8)}]}]  # fmt: skip
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, extra in (("whole", []), ("cut", ["--context-tokens", "16"])):
        run_script(*extract_args(tiny_verifier, data, tmp_path / name), *extra)
    whole, cut = (open_shards([str(tmp_path / name)]).samples for name in ("whole", "cut"))
    assert [r.position for r in cut] == [300 - 1 - 16, 40 - 1 - 16, 120 - 1 - 16, 0]
    assert [r.first_loss for r in whole] == [300, 40, 120, 5]  # stage 04 trains no window before it
    assert [r.first_loss for r in cut] == [16 + 1, 16 + 1, 16 + 1, 5]
    assert [r.num_tokens for r in cut] == [w.num_tokens - c.position for w, c in zip(whole, cut)]
    assert json.loads((shard_of(tmp_path / "cut") / "meta.json").read_text())["context_tokens"] == 16
    for w, c in zip(whole, cut, strict=True):
        full, stored = load_sample(w), load_sample(c)
        assert all(torch.equal(full[k][c.position :], stored[k]) for k in full)
        packed = [pack([window_of(s, r)], max_seq_len=10**9) for s, r in ((full, w), (stored, c))]
        slots = [p["loss_mask"][0].bool() for p in packed]
        assert int(slots[0].sum()) == int(slots[1].sum()) > 0
        for key in ("hidden_states", "input_ids", "verifier_last", "position_ids"):
            assert torch.equal(packed[0][key][0][slots[0]], packed[1][key][0][slots[1]]), key

    run_script(script("02_build_vocab_mapping.py"), "--data-dir", str(tmp_path / "cut"), "--out-dir",
               str(tmp_path / "vocab"), "--draft-vocab-size", "64")  # fmt: skip
    cfg = TrainConfig(data_dir=[str(tmp_path / "cut")], vocab_mapping_dir=str(tmp_path / "vocab"),
                      out_dir=str(tmp_path / "train"), loss_on_all_tokens=True)  # fmt: skip
    with pytest.raises(UserError, match="'document' is stored from position 283 on .* loss_on_all_tokens"):
        open_data(cfg)
