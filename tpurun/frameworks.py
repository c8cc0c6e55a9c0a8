"""The one door to TensorFlow, JAX, Keras and KerasHub: every tpurun module imports them here.

The rule it keeps: **Keras and JAX only after the process is set up** for its choice of backend and
devices (:func:`tpurun.runtime.activate.activate` calls :func:`activated`). Keras fixes its backend
at its first import, and JAX its devices at its first use, so a module that reached either one
earlier would train on the wrong backend or device count. :func:`keras` and :func:`jax` refuse
before then, loudly, as the programming error it would be. TensorFlow can come at any time (its
import fixes nothing activation needs), and on the JAX backend it comes only if something needs it:
the ``tf.data`` reader, a SavedModel export. Importing it costs 4-5 s, so nothing asks for it just
in case: :func:`imported_tensorflow` answers "is a TensorFlow object possible here" without
importing it, and what a TensorFlow import must bring with it in this process (JAX keeping the
GPUs, the run's seed) waits in :func:`when_tensorflow_imported` until it comes.

What the door adds to a plain import:

- TensorFlow without its C++ start-up notices on stderr (oneDNN, CPU features): TF 2.21 logs them
  through absl before ``TF_CPP_MIN_LOG_LEVEL`` applies, and in a notebook cell they bury the lines
  that matter. If the import fails, what it wrote is shown after all.
- TensorFlow's GCS client settings (:data:`GCS_DEFAULTS`), which it reads once, at the process's
  first ``gs://`` use.
- A matplotlib backend this process can use. Importing TensorFlow or Keras imports matplotlib where it is
  installed, and matplotlib refuses a ``MPLBACKEND`` it cannot load: a notebook kernel exports
  ``module://matplotlib_inline.backend_inline``, which ``!.venv/bin/tpurun`` (another environment)
  cannot import. tpurun never opens a window, so such a value is replaced by ``agg`` in tpurun's
  own process (:func:`usable_matplotlib_backend`; ``tpurun doctor`` says what it found).

- Keras' serialization without TensorFlow (:func:`serialize_without_tensorflow`): with TensorFlow
  installed, Keras 3 imports it the first time it serializes anything (a ``.keras`` save), even on
  the JAX backend.

tpurun's own child scripts that must run without tpurun (``infer/scripts/``)
import the frameworks directly; ``tests/test_layout.py`` checks that no other module does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType

from tpurun.errors import EnvironmentSetupError

#: TF's GCS client reads these once, at a process's first gs:// use. Its own defaults retry a
#: refused connection 10 times with delays growing to 32 s (about 196 s before an error), and wait
#: 120 s for each connection. tpurun's: 4 retries from 0.25 s, at most 2 s apart (a dead endpoint
#: fails in about 6 s; blips of a few seconds are ridden out), 20 s to connect. Variables the user
#: set are left as they are.
GCS_DEFAULTS = {
    "GCS_RETRY_CONFIG_MAX_RETRIES": "4",
    "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": "250000",
    "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": "2000000",
    "GCS_REQUEST_CONNECTION_TIMEOUT_SECS": "20",
}

#: TensorFlow's C++ log level in tpurun's processes (a value the user set is kept). 3 hides ERROR
#: lines too, which here are notices, not failures of the run: oneDNN's "supports DT_INT64 only on
#: platforms with AVX-512" when a text model's int64 token ids first meet it, a CUDA build's
#: "failed call to cuInit" on a machine without a GPU. A real failure reaches tpurun as a Python
#: exception, which it says in its own words; `TF_CPP_MIN_LOG_LEVEL=0 tpurun ...` shows them all.
TF_LOG_LEVEL = "3"

_backend: str | None = None  # set by activated(): the backend this process was set up for
#: TensorFlow's seed for a seed of 0: TF compares (global seed, op seed) with (0, 0), which fails
#: on tf.data's per-pass seeds (tensors). Any value TF does not take to 0 (modulo 2**31 - 1).
TF_SEED_FOR_ZERO = 1_000_003


class ImportOrderError(RuntimeError):
    """Keras or JAX was asked for before the process was set up: a bug in tpurun, not the user's."""


def activated(backend: str) -> None:
    """Declare the process set up for ``backend``: the environment that fixes Keras' backend and
    JAX's devices is in place, so both may be imported from now on."""
    global _backend
    _backend = backend


def backend() -> str | None:
    """The backend :func:`activated` declared, or None before then."""
    return _backend


def apply_gcs_defaults() -> None:
    """Set :data:`GCS_DEFAULTS` where the environment has no value (before the first gs:// use)."""
    for key, value in GCS_DEFAULTS.items():
        os.environ.setdefault(key, value)


#: matplotlib's own backend names (matplotlib 3.8-3.10): any other value must be ``module://...``.
_MPL_BACKENDS = frozenset(
    "gtk3agg gtk3cairo gtk4agg gtk4cairo macosx nbagg notebook qtagg qtcairo qt5agg qt5cairo "
    "tkagg tkcairo webagg wx wxagg wxcairo agg cairo pdf pgf ps svg template".split()
)
replaced_matplotlib_backend: str | None = None  # what usable_matplotlib_backend() replaced


def usable_matplotlib_backend(env: dict | os._Environ = os.environ) -> str | None:
    """Replace an inherited ``MPLBACKEND`` that matplotlib would refuse with ``agg``.

    Returns:
        The value replaced, or None when there was nothing to replace.
    """
    global replaced_matplotlib_backend
    value = env.get("MPLBACKEND", "")
    if not value or _loadable_backend(value):
        return None
    env["MPLBACKEND"] = "agg"
    if env is os.environ:
        replaced_matplotlib_backend = value
    return value


def _loadable_backend(value: str) -> bool:
    if not value.startswith("module://"):
        return value.lower() in _MPL_BACKENDS
    try:
        return importlib.util.find_spec(value.removeprefix("module://")) is not None
    except (ImportError, ValueError):  # its parent package is missing too
        return False


def _pyplot_on_first_use() -> None:
    """Make ``matplotlib.pyplot`` load when first used rather than when Keras imports it.

    Keras' ``visualization`` package imports pyplot at ``import keras`` wherever matplotlib is
    installed: 0.25 s of every start on 2 cores (of 1.4 s for Keras), before the first step, for
    plotting helpers a training run never calls. Until something imports or uses it, pyplot is a
    stand-in module (PEP 562's module ``__getattr__``) that imports the real one at its first
    attribute and hands that on: Keras' helpers and tpurun's curves.png get the real pyplot then.
    (The standard library's ``LazyLoader`` cannot do this: the import statement itself reads the
    module's ``__spec__``, which loads it.)
    """
    if "matplotlib.pyplot" in sys.modules:
        return
    try:
        spec = importlib.util.find_spec("matplotlib.pyplot")  # imports matplotlib itself (60 ms)
    except (ImportError, ValueError):
        return
    if spec is None:
        return
    stand_in = ModuleType("matplotlib.pyplot")
    stand_in.__spec__ = spec

    def real(name: str) -> object:
        if sys.modules.get("matplotlib.pyplot") is stand_in:
            del sys.modules["matplotlib.pyplot"]
        return getattr(importlib.import_module("matplotlib.pyplot"), name)

    stand_in.__getattr__ = real  # type: ignore[method-assign]
    sys.modules["matplotlib.pyplot"] = stand_in
    sys.modules["matplotlib"].pyplot = stand_in  # as an import of the submodule leaves it


def tensorflow(submodule: str | None = None) -> ModuleType:
    """TensorFlow (or ``tensorflow.<submodule>``), imported quietly. Allowed at any time."""
    apply_gcs_defaults()
    usable_matplotlib_backend()
    tf = sys.modules.get("tensorflow") or _quiet_import(
        "tensorflow", then=lambda module: module.config.list_physical_devices()
    )
    _run_tensorflow_hooks(tf)
    return importlib.import_module(f"tensorflow.{submodule}") if submodule else tf


def imported_tensorflow() -> ModuleType | None:
    """TensorFlow if this process has imported it already, else None; never imports it.

    For a check that only TensorFlow's own objects can pass (``isinstance`` against its errors,
    its datasets): none exists before TensorFlow is imported, so None means the answer is no.
    """
    tf = sys.modules.get("tensorflow")
    if tf is not None:
        _run_tensorflow_hooks(tf)
    return tf


_tensorflow_hooks: dict[str, Callable[[ModuleType], object]] = {}  # not yet run, by name


def when_tensorflow_imported(name: str, hook: Callable[[ModuleType], object]) -> None:
    """Call ``hook(tf)`` once TensorFlow is in this process: now if it is, else when it first
    comes through :func:`tensorflow` or :func:`imported_tensorflow`. A hook of the same ``name``
    not yet run is replaced (a notebook's next run sets the process up again)."""
    _tensorflow_hooks[name] = hook
    if "tensorflow" in sys.modules:
        _run_tensorflow_hooks(sys.modules["tensorflow"])


def _run_tensorflow_hooks(tf: ModuleType) -> None:
    while _tensorflow_hooks:  # in the order given; each taken off first, so it runs once
        hook = _tensorflow_hooks.pop(next(iter(_tensorflow_hooks)))
        hook(tf)


def keras(submodule: str | None = None) -> ModuleType:
    """Keras (or ``keras.<submodule>``), once the process is set up.

    Raises:
        ImportOrderError: before :func:`activated`.
    """
    _check_order("Keras", "keras")
    usable_matplotlib_backend()  # Keras imports matplotlib where it is installed, as TF does
    if "keras" not in sys.modules:
        _pyplot_on_first_use()
    module = importlib.import_module("keras")
    serialize_without_tensorflow()
    return importlib.import_module(f"keras.{submodule}") if submodule else module


def jax(submodule: str | None = None) -> ModuleType:
    """JAX (or ``jax.<submodule>``), once the process is set up.

    Raises:
        ImportOrderError: before :func:`activated`.
    """
    _check_order("JAX", "jax")
    return importlib.import_module(f"jax.{submodule}" if submodule else "jax")


class _ImportedOnly:
    """Keras' lazy ``tensorflow`` module as its serialization sees it: ``available`` once imported.

    Everything else goes to the lazy module, which imports TensorFlow when used (deserializing a
    ``__typespec__`` still does).
    """

    __slots__ = ("lazy",)

    def __init__(self, lazy: object):
        self.lazy = lazy

    @property
    def available(self) -> bool:
        return "tensorflow" in sys.modules and bool(self.lazy.available)

    def __getattr__(self, name: str) -> object:
        return getattr(self.lazy, name)


def serialize_without_tensorflow() -> None:
    """Keep Keras' serialization from importing TensorFlow the first time it serializes anything:
    a ``.keras`` save (measured here on JAX: the first save 1.8-2.0 s, 0.01 s without the import).

    ``keras.src.saving.serialization_lib`` asks ``tf.available and isinstance(obj,
    tf.TensorShape)`` (and ``tf.DType``, ``tf.TypeSpec``) of every object it serializes, where
    ``tf`` is a lazy module whose ``available`` imports TensorFlow to answer. No object can be an
    instance of a TensorFlow class before TensorFlow is imported, so there "available" can mean
    "imported" without changing any answer, on either backend: that module alone gets a view of
    the lazy module that says so. The lazy module itself is left as it is, because elsewhere
    ``available`` means "installed" on purpose: ``set_random_seed`` seeds TensorFlow for
    ``tf.data`` by it, the preprocessing layers (``StringLookup``, ``TextVectorization``...)
    refuse to be built without it, and the legacy JSON decoder rebuilds ``TensorShape``s by it.
    A Keras whose module is laid out otherwise is left alone: slower, never wrong.
    """
    module = sys.modules.get("keras.src.saving.serialization_lib")
    lazy = getattr(module, "tf", None)
    # Read off the class: asking the lazy module itself for ``available`` would import TensorFlow.
    if type(lazy).__name__ == "LazyModule" and isinstance(
        getattr(type(lazy), "available", None), property
    ):
        module.tf = _ImportedOnly(lazy)


#: What a missing keras-hub is told to install.
HUB_EXTRA = "pip install 'tpurun[hub]'"


def keras_hub() -> ModuleType:
    """KerasHub (``keras_hub``), once the process is set up, as :func:`keras` is.

    Raises:
        ImportOrderError: before :func:`activated` (KerasHub imports Keras).
        EnvironmentSetupError: keras-hub, or a package it imports, is not installed.
    """
    _check_order("KerasHub", "keras_hub")
    loaded = sys.modules.get("keras_hub")
    if loaded is not None:
        return loaded
    if importlib.util.find_spec("tensorflow") is not None:
        tensorflow()  # first and quietly: keras_hub imports it where installed (tensorflow-text)
    try:
        return _quiet_import("keras_hub")
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing == "keras_hub":
            raise EnvironmentSetupError(
                "model.preset needs KerasHub, which is not installed in this environment: "
                f"{HUB_EXTRA} (keras-hub needs keras>=3.15 and Python>=3.11)."
            ) from None
        raise EnvironmentSetupError(
            f"KerasHub is installed but cannot be imported: {type(exc).__name__}: {exc}. "
            f"{HUB_EXTRA} installs it with what it needs (tensorflow-text, sentencepiece)."
        ) from None


# tf.data map functions ask the door for TensorFlow while they are traced. AutoGraph would convert
# these functions too (and warn that os.environ has no source); marked as TF's own
# tf.autograph.experimental.do_not_convert marks a function, they are called as they are.
for _door in (tensorflow, keras, jax, keras_hub, apply_gcs_defaults, usable_matplotlib_backend):
    _door.autograph_info__ = {}


def _check_order(name: str, module: str) -> None:
    if _backend is None:
        raise ImportOrderError(
            f"{name} was asked for before tpurun.runtime.activate set this process up, so "
            f"'{module}' would start with the wrong backend or devices. Call it after activate()."
        )


# TensorFlow's start-up notices (absl's I/W lines, and absl's own warning about them): noise even
# when the import fails, so they are left out of what is shown then.
_NOTICE = re.compile(r"^([IW]\d{4} |WARNING: All log messages before absl::InitializeLog)")


def _quiet_import(name: str, then: Callable[[ModuleType], object] | None = None) -> ModuleType:
    """Import ``name`` with file descriptor 2 captured, then call ``then(module)`` inside the
    capture too; on failure, replay what they wrote.

    :func:`tensorflow` lists TensorFlow's devices there: a full (CUDA) build looks for a GPU when
    devices are first listed and logs ``failed call to cuInit`` on a machine without one
    (Kaggle's CPU sessions; here, the full build keras-hub's tensorflow-text pulls in). Listing
    physical devices initializes no GPU memory, so JAX can still be given the GPUs after it.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", TF_LOG_LEVEL)
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to capture (a daemon, some notebook hosts)
        return importlib.import_module(name)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            module = importlib.import_module(name)
            if then is not None:
                then(module)
            return module
        except BaseException:
            os.dup2(saved, 2)
            capture.seek(0)
            said = capture.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in said if not _NOTICE.match(line)))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
