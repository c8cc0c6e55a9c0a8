"""How much slower is an epoch under `tpurun train` than in a hand-written Keras 3 script?

Both train the NAIC-like example (configs/naic_like.yaml: the MLP of configs/models/recognizer.py
on 1024 raw float32 features) on the same data, backend, simulated CPU devices, global batch,
steps per epoch, steps_per_execution and learning rate, with an equally good tf.data pipeline and
the per-epoch callbacks a hand-written script has (checkpoint, CSV log, LR plateau). The baseline
is benchmarks/baseline_keras.py. Each run is a fresh subprocess; the runs alternate (tpurun,
baseline, tpurun, ...) so that load on the machine hits both.

Reported: the median and mean per-epoch seconds, leaving out each run's first epoch (it compiles),
and their ratio tpurun/baseline (the target is <= 1.05); the time to the first step, measured from
the start of fit (``on_train_begin``) in both; and each process's wall time (start-up, data
checks, model building and checkpoint writes included).

    .venv/bin/python benchmarks/runner_overhead.py                 # JAX, 8 CPU devices, ~2 min
    .venv/bin/python benchmarks/runner_overhead.py --backend tensorflow --json

Per-epoch seconds run from ``on_epoch_begin`` to ``on_epoch_end`` of a callback placed first in
the list in both (tpurun's own progress callback is first), so they include training and
validation but not the checkpoint and CSV writes that the later callbacks do at the epoch's end;
the wall times include those. Data is written once into benchmarks/_work/ (gitignored).

tpurun runs configs/naic_like.yaml as it is. Both sides run Keras' batch-end hooks on the main
thread (tpurun's progress callback; the baseline's ModelCheckpoint and timing callback). On the TensorFlow
backend (MirroredStrategy over 8 logical CPU devices, steps_per_execution 1) epoch times on a
2-core machine swing from ~1.5 s to ~10 s in either program; give it more --repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
CONFIG = ROOT / "configs" / "naic_like.yaml"
GENERATOR = ROOT / "configs" / "data" / "make_naic_like.py"
BASELINE = HERE / "baseline_keras.py"
BIN = Path(sys.executable).parent
TARGET_RATIO = 1.05
TRAIN_RECORDS = 16384
VALIDATION_RECORDS = 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Per-epoch time of `tpurun train` versus a hand-written Keras 3 script."
    )
    p.add_argument("--backend", choices=["jax", "tensorflow"], default="jax")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--per-core-batch", type=int, default=32, help="default 32 (global 256)")
    p.add_argument("--steps-per-epoch", type=int, default=128)
    p.add_argument("--validation-steps", type=int, default=4)
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=None,
        help="default 32; 1 for TensorFlow on several devices (keras-team/keras#19246)",
    )
    p.add_argument("--epochs", type=int, default=4, help="per run; the first is left out")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.steps_per_execution is None:
        tf_multi = args.backend == "tensorflow" and args.devices > 1
        args.steps_per_execution = 1 if tf_multi else 32
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch (compilation) is left out")
    return args


def log(args: argparse.Namespace, message: str) -> None:
    # Progress goes to stderr, so `--json` leaves stdout as one JSON document.
    print(message, file=sys.stderr if args.json else sys.stdout, flush=True)


# ------------------------------------------------------------------------------------------ data
def ensure_data(args: argparse.Namespace) -> Path:
    """Write the NAIC-like shards with the example's generator, once per size."""
    global_batch = args.per_core_batch * args.devices
    # A fixed 16,384 records (67 MB): an epoch longer than that reads them again (both pipelines
    # repeat), so other sizes reuse the same files.
    train = max(TRAIN_RECORDS, global_batch)
    validation = max(VALIDATION_RECORDS, args.validation_steps * global_batch)
    folder = WORK / "data"
    marker = folder / "dataset.json"
    wanted = {"train": train, "validation": validation, "seed": 0}
    try:
        if json.loads(marker.read_text()) == wanted:
            return folder
    except (OSError, ValueError):
        pass
    log(args, f"writing {train} train and {validation} validation records into {folder} ...")
    cmd = [sys.executable, str(GENERATOR), "--out", str(folder)]
    cmd += ["--train", str(train), "--validation", str(validation), "--seed", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise SystemExit(f"error: {GENERATOR.name} failed:\n{proc.stderr.strip()}")
    marker.write_text(json.dumps(wanted))
    return folder


# ------------------------------------------------------------------------------------------ runs
def child_env() -> dict[str, str]:
    """The parent's environment without settings that would pick a backend or devices."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS", "TPURUN_PLAIN")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["TPURUN_CACHE_DIR"] = str(WORK / "cache")  # record counts; keeps ~/.cache out of it
    return env


def learning_rate(args: argparse.Namespace) -> float:
    # The example's rule: 1e-3 for a global batch of 128, scaled linearly.
    return 1e-3 * args.per_core_batch * args.devices / 128


def run_process(cmd: list[str], args: argparse.Namespace, what: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=child_env(), timeout=args.timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"error: {what} took more than {args.timeout:g}s: {' '.join(cmd)}"
        ) from None
    wall = time.monotonic() - started
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SystemExit(f"error: {what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout, wall


def run_tpurun(args: argparse.Namespace, data: Path, out: Path) -> dict:
    """`tpurun train configs/naic_like.yaml` with the benchmark's sizes; reads its summary.json."""
    sets = {
        "runtime.backend": args.backend,
        "runtime.accelerator": "cpu",
        "runtime.cpu_devices": args.devices,
        "data.train": str(data / "naic-train-*.tfrecord"),
        "data.validation": str(data / "naic-validation-*.tfrecord"),
        "train.per_core_batch_size": args.per_core_batch,
        "train.epochs": args.epochs,
        "train.steps_per_epoch": args.steps_per_epoch,
        "train.validation_steps": args.validation_steps,
        "train.steps_per_execution": args.steps_per_execution,
        "train.learning_rate.base": learning_rate(args),
        "train.learning_rate.base_batch_size": "null",  # the rate above, unscaled
    }
    cmd = [str(BIN / "tpurun"), "train", str(CONFIG), "--plain", "--output", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    _, wall = run_process(cmd, args, "tpurun train")
    summary = json.loads((out / "naic-like" / "summary.json").read_text())
    expected = {
        "status": "completed",
        "backend": args.backend,
        "replicas": args.devices,
        "global_batch_size": args.per_core_batch * args.devices,
        "steps_per_epoch": args.steps_per_epoch,
        "steps_per_execution": args.steps_per_execution,
    }
    for key, value in expected.items():
        if summary.get(key) != value:
            raise SystemExit(
                f"error: tpurun ran with {key}={summary.get(key)!r}, expected {value!r}; the two "
                "runs would not be comparable"
            )
    return {
        "epoch_seconds": summary["epoch_seconds"],
        "time_to_first_step": summary["time_to_first_step"],
        "wall_seconds": round(wall, 3),
        "val_accuracy": summary["final_metrics"].get("val_accuracy"),
    }


def run_baseline(args: argparse.Namespace, data: Path, out: Path) -> dict:
    cmd = [sys.executable, str(BASELINE), "--data", str(data), "--out", str(out)]
    cmd += ["--backend", args.backend, "--devices", str(args.devices)]
    cmd += ["--per-core-batch", str(args.per_core_batch), "--epochs", str(args.epochs)]
    cmd += ["--steps-per-epoch", str(args.steps_per_epoch)]
    cmd += ["--validation-steps", str(args.validation_steps)]
    cmd += ["--steps-per-execution", str(args.steps_per_execution)]
    cmd += ["--learning-rate", repr(learning_rate(args))]
    cmd += ["--launched-at", repr(time.monotonic())]
    stdout, wall = run_process(cmd, args, "the baseline script")
    result = json.loads(stdout.strip().splitlines()[-1])
    return {
        "epoch_seconds": result["epoch_seconds"],
        "time_to_first_step": result["time_to_first_step"],
        "process_to_first_step": result["process_to_first_step"],
        "wall_seconds": round(wall, 3),
        "val_accuracy": result["final_metrics"].get("val_accuracy"),
    }


# --------------------------------------------------------------------------------------- summary
def summarize(runs: list[dict]) -> dict:
    steady = [s for run in runs for s in run["epoch_seconds"][1:]]
    first = [run["time_to_first_step"] for run in runs]
    out = {
        "steady_epoch_median": statistics.median(steady),
        "steady_epoch_mean": statistics.fmean(steady),
        "first_epoch_median": statistics.median(run["epoch_seconds"][0] for run in runs),
        "time_to_first_step_median": statistics.median(first),
        "wall_seconds_median": statistics.median(run["wall_seconds"] for run in runs),
        "steady_epochs": len(steady),
    }
    if all("process_to_first_step" in run for run in runs):
        out["process_to_first_step_median"] = statistics.median(
            run["process_to_first_step"] for run in runs
        )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def print_table(result: dict) -> None:
    s = result["setup"]
    t, b = result["tpurun"], result["baseline"]
    print(
        f"\nNAIC-like MLP, {s['backend']}, {s['devices']} CPU devices, global batch "
        f"{s['global_batch_size']}, {s['steps_per_epoch']} steps/epoch (+{s['validation_steps']} "
        f"validation), steps_per_execution {s['steps_per_execution']}, {s['epochs']} epochs x "
        f"{s['repeats']} runs each; {t['steady_epochs']} steady epochs per side\n"
    )
    rows = [
        ("epoch seconds, steady, median", "steady_epoch_median"),
        ("epoch seconds, steady, mean", "steady_epoch_mean"),
        ("first epoch seconds (compiles), median", "first_epoch_median"),
        ("time to first step from fit start, median", "time_to_first_step_median"),
        ("process start to first step, median", "process_to_first_step_median"),
        ("process wall seconds, median", "wall_seconds_median"),
    ]

    def cell(value: float | None) -> str:
        return f"{value:10.3f}" if value is not None else f"{'n/a':>10s}"

    print(f"{'':44s}{'tpurun':>10s}{'baseline':>10s}{'ratio':>8s}")
    for label, key in rows:
        tv, bv = t.get(key), b.get(key)
        ratio = f"{tv / bv:8.3f}" if tv is not None and bv else ""
        print(f"{label:44s}{cell(tv)}{cell(bv)}{ratio}")
    verdict = "within" if result["ratio"] <= TARGET_RATIO else "ABOVE"
    print(
        f"\nratio tpurun/baseline of the median steady-state epoch: {result['ratio']:.3f} "
        f"({verdict} the {TARGET_RATIO} target)"
    )
    per_run = {
        kind: " ".join(f"{statistics.median(r['epoch_seconds'][1:]):.3f}" for r in runs)
        for kind, runs in result["runs"].items()
    }
    print(
        f"steady epoch median of each run (s): tpurun {per_run['tpurun']} | "
        f"baseline {per_run['baseline']}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    data = ensure_data(args)
    runs: dict[str, list[dict]] = {"tpurun": [], "baseline": []}
    for i in range(args.repeats):
        for kind, fn in (("tpurun", run_tpurun), ("baseline", run_baseline)):
            out = WORK / "runs" / f"{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
            result = fn(args, data, out)
            runs[kind].append(result)
            log(
                args,
                f"[{i + 1}/{args.repeats}] {kind:8s} epochs "
                + " ".join(f"{s:.2f}" for s in result["epoch_seconds"])
                + f" s, first step {result['time_to_first_step']:.2f} s, "
                f"wall {result['wall_seconds']:.1f} s, val_accuracy {result['val_accuracy']:.3f}",
            )
    tpurun, baseline = summarize(runs["tpurun"]), summarize(runs["baseline"])
    result = {
        "setup": {
            "backend": args.backend,
            "devices": args.devices,
            "per_core_batch_size": args.per_core_batch,
            "global_batch_size": args.per_core_batch * args.devices,
            "steps_per_epoch": args.steps_per_epoch,
            "validation_steps": args.validation_steps,
            "steps_per_execution": args.steps_per_execution,
            "epochs": args.epochs,
            "repeats": args.repeats,
            "cpu_count": os.cpu_count(),
        },
        "tpurun": tpurun,
        "baseline": baseline,
        "ratio": round(tpurun["steady_epoch_median"] / baseline["steady_epoch_median"], 4),
        "target_ratio": TARGET_RATIO,
        "runs": runs,
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
        print(f"({result['seconds']:.0f} s in all)")


if __name__ == "__main__":
    main()
