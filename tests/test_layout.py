"""The package's shape, read from its source: no import cycles, small modules and functions, and
the frameworks reached only through tpurun.frameworks."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "tpurun"
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
# Run in a fresh `python -I` without tpurun, as a user without tpurun would: they import the
# frameworks themselves.
STANDALONE = {
    "tpurun/infer/scripts/run_artifact.py",
    "tpurun/infer/scripts/keras_loader.py",
    "tpurun/infer/scripts/run_huggingface.py",
}
FRAMEWORKS = ("keras", "jax", "jaxlib", "tensorflow")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module name an import statement names, anywhere in the tree (functions included)."""
    names = set()
    base = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                prefix = base
                for _ in range(node.level - 1):
                    prefix = prefix.rpartition(".")[0]
                source = f"{prefix}.{source}" if source else prefix
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """tpurun's modules and the tpurun modules each imports. The package root is left out: its
    public API imports lazily from every folder, and says nothing about the layers."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = {owner(n) for n in _imported(tree, name, path.name == "__init__.py")}
        graph[name] = {t for t in targets if t and t not in (name, "tpurun")}
    graph.pop("tpurun", None)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 50  # the whole package was read
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


def test_few_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_modules_stay_small():
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def _is_command(node: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Call) and getattr(d.func, "attr", "") in ("command", "callback")
        for d in node.decorator_list
    )


def test_functions_stay_small():
    """A Typer command's signature (its options, each with help text) is not counted."""
    long = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.body[0].lineno if _is_command(node) else node.lineno
                if (n := node.end_lineno - start + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_only_the_door_imports_the_frameworks():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        rel = str(path.relative_to(PACKAGE.parent))
        if rel in STANDALONE or rel == "tpurun/frameworks.py":
            continue
        for name in _imported(ast.parse(path.read_text()), "x", False):
            if name.split(".")[0] in FRAMEWORKS:
                offenders.append(f"{rel}: {name}")
    assert not offenders, "import these through tpurun.frameworks:\n" + "\n".join(offenders)


@pytest.mark.slow
@pytest.mark.parametrize(
    "code",
    [
        "from tpurun import frameworks; frameworks.keras()",
        "from tpurun import frameworks; frameworks.jax()",
        "import tpurun.training.callbacks.run_control",  # a module built on Keras, imported too early
    ],
)
def test_keras_and_jax_wait_for_activation(code):
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "ImportOrderError" in result.stderr
    assert "before tpurun.runtime.activate set this process up" in result.stderr


@pytest.mark.slow
def test_tensorflow_may_come_first_and_then_activation_opens_the_door():
    code = (
        "from tpurun import frameworks\n"
        "tf = frameworks.tensorflow()\n"
        "assert frameworks.backend() is None\n"
        "from tpurun.runtime.choice import choose\n"
        "from tpurun.runtime.machine import probe\n"
        "from tpurun.config import RuntimeConfig\n"
        "from tpurun.runtime.activate import activate\n"
        "choice = choose(RuntimeConfig(), 1, probe())\n"
        "activate(choice, seed=1)\n"
        "print(frameworks.backend(), frameworks.keras().backend.backend())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["jax", "jax"]
