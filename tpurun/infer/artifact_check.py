"""The export check's parent side: the artifact loaded by :mod:`tpurun.infer.scripts.run_artifact` in a fresh
Python process that never imports tpurun, and its outputs compared with the trained model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.errors import TpurunError

#: The standalone scripts (run in a fresh ``python -I``, without tpurun) that check an artifact.
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def run_script(
    python: str, script: str, args: list[str], env: dict[str, str], failure: str
) -> dict:
    """Run ``SCRIPTS/script`` in a fresh ``python -I`` with ``env`` added to this process'
    environment less PYTHONPATH and XLA_FLAGS; its report, the JSON of its last stdout line.

    Raises:
        TpurunError: the script fails: ``failure``, then its last line on stderr.
    """
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    command = [python, "-I", "-B", str(SCRIPTS / script), *args]
    done = subprocess.run(command, capture_output=True, text=True, env={**base, **env}, timeout=900)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = lines[-1] if lines else f"exit code {done.returncode}"
        raise TpurunError(failure.replace("{last}", last))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _structure(model_inputs: Any) -> dict:
    if isinstance(model_inputs, dict):
        return {"kind": "dict", "keys": sorted(model_inputs)}
    if isinstance(model_inputs, (list, tuple)):
        return {"kind": "list"}
    return {"kind": "single"}


def check(
    fmt: str,
    artifact: str,
    inputs: Any,
    expected: list,
    loader: str | None,
    backend: str,
    work: str,
    tol: float,
    hub: dict | None = None,
) -> dict:
    """Load the artifact in a fresh process, run ``inputs``, compare with ``expected``.
    ``hub``: how run_artifact.py rebuilds a preset's task for an adapter (``--format lora``).

    Raises:
        TpurunError: it does not load, or its outputs differ by more than ``tol`` (absolute and
            relative, as ``numpy.allclose``).
    """
    keras = frameworks.keras()
    import numpy as np

    flat = [np.asarray(a) for a in keras.tree.flatten(inputs)]
    paths = {k: os.path.join(work, f"check-{k}") for k in ("in.npz", "out.npz", "structure.json")}
    np.savez(paths["in.npz"], **{f"in_{i}": a for i, a in enumerate(flat)})
    Path(paths["structure.json"]).write_text(
        json.dumps({**_structure(inputs), "loader": loader, "hub": hub})
    )
    # On the CPU, where the check is meant to run (a TPU stays with this process), with the
    # backend a user without tpurun would pick.
    env = {
        "KERAS_BACKEND": "tensorflow" if fmt == "saved_model" else backend,
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "-1",
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    args = [fmt, artifact, paths["in.npz"], paths["out.npz"], paths["structure.json"]]
    failure = (f"export: the {fmt} artifact does not load and run in a fresh Python process: "
               "{last}. Nothing was written.")  # fmt: skip
    report = run_script(sys.executable, "run_artifact.py", args, env, failure)
    with np.load(paths["out.npz"]) as saved:
        got = [saved[f"out_{i}"] for i in range(len(saved.files))]
    if len(got) != len(expected):
        raise TpurunError(
            f"export: the {fmt} artifact gives {len(got)} output(s), the trained "
            f"model {len(expected)}. Nothing was written."
        )
    diffs, close = [], True
    for have, want in zip(got, expected, strict=True):
        if have.shape != want.shape:
            raise TpurunError(
                f"export: the {fmt} artifact's output has shape {have.shape}, the "
                f"trained model's {want.shape}. Nothing was written."
            )
        have, want = have.astype(np.float64), want.astype(np.float64)
        diffs.append(float(np.max(np.abs(have - want), initial=0.0)))
        close = close and bool(np.allclose(have, want, rtol=tol, atol=tol))
    report["max_abs_diff"] = max(diffs, default=0.0)
    if not close:
        raise TpurunError(
            f"export: the {fmt} artifact's outputs differ from the trained model's on "
            f"{len(flat[0])} inputs by up to {report['max_abs_diff']:.3g} (tolerance {tol:g}). "
            "Nothing was written."
        )
    return report
