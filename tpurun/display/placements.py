"""``tpurun config CONFIG --placement``'s listing: one aligned line per variable, plain everywhere (a
listing to read or grep, often hundreds of lines, that a table would wrap)."""

from __future__ import annotations

import sys
from typing import Any

from tpurun.display.reports import show_json
from tpurun.runtime.sizes import size

COLUMNS = ("path", "shape", "split", "rule", "per device")


def _split(axes: list[str | None]) -> str:
    """``[None, "model", None]`` -> ``-, model, -``: the mesh axis each dimension is split over."""
    return ", ".join(a or "-" for a in axes) if axes else "-"


def show(listing: dict[str, Any], as_json: bool = False) -> None:
    """The placement listing (:func:`tpurun.training.placement.placement`), or it as JSON."""
    if as_json:
        show_json(listing)
        return
    mesh, variables = listing["mesh"], listing["variables"]
    rows = [(v["path"], str(v["shape"]), _split(v["axes"]), v["rule"], size(v["bytes_per_device"]))
            for v in variables]  # fmt: skip
    widths = [max(len(r[i]) for r in [COLUMNS, *rows]) for i in range(len(COLUMNS) - 1)]
    lines = [
        f"{len(variables)} variables on a mesh of data {mesh['data']} x model {mesh['model']}, "
        f"layout {listing['layout']}:",
        *(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + f"  {r[-1]}"
            for r in [COLUMNS, *rows]
        ),
        f"weights per device: {size(listing['bytes_per_device'])} of {size(listing['bytes'])} "
        "(gradients, optimizer state and activations come on top)",
    ]
    sys.stdout.write("\n".join(line.rstrip() for line in lines) + "\n")
