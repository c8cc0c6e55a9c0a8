"""Start-up, per-epoch and whole-process time of `tpurun train` against hand-written Keras 3 scripts.

Both train the NAIC-like example (configs/naic_like.yaml: the MLP of configs/models/recognizer.py
on 1024 raw float32 features) on the same data, backend, simulated CPU devices, global batch,
steps per epoch, steps_per_execution and learning rate, with an equally good tf.data pipeline and
the per-epoch callbacks a hand-written script has (checkpoint, CSV log, LR plateau). The baseline
is benchmarks/baseline_keras.py. Each run is a fresh subprocess; the runs alternate (tpurun,
baseline, tpurun, ...) so that load on the machine hits both.

A third program, the *naive* script, is the same hand-written script without
``steps_per_execution`` (one step per call into the compiled function), as a notebook recipe has it.

Other tpurun programs can run beside, in the same rotation, each its own kind:

* ``--before ROOT``: the tpurun of another checkout (a ``git worktree`` of an older commit), run by
  this interpreter's ``tpurun`` with ``PYTHONPATH=ROOT`` and ROOT's own config; the script checks
  first that ``import tpurun`` finds ROOT's code that way (and this checkout's without it);
* ``--reader R``: this checkout's tpurun again with ``data.reader: R`` (``auto``, what the config
  says, is the main kind; ``native`` on a machine where TensorFlow is installed, say);
* ``--venv DIR``: this checkout's tpurun run by another environment's ``DIR/bin/tpurun`` (the
  ``.venv-jax`` without TensorFlow, say).

JAX's compilation cache (``runtime.compilation_cache``): this checkout's tpurun keeps compiled
programs between launches, so it runs twice: ``tpurun`` with a *warm* cache (its own folder in
benchmarks/_work/, filled by one untimed run first: every launch after a user's first) and
``tpurun:cold`` with the folder emptied before each run (a first launch). The ``--reader`` and
``--venv`` kinds run warm; ``before`` runs as its checkout would (no cache unless it has the key),
and the hand-written scripts run without one (the suite's or the user's JAX cache variables are
removed from every child's environment).

Reported, with the goals of the first-hour issue and of issue 25:

* the time to the first step, from the launch of the process (tpurun: when its ``compiled:`` line
  reaches the pipe; the scripts: ``on_train_batch_end``, on the same monotonic clock): tpurun may
  take at most 1 s more than the hand-written script, and (with ``--before``) at most 0.6 of the
  older tpurun's;
* the median steady-state epoch (each run's first epoch, which compiles, left out), tpurun over
  the hand-written script: at most 1.02;
* each process's wall time (start-up, data checks, model building, checkpoint writes and the exit
  included), tpurun over the naive script: at most 0.7.

    .venv/bin/python benchmarks/runner_overhead.py                 # JAX, 8 CPU devices, ~3 min
    .venv/bin/python benchmarks/runner_overhead.py --backend tensorflow --json
    git worktree add /tmp/before COMMIT
    .venv/bin/python benchmarks/runner_overhead.py --before /tmp/before --reader native \
        --venv .venv-jax                                           # ~8 min

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
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
CONFIG = ROOT / "configs" / "naic_like.yaml"
GENERATOR = ROOT / "configs" / "data" / "make_naic_like.py"
BASELINE = HERE / "baseline_keras.py"
BIN = Path(sys.executable).parent
TARGET_RATIO = 1.02  # steady epoch, tpurun / hand-written
FIRST_STEP_GOAL = 1.0  # seconds more than the hand-written script, from the launch
WHOLE_PROCESS_GOAL = 0.7  # tpurun's wall time / the naive script's
BEFORE_FIRST_STEP_GOAL = 0.6  # tpurun's time to the first step / the older checkout's
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
    p.add_argument(
        "--before",
        metavar="ROOT",
        type=Path,
        help="also run the tpurun of the checkout at ROOT (PYTHONPATH=ROOT), e.g. a git worktree",
    )
    p.add_argument(
        "--reader",
        action="append",
        default=[],
        choices=["native", "tf_data"],
        help="also run this checkout's tpurun with data.reader set so (repeatable)",
    )
    p.add_argument(
        "--venv",
        action="append",
        default=[],
        type=Path,
        help="also run this checkout's tpurun through DIR/bin/tpurun (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if args.before is not None and not (args.before / "tpurun" / "__init__.py").is_file():
        p.error(f"--before {args.before}: no tpurun package there")
    for venv in args.venv:
        if not (venv / "bin" / "tpurun").is_file():
            p.error(f"--venv {venv}: no bin/tpurun there")
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
@dataclass(frozen=True)
class Program:
    """One tpurun to time: the console script that runs it, the checkout whose code and config it
    runs, and the settings it adds to the config."""

    kind: str
    script: Path
    root: Path = ROOT
    sets: dict = field(default_factory=dict)
    cache: str | None = "warm"  # JAX's compilation cache: warm, cold (emptied each run) or none

    @property
    def cache_folder(self) -> Path | None:
        """Its own compilation cache (None for a tpurun that has none: it would not use it)."""
        return None if self.cache is None else WORK / "jax-cache" / self.kind.replace(":", "-")

    @property
    def pythonpath(self) -> str | None:
        """``PYTHONPATH`` for another checkout's code (the console script's own install else)."""
        return None if self.root == ROOT else str(self.root)


def programs(args: argparse.Namespace) -> list[Program]:
    """The tpurun programs of the run: this checkout's first (the goals' tpurun)."""
    found = [
        Program("tpurun", BIN / "tpurun"),
        Program("tpurun:cold", BIN / "tpurun", cache="cold"),
    ]
    found += [Program(f"tpurun:{r}", BIN / "tpurun", sets={"data.reader": r}) for r in args.reader]
    found += [Program(f"tpurun:{v.name}", v.resolve() / "bin" / "tpurun") for v in args.venv]
    if args.before is not None:
        before = args.before.resolve()
        has_cache = "compilation_cache" in (before / "tpurun/config/schema.py").read_text()
        found.append(Program("before", BIN / "tpurun", root=before,
                             cache="warm" if has_cache else None))  # fmt: skip
    return found


def check_code(program: Program) -> str:
    """The ``tpurun`` package ``program`` imports; exits unless it is its checkout's."""
    python = program.script.parent / "python"
    cmd = [str(python), "-c", "import tpurun; print(tpurun.__file__)"]
    # From "/", so that no checkout is the current folder (which `python -c` puts first).
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd="/",
                          env=child_env(program.pythonpath))  # fmt: skip
    found = Path(proc.stdout.strip() or "?").resolve()
    if proc.returncode != 0 or found != (program.root / "tpurun" / "__init__.py").resolve():
        raise SystemExit(
            f"error: {program.kind} should run the code of {program.root}, and {python} imports "
            f"{found} there: {proc.stderr.strip()[-300:]}"
        )
    return str(found)


def child_env(pythonpath: str | None = None, cache: Path | None = None) -> dict[str, str]:
    """The parent's environment without settings that would pick a backend or devices or the
    code or a compilation cache; ``pythonpath``: the checkout whose tpurun a child runs (else its
    install's); ``cache``: the JAX compilation cache folder it keeps (None: none)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS", "TPURUN_PLAIN", "PYTHONPATH")
        and not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))
    }
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["TPURUN_CACHE_DIR"] = str(WORK / "cache")  # record counts; keeps ~/.cache out of it
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def learning_rate(args: argparse.Namespace) -> float:
    # The example's rule: 1e-3 for a global batch of 128, scaled linearly.
    return 1e-3 * args.per_core_batch * args.devices / 128


def run_process(
    cmd: list[str],
    args: argparse.Namespace,
    what: str,
    marker: str | None = None,
    pythonpath: str | None = None,
    cache: Path | None = None,
) -> tuple[str, float, float | None]:
    """Run ``cmd``; return its stdout, its wall seconds, and the seconds from the launch until a
    stdout line containing ``marker`` arrived (None without a marker)."""
    started = time.monotonic()
    seen = None
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                env=child_env(pythonpath, cache), cwd=ROOT)  # fmt: skip
        timer = threading.Timer(args.timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                if marker and seen is None and marker in line:
                    seen = time.monotonic() - started
                lines.append(line)
            proc.wait()
        finally:
            timer.cancel()
        wall = time.monotonic() - started
        err.seek(0)
        stderr = err.read()
    if wall >= args.timeout:
        raise SystemExit(f"error: {what} took more than {args.timeout:g}s: {' '.join(cmd)}")
    if proc.returncode != 0:
        tail = "\n".join((stderr or "".join(lines)).strip().splitlines()[-15:])
        raise SystemExit(f"error: {what} failed (exit {proc.returncode}):\n{tail}")
    return "".join(lines), wall, seen


def run_tpurun(args: argparse.Namespace, data: Path, out: Path, program: Program) -> dict:
    """`tpurun train configs/naic_like.yaml` (``program``'s checkout's) with the benchmark's
    sizes; reads its summary.json."""
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
        **program.sets,
    }
    config = program.root / CONFIG.relative_to(ROOT)
    cmd = [str(program.script), "train", str(config), "--plain", "--output", str(out)]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    # The plain reporter prints (and flushes) this line when the first step has finished.
    if program.cache == "cold":
        shutil.rmtree(program.cache_folder, ignore_errors=True)
    stdout, wall, first = run_process(cmd, args, f"{program.kind} train", marker="compiled:",
                                      pythonpath=program.pythonpath,
                                      cache=program.cache_folder)  # fmt: skip
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
        "process_to_first_step": round(first, 3),
        "wall_seconds": round(wall, 3),
        "val_accuracy": summary["final_metrics"].get("val_accuracy"),
        # What read the records, as the start line says it (older versions: tf.data, unsaid).
        "reader": start_line_reader(stdout),
    }


def start_line_reader(stdout: str) -> str | None:
    """``native (TensorFlow is not installed)`` from the start line's ``, reader: ... -> RUN``;
    None for a tpurun that does not say (before the native reader: tf.data)."""
    for line in stdout.splitlines():
        if ", reader: " in line:
            return line.split(", reader: ", 1)[1].split(" -> ", 1)[0].strip()
    return None


def run_baseline(args: argparse.Namespace, data: Path, out: Path, naive: bool = False) -> dict:
    """The hand-written script; ``naive``: as a notebook recipe has it, with no
    ``steps_per_execution`` (one step per call into the compiled function)."""
    cmd = [sys.executable, str(BASELINE), "--data", str(data), "--out", str(out)]
    cmd += ["--backend", args.backend, "--devices", str(args.devices)]
    cmd += ["--per-core-batch", str(args.per_core_batch), "--epochs", str(args.epochs)]
    cmd += ["--steps-per-epoch", str(args.steps_per_epoch)]
    cmd += ["--validation-steps", str(args.validation_steps)]
    cmd += ["--steps-per-execution", "1" if naive else str(args.steps_per_execution)]
    cmd += ["--learning-rate", repr(learning_rate(args))]
    cmd += ["--launched-at", repr(time.monotonic())]
    stdout, wall, _ = run_process(cmd, args, "the baseline script")
    result = json.loads(stdout.strip().splitlines()[-1])
    return {
        "epoch_seconds": result["epoch_seconds"],
        "time_to_first_step": result["time_to_first_step"],
        "process_to_first_step": result["process_to_first_step"],
        "wall_seconds": round(wall, 3),
        "val_accuracy": result["final_metrics"].get("val_accuracy"),
    }


def run_naive(args: argparse.Namespace, data: Path, out: Path) -> dict:
    return run_baseline(args, data, out, naive=True)


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
    out["process_to_first_step_median"] = statistics.median(
        run["process_to_first_step"] for run in runs
    )
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def goals(summaries: dict[str, dict]) -> list[tuple[str, float, str, bool]]:
    """The start-up and overhead goals, for each tpurun program: (what, measured, goal, met)."""
    b, n = summaries["baseline"], summaries["naive"]
    before = summaries.get("before")
    out = []
    for kind, t in summaries.items():
        if not kind.startswith("tpurun"):
            continue
        first = t["process_to_first_step_median"] - b["process_to_first_step_median"]
        epoch = t["steady_epoch_median"] / b["steady_epoch_median"]
        whole = t["wall_seconds_median"] / n["wall_seconds_median"]
        out += [
            (f"{kind}: time to first step - hand-written (s)", first, f"<= +{FIRST_STEP_GOAL:g}",
             first <= FIRST_STEP_GOAL),
            (f"{kind}: steady epoch / hand-written", epoch, f"<= {TARGET_RATIO}",
             epoch <= TARGET_RATIO),
            (f"{kind}: whole process / naive script", whole, f"<= {WHOLE_PROCESS_GOAL}",
             whole <= WHOLE_PROCESS_GOAL),
        ]  # fmt: skip
        if before is not None:
            ratio = t["process_to_first_step_median"] / before["process_to_first_step_median"]
            out.append((f"{kind}: time to first step / before", ratio,
                        f"<= {BEFORE_FIRST_STEP_GOAL}", ratio <= BEFORE_FIRST_STEP_GOAL))  # fmt: skip
    return out


ROWS = (
    ("epoch seconds, steady, median", "steady_epoch_median"),
    ("epoch seconds, steady, mean", "steady_epoch_mean"),
    ("first epoch seconds (compiles), median", "first_epoch_median"),
    ("time to first step from fit start, median", "time_to_first_step_median"),
    ("process start to first step, median", "process_to_first_step_median"),
    ("process wall seconds, median", "wall_seconds_median"),
)


def print_table(result: dict) -> None:
    s = result["setup"]
    summaries = result["summaries"]
    print(
        f"\nNAIC-like MLP, {s['backend']}, {s['devices']} CPU devices, global batch "
        f"{s['global_batch_size']}, {s['steps_per_epoch']} steps/epoch (+{s['validation_steps']} "
        f"validation), steps_per_execution {s['steps_per_execution']} (naive: 1), {s['epochs']} "
        f"epochs x {s['repeats']} runs each, in rotation; load average {s['loadavg_start']} at "
        f"start, {s['loadavg_end']} at end\n"
    )
    for kind, code in s["code"].items():
        readers = sorted({str(r["reader"] or "tf_data (not said)") for r in result["runs"][kind]})
        print(f"  {kind}: {code}; reader: {', '.join(readers)}")
    print()
    kinds = list(summaries)
    width = max(10, *(len(k) + 2 for k in kinds))
    print(f"{'seconds':44s}" + "".join(f"{k:>{width}s}" for k in kinds))
    for label, key in ROWS:
        print(f"{label:44s}" + "".join(f"{summaries[k][key]:{width}.3f}" for k in kinds))
    print()
    tpuruns = [k for k in kinds if k.startswith("tpurun") or k == "before"]
    print(f"{'ratios':44s}" + "".join(f"{k:>{width}s}" for k in tpuruns))
    ratio_rows = [
        ("steady epoch / hand-written", "steady_epoch_median", "baseline"),
        ("first step from launch / hand-written", "process_to_first_step_median", "baseline"),
        ("whole process / naive script", "wall_seconds_median", "naive"),
    ]
    if "before" in summaries:
        ratio_rows += [
            ("first step from launch / before", "process_to_first_step_median", "before"),
            ("whole process / before", "wall_seconds_median", "before"),
        ]
    for label, key, base in ratio_rows:
        values = (summaries[k][key] / summaries[base][key] for k in tpuruns)
        print(f"{label:44s}" + "".join(f"{v:{width}.3f}" for v in values))
    print()
    for what, measured, goal, met in result["goals"]:
        value = f"{measured:+8.3f}" if what.endswith("(s)") else f"{measured:8.3f}"
        print(f"{what:56s}{value}  goal {goal:7s} {'met' if met else 'MISSED'}")
    print("\nper run: steady epoch median / first step from launch / wall (s)")
    for kind, runs in result["runs"].items():
        cells = (
            f"{statistics.median(r['epoch_seconds'][1:]):.3f}/{r['process_to_first_step']:.2f}/"
            f"{r['wall_seconds']:.1f}"
            for r in runs
        )
        print(f"  {kind:18s} " + "  ".join(cells))


def run_all(args: argparse.Namespace, data: Path, tpuruns: list[Program]) -> dict[str, list]:
    """Each kind ``--repeats`` times, rotating the order each round."""
    kinds = {p.kind: (lambda a, d, o, p=p: run_tpurun(a, d, o, p)) for p in tpuruns}
    kinds.update(baseline=run_baseline, naive=run_naive)
    names = list(kinds)
    runs: dict[str, list[dict]] = {kind: [] for kind in names}
    for program in tpuruns:  # a warm cache holds what a first launch compiled: one, untimed
        if program.cache == "warm":
            shutil.rmtree(program.cache_folder, ignore_errors=True)
            out = WORK / "runs" / f"{program.kind.replace(':', '-')}-warm-up"
            shutil.rmtree(out, ignore_errors=True)
            run_tpurun(args, data, out, program)
            log(args, f"[warm-up] {program.kind}: its compilation cache filled, untimed")
    for i in range(args.repeats):
        turn = i % len(names)
        for kind in names[turn:] + names[:turn]:
            out = WORK / "runs" / f"{kind.replace(':', '-')}-{i}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
            result = kinds[kind](args, data, out)
            runs[kind].append(result)
            log(
                args,
                f"[{i + 1}/{args.repeats}] {kind:16s} epochs "
                + " ".join(f"{s:.2f}" for s in result["epoch_seconds"])
                + f" s, first step {result['process_to_first_step']:.2f} s after launch, "
                f"wall {result['wall_seconds']:.1f} s, val_accuracy {result['val_accuracy']:.3f}",
            )
    return runs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.monotonic()
    tpuruns = programs(args)
    code = {p.kind: check_code(p) for p in tpuruns}
    data = ensure_data(args)
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    runs = run_all(args, data, tpuruns)
    summaries = {kind: summarize(kind_runs) for kind, kind_runs in runs.items()}
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
            "loadavg_start": loadavg_start,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "code": code,
        },
        "summaries": summaries,
        "ratio": round(
            summaries["tpurun"]["steady_epoch_median"]
            / summaries["baseline"]["steady_epoch_median"],
            4,
        ),
        "goals": [(what, round(m, 4), goal, met) for what, m, goal, met in goals(summaries)],
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
