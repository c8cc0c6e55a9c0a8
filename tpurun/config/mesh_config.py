"""The ``runtime`` keys of a model bigger than one chip: the device mesh, the layout of the weights
over it, and the device figures the memory check and MFU use where the runtime cannot tell."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ByteSize, Field, field_validator

from tpurun.config.base import Section

#: The mesh's axis names, as the layout rules write them.
AXES = ("data", "model")


class MeshConfig(Section):
    data: int | Literal["auto"] = Field(
        "auto",
        description="Devices along the data axis: each holds a slice of every batch. `auto`: "
        "the devices (of every process) divided by `model`.",
    )
    model: int = Field(
        1,
        ge=1,
        description="Devices along the model axis: each holds a slice of every weight the layout "
        "shards. 1: data parallel only (every device holds the whole model).",
    )

    @field_validator("data")
    @classmethod
    def _positive(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"got {value}; a number of devices (1 or more), or `auto`")
        return value


class LayoutRule(Section):
    pattern: str = Field(
        description="A regular expression matched against a variable's whole path (Python's "
        "`re.fullmatch`, as Keras 3.14 and later match LayoutMap keys): "
        "`decoder_block_\\d+/ffw_gating/kernel`. A pattern that matches nothing is refused, "
        "naming the closest paths, or the whole-path pattern where it matches part of some.",
    )
    axes: list[Literal["data", "model"] | None] = Field(
        description="One entry per dimension of the variables it matches: the mesh axis that "
        "dimension is split over, or null (not split).",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression ({exc})") from None
        return value


Layout = Literal["preset", "auto"] | list[LayoutRule]

LAYOUT_DESCRIPTION = (
    "How the weights are split over the mesh's model axis. `preset`: the backbone's own "
    "`get_layout_map` (KerasHub's Gemma, Llama, Qwen). `auto`: tpurun's rule for any Keras "
    "model (Gemma 3, Qwen 3, Mistral, Mixtral, Phi-3 have no map): an attention kernel is split "
    "by head where `model` divides the head count, else along the hidden size (a head is never "
    "split); an embedding along its vocabulary; any other weight of 2 or more dimensions along "
    "its largest dimension the axis divides. A list of `{pattern, axes}` rules: yours, first; what they do not "
    "match is placed by the preset's layout where the model has one, else by `auto` (a rule of "
    "all nulls keeps a weight whole on purpose). Unset: `preset` where the model has one, else "
    "`auto`. Either way, a weight of 2 or more dimensions and at least 1 "
    "MiB (or 1% of the model) left whole on every device is an error."
)

DEVICE_MEMORY_DESCRIPTION = (
    "One device's usable memory (`16GiB`, `15.75GB` or bytes), for the memory check. Unset: "
    "what the runtime reports, else tpurun's table of TPU generations; unknown on a CPU (no check)."
)

PEAK_TFLOPS_DESCRIPTION = (
    "One device's peak rate in TFLOP/s, for MFU. Unset: tpurun's table (TPU v3 to v6e, common "
    "GPUs); on a CPU no MFU is shown."
)

# Re-exported for the schema: pydantic's byte size parses "16GiB", "64MB", "1e9" and bytes.
DeviceMemory = ByteSize
