"""The ``tpurun`` command: it parses the arguments, calls one library function, hands the result to
:mod:`tpurun.display.reports` (training's own output is :mod:`tpurun.display.lines`), and is the only module that
chooses an exit code, through :mod:`tpurun.cli.boundary`. The ``data`` commands are
:mod:`tpurun.cli.data`; ``evaluate``, ``predict`` and ``export`` are :mod:`tpurun.cli.infer`.

Exit codes (docs/exit-codes.md): 0 success; 1 anything unexpected, with the traceback written to a
file whose path is printed (for ``doctor``: a check failed); 2 a user error (config, data, usage, an
environment that cannot run the config), one short paragraph and no traceback; 3 ``train`` stopped by
SIGTERM or SIGINT (during training with its checkpoint saved, before it with nothing to lose), so
rerunning continues; 130 a second signal (stop at once), or Ctrl-C in the other commands.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from tpurun._version import __version__
from tpurun.cli.args import CheckOpt, ConfigArg, PlacementOpt, SetOpt
from tpurun.cli.boundary import SetCommand, end_process, exit_codes
from tpurun.cli.data import data_app
from tpurun.cli.infer import evaluate, export, predict
from tpurun.errors import EXIT_USER_ERROR
from tpurun.training.signals import SIGNALS

app = typer.Typer(
    name="tpurun",
    help="Train Keras 3 models from a YAML file, on TPUs, GPUs or CPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tpurun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version.")
    ] = False,
) -> None:
    """Train Keras 3 models from a YAML file, on TPUs, GPUs or CPUs."""


@app.command(cls=SetCommand)
def train(
    config: ConfigArg,
    set_: SetOpt = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Parent folder for the run (overrides output.dir)."),
    ] = None,
    plain: Annotated[
        bool,
        typer.Option("--plain", help="Plain lines instead of a live view (also TPURUN_PLAIN=1)."),
    ] = False,
    restart: Annotated[
        bool,
        typer.Option("--restart", help="Start over; the existing run directory is moved aside."),
    ] = False,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            metavar="PATH",
            help="Continue from this checkpoint: a run directory, a checkpoint's .json, or a "
            ".keras / .weights.h5 file (a LoRA run's .adapter.h5 / .lora.h5) (default: this "
            "run's latest).",
        ),
    ] = None,
    time_limit: Annotated[
        str | None,
        typer.Option(
            "--time-limit",
            metavar="DURATION",
            help="Stop cleanly, with a checkpoint, after this long (e.g. 8h45m).",
        ),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(
            "--profile",
            metavar="START:STEPS",
            help="Trace STEPS steps from this session's step START with the profiler, into "
            "<run>/plugins/profile (train.profile).",
        ),
    ] = None,
) -> None:
    """Train a model as CONFIG describes; rerunning continues an unfinished run."""
    with exit_codes(train=True):  # a signal stops it with exit 3 from here on
        from tpurun.config import load_config
        from tpurun.display import make_reporter

        reporter = make_reporter(plain)
        if time_limit:
            _check_duration(time_limit)
        overrides = [*(set_ or []), *([f"train.time_limit={time_limit}"] if time_limit else [])]
        if profile:
            overrides.append(_profile_override(profile))
        cfg = load_config(config, overrides)
        from tpurun.training.session import run

        try:
            run(cfg, output=output, reporter=reporter, restart=restart, resume=resume)
        finally:
            reporter.close()  # a live view gives the terminal back before any message is printed


def _check_duration(value: str) -> None:
    from tpurun.config import parse_duration
    from tpurun.errors import ConfigError

    try:
        parse_duration(value)
    except ValueError as exc:
        raise ConfigError([f"--time-limit {value}: {exc}"]) from None


def _profile_override(value: str) -> str:
    """``--profile 10:5`` as the ``--set`` it stands for."""
    from tpurun.errors import ConfigError

    first, sep, count = value.partition(":")
    if not (sep and first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
        raise ConfigError(
            [
                f"--profile {value}: expected START:STEPS, two integers >= 1 (10:5 traces steps 10 "
                "to 14 of this session)"
            ]
        )
    return f"train.profile={{start_step: {int(first)}, steps: {int(count)}}}"


@app.command("config", cls=SetCommand)
def config_command(
    config: ConfigArg,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML.")] = False,
    check: CheckOpt = False,
    placement: PlacementOpt = False,
) -> None:
    """Print the resolved config with its derived values (replicas, batch, LR, steps; a preset's task and parameters), without training."""
    with exit_codes():
        from tpurun.config import load_config
        from tpurun.display import placements, reports

        cfg = load_config(config, set_ or [])
        if check:
            from tpurun.training.factory_source import check_factory_source

            factory = check_factory_source(cfg)
        if check and not as_json:
            reports.show_valid(str(config), factory)
            return
        if check:
            data = cfg.to_dict()
        else:
            from tpurun.plan.prepare import prepare_here

            prepared = prepare_here(cfg)
            if placement:  # instead of the config: where each weight goes on the mesh
                from tpurun.training.placement import placement as placed

                return placements.show(placed(cfg, prepared), as_json=as_json)
            data = prepared.effective()
            if cfg.model.preset is not None:  # builds it on the CPU to count its parameters
                from tpurun.hub.report import describe
                from tpurun.runtime.memory_check import run_mesh

                mesh = run_mesh(cfg, prepared.choice, prepared.plan)
                data["derived"].update(describe(cfg, prepared.choice.backend, prepared.plan, mesh))
        reports.show_config(data, as_json=as_json)


@app.command(cls=SetCommand)
def doctor(
    config: Annotated[
        Path | None,
        typer.Argument(
            help="An experiment's YAML file: also check its data, model and output.", dir_okay=False
        ),
    ] = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text instead of a table.")] = False,
) -> None:
    """Say whether this machine can train CONFIG, and what to fix. Exit 1 if a check fails."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.doctor import exit_code, report, run_checks

        if not as_json:
            # Measured on 2 cores: the devices probe's children import TensorFlow (5 s of CPU)
            # and JAX (1 s) side by side, 7-15 s; health 1-3 s; a config's model step 2-15 s.
            reports.note(
                "running checks (10-20 s on 2 cores, longer with a config: child processes start "
                "TensorFlow and JAX, each with a timeout, so none can hang)..."
            )
        checks = run_checks(str(config) if config else None, overrides=set_ or [])
        reports.show_checks(report(checks), as_json=as_json, plain=plain)
    raise typer.Exit(code=exit_code(checks))


# After training: the commands that open a run (tpurun.cli.infer), in --help's order.
app.command()(evaluate)
app.command()(predict)
app.command()(export)


@app.command("runs")
def runs_command(
    folder: Annotated[
        str,
        typer.Argument(help="The folder the runs are in (a config's output.dir).", metavar="DIR"),
    ] = "runs",
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as JSON.")] = False,
    plain: Annotated[bool, typer.Option("--plain", help="Plain text instead of a table.")] = False,
) -> None:
    """List the runs under DIR, newest first: status, epochs, best value, speed, input wait."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.observe.runs import list_runs

        reports.show_runs(list_runs(folder), folder, as_json=as_json, plain=plain)


@app.command("plot")
def plot_command(
    runs: Annotated[
        list[str],
        typer.Argument(
            help="Run directories (or names under ./runs), drawn on the same axes.",
            show_default=False,
            metavar="RUN...",
        ),
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric", "-m", metavar="NAME", help="Only this metric (repeatable; default: all)."
        ),
    ] = None,
    output: Annotated[
        str, typer.Option("--output", "-o", metavar="FILE.png", help="Where the picture goes.")
    ] = "curves.png",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Draw loss and metric curves (train and validation, runs overlaid, the LR) into a PNG."""
    with exit_codes():
        from tpurun.display import reports
        from tpurun.observe.curves import plot_runs

        reports.show_plotted(plot_runs(runs, metric, output), as_json=as_json)


app.add_typer(data_app)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch(
    ctx: typer.Context,
    processes: Annotated[
        int, typer.Option("-n", "--processes", help="How many local processes train together.")
    ] = 2,
) -> None:
    """Rehearse a multi-host run: N local processes on a loopback coordinator, each with its share
    of runtime.cpu_devices, e.g. `tpurun launch -n 2 train CONFIG`."""
    from tpurun.multihost.launch import launch as run_processes

    with exit_codes():
        code = run_processes(processes, list(ctx.args))
    raise typer.Exit(code=code)


def main() -> None:
    """Console-script entry point."""
    SIGNALS.hold()  # until the command starts: Typer takes a while to build the commands
    try:
        app()
    except SystemExit as exc:
        # Click reports usage errors with exit code 2 already; keep every other code as is.
        code = (
            exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_USER_ERROR)
        )
        activate = sys.modules.get("tpurun.runtime.activate")  # imported: it may have joined
        if activate is not None:
            activate.leave(code)
        end_process(code)
