"""The package's layout holds: grouped by concern in layers (eagle3_pipeline.LAYERS), no import running
back up a layer, no import circle, functions within 80 lines and classes within 150 (issue 28)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import eagle3_pipeline

PKG = Path(eagle3_pipeline.__file__).parent
MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 150
# config schema classes: one field with its help text per setting, nothing else
SCHEMA_CLASSES = {"TrainConfig", "ExtractConfig", "RegenerateConfig", "EvaluateConfig", "ExportConfig"}


def _modules() -> dict[str, Path]:
    """'group.module' -> file, for every module in a group folder."""
    return {f"{p.parent.name}.{p.stem}": p for p in sorted(PKG.glob("*/*.py")) if p.stem != "__init__"}


def _imports(path: Path) -> set[str]:
    """The package modules `path` imports ('group.module'), at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eagle3_pipeline."):
            parts = node.module.split(".")
            if len(parts) == 3:
                names.append(".".join(parts[1:]))
            else:
                names += [f"{parts[1]}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            ours = [a.name for a in node.names if a.name.startswith("eagle3_pipeline.")]
            names += [".".join(n.split(".")[1:3]) for n in ours]
        found.update(n for n in names if n.count(".") == 1)
    return found


def test_every_module_sits_in_a_layer_group_and_the_package_root_holds_none():
    assert sorted(p.name for p in PKG.glob("*.py")) == ["__init__.py"]
    groups = {p.parent.name for p in PKG.glob("*/__init__.py")}
    assert groups == set(eagle3_pipeline.LAYERS)


def test_no_import_runs_back_up_a_layer():
    rank = {g: i for i, g in enumerate(eagle3_pipeline.LAYERS)}
    modules = _modules()
    upward = [
        f"{name} imports {dep}"
        for name, path in modules.items()
        for dep in _imports(path)
        if dep in modules and rank[dep.split(".")[0]] > rank[name.split(".")[0]]
    ]
    assert upward == []


def test_no_import_circle():
    modules = _modules()
    graph = {n: {d for d in _imports(p) if d in modules and d != n} for n, p in modules.items()}
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert circles == []


def test_functions_and_classes_stay_short():
    long = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                long.append(f"{name}.{node.name}: {lines} lines")
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES and node.name not in SCHEMA_CLASSES:
                long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []


def test_the_import_checker_sees_an_upward_import(tmp_path):
    """The checker itself: a module of `core` importing `training` is found (so the tests above can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text("from eagle3_pipeline.training import train\nimport eagle3_pipeline.data.shards\n"
                   "def f():\n    from eagle3_pipeline.sizing.plan import build\n")
    assert _imports(bad) == {"training.train", "data.shards", "sizing.plan"}


BENCHMARKS = PKG.parent / "benchmarks"


def _long_definitions(path: Path) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
            long.append(f"{path.name}:{node.name}: {lines} lines")
        if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
            long.append(f"{path.name}:{node.name}: {lines} lines")
    return long


def test_benchmarks_import_as_the_package_does_and_hold_no_results():
    """benchmarks/ is run as modules from the repository root (`python -m benchmarks.X`): no file (nor a
    program it hands to a subprocess) edits sys.path; the JSON reports live in benchmarks.RESULTS, not
    beside the code; functions and classes within the package's limits."""
    from benchmarks import RESULTS

    sources = sorted(BENCHMARKS.rglob("*.py"))
    assert [p.name for p in sources if "sys.path" in p.read_text()] == []
    assert sorted(p.relative_to(BENCHMARKS).as_posix() for p in BENCHMARKS.rglob("*.json")) == []
    assert RESULTS.is_dir() and not RESULTS.is_relative_to(BENCHMARKS) and any(RESULTS.glob("*.json"))
    assert [x for p in sources for x in _long_definitions(p)] == []


def test_each_file_is_one_xdist_work_unit_and_the_vllm_tier_two_units_first(request):
    """scripts/test.sh's pytest-xdist units (conftest.work_unit, its scheduler), on this session's tests: a
    file is its own unit (module fixtures built once); the vLLM tier's files whose tests use tier_stages' runs
    one unit (those runs built once), the others a second; both before every other file."""
    from conftest import SLOW_UNITS, VLLM_GROUPS, work_unit

    items = request.session.items
    runs = {item.path for item in items if "tier_stages" in item.fixturenames}
    want = [VLLM_GROUPS[item.path not in runs] if item.path.name.startswith("test_vllm_") else item.path.stem
            for item in items]  # fmt: skip
    units = [work_unit(item.path) for item in items]
    assert units and units == want
    rank = [VLLM_GROUPS.index(u) if u in VLLM_GROUPS else len(VLLM_GROUPS) for u in units]
    assert rank == sorted(rank)  # the tier runs' unit, then the states' unit, then every other file
    others = list(dict.fromkeys(u for u in units if u not in VLLM_GROUPS))
    slow = [u for u in SLOW_UNITS if u in others]
    assert others[: len(slow)] == slow  # the slowest files next, longest first


class _Node:
    """A pytest-xdist node as the scheduler sees it: the test indices it was sent."""

    shutting_down = False

    def __init__(self) -> None:
        self.sent: list[list[int]] = []

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent.append(indices)

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_node_gets_its_next_unit_only_when_down_to_the_test_it_holds_back(pytestconfig, monkeypatch):
    """conftest's scheduler: a node still running a test with one more queued behind it is not given the next
    unit (the other node may be idle); once down to that last queued test it is."""
    from collections import OrderedDict

    from conftest import pytest_xdist_make_scheduler

    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])  # what `-n 2` sets
    sched = pytest_xdist_make_scheduler(pytestconfig, None)
    node = _Node()
    sched.registered_collections[node] = ["a.py::t0", "a.py::t1", "b.py::t2"]
    sched.assigned_work[node] = {"a": {"a.py::t0": False, "a.py::t1": False}}
    sched.workqueue = OrderedDict(b={"b.py::t2": False})
    sched._reschedule(node)  # t0 running, t1 queued
    assert node.sent == [] and list(sched.workqueue) == ["b"]
    sched.mark_test_complete(node, 0)  # t0 done: t1 is held back until the worker knows its next test
    assert node.sent == [[2]] and not sched.workqueue


def test_each_xdist_worker_runs_torch_and_vllm_on_its_share_of_the_cores():
    """Two workers on two cores: a thread each, vLLM's pinned to a core of its own; alone, torch's default.
    In a session under scripts/test.sh this worker, and a process it starts, run torch on that share."""
    import subprocess
    import sys

    import torch
    from conftest import script_env, xdist_worker_env

    assert xdist_worker_env(2, "gw1", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1", "OMP_NUM_THREADS": "1"}
    assert xdist_worker_env(2, "gw0", [0, 1, 2, 3])["OMP_NUM_THREADS"] == "2"
    assert xdist_worker_env(1, "gw0", [0, 1]) == {}
    share = xdist_worker_env(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
                             os.environ.get("PYTEST_XDIST_WORKER", "gw0"), sorted(os.sched_getaffinity(0)))
    want = int(share.get("OMP_NUM_THREADS", torch.get_num_threads()))
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    child = subprocess.run(probe, env=script_env(), capture_output=True, text=True, check=True)
    assert (torch.get_num_threads(), int(child.stdout)) == (want, want)


# vllm_side's half that runs inside vLLM's own environment, where the pipeline's dependencies are not installed
VLLM_ENV_MODULES = ("worker", "protocol", "cpu", "images", "__main__")


def test_the_vllm_env_half_of_vllm_side_imports_only_the_standard_library_vllm_and_itself():
    """`python -m eagle3_pipeline.vllm_side` runs in vLLM's environment: its modules (and the package
    __init__ files it passes through) may import nothing of the pipeline's half or its dependencies."""
    import sys

    side = PKG / "vllm_side"
    files = [side / f"{m}.py" for m in VLLM_ENV_MODULES] + [PKG / "__init__.py", side / "__init__.py"]
    own = {f"eagle3_pipeline.vllm_side.{m}" for m in VLLM_ENV_MODULES} | {"eagle3_pipeline.vllm_side"}
    foreign = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                names = [n for n in names if not n.startswith("eagle3_pipeline.") or n in own] or names[:1]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top in sys.stdlib_module_names or top in ("vllm", "PIL") or n in own:  # PIL: vLLM's
                    continue
                foreign.append(f"{path.relative_to(PKG)} imports {n}")
    assert foreign == []
    assert (side / "cpu_plugin" / "pyproject.toml").is_file()  # the CPU plugin lives here too
