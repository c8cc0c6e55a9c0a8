"""Several processes on one CPU machine: 1x8, 2x4 and 4x2 (processes x devices) of one config.

Prints each layout's steady examples/s (summary.json, the first epoch left out), the ratio to 1x8,
the time JAX's distributed runtime takes to start, and what the per-execution stop agreement
costs (tpurun.multihost.collectives.agree_on_stop). A CPU machine shows correctness and overhead, not speed-up:
the 8 "devices" are slices of the same 2 cores, and processes add gloo all-reduces over loopback.

    .venv/bin/python benchmarks/multi_process.py [--epochs 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
EXE = str(Path(sys.executable).parent / "tpurun")
FACTORY = ROOT / "tests" / "factories.py"

_AGREE = """
import os, sys, time
os.environ.update(JAX_PLATFORMS="cpu", KERAS_BACKEND="jax")
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
t = time.perf_counter()
jax.distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
start = time.perf_counter() - t
from tpurun.multihost.collectives import agree_on_stop
agree_on_stop(None)
t = time.perf_counter()
for _ in range(200):
    agree_on_stop(None, None)
per_call = (time.perf_counter() - t) / 200
print(f"RESULT {start:.3f} {per_call * 1000:.2f}", flush=True)
"""


def _env() -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS")
    }
    return {**env, "TPURUN_PLAIN": "1"}


def _data(folder: Path) -> None:
    from tpurun.data.write import write_shards

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32768, 8)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int64)
    records = [{"x": x[i].tobytes(), "y": int(y[i])} for i in range(len(x))]
    folder.mkdir(parents=True)
    write_shards(str(folder / "train"), records[:28672], 8)
    write_shards(str(folder / "val"), records[28672:], 4)


def _run(tmp: Path, processes: int, epochs: int) -> float:
    config = {
        "name": f"p{processes}",
        "runtime": {"cpu_devices": 8},
        "model": {"factory": f"{FACTORY}:mlp", "loss": "binary_crossentropy", "metrics": ["accuracy"]},
        "data": {
            "train": str(tmp / "data" / "train-*"),
            "validation": str(tmp / "data" / "val-*"),
            "features": {"x": {"type": "raw", "dtype": "float32", "shape": [8]},
                         "y": {"type": "int64", "cast": "float32"}},
            "inputs": "x",
            "targets": "y",
        },
        "train": {"per_core_batch_size": 32, "epochs": epochs, "steps_per_execution": 16},
        "output": {"dir": str(tmp / "runs")},
    }  # fmt: skip
    path = tmp / f"p{processes}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [EXE, "train", str(path)]
    if processes > 1:
        command = [EXE, "launch", "-n", str(processes), "train", str(path)]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(done.stdout + done.stderr)
    return json.loads((tmp / "runs" / f"p{processes}" / "summary.json").read_text())[
        "examples_per_sec"
    ]


def _agreement() -> tuple[float, float]:
    from tpurun.multihost.launch import free_port

    address = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE, address, str(i)], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for i in range(2)]  # fmt: skip
    lines = [p.communicate(timeout=300)[0] for p in procs]
    start, per_call = (float(v) for v in lines[0].split("RESULT")[1].split())
    return start, per_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tpurun-multi-") as tmp:
        tmp = Path(tmp)
        _data(tmp / "data")
        rates = {}
        for processes in (1, 2, 4):
            started = time.monotonic()
            rates[processes] = _run(tmp, processes, args.epochs)
            wall = time.monotonic() - started
            layout = f"{processes}x{8 // processes}"
            print(f"{layout}: {rates[processes]:,.0f} examples/s (steady epochs), wall {wall:.1f} s, "
                  f"ratio to 1x8 {rates[processes] / rates[1]:.2f}")  # fmt: skip
    start, per_call = _agreement()
    print(f"jax.distributed.initialize, 2 processes on 127.0.0.1: {start:.2f} s")
    print(f"stop agreement (one all-gather per execution): {per_call:.2f} ms per call; at "
          "steps_per_execution 16 that is ~1/16 of it per step")  # fmt: skip


if __name__ == "__main__":
    main()
