"""Load a model that ``tpurun export --format keras`` wrote, without tpurun.

The model uses code of its own (custom layers, activations...), which plain
``keras.saving.load_model`` cannot find in another process. ``tpurun export`` copied that code into
the folder ``<name>_code/`` beside the model and this file beside both, as ``<name>_loader.py``::

    import sys
    sys.path.insert(0, "/kaggle/input/my-model")  # the folder holding these files
    import model_loader                            # for model.keras
    model = model_loader.load()

Standalone on purpose: it imports Keras and the copied files, never tpurun.
"""

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = Path(__file__).stem.removesuffix("_loader")
CODE = HERE / f"{NAME}_code"
MODEL = HERE / f"{NAME}.keras"
MODULES = CODE / "modules.txt"  # installed modules (package.module) the model's code lives in


def custom_objects() -> dict:
    """The classes and functions of the model's own code, by name, as Keras' loader looks them up."""
    modules = []
    sys.path.insert(0, str(CODE))  # the copied files may import each other by name
    for path in sorted(CODE.glob("*.py")):
        spec = importlib.util.spec_from_file_location(f"{NAME}_code_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    if MODULES.exists():
        names = [line.strip() for line in MODULES.read_text().splitlines() if line.strip()]
        modules += [importlib.import_module(name) for name in names]
    objects = {}
    for module in modules:
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj) or inspect.isfunction(obj)
            ) and obj.__module__ == module.__name__:
                objects[name] = obj
    return objects


def load(path=MODEL):
    """The Keras model, for inference (``compile=False``: no training setup)."""
    import keras

    return keras.saving.load_model(str(path), custom_objects=custom_objects(), compile=False)
