"""What one accelerator device holds and computes: the table the memory check and MFU read.

One JAX device is one TPU *chip* from v4 on (v4 and v5p fuse their two TensorCores, "megacore";
v5e and v6e have one), and one *core* on v2 and v3 (a v3-8 is 8 devices of 16 GiB each). The peak
is the dense bfloat16 matrix-unit rate per device, as Google publishes it and as MaxText divides by
for MFU. Usable memory is a little less than the HBM: the runtime keeps some (a v5e chip has 16 GiB,
of which about 15.75 GiB can be allocated); where the runtime reports its own limit
(``device.memory_stats()["bytes_limit"]``), that figure wins over this table.

Imports no framework: the device kind is the string JAX reports (``jax.devices()[0].device_kind``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a known kind: its name, usable memory and peak bfloat16 rate."""

    name: str  # as users call it: v5e, v4, T4 ...
    memory_bytes: int  # usable by a program on one device
    peak_tflops: float  # dense bfloat16 (float16 on GPUs without bfloat16), per device


#: TPU generations (JAX's device_kind -> spec). HBM per device minus the runtime's reserve.
TPUS: dict[str, DeviceSpec] = {
    "v2": DeviceSpec("v2", int(7.75 * GiB), 22.5),  # per core: 45 TFLOP/s, 16 GiB a chip
    "v3": DeviceSpec("v3", int(15.75 * GiB), 61.5),  # per core: 123 TFLOP/s, 32 GiB a chip
    "v4": DeviceSpec("v4", int(31.75 * GiB), 275.0),
    "v5e": DeviceSpec("v5e", int(15.75 * GiB), 197.0),
    "v5p": DeviceSpec("v5p", int(94.75 * GiB), 459.0),
    "v6e": DeviceSpec("v6e", int(31.75 * GiB), 918.0),
}

#: GPUs users meet on Kaggle and Colab (device_kind substring -> spec); memory_stats() gives their
#: real limit, so the memory here is only a fallback.
GPUS: dict[str, DeviceSpec] = {
    "T4": DeviceSpec("T4", 15 * GiB, 65.0),  # float16 tensor cores (no bfloat16)
    "P100": DeviceSpec("P100", 16 * GiB, 18.7),  # float16
    "V100": DeviceSpec("V100", 16 * GiB, 125.0),  # float16
    "L4": DeviceSpec("L4", 22 * GiB, 121.0),
    "A100": DeviceSpec("A100", 40 * GiB, 312.0),
    "H100": DeviceSpec("H100", 80 * GiB, 989.0),
}

# JAX's device_kind strings: "TPU v2", "TPU v3", "TPU v4", "TPU v5 lite" (v5e), "TPU v5" and
# "TPU v5p" (v5p), "TPU v6 lite" and "TPU v6e" (v6e, Trillium).
_TPU_KIND = re.compile(r"TPU\s*v(\d)\s*(lite|e|p)?", re.IGNORECASE)


def spec(device_kind: str) -> DeviceSpec | None:
    """The spec of a device JAX names ``device_kind``; None for a CPU or an unknown device."""
    found = _TPU_KIND.search(device_kind or "")
    if found:
        generation, variant = found.group(1), (found.group(2) or "").lower()
        if generation in ("5", "6"):
            name = f"v{generation}" + ("e" if variant in ("lite", "e") else "p")
            if name == "v6p":
                return None  # no such chip: an unknown kind, not a guess
        else:
            name = f"v{generation}"
        return TPUS.get(name)
    for key, value in GPUS.items():
        if key.lower() in (device_kind or "").lower():
            return value
    return None


def by_name(name: str) -> DeviceSpec | None:
    """A TPU spec by the name users write (``v5e``, ``v4``), for a plan made off the machine."""
    return TPUS.get(name.lower().removeprefix("tpu").strip("- "))
