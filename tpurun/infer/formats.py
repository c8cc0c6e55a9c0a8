"""Writing each export format (:mod:`tpurun.infer.export` checks and places what these write).

- ``saved_model``: Keras' ``ExportArchive`` with a serving endpoint, written from the host
  (``experimental_io_device``); a JAX model for ``native_serialization_platforms``.
- ``onnx``: Keras' own ONNX export (jax2onnx on JAX, tf2onnx on TensorFlow).
- ``keras``: the ``.keras`` file, and when the model uses code of its own, a copy of that code and
  a loader module (:mod:`tpurun.infer.scripts.keras_loader`) beside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.errors import TpurunError
from tpurun.infer.artifact_check import SCRIPTS
from tpurun.training.final_model import inference_saver


def _input_signature(model: Any) -> Any:
    get_input_signature = frameworks.keras(
        "src.export.export_utils"
    ).get_input_signature  # what model.export uses

    return get_input_signature(model)


def write_saved_model(
    model: Any, path: str, platforms: Sequence[str], signature: Any = None
) -> None:
    """``signature``: the serving function's inputs (default: the model's own, as
    ``model.export`` takes them)."""
    keras = frameworks.keras()
    tf = frameworks.tensorflow()
    kwargs = {}
    if keras.backend.backend() == "jax":
        kwargs["jax2tf_kwargs"] = {"native_serialization_platforms": tuple(platforms)}
    archive = keras.export.ExportArchive()
    signature = signature if signature is not None else _input_signature(model)
    archive.track_and_add_endpoint("serve", model, signature, **kwargs)
    # The variables are written from the host: a TPU cannot reach the local disk.
    options = tf.saved_model.SaveOptions(experimental_io_device="/job:localhost")
    archive.write_out(path, options=options, verbose=False)


def _jax_plugins_only() -> None:
    """jax2onnx imports every plugin on its first conversion, and its flax and equinox examples
    compile models as they import (25 s of a 30 s export here). A Keras model lowers to JAX
    primitives only: import those plugins, and mark the import done. Best effort: on another
    jax2onnx the full import happens as usual."""
    try:
        from jax2onnx.plugins import plugin_system as plugins
    except ImportError:
        return
    if getattr(plugins, "_already_imported_plugins", True) or not hasattr(plugins, "_import_tree"):
        return
    plugins._import_tree(Path(plugins.__file__).parent / "jax", "jax2onnx.plugins.jax")
    plugins._already_imported_plugins = True


def _all_plugins() -> None:
    with contextlib.suppress(ImportError):
        from jax2onnx.plugins import plugin_system as plugins

        plugins._already_imported_plugins = False


def write_onnx(model: Any, path: str) -> None:
    import warnings

    keras = frameworks.keras()

    backend = keras.backend.backend()
    needed = "jax2onnx" if backend == "jax" else "tf2onnx"
    if importlib.util.find_spec(needed) is None:
        raise TpurunError(
            f"--format onnx: Keras exports {backend} models with {needed}, which is not "
            "installed: pip install 'tpurun[export]'."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # Keras' numpy-2 patch of tf2onnx
        if backend != "jax":
            model.export(path, format="onnx", verbose=False)
            return
        _jax_plugins_only()
        try:
            model.export(path, format="onnx", verbose=False)
        except Exception:  # a primitive whose plugin lives elsewhere: retry with all of them
            _all_plugins()
            model.export(path, format="onnx", verbose=False)


def _user_code(model: Any) -> list[str]:
    """Classes and functions in the saved model's config that are not Keras' own."""
    keras = frameworks.keras()

    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            module = value.get("module")
            if isinstance(module, str) and "class_name" in value:
                if not (module == "keras" or module.startswith("keras.") or module == "builtins"):
                    found.append(f"{module}.{value['class_name']}")
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(keras.saving.serialize_keras_object(model))
    return found


def _imports(value: Any) -> list[str]:
    """Every ``module:name`` import string in a config section."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in _imports(v)]
    if isinstance(value, list):
        return [x for v in value for x in _imports(v)]
    if isinstance(value, str) and ":" in value and "://" not in value:
        module = value.rpartition(":")[0]
        return [module] if module.endswith(".py") or module.replace(".", "").isidentifier() else []
    return []


def write_keras(model: Any, path: str, config: Any) -> str | None:
    """The ``.keras`` file, for inference (no training setup). When the model uses code of its
    own, that code is copied beside it with a loader module; returns the loader's path."""
    save = inference_saver(model) if getattr(model, "compiled", False) else model.save
    save(path)
    if not _user_code(model):
        return None
    folder, name = os.path.split(path)
    stem = name.removesuffix(".keras")
    code = os.path.join(folder, f"{stem}_code")
    os.makedirs(code)
    modules = []
    for module in dict.fromkeys(_imports(config.to_dict()["model"])):
        if module.endswith(".py"):
            shutil.copy2(config.resolve_path(module), os.path.join(code, os.path.basename(module)))
        else:
            modules.append(module)
    Path(code, "modules.txt").write_text("".join(f"{m}\n" for m in modules))
    loader = os.path.join(folder, f"{stem}_loader.py")
    shutil.copy2(SCRIPTS / "keras_loader.py", loader)
    return loader
