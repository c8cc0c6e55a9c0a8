"""The user's code a config names (``path/to/file.py:name`` or ``package.module:name``): imported,
and its failures said in one line at the user's own file and line."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from tpurun.errors import ModelError, describe
from tpurun.training.factory_source import syntax_error


def import_object(spec: str, base_dir: Path, what: str) -> Any:
    """Import ``"path/to/file.py:name"`` (relative to ``base_dir``) or ``"package.module:name"``.

    Raises:
        ModelError: the file, module or attribute does not exist, or the module fails to import.
    """
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise ModelError(f"{what} '{spec}': no such file {path}.")
        name = f"tpurun_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            # The file's folder goes on sys.path so it can import its sibling modules.
            sys.path.insert(0, str(path.parent))
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:
                raise ModelError(
                    f"{what} '{spec}': importing {path} failed: {brief(exc)}"
                ) from None
            sys.modules[name] = module
    else:
        if str(base_dir) not in sys.path:
            sys.path.insert(0, str(base_dir))
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            if not _names_module(module_part, exc.name):  # a package the module itself imports
                raise ModelError(
                    f"{what} '{spec}': importing {module_part} failed: {brief(exc)}"
                ) from None
            raise ModelError(f"{what} '{spec}': no module named '{exc.name}'.") from None
        except Exception as exc:
            raise ModelError(
                f"{what} '{spec}': importing {module_part} failed: {brief(exc)}"
            ) from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ModelError(f"{what} '{spec}': {module_part} has no '{attr}'.{hint}")
    return getattr(module, attr)


def _names_module(module: str, missing: str | None) -> bool:
    """Whether the missing module is ``module`` or one of its parent packages."""
    return missing is not None and (module == missing or module.startswith(f"{missing}."))


def brief(exc: BaseException) -> str:
    """The exception, with the innermost frame of user code, in one line: a syntax error at its
    own file and line (its traceback ends in the import machinery), anything else at the last
    frame outside installed packages and Python's frozen import code."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return syntax_error(exc)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "site-packages" not in f.filename and not f.filename.startswith("<")
    ]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{describe(exc)}{where}"
