"""A failure says what it is in one readable line: an unexpected one its type and first
meaningful line; a model that fails on JAX because of TensorFlow ops, the backend that runs it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import typer
from conftest import toy_config
from helpers import HAS_TENSORFLOW

import tpurun
from tpurun.cli.boundary import exit_codes
from tpurun.errors import ModelError, describe

KERAS_WRAPPED = (
    "Exception encountered when calling Functional.call().\n\n"
    "\x1b[1m'str' object has no attribute '_error_repr'\x1b[0m\n\n"
    "Arguments received by Functional.call():\n"
    "  • inputs=jnp.ndarray(shape=(32, 8), dtype=float32)\n"
    "  • kwargs=<class 'inspect._empty'>"
)


def test_describe_takes_the_first_line_that_says_something():
    assert describe(RuntimeError(KERAS_WRAPPED)) == (
        "RuntimeError: 'str' object has no attribute '_error_repr'"
    )
    assert describe(ValueError("")) == "ValueError"
    assert (
        describe(KeyError("x" * 500)).endswith("...") and len(describe(KeyError("x" * 500))) < 320
    )


def test_an_unexpected_failure_is_one_readable_line(capsys):
    with pytest.raises(typer.Exit) as info, exit_codes():
        raise RuntimeError(KERAS_WRAPPED)
    assert info.value.exit_code == 1
    line = capsys.readouterr().err.strip()
    head = (
        "error: unexpected failure: RuntimeError: 'str' object has no attribute '_error_repr'; "
        "the traceback is in "
    )
    assert line.startswith(head), line
    assert "kwargs" not in line and "\x1b" not in line
    # The file named holds the whole traceback: where it was raised, and the full message.
    written = Path(line.removeprefix(head))
    assert written.name.startswith("tpurun-error-") and written.suffix == ".log", written
    text = written.read_text()
    written.unlink()
    assert text.startswith("Traceback (most recent call last):\n"), text
    assert f'"{__file__}", line ' in text and "raise RuntimeError(KERAS_WRAPPED)" in text
    assert text.endswith(f"RuntimeError: {KERAS_WRAPPED}\n"), text


LAMBDA_FACTORY = textwrap.dedent("""
    import keras
    import tensorflow as tf

    def build(output_shape=None):
        inputs = keras.Input(shape=(8,), name="x")
        h = keras.layers.Lambda(lambda t: tf.math.log1p(tf.abs(t)), output_shape=output_shape)(inputs)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(h))
""")


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the factory uses TensorFlow ops")
@pytest.mark.parametrize("output_shape", [None, [8]], ids=["fails-building", "fails-at-fit"])
def test_tensorflow_ops_on_jax_are_told_the_backend_that_runs_them(
    toy_data, tmp_path, output_shape
):
    """Without output_shape the factory fails (Keras infers the shape on JAX); with it, the
    factory builds and Keras fails building the model on the first batch, in errors that name
    neither TensorFlow nor the op."""
    factory = tmp_path / "lam.py"
    factory.write_text(LAMBDA_FACTORY)
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1},
                        model={"factory": f"{factory}:build",
                               "kwargs": {"output_shape": output_shape}})  # fmt: skip
    with pytest.raises(ModelError, match="runtime.backend: tensorflow. Set it, or use keras.ops"):
        tpurun.train(config, verbose=False)


@pytest.mark.slow
def test_a_framework_import_failing_in_another_package_names_that_package(tmp_path):
    """TensorFlow imports matplotlib; a matplotlib that fails is named as the cause, and the
    command suggested checks matplotlib, not TensorFlow. (The tf.data reader imports
    TensorFlow; the native reader, the default without it, never does.)"""
    from conftest import ROOT, run_cli

    (tmp_path / "matplotlib").mkdir()
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ValueError('broken on purpose')\n")
    pytest.importorskip("tensorflow")
    result = run_cli("data", "bench", str(ROOT / "configs" / "quickstart.yaml"),
                     "--set", "data.reader=tf_data", env={"PYTHONPATH": str(tmp_path)})  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: TensorFlow cannot be imported: the matplotlib it imports failed (ValueError: "
        "broken on purpose). The cause is matplotlib or its settings, not TensorFlow: check "
        "`python -c 'import matplotlib'` in this environment, with the same environment "
        "variables; `tpurun doctor` shows what it finds."
    )
