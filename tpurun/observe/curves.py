"""Training curves as pictures: ``tpurun plot``, :func:`tpurun.plot`, and each run's ``curves.png``.

Reads each run's CSV log (one row per finished epoch) and draws one panel per metric: training
solid, validation dashed, one colour per run, the learning rate on a second axis of the loss panel,
and a log scale for a loss that spans two decades or more. Uses matplotlib's object API with the
Agg canvas (no pyplot, no display needed); matplotlib is imported only here, when a plot is made
or, for a session's ``curves.png``, as its training begins (:func:`import_ahead`).

(Named curves.py, not plot.py: a submodule ``tpurun.plot`` would replace the function
:func:`tpurun.plot` on the package once imported.)
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpurun.errors import TpurunError
from tpurun.storage import fileio
from tpurun.storage.rundir import CURVES, RunDir

PANEL_INCHES = (6.4, 4.0)  # one metric's panel
DPI = 100
MAX_COLUMNS = 2
LOG_SCALE_SPAN = 100.0  # max / min of a positive loss at which its axis turns logarithmic
NOT_METRICS = ("epoch", "learning_rate", "lr", "input_wait")
VIZ_EXTRA = "pip install 'tpurun[viz]' (or pip install matplotlib)"


@dataclass
class RunLog:
    """One run's logged epochs: ``columns`` maps each CSV column to a value per epoch (NaN where
    missing)."""

    name: str
    path: str
    epochs: list[int]  # from 1
    columns: dict[str, list[float]]

    def metrics(self) -> list[str]:
        """The metric names (without ``val_``), the loss first, in the log's order after it."""
        names: list[str] = []
        for column in self.columns:
            name = column.removeprefix("val_")
            if column not in NOT_METRICS and name not in names:
                names.append(name)
        return sorted(names, key=lambda n: n != "loss")


def _number(text: str) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan  # "NA", or a metric with several values ("[0.1, 0.2]")


def resolve_run(run: str) -> str:
    """A run directory: the path given, else ``runs/<run>`` (the names ``tpurun runs`` lists).

    Raises:
        TpurunError: neither is a folder.
    """
    if fileio.isdir(run):
        return run
    beside = os.path.join("runs", run)
    if not fileio.is_remote(run) and os.path.isdir(beside):
        return beside
    raise TpurunError(
        f"{run}: no such run directory. Give the folder `tpurun train` made "
        "(<output.dir>/<name>); `tpurun runs DIR` lists them."
    )


def read_run(run: str) -> RunLog:
    """A run's CSV log (``callbacks.csv_log.filename`` from its config.yaml, else ``log.csv``).

    Raises:
        TpurunError: no such run, or no epoch logged yet.
    """
    path = resolve_run(run)
    rundir = RunDir(path, writer=False)
    filename = rundir.log_name()
    rows = rundir.read_log(filename) if filename else []
    if not rows:
        raise TpurunError(
            f"{path}: no epochs to plot: {filename or 'log.csv'} is missing or empty (no epoch "
            "finished yet, or callbacks.csv_log was null)."
        )
    columns = {key: [_number(row.get(key)) for row in rows] for key in rows[0] if key != "epoch"}
    epochs = [int(_number(row.get("epoch")) + 1) for row in rows]
    return RunLog(fileio.basename(path.rstrip("/")), path, epochs, columns)


def _chosen(logs: Sequence[RunLog], metrics: Sequence[str] | None) -> list[str]:
    logged: list[str] = []
    for log in logs:
        logged += [m for m in log.metrics() if m not in logged]
    if not metrics:
        return logged
    unknown = [m for m in metrics if m.removeprefix("val_") not in logged]
    if unknown:
        raise TpurunError(
            f"--metric {unknown[0]}: not in the logs of {', '.join(log.name for log in logs)}; "
            f"they log {', '.join(logged)}."
        )
    return list(dict.fromkeys(m.removeprefix("val_") for m in metrics))


def _span(values: list[float]) -> float:
    positive = [v for v in values if v == v and v > 0]
    if not positive or len(positive) < len([v for v in values if v == v]):
        return 1.0  # zero or negative values: no log scale
    return max(positive) / min(positive)


def figure(runs: Sequence[str], metrics: Sequence[str] | None = None) -> Any:
    """A matplotlib Figure of the runs' curves (one panel per metric).

    Raises:
        TpurunError: a run without a log, an unknown metric, or matplotlib missing.
    """
    return draw([read_run(run) for run in runs], metrics)


def draw(logs: Sequence[RunLog], metrics: Sequence[str] | None = None) -> Any:
    """The Figure of :func:`figure`, from logs already read."""
    names = _chosen(logs, metrics)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise TpurunError(f"plotting needs matplotlib: {VIZ_EXTRA}.") from None
    columns = min(MAX_COLUMNS, len(names))
    rows = math.ceil(len(names) / columns)
    fig = Figure(
        figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows), dpi=DPI, layout="constrained"
    )
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    several = len(logs) > 1
    for ax, name in zip(axes, names, strict=False):
        plotted: list[float] = []
        for i, log in enumerate(logs):
            color = f"C{i % 10}"
            marker = "o" if len(log.epochs) <= 20 else None
            for column, style, label in ((name, "-", "train"), (f"val_{name}", "--", "validation")):
                if column not in log.columns:
                    continue
                values = log.columns[column]
                plotted += values
                ax.plot(
                    log.epochs,
                    values,
                    style,
                    color=color,
                    marker=marker,
                    markersize=3,
                    label=f"{log.name} {label}" if several else label,
                )
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
        if name.endswith("loss") and _span(plotted) >= LOG_SCALE_SPAN:
            ax.set_yscale("log")
        lines = ax.get_lines()
        if name == names[0]:
            lines += _learning_rate(ax, logs, several)
        ax.legend(lines, [line.get_label() for line in lines], fontsize="small")
    title = ", ".join(log.name for log in logs)
    fig.suptitle(title if len(title) <= 100 else title[:97] + "...")
    return fig


def _learning_rate(ax: Any, logs: Sequence[RunLog], several: bool) -> list[Any]:
    """The learning rate on a second y axis of ``ax``, dotted; returns its lines."""
    with_lr = [(i, log) for i, log in enumerate(logs) if "learning_rate" in log.columns]
    if not with_lr:
        return []
    twin = ax.twinx()
    lines, values = [], []
    for i, log in with_lr:
        rates = log.columns["learning_rate"]
        values += rates
        (line,) = twin.plot(
            log.epochs,
            rates,
            ":",
            color=f"C{i % 10}",
            alpha=0.7,
            label=f"{log.name} learning rate" if several else "learning rate",
        )
        lines.append(line)
    twin.set_ylabel("learning rate")
    finite = [v for v in values if v == v and v > 0]
    if _span(values) >= LOG_SCALE_SPAN:
        twin.set_yscale("log")
    elif finite and max(finite) <= min(finite) * 1.01:
        # A constant rate: from 0 to twice it, so the axis does not blow float noise up into
        # ticks (0.00096 ... 0.00104) that mean nothing.
        twin.set_ylim(0, 2 * max(finite))
    return lines


def save(fig: Any, path: str) -> str:
    """Write ``fig`` as a PNG (local or ``gs://``), atomically."""
    fileio.save_atomically(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))
    return path


def pixels(fig: Any) -> tuple[int, int]:
    width, height = fig.get_size_inches() * DPI
    return round(width), round(height)


def plot_runs(runs: Sequence[str], metrics: Sequence[str] | None, output: str) -> dict[str, Any]:
    """``tpurun plot``: draw the runs' curves into ``output``; what was drawn, for the report."""
    fig = figure(runs, metrics)
    save(fig, output)
    width, height = pixels(fig)
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    return {
        "output": output,
        "width": width,
        "height": height,
        "runs": [resolve_run(run) for run in runs],
        "metrics": [ax.get_title() for ax in panels],
        "lines": sum(len(ax.get_lines()) for ax in panels),
    }


def import_ahead(run: RunDir) -> threading.Thread | None:
    """Start importing matplotlib in a thread, for the ``curves.png`` that :func:`save_curves`
    draws when the session ends. The import is most of that drawing's cost (0.25 s in a fresh
    interpreter on 2 cores; at the NAIC-like run's end, with some of its dependencies loaded,
    starting it early took the end from 0.27 s to 0.16 s), and at the end nothing else is left
    to overlap it with; called as the first training step starts to compile (XLA compiles
    without holding the GIL, on one core), it is done before the end needs it. Not a daemon: an exit waits for the import to finish rather than stopping it
    halfway. Returns the thread; None where this process does not draw, or matplotlib is missing
    or imported already."""
    if not run.writer or "matplotlib.figure" in sys.modules:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        return None  # the end says curves.png is not written, and how to get it
    thread = threading.Thread(target=_import_figure, name="tpurun-matplotlib")
    thread.start()
    return thread


def _import_figure() -> None:
    try:
        import matplotlib.figure  # noqa: F401
    except Exception:  # noqa: BLE001 (the end imports it again, and says what failed)
        pass


def save_curves(run: RunDir) -> str | None:
    """``curves.png`` in a run directory, from its log; None when it has no epoch logged yet or
    this process does not write the run directory.

    Raises:
        TpurunError: matplotlib is not installed.
    """
    if not run.writer:
        return None
    try:
        log = read_run(run.path)
    except TpurunError:
        return None  # no epoch logged (or the CSV log is off)
    fig = draw([log])
    return run.write_file(CURVES, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI))


def inline() -> None:
    """Let IPython show a Figure returned as a cell's value (pyplot would arrange that on import;
    this module does not use pyplot). Does nothing outside IPython, or when a format is set."""
    import sys

    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is None:
        return
    from matplotlib.figure import Figure

    formatter = shell.display_formatter.formatters["image/png"]
    try:
        formatter.lookup_by_type(Figure)
    except KeyError:
        from IPython.core.pylabtools import print_figure

        formatter.for_type(Figure, lambda fig: print_figure(fig, "png"))
