"""Argument types shared by the commands of :mod:`tpurun.cli.app` and :mod:`tpurun.cli.data`."""

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
