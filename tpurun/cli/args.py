"""Argument types shared by the commands of :mod:`tpurun.cli.app` and :mod:`tpurun.cli.data`, and
the longer options of one command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ConfigArg = Annotated[
    Path, typer.Argument(help="The experiment's YAML file.", show_default=False, dir_okay=False)
]


SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a key: --set train.epochs=3 (repeatable).",
        metavar="KEY=VALUE",
    ),
]


# tpurun config's two alternatives to printing the config.
CheckOpt = Annotated[
    bool,
    typer.Option(
        "--check",
        help="Only validate the file (instant: no data, no devices, the model factory's file "
        "compiled but not imported): print 'CONFIG: valid' and what was checked, or with "
        "--json the validated config.",
    ),
]
PlacementOpt = Annotated[
    bool,
    typer.Option(
        "--placement",
        help="List each weight's place on the mesh instead: its path, shape, split, the rule "
        "that placed it and its bytes per device (the model built on the CPU, shapes only; "
        "nothing trains).",
    ),
]
