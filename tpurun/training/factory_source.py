"""``tpurun config --check``'s look at the model factory: its file compiled, never imported.

Importing a factory imports Keras and a backend (5-13 s with TensorFlow installed, measured on 2
cores), and ``--check`` answers at once; compiling its source takes milliseconds and finds what a
new user meets first: a missing file, a syntax error, a misspelt function name. What only running
the module finds (a NameError at import, a package that is not installed) is left to ``tpurun
doctor CONFIG`` and ``train``, and the output says so.
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

from tpurun.config import Config
from tpurun.errors import ModelError


def syntax_error(exc: SyntaxError) -> str:
    """A syntax error in one line, at its own file and line, with the code there (its traceback
    ends in Python's import machinery, which says nothing to a user)."""
    code = (exc.text or "").strip()
    shown = f", `{code}`" if code else ""
    return f"{type(exc).__name__}: {exc.msg} (at {exc.filename}:{exc.lineno}{shown})"


def _source_file(module_part: str, base_dir: Path) -> Path | None:
    """The file a factory spec names: ``path/to/file.py``, or a module found under ``base_dir``
    (None for a module that is installed elsewhere: not looked for, as finding it may import)."""
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        return path if path.is_absolute() else base_dir / path
    for candidate in (
        f"{module_part.replace('.', '/')}.py",
        f"{module_part.replace('.', '/')}/__init__.py",
    ):
        if (base_dir / candidate).is_file():
            return base_dir / candidate
    return None


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module defines at its top level; None when it may define others unseen (a
    star import, a module ``__getattr__``)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            return None  # names defined under a condition: left to the import
    return None if "__getattr__" in names else names


def check_factory_source(config: Config) -> str | None:
    """Compile ``model.factory``'s file and find its function in it, without running it.

    Returns:
        What was checked, in a few words ("models/digits.py compiles and defines build"); None
        without a factory file to look at (a preset, an installed module).

    Raises:
        ModelError: no such file, a syntax error (at its file and line), or no such name in it.
    """
    spec = config.model.factory
    if spec is None:
        return None
    module_part, _, attr = spec.rpartition(":")
    path = _source_file(module_part, config.base_dir)
    if path is None:
        return None
    if not path.is_file():
        raise ModelError(f"model.factory '{spec}': no such file {path}.")
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as exc:
        raise ModelError(
            f"model.factory '{spec}': {path} does not compile: {syntax_error(exc)}"
        ) from None
    names = _top_level_names(tree)
    if names is not None and attr not in names:
        close = difflib.get_close_matches(
            attr, sorted(n for n in names if not n.startswith("_")), n=1
        )
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ModelError(f"model.factory '{spec}': {path} defines no '{attr}'.{hint}")
    return f"{module_part} compiles and defines {attr}"
