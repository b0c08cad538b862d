"""The package layout of docs/design.md holds: no import cycles anywhere, and imports run one way
(models -> nothing of runtime; runtime -> nothing of serving; kernels -> nothing of ours; the
engine -> no harness, gates or reports; harness and reports -> no engine, no torch).

The import graph is read from the source with `ast` (imports inside functions and under
TYPE_CHECKING count too: a cycle hidden from the interpreter is still a cycle for a reader).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from .together import Results, together

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("reference_engine", "harness", "reports", "gates")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path, modules: set[str] | None = None) -> set[str]:
    """Absolute dotted names this module imports: `from x import y` gives x.y, and x itself
    unless `modules` says every y is a submodule of x (then only the submodules are used)."""
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module
            subs = {f"{base_name}.{alias.name}" for alias in node.names}
            names.update(subs)
            if modules is None or not subs <= modules:
                names.add(base_name)
    return names


def import_graph(root: Path, packages: tuple[str, ...]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, every dotted name each module imports)."""
    modules = module_files(root, packages)
    edges: dict[str, set[str]] = {}
    raw: dict[str, set[str]] = {}
    known = set(modules)
    for module, path in modules.items():
        raw[module] = imported_names(module, path)
        edges[module] = {
            name for name in imported_names(module, path, known) if name in modules and name != module
        }
    return edges, raw


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def violations(raw: dict[str, set[str]], source: str, forbidden: tuple[str, ...]) -> list[str]:
    """'module -> name' for every import by a module under `source` of a name under `forbidden`."""

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    return sorted(
        f"{module} -> {name}"
        for module, names in raw.items()
        if under(module, source)
        for name in names
        if any(under(name, f) for f in forbidden)
    )


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    return import_graph(ROOT, PACKAGES)


def test_the_packages_of_the_design_exist(graph) -> None:
    edges, _ = graph
    for package in ("models", "kernels", "runtime", "serving", "training"):
        assert f"reference_engine.{package}" in edges, f"reference_engine/{package}/ is missing"


def test_there_is_no_import_cycle_anywhere(graph) -> None:
    edges, _ = graph
    assert find_cycle(edges) is None, f"import cycle: {' -> '.join(find_cycle(edges))}"


def test_the_cycle_finder_finds_a_deliberately_added_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import other\n"
    )
    (pkg / "c.py").write_text("def f():\n    from . import a\n")
    edges, _ = import_graph(tmp_path, ("pkg",))
    assert find_cycle(edges) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
    (pkg / "c.py").write_text("")
    assert find_cycle(import_graph(tmp_path, ("pkg",))[0]) is None
    # a package that imports a submodule which takes a name from the package: a cycle; a
    # submodule that only imports its sibling modules through the package is none
    (pkg / "__init__.py").write_text("from .c import f\nTHING = 1\n")
    (pkg / "c.py").write_text("from . import THING\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))[0]) == ["pkg", "pkg.c", "pkg"]
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("")
    assert find_cycle(import_graph(tmp_path, ("pkg",))[0]) is None


@pytest.mark.parametrize(
    ("source", "forbidden"),
    [
        (
            "reference_engine.models",
            (
                "reference_engine.runtime",
                "reference_engine.serving",
                "reference_engine.training",
                "reference_engine.checkpoint",
            ),
        ),
        (
            "reference_engine.runtime",
            (
                "reference_engine.serving",
                "reference_engine.training",
                "reference_engine.generate",
                "reference_engine.bench",
                "reference_engine.serve",
                "reference_engine.engine_args",
                "reference_engine.checkpoint",
            ),
        ),
        (
            "reference_engine.kernels",
            (
                "reference_engine.config",
                "reference_engine.models",
                "reference_engine.runtime",
                "reference_engine.serving",
                "reference_engine.errors",
                "reference_engine.checkpoint",
            ),
        ),
        ("reference_engine", ("harness", "gates", "reports", "tests")),
        ("harness", ("reference_engine", "gates", "torch")),  # it may build a report
        ("reports", ("reference_engine", "harness", "gates", "torch")),
    ],
    ids=["models", "runtime", "kernels", "engine", "harness", "reports"],
)
def test_imports_run_one_way(graph, source: str, forbidden: tuple[str, ...]) -> None:
    _, raw = graph
    assert violations(raw, source, forbidden) == []


RUNTIME = "reference_engine.runtime"
# inside the runtime: the engine composes the scheduler (who holds a slot), the model runner
# (how a forward runs: graph or eager) and the speculative step; none of them reaches up
RUNTIME_LAYERS = [
    (f"{RUNTIME}.oracle", (RUNTIME,)),  # below everything in the runtime
    (
        f"{RUNTIME}.forwards",
        (
            f"{RUNTIME}.graphs",
            f"{RUNTIME}.model_runner",
            f"{RUNTIME}.engine",
            f"{RUNTIME}.scheduler",
            f"{RUNTIME}.speculative_step",
        ),
    ),
    (
        f"{RUNTIME}.graphs",
        (
            f"{RUNTIME}.model_runner",
            f"{RUNTIME}.engine",
            f"{RUNTIME}.scheduler",
            f"{RUNTIME}.speculative_step",
            f"{RUNTIME}.one_request",
        ),
    ),
    (
        f"{RUNTIME}.model_runner",
        (
            f"{RUNTIME}.engine",
            f"{RUNTIME}.scheduler",
            f"{RUNTIME}.speculative_step",
            f"{RUNTIME}.one_request",
        ),
    ),
    (
        f"{RUNTIME}.scheduler",
        (
            f"{RUNTIME}.engine",
            f"{RUNTIME}.model_runner",
            f"{RUNTIME}.graphs",
            f"{RUNTIME}.forwards",
            f"{RUNTIME}.speculative_step",
            f"{RUNTIME}.one_request",
            "torch",
        ),
    ),
    (f"{RUNTIME}.speculative_step", (f"{RUNTIME}.engine", f"{RUNTIME}.scheduler", f"{RUNTIME}.one_request")),
    (f"{RUNTIME}.prefill", (f"{RUNTIME}.engine", f"{RUNTIME}.scheduler", f"{RUNTIME}.speculative_step")),
    (f"{RUNTIME}.engine", (f"{RUNTIME}.one_request",)),
]


@pytest.mark.parametrize(
    ("source", "forbidden"), RUNTIME_LAYERS, ids=[source.rsplit(".", 1)[1] for source, _ in RUNTIME_LAYERS]
)
def test_the_runtime_layers_import_downward_only(graph, source: str, forbidden: tuple[str, ...]) -> None:
    _, raw = graph
    assert violations(raw, source, forbidden) == []


def test_a_planted_upward_import_in_the_runtime_is_seen(tmp_path: Path) -> None:
    """The layer rules on a copy of the package with one upward import added: the scheduler
    reaching for the model runner."""
    import shutil

    shutil.copytree(
        ROOT / "reference_engine",
        tmp_path / "reference_engine",
        ignore=shutil.ignore_patterns("assets", "__pycache__"),
    )
    scheduler = tmp_path / "reference_engine" / "runtime" / "scheduler.py"
    scheduler.write_text(scheduler.read_text() + "\nfrom .model_runner import ModelRunner\n")
    _, raw = import_graph(tmp_path, ("reference_engine",))
    found = [v for source, forbidden in RUNTIME_LAYERS for v in violations(raw, source, forbidden)]
    assert found == [
        f"{RUNTIME}.scheduler -> {RUNTIME}.model_runner",
        f"{RUNTIME}.scheduler -> {RUNTIME}.model_runner.ModelRunner",
    ]


def test_kernels_import_only_torch_triton_and_themselves(graph) -> None:
    _, raw = graph
    stdlib = set(sys.stdlib_module_names)
    bad = sorted(
        f"{module} -> {name}"
        for module, names in raw.items()
        if module.startswith("reference_engine.kernels")
        for name in names
        if name.split(".")[0] not in {"torch", "triton", "__future__"} | stdlib
        and not name.startswith("reference_engine.kernels")
    )
    assert bad == []


def test_the_direction_check_sees_a_forbidden_import() -> None:
    raw = {
        "reference_engine.models.layers": {"torch", "reference_engine.runtime.state"},
        "reference_engine.runtime.engine": {"reference_engine.models"},
    }
    assert violations(raw, "reference_engine.models", ("reference_engine.runtime",)) == [
        "reference_engine.models.layers -> reference_engine.runtime.state"
    ]


def test_no_planted_fault_branch_in_the_engine() -> None:
    found = subprocess.run(
        ["git", "grep", "-n", "fault ==", "--", "reference_engine"], cwd=ROOT, capture_output=True, text=True
    )
    assert found.returncode == 1 and found.stdout == "", found.stdout


ENTRY_POINTS = [
    "reference_engine.serve",
    "reference_engine.generate",
    "reference_engine.checkpoint",
    "reference_engine.bench",
]


def help_of(module: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def helps(request) -> Results:
    """`python -m <entry point> --help` of each, side by side in the background."""
    jobs = {f"test_entry_points_keep_their_names[{m}]": partial(help_of, m) for m in ENTRY_POINTS}
    return together(request, jobs)


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_points_keep_their_names(helps, request, module: str) -> None:
    done = helps[request.node.name]  # python -m <module> --help
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_the_checkpoint_loader_knows_nothing_of_synthetic_checkpoints(graph) -> None:
    """Reading a user's checkpoint never goes through the code that writes random ones."""
    _, raw = graph
    loader = raw["reference_engine.checkpoint"]
    assert not {n for n in loader if n.startswith("reference_engine.checkpoint.")}, loader
