"""tpurun: a YAML-driven Keras 3 training runner for TPUs, GPUs and CPUs.

The public Python API. Nothing heavy is imported here: Keras fixes its backend at first import, and
tpurun must choose it first.
"""

from __future__ import annotations

from typing import Any

from tpurun._version import __version__

__all__ = ["__version__", "evaluate", "export", "load", "load_config", "plot", "predict", "train"]


def load_config(source: Any, overrides: list[str] | tuple[str, ...] = ()):
    """Load and validate a config (a YAML path or a dict); see :func:`tpurun.config.load_config`."""
    from tpurun.config import load_config as _load

    return _load(source, overrides)


def train(
    config: Any,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    output: str | None = None,
    restart: bool = False,
    resume: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train from a notebook cell and return the run's summary.

    Args:
        config: a path to a YAML config, a dict in the same form, or a loaded Config.
        overrides: ``"dotted.key=value"`` strings, as ``--set`` takes them.
        output: overrides ``output.dir``.
        restart: start over instead of resuming the run directory.
        resume: continue from this checkpoint instead (as ``--resume``).
        verbose: print plain progress lines (they read well in a notebook cell).

    Raises:
        tpurun.errors.TpurunError: a problem with the config, data, model or environment. If Keras
            was already imported in this kernel with another backend, the message says so.
            :class:`~tpurun.errors.Interrupted`: stopped by the stop button (SIGINT) or SIGTERM,
            with a checkpoint; calling it again continues.
        KeyboardInterrupt: a second signal during training, or one before training started.
    """
    from tpurun.training.signals import SIGNALS

    # From the main thread, the signals take the route the command line's do for this call: a
    # stop button before training raises a KeyboardInterrupt (Signalled) once it can surface;
    # during training it stops at the next step with a checkpoint (Interrupted).
    with SIGNALS.command(train=True):
        from tpurun.config import Config
        from tpurun.display.lines import PlainReporter
        from tpurun.display.reporter import Reporter
        from tpurun.training import session

        cfg = config if isinstance(config, Config) else load_config(config, overrides)
        reporter = PlainReporter() if verbose else Reporter()
        return session.run(cfg, output=output, reporter=reporter, restart=restart, resume=resume)


def evaluate(run_dir: str, data: str | None = None, checkpoint: str = "best") -> dict[str, Any]:
    """Score a split with a trained run's checkpoint, every record exactly once, as
    ``tpurun evaluate`` does; also written to the run's ``eval-<name>.json``.

    Args:
        run_dir: the run directory ``train`` made.
        data: a glob of records with the same features and targets; None: data.validation.
        checkpoint: ``best`` (else the final model.keras), ``latest``, or a checkpoint file.

    Returns:
        ``metrics`` (Keras' names: loss, accuracy...), ``records`` scored, and where from.
    """
    from tpurun.infer.evaluate import evaluate as _evaluate

    return _evaluate(run_dir, data, checkpoint)


def predict(
    run_dir: str,
    data: str | list[str],
    output: str,
    *,
    id_feature: str | None = None,
    checkpoint: str = "best",
    max_length: int | None = None,
    sampler: str = "greedy",
    top_k: int | None = None,
    seed: int | None = None,
) -> dict[str, Any]:
    """Predict every record of ``data`` once, in file order, into a ``.csv``, ``.npy`` or ``.npz``
    file, as ``tpurun predict`` does. Targets may be absent from the records.

    On a fine-tuned causal LM, each record's prompt is completed instead, into a ``.csv`` or
    ``.jsonl`` file (id, prompt, completion): ``max_length`` is the whole sequence in tokens
    (prompt included; default the run's sequence length), ``sampler`` ``greedy`` or ``top_k``
    (with ``top_k`` and a ``seed``, by default the run's).

    Returns:
        ``rows`` written, ``columns``, ``output``.
    """
    from tpurun.infer.predict import predict as _predict

    return _predict(
        run_dir,
        data,
        output,
        id_feature=id_feature,
        checkpoint=checkpoint,
        max_length=max_length,
        sampler=sampler,
        top_k=top_k,
        seed=seed,
    )


def export(
    run_dir: str,
    format: str,
    output: str,
    *,
    checkpoint: str = "best",
    platforms: str | list[str] | None = None,
    check_python: str | None = None,
) -> dict[str, Any]:
    """Export a trained run's model as ``keras``, ``saved_model``, ``onnx``, ``lora`` or
    ``huggingface``, with a sidecar ``<output>.json``, checked in a fresh process without tpurun,
    as ``tpurun export`` does.

    Args:
        platforms: where a JAX model's SavedModel runs (default ``cpu,cuda``; cpu included).
        check_python: the Python whose transformers checks a ``huggingface`` folder.
    """
    from tpurun.infer.export import export as _export

    return _export(
        run_dir,
        format,
        output,
        checkpoint=checkpoint,
        platforms=platforms,
        check_python=check_python,
    )


def load(run_dir: str, checkpoint: str = "best"):
    """A trained run's Keras model, with a checkpoint's weights, and its feature spec.

    ``model, spec = tpurun.load("runs/my-experiment")``: the model is built by the run's own
    factory (so its custom layers are resolved from config.yaml's import paths) on the backend and
    precision the config gives; ``spec`` holds the features a record decodes into (``features``,
    ``inputs``, ``targets``, ``compression``) and the label's ``class_names``.

    A run that fine-tuned a ``model.preset`` gives the KerasHub task with its preprocessor at the
    run's sequence length, ready for ``model.generate(["..."])`` or ``model.predict(["..."])``:
    with LoRA, the preset (under the run's precision) with the run's rank and alpha and the
    adapter of ``model.lora.h5``; without, the task ``model.keras`` holds.
    """
    from tpurun.infer.trained_run import load as _load

    return _load(run_dir, checkpoint)


def plot(runs: str | list[str], metrics: list[str] | None = None, *, output: str | None = None):
    """The runs' training curves as a matplotlib Figure, as ``tpurun plot`` draws them: one
    panel per metric, training solid and validation dashed, runs overlaid, the learning rate on a
    second axis. In a notebook it shows inline as the cell's value.

    Args:
        runs: a run directory, or several (names under ``./runs`` work too).
        metrics: only these metrics (default: every one logged).
        output: also write the picture there as a PNG.
    """
    from tpurun.observe.curves import figure, inline, save

    fig = figure([runs] if isinstance(runs, str) else list(runs), metrics)
    if output:
        save(fig, output)
    inline()
    return fig
