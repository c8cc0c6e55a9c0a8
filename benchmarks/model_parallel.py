"""Model parallelism on 8 simulated devices: `tpurun train` against a hand-written ``ModelParallel``
script, the cost of asynchronous sharded checkpoints, and the host's memory while a preset loads.

1. **Step time.** Both fully fine-tune (every weight trains) a Gemma-architecture preset larger
   than the tests' (built once into benchmarks/_work/, gitignored: 4 layers, hidden 256, 8 query
   and 4 key/value heads, ~4M parameters) on a 2 x 4 mesh, the weights split by the backbone's own
   ``get_layout_map``, on the text records benchmarks/finetune.py writes, with the same global
   batch, sequence length, steps, ``steps_per_execution``, Adam learning rate, loss and metrics.
   The hand-written script is what the KerasHub distribution guide writes: ``DeviceMesh``,
   ``GemmaBackbone.get_layout_map``, ``ModelParallel``, ``from_preset``, ``compile``, ``fit`` on a
   ``tf.data`` pipeline with the preset's preprocessor mapped over it, and ``TerminateOnNaN`` (it
   reads the loss after each execution, as tpurun's NaN check does). It is this file run with
   ``--hand``, a process that imports no tpurun. Goal: tpurun's step at most 1.03 x the script's.
2. **Checkpoint cost.** tpurun as above, and with ``callbacks.checkpoint.every_steps`` (a sharded
   Orbax checkpoint written in the background every N steps, and at each epoch's end). Goal: the
   asynchronous saves cost at most 2% of the step time. Every save of a checkpoint also blocks
   the step while the shards are copied off the devices: on a TPU that copy is a DMA to a host
   with many cores; here devices and host share 2 cores, so the figure is pessimistic.
3. **Host memory while loading** (a report, no goal). A larger preset (~63M parameters, 250 MB
   in float32) is built under a 1 x 8 mesh by tpurun's own path (``mesh_layout.install``, then the
   model built in the runtime's scope): the peak resident memory the load adds (``VmHWM``, reset
   just before it) against the weights' size. On simulated CPU devices the shards themselves
   live in host memory: a load that never holds the whole model on the host beside its shards
   adds about 1x the weights; one that builds all of them whole first adds 2x or more.

Each run is a fresh process; the runs alternate (tpurun, hand-written, tpurun with checkpoints,
...) so that load on the machine hits all three. A step's time is the median steady epoch (each
run's first epoch, which compiles, left out; ``on_epoch_begin`` to ``on_epoch_end``, as tpurun's
``epoch_seconds``) over its steps.

    .venv/bin/python benchmarks/model_parallel.py            # ~11 min on 2 cores
    .venv/bin/python benchmarks/model_parallel.py --json
"""

import time

PROCESS_START = time.monotonic()

# ruff: noqa: E402  (the clock starts before the heavy imports, and the backend is set before keras)
import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work" / "model_parallel"
BIN = Path(sys.executable).parent
STEP_GOAL = 1.03  # tpurun's step time over the hand-written script's, at most
CHECKPOINT_GOAL = 1.02  # with sharded checkpoints every N steps over without, at most
# The step-time model: big enough that a step is mostly arithmetic, not dispatch.
STEP_SIZES = {"num_layers": 4, "hidden_dim": 256, "intermediate_dim": 1024,
              "num_query_heads": 8, "num_key_value_heads": 4, "head_dim": 32}  # fmt: skip
# The loading model: big enough that its weights stand out of the process's own memory; as
# many key/value heads as the model axis of a 1 x 8 mesh (fewer would be indivisible).
LOAD_SIZES = {"num_layers": 6, "hidden_dim": 1024, "intermediate_dim": 4096,
              "num_query_heads": 8, "num_key_value_heads": 8, "head_dim": 128}  # fmt: skip

sys.path.insert(0, str(HERE))
from finetune import (  # the same records, runner, logs and hand-written fit
    cpu_devices,
    ensure_inputs,
    hand_fit,
    load_average,
    log,
    run,
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Model parallelism on 8 simulated devices: tpurun versus a hand-written "
        "ModelParallel script, the cost of sharded checkpoints, the host's memory while loading."
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--mesh", default="2x4", help="data x model (default 2x4)")
    p.add_argument("--per-core-batch", type=int, default=2, help="default 2 (global 16)")
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--steps-per-epoch", type=int, default=48)
    p.add_argument("--steps-per-execution", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=24, help="steps (default 24)")
    p.add_argument("--epochs", type=int, default=3, help="per run; the first is left out")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed per run")
    p.add_argument("--skip-memory", action="store_true", help="leave out the loading measurement")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    # The child processes' own modes (this file, in processes of their own).
    p.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build-preset", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    p.add_argument("--load-memory", help=argparse.SUPPRESS)
    p.add_argument("--init-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mesh_shape = tuple(int(n) for n in args.mesh.lower().split("x"))
    if len(args.mesh_shape) != 2 or args.mesh_shape[0] * args.mesh_shape[1] != args.devices:
        p.error(f"--mesh {args.mesh}: two sizes whose product is --devices ({args.devices})")
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch (compilation) is left out")
    return args


# ------------------------------------------------------------------------ the hand-written script
def hand(args: argparse.Namespace) -> None:
    """The full fine-tune under ModelParallel as a KerasHub user writes it; prints one JSON line."""
    cpu_devices(args.devices)
    import jax
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    mesh = keras.distribution.DeviceMesh(args.mesh_shape, ("batch", "model"),
                                         jax.devices("cpu")[: args.devices])  # fmt: skip
    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    hand_fit(args, keras_hub.models.GemmaCausalLM.from_preset(args.preset))


# ------------------------------------------------------------------- the host's memory, loading
def _memory_status(key: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"error: no {key} in /proc/self/status (Linux only)")


def load_memory(args: argparse.Namespace) -> None:
    """Build the preset under a 1 x N mesh by tpurun's own path; print the memory it took."""
    cpu_devices(args.devices)
    sys.path.insert(0, str(ROOT))
    from tpurun.config import load_config
    from tpurun.hub import mesh_layout
    from tpurun.hub.task_model import build_task
    from tpurun.plan.prepare import choose_for
    from tpurun.runtime.activate import activate
    from tpurun.runtime.machine import probe
    from tpurun.training.model import build_model

    config = load_config({
        "model": {"preset": args.load_memory},
        "data": {"train": os.path.join(args.data, "chat-*.tfrecord")},
        "runtime": {"backend": "jax", "accelerator": "cpu", "cpu_devices": args.devices,
                    "mesh": {"data": 1, "model": args.devices}, "layout": "preset"},
    })  # fmt: skip
    runtime = activate(choose_for(config, probe()), config.seed)
    mesh_layout.install(runtime, config)
    before = _memory_status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM (the peak) starts again from VmRSS
    with runtime.scope():
        if args.init_only:  # Keras' initialisation alone, the weights not read
            model = build_task(config, load_weights=False, compile=False)
        else:
            model = build_model(config, "jax", {})
    peak, after = _memory_status("VmHWM"), _memory_status("VmRSS")
    weights = sum(v.value.nbytes for v in model.weights)
    largest = max(v.value.nbytes for v in model.weights)
    sharded = sum(1 for v in model.weights if not v.value.sharding.is_fully_replicated)
    print(json.dumps({"weights_bytes": weights, "largest_weight_bytes": largest,
                      "variables": len(model.weights), "sharded_variables": sharded,
                      "rss_before": before, "rss_after": after, "peak": peak}))  # fmt: skip


# ------------------------------------------------------------------------------------ the driver
def ensure_preset(args: argparse.Namespace, name: str, sizes: dict) -> Path:
    folder = WORK / "presets" / name
    if not (folder / "model.weights.h5").exists():
        log(args, f"building the {name} preset into {folder} ...")
        shutil.rmtree(folder, ignore_errors=True)
        run([sys.executable, __file__, "--build-preset", str(folder), "--sizes", json.dumps(sizes)],
            args, f"building {name}")  # fmt: skip
    return folder


def build_preset(folder: str, sizes: dict) -> None:
    cpu_devices(1)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    from hub_presets import gemma

    from tpurun import frameworks

    frameworks.activated("jax")
    gemma(Path(folder), **sizes)


def run_tpurun(args, preset: Path, data: Path, out: Path, checkpoint_every: int | None) -> dict:
    data_axis, model_axis = args.mesh_shape
    checkpoint = {"every_steps": checkpoint_every} if checkpoint_every else None
    config = {
        "name": "mp",
        "seed": 0,
        "model": {"preset": str(preset), "sequence_length": args.sequence_length},
        "data": {"train": str(data / "chat-*.tfrecord")},
        "train": {
            "per_core_batch_size": args.per_core_batch,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "steps_per_execution": args.steps_per_execution,
            "learning_rate": {"base": args.learning_rate, "base_batch_size": None},
        },
        "runtime": {"backend": "jax", "accelerator": "cpu", "cpu_devices": args.devices,
                    "mesh": {"data": data_axis, "model": model_axis}, "layout": "preset"},
        "callbacks": {"checkpoint": checkpoint},
        "output": {"dir": str(out)},
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / "mp.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    _, wall = run([str(BIN / "tpurun"), "train", str(path), "--plain"], args, "tpurun train")
    summary = json.loads((out / "mp" / "summary.json").read_text())
    if summary.get("status") != "completed" or summary.get("global_batch_size") != (
        args.per_core_batch * args.devices
    ):
        raise SystemExit(f"error: tpurun's run is not comparable: {summary.get('status')}, "
                         f"global batch {summary.get('global_batch_size')}")  # fmt: skip
    saved = sorted(p.name for p in (out / "mp" / "checkpoints").glob("*.orbax"))
    if checkpoint_every and not saved:
        raise SystemExit("error: the run with checkpoints wrote no .orbax folder")
    header, *rows = (out / "mp" / "log.csv").read_text().splitlines()
    column = header.split(",").index("loss")
    losses = [float(row.split(",")[column]) for row in rows]
    return {"epoch_seconds": summary["epoch_seconds"], "loss": losses, "wall": wall,
            "checkpoints": saved}  # fmt: skip


def run_hand(args: argparse.Namespace, preset: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--hand", "--preset", str(preset), "--data", str(data),
           "--devices", str(args.devices), "--mesh", args.mesh,
           "--per-core-batch", str(args.per_core_batch),
           "--sequence-length", str(args.sequence_length),
           "--steps-per-epoch", str(args.steps_per_epoch),
           "--steps-per-execution", str(args.steps_per_execution),
           "--epochs", str(args.epochs), "--learning-rate", repr(args.learning_rate)]  # fmt: skip
    stdout, wall = run(cmd, args, "the hand-written script")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall": wall}


def step_seconds(args: argparse.Namespace, runs: list[dict]) -> dict:
    steady = [seconds for r in runs for seconds in r["epoch_seconds"][1:]]
    per_run = [statistics.median(r["epoch_seconds"][1:]) / args.steps_per_epoch for r in runs]
    return {
        "step_seconds": round(statistics.median(steady) / args.steps_per_epoch, 5),
        "step_seconds_per_run": [round(v, 5) for v in per_run],
        "first_epoch_median": round(statistics.median(r["epoch_seconds"][0] for r in runs), 2),
        "wall_median": round(statistics.median(r["wall"] for r in runs), 1),
        "steady_epochs": len(steady),
    }


def measure_loading(args: argparse.Namespace, data: Path) -> dict:
    preset = ensure_preset(args, "gemma_load", LOAD_SIZES)

    def child(*extra: str) -> dict:
        stdout, _ = run([sys.executable, __file__, "--load-memory", str(preset), "--data",
                         str(data), "--devices", str(args.devices), *extra], args,
                        "loading under a 1 x N mesh")  # fmt: skip
        figures = json.loads(stdout.strip().splitlines()[-1])
        return {**figures, "added": figures["peak"] - figures["rss_before"]}

    loaded, initialised = child(), child("--init-only")
    weights = loaded["weights_bytes"]
    return {
        **loaded,
        "init_added": initialised["added"],
        "peak_added_over_weights": round(loaded["added"] / weights, 3),
        "init_over_weights": round(initialised["added"] / weights, 3),
        "reading_over_weights": round((loaded["added"] - initialised["added"]) / weights, 3),
    }


def compare(args: argparse.Namespace, preset: Path, data: Path) -> dict:
    kinds = {
        "tpurun": lambda out: run_tpurun(args, preset, data, out, None),
        "hand": lambda out: run_hand(args, preset, data, out),
        "checkpoints": lambda out: run_tpurun(args, preset, data, out, args.checkpoint_every),
    }
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    loads = [load_average()]
    for i in range(args.repeats):
        for kind, fn in kinds.items():
            out = WORK / "runs" / f"{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
            result = fn(out)
            runs[kind].append(result)
            loads.append(load_average())
            log(args, f"[{i + 1}/{args.repeats}] {kind:11s} epochs "
                + " ".join(f"{s:.2f}" for s in result["epoch_seconds"])
                + f" s, loss {result['loss'][0]:.3f} -> {result['loss'][-1]:.3f}, wall "
                f"{result['wall']:.0f} s, load {loads[-1][0] if loads[-1] else '?'}")  # fmt: skip
    figures = {kind: step_seconds(args, runs[kind]) for kind in kinds}
    t, h, c = (figures[kind] for kind in kinds)
    return {
        **figures,
        "step_ratio": round(t["step_seconds"] / h["step_seconds"], 4),
        "checkpoint_ratio": round(c["step_seconds"] / t["step_seconds"], 4),
        # Each run against the one beside it, under about the same load.
        "paired_step_ratios": [round(a / b, 4) for a, b in zip(
            t["step_seconds_per_run"], h["step_seconds_per_run"], strict=True)],
        "paired_checkpoint_ratios": [round(a / b, 4) for a, b in zip(
            c["step_seconds_per_run"], t["step_seconds_per_run"], strict=True)],
        "checkpoints_per_run": runs["checkpoints"][0]["checkpoints"],
        "load_average_1m": [load[0] for load in loads if load],
        "runs": runs,
    }  # fmt: skip


def report(result: dict) -> None:
    s = result["setup"]
    print(f"\nFull fine-tune of a Gemma preset ({s['model']}) on a {s['mesh']} mesh of "
          f"{s['devices']} CPU devices, global batch {s['global_batch_size']} x "
          f"{s['sequence_length']} tokens, {s['steps_per_epoch']} steps/epoch, "
          f"steps_per_execution {s['steps_per_execution']}, {s['epochs']} epochs x "
          f"{s['repeats']} runs each\n")  # fmt: skip
    print(f"{'':32s}{'tpurun':>12s}{'hand':>12s}{'+ckpt':>12s}")
    for label, key in (("step seconds, steady median", "step_seconds"),
                       ("first epoch seconds, median", "first_epoch_median"),
                       ("process wall seconds, median", "wall_median")):  # fmt: skip
        row = "".join(f"{result[kind][key]:12,.4f}" for kind in ("tpurun", "hand", "checkpoints"))
        print(f"{label:32s}{row}")
    print(f"\nload average (1 min) between runs: {result['load_average_1m']}")
    print(
        "tpurun / hand-written step, run by run: "
        + " ".join(f"{r:.3f}" for r in result["paired_step_ratios"])
    )
    print(
        f"tpurun / hand-written step: {result['step_ratio']:.3f}  goal <= {STEP_GOAL}  "
        f"{'met' if result['step_ratio'] <= STEP_GOAL else 'MISSED'}"
    )
    print(
        f"checkpoints every {s['checkpoint_every']} steps ({', '.join(result['checkpoints_per_run'])} "
        "kept) / none, run by run: "
        + " ".join(f"{r:.3f}" for r in result["paired_checkpoint_ratios"])
    )
    print(
        f"with / without asynchronous checkpoints: {result['checkpoint_ratio']:.3f}  goal <= "
        f"{CHECKPOINT_GOAL}  {'met' if result['checkpoint_ratio'] <= CHECKPOINT_GOAL else 'MISSED'}"
    )
    memory = result.get("loading")
    if memory:
        mb = 1 << 20
        print(
            f"\nloading a {memory['weights_bytes'] / mb:,.0f} MB preset under a 1 x {s['devices']} "
            f"mesh ({memory['sharded_variables']} of {memory['variables']} variables split; "
            f"largest {memory['largest_weight_bytes'] / mb:,.0f} MB): the host's peak rose "
            f"{memory['added'] / mb:,.0f} MB ({memory['peak_added_over_weights']:.2f} x the "
            f"weights; the shards, on simulated devices, are in it): Keras' random "
            f"initialisation {memory['init_over_weights']:.2f} x, reading the weights "
            f"{memory['reading_over_weights']:.2f} x"
        )
    print(f"\n({result['seconds']:.0f} s in all)")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hand:
        return hand(args)
    if args.build_preset:
        return build_preset(args.build_preset, json.loads(args.sizes))
    if args.load_memory:
        return load_memory(args)
    started = time.monotonic()
    _, data = ensure_inputs(args)  # benchmarks/finetune.py's records of text
    preset = ensure_preset(args, "gemma_step", STEP_SIZES)
    result = {
        "setup": {
            "devices": args.devices,
            "mesh": args.mesh,
            "model": ", ".join(f"{k} {v}" for k, v in STEP_SIZES.items()),
            "per_core_batch_size": args.per_core_batch,
            "global_batch_size": args.per_core_batch * args.devices,
            "sequence_length": args.sequence_length,
            "steps_per_epoch": args.steps_per_epoch,
            "steps_per_execution": args.steps_per_execution,
            "checkpoint_every": args.checkpoint_every,
            "epochs": args.epochs,
            "repeats": args.repeats,
            "cpu_count": os.cpu_count(),
        },
        **compare(args, preset, data),
    }
    if not args.skip_memory:
        result["loading"] = measure_loading(args, data)
    result["step_goal"], result["checkpoint_goal"] = STEP_GOAL, CHECKPOINT_GOAL
    result["met"] = (result["step_ratio"] <= STEP_GOAL
                     and result["checkpoint_ratio"] <= CHECKPOINT_GOAL)  # fmt: skip
    result["seconds"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        report(result)


if __name__ == "__main__":
    main()
