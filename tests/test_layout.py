"""The package's shape, read from its source: no import cycles, small modules and functions, and
the frameworks reached only through tpurun.frameworks."""

from __future__ import annotations

import ast
import re
import shutil
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
#: tpurun's folders (and top-level modules) from the lowest layer up: a module imports only from
#: its own folder or a lower one, so that a value a lower layer needs is passed down to it.
LAYERS = ["errors", "frameworks", "_version", "config", "storage", "multihost", "runtime", "data",
          "hub", "plan", "display", "observe", "training", "doctor", "infer", "cli", "__main__"]  # fmt: skip
#: Function-level imports of tpurun's own modules in library code (outside cli/, the package's
#: __init__ files and the standalone scripts), each with a `# lazy:` comment saying what it defers.
MAX_LAZY_IMPORTS = 40
MARKER = re.compile(r"[ \t]*# fmt: skip[ \t]*$", re.MULTILINE)


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


@pytest.fixture(scope="module")
def formatted(tmp_path_factory) -> Path:
    """A copy of the package with every `# fmt: skip` marker stripped and formatted by ruff: the
    caps are measured there, so that packing lines cannot meet them."""
    copy = tmp_path_factory.mktemp("formatted") / "tpurun"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.rglob("*.py"):
        path.write_text(MARKER.sub("", path.read_text()))
    ruff = Path(sys.executable).with_name("ruff")
    config = PACKAGE.parent / "pyproject.toml"
    subprocess.run([str(ruff), "format", "--quiet", "--config", str(config), str(copy)], check=True)
    assert not any("# fmt: skip" in p.read_text() for p in copy.rglob("*.py"))
    return copy


def test_modules_stay_small(formatted):
    long = {
        str(p.relative_to(formatted.parent)): n
        for p in formatted.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines, formatted without fmt: skip: {long}"


def _is_command(node: ast.FunctionDef) -> bool:
    return any(
        isinstance(d, ast.Call) and getattr(d.func, "attr", "") in ("command", "callback")
        for d in node.decorator_list
    )


def test_functions_stay_small(formatted):
    """A Typer command's signature (its options, each with help text) is not counted."""
    long = {}
    for path in formatted.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = node.body[0].lineno if _is_command(node) else node.lineno
                if (n := node.end_lineno - start + 1) > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(formatted.parent)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _layer(module: str) -> str:
    return module.split(".")[1]


def test_folders_import_downward():
    """No folder cycles: each import goes to the importer's own folder or one below it."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    graph = import_graph()
    assert {_layer(m) for m in graph} <= set(LAYERS), "a folder LAYERS does not place"
    upward = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if rank[_layer(b)] > rank[_layer(a)]
    )
    assert not upward, "imports of a higher folder:\n" + "\n".join(upward)


def _lazy_imports() -> list[tuple[str, int, str]]:
    """(file, line, the line) of each function-level import of a tpurun module in library code."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "cli" or path.name == "__init__.py" or "scripts" in rel.parts:
            continue
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        seen = set()
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                    [a.name for a in node.names] if isinstance(node, ast.Import) else [])  # fmt: skip
                if any(n.split(".")[0] == "tpurun" for n in names) and node.lineno not in seen:
                    seen.add(node.lineno)
                    found.append((str(rel), node.lineno, lines[node.lineno - 1]))
    return found


def test_lazy_imports_of_tpurun_modules_are_few_and_say_why():
    """tpurun's own modules import in about 0.2 s together: a function-level import of one keeps a
    framework or a measured cost off the `--help` and config-validation path, and says so."""
    lazy = _lazy_imports()
    assert len(lazy) <= MAX_LAZY_IMPORTS, f"{len(lazy)} lazy imports of tpurun modules: {lazy}"
    source = {p: (PACKAGE / p).read_text().splitlines() for p in {f for f, _, _ in lazy}}

    def explained(lines: list[str], n: int) -> bool:
        """`# lazy:` on the import's line, or in the comments above its block of imports."""
        at = n - 1
        while at >= 0 and lines[at].strip().startswith(("from ", "import ", "#")):
            if "# lazy:" in lines[at]:
                return True
            at -= 1
        return False

    unexplained = [f"{f}:{n}" for f, n, _ in lazy if not explained(source[f], n)]
    assert not unexplained, "lazy imports without a `# lazy:` reason: " + ", ".join(unexplained)


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
