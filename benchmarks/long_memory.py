"""Peak memory and time of one training step (forward + backward) against the sample's length, CPU:
this project's linear-memory path beside speculators 0.9.0's own trainer step, in the same run.

  .venv/bin/python -m benchmarks.long_memory --quick        # tiny draft to 16k, SmolLM2-135M shapes to 4k
  .venv/bin/python -m benchmarks.long_memory                # both to 32k, OOM recorded at the memory cap

Each point is one row holding one document of L tokens (the long-sample case: every query reads all
earlier keys), random states and random weights (no download), 3 TTT steps, kl_div, fp32, in a child
process of its own under an address-space cap (RLIMIT_AS, --cap-gb): a point that passes the cap is
recorded as OOM at the cap, the run goes on. The child reads its max RSS (resource.getrusage, the RSS
high-water mark) after a 256-token warm-up step (model, grads, batch: the baseline) and after the timed
step: `growth` is the step's own peak above that baseline.

- `speculators`: the draft its CLI builds (`speculators.train.cli.build_draft_model` from a random Llama
  verifier of the shape: norm_before_residual / norm_before_fc / norm_output on, its config defaults from
  `TrainConfig.resolve`), its batch (`CollateFn` + `shift_batch`), its loss (`get_trainer_kwargs`:
  kl_div) and its `Trainer.train_epoch` step (model(**batch, **train_kwargs) under autocast, backward).
  Its default kernels cannot train on a CPU (flex attention has no CPU backward, the fused losses are
  Triton kernels), so it runs `--draft-attn-impl sdpa --loss-implementation eager`, as
  benchmarks/speculators_baseline.py does.
- `blockwise+chunked`: this project's `attn_impl blockwise`, `loss_impl chunked`
  (models/linear_memory.py) through train_metrics.forward, on the same draft layout (the same norms).
  The time spent in blockwise attention (forward + its recomputing backward) is measured apart.
- `sdpa+eager`: this project's forward with speculators' kernels (not run unless --impls names it).
- `blockwise+chunked+window`: `blockwise+chunked` on a draft with `[train] sliding_window` --window
  (default 2048; models/draft_window.py): its chunks skip the keys out of reach, so the time per token
  should stop growing with L (not run unless --impls names it):

  nice -n 5 .venv/bin/python -m benchmarks.long_memory --shapes tiny --lengths 4096 8192 16384 32768 \
      --impls blockwise+chunked+window --out docs/results/long_memory_window.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import REPO as ROOT
from benchmarks import RESULTS

from eagle3_pipeline.models import linear_memory  # noqa: E402
from eagle3_pipeline.models.draft import DraftSpec, build_draft  # noqa: E402
from eagle3_pipeline.training import kernel_policy as kernels  # noqa: E402
from eagle3_pipeline.training.train_metrics import Recipe, forward  # noqa: E402

TTT = 3
WARMUP_TOKENS = 256
OOM_EXIT = 3  # the child's exit status when an allocation failed under the cap
# hidden, heads, kv heads, head_dim, intermediate, vocab, draft vocab
SHAPES = {
    "tiny": (64, 4, 2, 32, 128, 200, 50),
    "smollm2-135m": (576, 9, 3, 64, 1536, 49152, 32000),
}
IMPLS = ("speculators", "blockwise+chunked", "sdpa+eager", "blockwise+chunked+window")
PROJECT_KERNELS = {"sdpa+eager": ("sdpa", "eager"), "blockwise+chunked": ("blockwise", "chunked"),
                   "blockwise+chunked+window": ("blockwise", "chunked")}  # fmt: skip
WINDOW = 2048  # --window's default: a window a Kimi-sized draft could keep (tokens)
QUICK = {"tiny": (1024, 2048, 4096, 8192, 16384), "smollm2-135m": (1024, 2048, 4096)}
FULL = {name: (1024, 2048, 4096, 8192, 16384, 32768) for name in SHAPES}


def spec_of(shape: str, window: int | None = None) -> DraftSpec:
    """The draft speculators' CLI builds for this shape (its default norms), in this project's terms;
    with a window, the same draft windowed (the project's `+window` path)."""
    h, heads, kv, hd, inter, vocab, draft_vocab = SHAPES[shape]
    return DraftSpec(
        hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        intermediate_size=inter, rms_norm_eps=1e-5, rope_theta=1e5, max_position_embeddings=65536,
        vocab_size=vocab, draft_vocab_size=draft_vocab, aux_layer_ids=(1, 2, 3), norm_before_residual=True,
        norm_before_fc=True, norm_output=True, sliding_window=window,
    )  # fmt: skip


def write_verifier(shape: str, folder: Path) -> Path:
    """A random 4-layer Llama of the shape with an identity-prefix vocab mapping: what speculators' CLI
    reads the draft's decoder shape from and loads the embedding and lm_head of."""
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM

    h, heads, kv, hd, inter, vocab, dv = SHAPES[shape]
    config = LlamaConfig(
        hidden_size=h, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
        intermediate_size=inter, vocab_size=vocab, num_hidden_layers=4, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=65536, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    np.save(folder / "d2t.npy", np.zeros(dv, dtype=np.int64))
    np.save(folder / "t2d.npy", np.arange(vocab) < dv)
    return folder


def states(shape: str, n: int) -> dict[str, torch.Tensor]:
    h, _, _, _, _, vocab, _ = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(n, 3 * h, generator=g),
        "input_ids": torch.randint(0, vocab, (n,), generator=g),
        "verifier_last": torch.randn(n, h, generator=g),
    }


def project_step(shape: str, impl: str, window: int = WINDOW) -> Any:
    """This project's model and a function running one step on n tokens."""
    windowed = impl.endswith("+window")
    k = kernels.Kernels(*PROJECT_KERNELS[impl], False, windowed=windowed)
    torch.manual_seed(0)
    model = build_draft(spec_of(shape, window if windowed else None), attn_impl=k.hf_attn_impl)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                torch.nn.init.normal_(p, std=0.02)
    model.train()
    recipe, cpu = Recipe(TTT, 1.0, "kl_div"), torch.device("cpu")

    def step(n: int) -> float:
        s = states(shape, n)
        batch = {key: v[None] for key, v in s.items()}
        batch.update(loss_mask=torch.ones(1, n, dtype=torch.bool), position_ids=torch.arange(n)[None],
                     document_ids=torch.zeros(1, n, dtype=torch.long))  # fmt: skip
        value, _ = forward(model, batch, recipe, cpu, None, k)
        value.backward()
        return float(value.detach())

    return step


def speculators_step(shape: str, verifier: Path) -> Any:
    """speculators' draft, collate and loss as its CLI builds them, and its trainer's step on n tokens
    (train.trainer.Trainer.train_epoch: forward under autocast, backward; the optimizer step left out
    here as on the project's side)."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings
    from speculators.train.config import TrainConfig as SpecConfig
    from speculators.train.data import CollateFn

    h, dv = SHAPES[shape][0], SHAPES[shape][6]
    argv = [
        "--verifier-name-or-path", str(verifier), "--data-path", str(verifier), "--speculator-type", "eagle3",
        "--draft-vocab-size", str(dv), "--d2t-path", str(verifier / "d2t.npy"),
        "--t2d-path", str(verifier / "t2d.npy"), "--target-layer-ids", "1", "2", "3",
        "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--optimizer", "adamw",
        "--num-workers", "0", "--hidden-states-dtype", "float32", "--ttt-steps", str(TTT), "--seed", "0",
        "--mask-token-id", str(SHAPES[shape][5] - 1),  # unused by EAGLE-3; spares a tokenizer lookup
    ]  # fmt: skip
    args = argparse.Namespace(**SpecConfig.resolve(argv).flatten())
    torch.manual_seed(0)
    d2t, t2d, draft_vocab = parse_vocab_mappings(args)
    model = build_draft_model(args, Eagle3DraftModel, t2d, d2t, draft_vocab)
    train_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(**vars(args))
    model.train()

    def step(n: int) -> float:
        s = states(shape, n + 1)  # shift_batch drops one token: n positions train
        raw = {"input_ids": s["input_ids"], "hidden_states": s["hidden_states"],
               "verifier_last_hidden_states": s["verifier_last"],
               "loss_mask": torch.ones(n + 1, dtype=torch.bool), "lengths": torch.tensor([n + 1]),
               "position_ids": torch.arange(n + 1)}  # fmt: skip
        batch = CollateFn(n, h, 3, torch.float32, shift_batch)([raw])
        with torch.autocast("cpu", dtype=torch.float32):
            _, loss, _ = model(**batch, **train_kwargs)
        model.zero_grad(set_to_none=True)
        loss.backward()
        return float(loss.detach())

    return step


class AttentionTimer:
    """Seconds spent inside blockwise attention's forward and backward (patched on the class)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        fn = linear_memory._BlockwiseTTTAttention
        for name in ("forward", "backward"):
            setattr(fn, name, staticmethod(self.timed(getattr(fn, name))))

    def timed(self, f: Any) -> Any:
        def run(*a: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a)
            finally:
                self.seconds += time.perf_counter() - t0

        return run


def max_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def point(shape: str, impl: str, n: int, verifier: Path, window: int = WINDOW) -> dict[str, Any]:
    """One step at length n (run in its own process: max RSS only ever grows)."""
    step = speculators_step(shape, verifier) if impl == "speculators" else project_step(shape, impl, window)
    step(WARMUP_TOKENS)
    base = max_rss_bytes()
    timer = AttentionTimer()
    t0, c0 = time.perf_counter(), time.process_time()
    loss = step(n)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = max_rss_bytes()
    out = {"peak_gib": peak / 2**30, "growth_gib": (peak - base) / 2**30, "seconds": seconds,
           "us_per_token": seconds / n * 1e6, "loss": loss,
           "cpu_us_per_token": cpu_seconds / n * 1e6}  # fmt: skip
    # the process's CPU time: a ratio the other jobs of a shared machine disturb far less than wall time
    if impl.startswith("blockwise"):
        out["attention_seconds"] = timer.seconds
    if impl.endswith("+window"):
        out["window"] = window
    return out


def child(a: argparse.Namespace) -> int:
    """--point: cap the address space, run the point, print its JSON (an allocation failure: OOM_EXIT)."""
    cap = int(a.cap_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    with contextlib.suppress(OSError):  # if the machine runs out first, the kernel kills this point first
        Path("/proc/self/oom_score_adj").write_text("1000")
    shape, impl, n = a.point[0], a.point[1], int(a.point[2])
    try:
        print(json.dumps(point(shape, impl, n, Path(a.verifier), a.window)), flush=True)
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "alloc" not in str(e).lower():
            raise
        print(f"out of memory: {str(e).splitlines()[0][:200]}", file=sys.stderr, flush=True)
        return OOM_EXIT
    return 0


def run_point(shape: str, impl: str, n: int, a: argparse.Namespace, verifier: Path) -> dict[str, Any]:
    row: dict[str, Any] = {"shape": shape, "impl": impl, "tokens": n}
    cmd = [sys.executable, "-m", __spec__.name, "--point", shape, impl, str(n), "--verifier", str(verifier),
           "--cap-gb", str(a.cap_gb), "--threads", str(a.threads), "--window", str(a.window)]  # fmt: skip
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return {**row, "skipped": f"over {a.timeout:.0f} s"}
    wall = time.perf_counter() - t0
    if done.returncode in (OOM_EXIT, -9):  # an allocation refused under the cap; killed by the kernel
        why = f"OOM at the {a.cap_gb:g} GiB cap" if done.returncode == OOM_EXIT else "killed (machine memory)"
        return {**row, "oom": True, "skipped": why, "detail": done.stderr.strip().splitlines()[-1:],
                "exit": done.returncode, "wall_s": wall}  # fmt: skip
    if done.returncode != 0:
        return {**row, "skipped": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    return {**row, **json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def machine(cap_gb: float) -> dict[str, Any]:
    from importlib.metadata import version

    import transformers

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "speculators": version("speculators"),
        "attn_chunk": kernels.ATTN_CHUNK,
        "cap_gib": cap_gb,
        "peak_method": "max RSS of the point's child process (resource.getrusage ru_maxrss)",
    }


def cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "- | -"
    if "skipped" in r:
        return f"{r['skipped']} | -"
    return f"{r['peak_gib']:.2f} ({r['growth_gib']:.2f}) | {r['seconds']:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """One line per shape and length: speculators beside the project, peak (growth) GiB and s / step."""
    lines = ["| shape | L | speculators: peak (growth) GiB | s / step | project: peak (growth) GiB "
             "| s / step | project / speculators peak | attention share |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    keys = sorted({(r["shape"], r["tokens"]) for r in rows}, key=lambda k: (list(SHAPES).index(k[0]), k[1]))
    for shape, n in keys:
        got = {r["impl"]: r for r in rows if (r["shape"], r["tokens"]) == (shape, n)}
        spec, own = got.get("speculators"), got.get("blockwise+chunked")
        ratio = share = "-"
        if own and "skipped" not in own:
            share = f"{own['attention_seconds'] / own['seconds']:.0%}"
            if spec and "skipped" not in spec:
                ratio = f"{own['peak_gib'] / spec['peak_gib']:.2f}"
            elif spec and spec.get("oom"):
                ratio = "speculators OOM"
        lines.append(f"| {shape} | {n // 1024}k | {cell(spec)} | {cell(own)} | {ratio} | {share} |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape, for the project's path: peak and growth at 16k over 4k, time per token (whole step and
    outside attention) from 4k to the longest length, below speculators' peak at every length it ran."""
    out: dict[str, Any] = {}
    for shape in SHAPES:
        ok = [r for r in rows if r["shape"] == shape and "skipped" not in r]
        own = {r["tokens"]: r for r in ok if r["impl"] == "blockwise+chunked"}
        spec = {r["tokens"]: r for r in ok if r["impl"] == "speculators"}
        s: dict[str, Any] = {}
        if 4096 in own and 16384 in own:
            s["peak_16k_over_4k"] = own[16384]["peak_gib"] / own[4096]["peak_gib"]
            s["growth_16k_over_4k"] = own[16384]["growth_gib"] / own[4096]["growth_gib"]
        longest = max(own, default=0)
        if 4096 in own and longest > 4096:
            a, b = own[4096], own[longest]
            s[f"us_per_token_{longest}_over_4096"] = b["us_per_token"] / a["us_per_token"]
            rest = [(r["seconds"] - r["attention_seconds"]) / r["tokens"] for r in (a, b)]
            s[f"us_per_token_outside_attention_{longest}_over_4096"] = rest[1] / rest[0]
        both = sorted(set(own) & set(spec))
        s["peak_below_speculators_at"] = [n for n in both if own[n]["peak_gib"] < spec[n]["peak_gib"]]
        s["peak_not_below_speculators_at"] = [n for n in both if own[n]["peak_gib"] >= spec[n]["peak_gib"]]
        s["speculators_oom_at"] = sorted(r["tokens"] for r in rows if r["shape"] == shape and r.get("oom")
                                         and r["impl"] == "speculators")  # fmt: skip
        s.update(window_ratios(ok))
        out[shape] = s
    return out


def window_ratios(ok: list[dict[str, Any]]) -> dict[str, float]:
    """Time per token (wall and the process's CPU time) at each length over 4k, per project path (full
    attention and windowed)."""
    out = {}
    for impl in ("blockwise+chunked", "blockwise+chunked+window"):
        for key in ("us_per_token", "cpu_us_per_token"):
            got = {r["tokens"]: r[key] for r in ok if r["impl"] == impl and key in r}
            for n in sorted(got):
                if 4096 in got and n > 4096:
                    out[f"{impl}: {key}_{n}_over_4096"] = got[n] / got[4096]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny to 16k, SmolLM2-135M shapes to 4k")
    p.add_argument("--cap-gb", type=float, default=12.0, 
                   help="address-space cap of each point's process (GiB)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="only these shapes")
    p.add_argument("--lengths", nargs="+", type=int, default=None, help="these sample lengths instead")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS[:2]), help="only these paths")
    p.add_argument("--threads", type=int, default=1, 
                   help="torch threads per point (1: the machine is shared)")
    p.add_argument("--out", default=None, help="JSON output (default: docs/results/long_memory.json)")
    p.add_argument("--keep", action="store_true",
                   help="keep the --out file's rows of points this run does not measure")
    p.add_argument("--window", type=int, default=WINDOW, help="the +window path's sliding_window")
    p.add_argument("--point", nargs=3, metavar=("SHAPE", "IMPL", "TOKENS"), help=argparse.SUPPRESS)
    p.add_argument("--verifier", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.point:
        return child(a)
    rows: list[dict[str, Any]] = []
    path = Path(a.out) if a.out else RESULTS / "long_memory.json"
    with tempfile.TemporaryDirectory(prefix="long-memory-") as tmp:
        for shape, lengths in (QUICK if a.quick else FULL).items():
            if a.shapes and shape not in a.shapes:
                continue
            verifier = write_verifier(shape, Path(tmp) / shape)
            for n in a.lengths or lengths:
                for impl in a.impls:
                    rows.append(run_point(shape, impl, n, a, verifier))
                    print(json.dumps(rows[-1]), flush=True)
                    save(path, a, rows)  # after each point: a run stopped early keeps what it measured
    print(table(rows))
    print(json.dumps(summary(rows), indent=2))
    return 0


def save(path: Path, a: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Write the JSON; --keep: with the rows already in `path` for points this run has not measured (runs
    of one table split over processes, e.g. one per path)."""
    if a.keep and path.exists():
        mine = {(r["shape"], r["impl"], r["tokens"]) for r in rows}
        old = json.loads(path.read_text())["rows"]
        old = [r for r in old if (r["shape"], r["impl"], r["tokens"]) not in mine]
        rows = sorted(old + rows, key=lambda r: (list(SHAPES).index(r["shape"]), r["tokens"], r["impl"]))
    out = {"machine": machine(a.cap_gb), "ttt_steps": TTT, "quick": a.quick, "argv": sys.argv[1:],
           "rows": rows, "summary": summary(rows)}  # fmt: skip
    path.write_text(json.dumps(out, indent=2) + "\n")

if __name__ == "__main__":
    sys.exit(main())
