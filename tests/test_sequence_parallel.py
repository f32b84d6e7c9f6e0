"""Sequence parallelism (training/sequence_parallel.py): a packed row split over 2 or 3 gloo ranks under
torchrun trains the loss, metrics and gradients of one process on the whole row; stage 04 with
--sequence-parallel 2 on 2 ranks logs one process's losses.

Run as a script (torchrun runs this file) it is the worker of the equality test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from eagle3_pipeline.core.errors import UserError
from eagle3_pipeline.training import sequence_parallel as seqpar

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DOCS = (37, 91, 11, 70)  # 209 positions: a multiple of neither 2 nor 3; documents straddle the slices
TTT = 3
WINDOW = 20  # the windowed draft's: shorter than the documents and than a slice (70 or 105 positions)
CFG = dict(attn_impl="blockwise", loss_impl="chunked", parallel_drafting=False, states="shards")


def _row(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(DOCS)
    return {
        "hidden_states": torch.randn(1, n, 3 * 64, generator=g),
        "input_ids": torch.randint(0, 200, (1, n), generator=g),
        "verifier_last": torch.randn(1, n, 64, generator=g),
        "loss_mask": (torch.rand(n, generator=g) < 0.8)[None],
        "document_ids": torch.arange(len(DOCS)).repeat_interleave(torch.tensor(DOCS))[None],
        "position_ids": torch.cat([torch.arange(d) for d in DOCS])[None],
    }


def test_the_slices_tile_the_row_and_carry_the_next_steps_tokens_and_targets():
    """Rank r holds positions r*n..(r+1)*n-1 of the row padded to sp*n (document -1), the ids of the next
    ttt_steps - 1 positions, and targets (verifier states, loss mask) that stop at the row's end."""
    row = _row()
    length = row["input_ids"].shape[1]
    for sp in (2, 3):
        n = -(-length // sp)
        parts = [seqpar.slice_row(row, sp, r, TTT) for r in range(sp)]
        states = torch.cat([p["hidden_states"] for p in parts], dim=1)
        assert states.shape[1] == n * sp and torch.equal(states[:, :length], row["hidden_states"])
        assert not states[:, length:].any()
        for r, p in enumerate(parts):
            a = r * n
            assert torch.equal(p["document_ids"][0, length:], torch.full((n * sp - length,), -1))
            ids = p["input_ids"][0]
            ids_past = torch.cat([row["input_ids"][0], torch.zeros(n * sp, dtype=torch.long)])
            want = ids_past[a : a + n + TTT - 1]
            assert ids.shape[0] == min(n + TTT - 1, n * sp - a) and torch.equal(ids, want[: ids.shape[0]])
            end = min(a + n + TTT - 1, length)
            assert torch.equal(p["verifier_last"], row["verifier_last"][:, a:end])
            assert torch.equal(p["loss_mask"], row["loss_mask"][:, a:end])
            assert torch.equal(p["position_ids"][0, : max(0, length - a)], row["position_ids"][0, a : a + n])


@pytest.mark.parametrize(
    "sp,world,cfg,says",
    [(2, 3, {}, "--sequence-parallel 2: it must divide the number of ranks (3"),
     (2, 2, {"attn_impl": "sdpa"}, "--attn-impl blockwise and --loss-impl chunked (now sdpa and chunked)"),
     (2, 2, {"loss_impl": "eager"}, "(now blockwise and eager)"),
     (2, 2, {"states": "online"}, 'train from shards (states = "shards")'),
     (2, 2, {"parallel_drafting": True}, "a parallel draft (parallel_drafting) trains on one rank per row")],
)  # fmt: skip
def test_a_setting_it_cannot_train_with_is_refused_naming_the_fix(sp, world, cfg, says):
    with pytest.raises(UserError, match=None) as e:
        seqpar.check(SimpleNamespace(sequence_parallel=sp, **{**CFG, **cfg}), world)
    assert says in str(e.value)
    seqpar.check(SimpleNamespace(sequence_parallel=1, **{**CFG, "attn_impl": "sdpa"}), 3)  # sp 1: anything


def test_2_and_3_ranks_sharing_a_row_train_one_process_loss_metrics_and_gradients(tmp_path):
    """torchrun, 3 gloo ranks: a group of 2 (ranks 0, 1) and the group of all 3 each train the row, each
    rank its slice through DDP over its group; the loss, every metric and every parameter's gradient (DDP's
    average over the group) equal one process's ttt_forward on the whole row within 1e-5 relative (a
    gradient: relative to its tensor's largest), GQA (llama), MLA and a windowed llama draft (window
    WINDOW, shorter than a slice: each rank's chunks reach into the previous rank's keys), ttt_steps 3."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "3", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads((tmp_path / "diffs.json").read_text())
    print(f"max relative differences {found}")
    assert sorted(found) == ["2 llama", "2 llama-window", "2 mla", "3 llama", "3 llama-window", "3 mla"]
    for run, diffs in found.items():
        assert diffs["grads_checked"] > 5, run
        assert max(diffs["loss"], diffs["metrics"], diffs["grads"]) <= 1e-5, (run, diffs)


def test_stage_04_with_sequence_parallel_2_on_2_ranks_logs_one_process_losses(tiny_run, tmp_path):
    """04_train.py under torchrun, --sequence-parallel 2 (both ranks train each row, rank 0 alone writes):
    the losses and gradient norms of one process with the same settings, steps 1 and 2, its validation,
    and the epoch's sample count (each sample once, counted once per group)."""
    from conftest import read_jsonl, run_script, script

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = [script("04_train.py"), "--config", str(tiny_run / "tiny.toml"), "--max-steps", "2",
            "--log-every", "1", "--val-max-samples", "1", "--attn-impl", "blockwise",
            "--loss-impl", "chunked"]  # fmt: skip
    proc = subprocess.run([TORCHRUN, "--standalone", "--nproc-per-node", "2", *args, "--out-dir",
                           str(tmp_path / "sp"), "--sequence-parallel", "2"],
                          env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = run_script(*args, "--out-dir", str(tmp_path / "one"))
    sp, one = (read_jsonl(tmp_path / name / "train_log.jsonl") for name in ("sp", "one"))
    assert [e["step"] for e in sp] == [e["step"] for e in one] == [1, 2]
    for a, b in zip(sp, one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["loss"] > 0.1, (a, b)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), (a, b)
    assert "[rank 1] step" not in proc.stderr and "ranks 2 x" in proc.stderr
    val = [[float(x) for x in re.findall(r"val step 2 \| loss (\S+) \| acc0 (\S+)", p.stderr)[0]]
           for p in (proc, single)]  # fmt: skip
    assert val[0] == pytest.approx(val[1], rel=1e-4), val  # validation on both ranks' slices too
    counted = r"epoch 0 \| samples \d+, each once \| positions \d+"
    epoch = [re.findall(counted, p.stderr) for p in (proc, single)]
    assert epoch[0] == epoch[1] and len(epoch[0]) == 1, epoch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _model(arch: str) -> torch.nn.Module:
    from dataclasses import replace

    from test_long_memory import DRAFT_VOCAB, SPECS

    from eagle3_pipeline.models.draft import build_draft, trainable_names
    from eagle3_pipeline.training import kernel_policy as kernels

    torch.manual_seed(0)
    spec = replace(SPECS["llama"], sliding_window=WINDOW) if arch == "llama-window" else SPECS[arch]
    model = build_draft(spec, attn_impl=kernels.HF_ATTN_NAMES["blockwise"])
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:  # heads at std 0.3: logits far from uniform, losses far from 0
                torch.nn.init.normal_(p, std=0.3 if p.shape[0] == DRAFT_VOCAB else 0.05)
    names = trainable_names(model, True)
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    return model


def _compare(arch: str, recipe: Any, seq: seqpar.SeqGroup) -> dict[str, float]:
    """The whole row in one process (the reference), then this rank's slice through DDP over its group:
    the largest relative differences of the loss, the metrics and the gradients."""
    from eagle3_pipeline.training import kernel_policy as kernels
    from eagle3_pipeline.training.train_metrics import forward

    cpu = torch.device("cpu")
    kern = kernels.Kernels("blockwise", "chunked", False, windowed=arch == "llama-window")
    ref_model = _model(arch)
    ref_loss, ref_metrics = forward(ref_model, _row(), recipe, cpu, None, kern)  # unbound: the row
    ref_loss.backward()
    model = _model(arch)
    seqpar.bind(model, seq)
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, process_group=seq.group)
    loss, metrics = forward(ddp, _row(), recipe, cpu, None, kern)
    loss.backward()
    summed = loss.detach() / seq.size
    torch.distributed.all_reduce(summed, group=seq.group)  # the group's shares sum to the row's loss
    refs = dict(ref_model.named_parameters())
    grads = [(p.grad, refs[n].grad) for n, p in model.named_parameters() if p.requires_grad]
    assert set(metrics) == set(ref_metrics)
    return {
        "loss": max(_rel(summed, ref_loss), _rel(metrics["loss_sum"], ref_loss)),
        "metrics": max(_rel(metrics[k], ref_metrics[k].float()) for k in ref_metrics),
        "grads": max(_rel(g, ref) for g, ref in grads),
        "grads_checked": len(grads),
    }


def _worker(out: Path) -> None:
    """Rank 0, 1 or 2 of the equality test: groups [0, 1] and [0, 1, 2] (every rank makes both)."""
    from eagle3_pipeline.models import linear_memory
    from eagle3_pipeline.training.distributed import Dist
    from eagle3_pipeline.training.train_metrics import Recipe

    linear_memory.ATTN_CHUNK, linear_memory.LOSS_CHUNK = 16, 24  # several chunks in every slice
    torch.distributed.init_process_group("gloo")
    dist = Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())
    pair = torch.distributed.new_group([0, 1])
    seqpar.setup(SimpleNamespace(sequence_parallel=3, **CFG), dist)
    groups = {"3": dist.seq, **({"2": seqpar.SeqGroup(2, dist.rank, pair)} if dist.rank < 2 else {})}
    recipes = {"llama": Recipe(TTT, 0.8, "kl_div"), "mla": Recipe(TTT, 1.0, '{"kl_div": 0.5, "ce": 0.5}'),
               "llama-window": Recipe(TTT, 0.8, "kl_div")}  # fmt: skip
    found = {f"{size} {arch}": _compare(arch, recipe, seq)
             for size, seq in groups.items() for arch, recipe in recipes.items()}  # fmt: skip
    if dist.rank == 0:
        (out / "diffs.json").write_text(json.dumps(found))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _worker(Path(sys.argv[1]))
