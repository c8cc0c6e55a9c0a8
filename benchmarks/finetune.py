"""A LoRA fine-tune of a KerasHub causal LM: `tpurun train` against a hand-written KerasHub script.

Both fine-tune the tiny Gemma preset of tests/hub_presets.py (built once into benchmarks/_work/,
which is gitignored) with LoRA rank 4, on the same TFRecords of text (written once by
`tpurun data write`), on the same simulated CPU devices (``--xla_force_host_platform_device_count``,
JAX, ``keras.distribution.DataParallel``), with the same global batch, sequence length, steps,
``steps_per_execution``, learning rate, loss and metrics. The hand-written script is what the
KerasHub guides write: ``GemmaCausalLM.from_preset``, ``backbone.enable_lora(4)``, ``compile``,
and ``fit`` on a ``tf.data`` pipeline of the records with the preset's preprocessor mapped over
them (the records read, shuffled and batched as well as tpurun reads them), and Keras'
``TerminateOnNaN``, which reads the loss after every execution as tpurun's NaN check does. It is
this file, run with ``--hand``: a separate process that imports no tpurun.

Without any read of the loss during an epoch (``--no-loss-reads``), JAX queues executions up
asynchronously; on 8 simulated CPU devices sharing 2 cores, their all-reduces then deadlocked
here (twice in a dozen runs: a hang, and XLA's abort of a stuck collective).

Each run is a fresh process; the runs alternate (tpurun, hand-written, tpurun, ...) so that load
on the machine hits both. Tokens per second are counted over the steady-state epochs only (each
run's first epoch, which compiles, is left out) as positions trained: steps x global batch x
sequence length per second of epoch (``on_epoch_begin`` to ``on_epoch_end`` of a callback first
in the list, as tpurun's ``epoch_seconds``). Goal: tpurun at least 0.97 of the hand-written
script.

    .venv/bin/python benchmarks/finetune.py            # 8 CPU devices, ~4 min on 2 cores
    .venv/bin/python benchmarks/finetune.py --json

``--packing`` measures something else: `tpurun train` on chat records of mixed lengths (1 to 6
question/answer exchanges, 33 to ~200 tokens, in a 256-token sequence), written by `tpurun data
write --tokenize` unpacked and with ``--packing``, one epoch a pass over every example. It prints
the padding share of each, positions/s (every position a step computes) and tokens/s (the
examples' own tokens, padding left out) over the steady epochs, and the packed run's tokens/s over
the unpacked run's.

    .venv/bin/python benchmarks/finetune.py --packing  # 2 CPU devices, ~5 min on 2 cores
"""

import time

PROCESS_START = time.monotonic()

# ruff: noqa: E402  (the clock starts before the heavy imports, and the backend is set before keras)
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work" / "finetune"
BIN = Path(sys.executable).parent
GOAL = 0.97  # tpurun's tokens/s over the hand-written script's
RECORDS = 2048


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Tokens/s of a LoRA fine-tune: `tpurun train` versus a hand-written script."
    )
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    p.add_argument("--per-core-batch", type=int, default=8, help="default 8 (global 64)")
    p.add_argument("--sequence-length", type=int, default=128)
    p.add_argument("--steps-per-epoch", type=int, default=32)
    p.add_argument("--steps-per-execution", type=int, default=8)
    p.add_argument("--epochs", type=int, default=4, help="per run; the first is left out")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (default 3)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--no-loss-reads",
        action="store_true",
        help="the hand-written script without TerminateOnNaN: nothing reads the loss during an "
        "epoch (executions queue up; on simulated CPU devices this can deadlock)",
    )
    # The hand-written script's own arguments (it is this file, in a process of its own).
    p.add_argument(
        "--packing",
        action="store_true",
        help="tokens/s and padding of chat records packed and unpacked (see above)",
    )
    p.add_argument("--hand", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.epochs < 2:
        p.error("--epochs must be at least 2: the first epoch (compilation) is left out")
    return args


# ------------------------------------------------------------------------ the hand-written script
def cpu_devices(n: int) -> None:
    """This process on JAX with ``n`` simulated CPU devices (before keras is imported)."""
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")  # tf.data's only: the model is JAX's


def hand(args: argparse.Namespace) -> None:
    """The fine-tune as a KerasHub user writes it, timed; prints one JSON line."""
    cpu_devices(args.devices)
    import jax
    import keras
    import keras_hub

    devices = jax.devices("cpu")[: args.devices]
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    keras.utils.set_random_seed(args.seed)
    model = keras_hub.models.GemmaCausalLM.from_preset(args.preset)
    model.backbone.enable_lora(rank=4)
    hand_fit(args, model, loss_reads=not args.no_loss_reads)


def hand_fit(args: argparse.Namespace, model, loss_reads: bool = True) -> None:
    """Compile and fit a KerasHub causal LM as its guides write it, on a ``tf.data`` pipeline of
    the text records with the preset's preprocessor mapped over it (read, shuffled and batched as
    well as tpurun reads them); prints one JSON line: the epochs' seconds and losses. Shared by
    the hand-written scripts of this file and of benchmarks/model_parallel.py."""
    import keras
    import keras_hub
    import tensorflow as tf

    seed = getattr(args, "seed", 0)

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.begin = time.monotonic()

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_seconds.append(time.monotonic() - self.begin)

    preprocessor = model.preprocessor
    preprocessor.sequence_length = args.sequence_length
    model.preprocessor = None  # the pipeline below runs it; fit must not map it again
    model.compile(
        optimizer=keras.optimizers.Adam(args.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[
            keras.metrics.SparseCategoricalAccuracy(),
            keras_hub.metrics.Perplexity(from_logits=True, name="perplexity"),
        ],
        steps_per_execution=args.steps_per_execution,
    )
    files = sorted(glob.glob(os.path.join(args.data, "chat-*.tfrecord")))
    spec = {"text": tf.io.FixedLenFeature([], tf.string)}

    def parse(serialized):
        return preprocessor(tf.io.parse_example(serialized, spec)["text"])

    autotune = tf.data.AUTOTUNE
    ds = tf.data.Dataset.from_tensor_slices(files).shuffle(len(files), seed=seed).repeat()
    ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=len(files), num_parallel_calls=2)
    ds = ds.shuffle(10000, seed=seed).batch(args.per_core_batch * args.devices, True)
    ds = ds.map(parse, num_parallel_calls=autotune).prefetch(autotune)
    timer = Timer()
    callbacks = [timer]
    if loss_reads:
        # Reads the loss after every execution, as tpurun's NaN check does (and Keras' progress
        # bar). Without any such read, executions queue up asynchronously, and on simulated CPU
        # devices their collectives can deadlock (seen here: a hang, and XLA's abort of a stuck
        # all-reduce).
        callbacks.append(keras.callbacks.TerminateOnNaN())
    history = model.fit(
        ds, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, callbacks=callbacks, verbose=0
    )
    print(json.dumps({"epoch_seconds": timer.epoch_seconds,
                      "loss": [float(v) for v in history.history["loss"]]}))  # fmt: skip


# ------------------------------------------------------------------------------------ the driver
def log(args: argparse.Namespace, message: str) -> None:
    print(message, file=sys.stderr if args.json else sys.stdout, flush=True)


def child_env() -> dict[str, str]:
    """The parent's environment without settings that would pick a backend or devices."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS", "TPURUN_PLAIN")
    }
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    # 8 simulated devices on a loaded 2-core machine: a device thread starved for long enough
    # makes XLA abort the collective it waits in (AwaitAndLogIfStuck). Both sides wait instead.
    env["XLA_FLAGS"] = "--xla_cpu_collective_call_terminate_timeout_seconds=900"
    env["TPURUN_CACHE_DIR"] = str(WORK / "cache")
    return env


def run(cmd: list[str], args: argparse.Namespace, what: str) -> tuple[str, float]:
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT,
                              timeout=args.timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"error: {what} took more than {args.timeout:g}s: {' '.join(cmd)}"
        ) from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise SystemExit(f"error: {what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout, time.monotonic() - started


def ensure_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    """The tiny Gemma preset and the text records, made once."""
    preset = WORK / "presets" / "tiny_gemma"
    if not (preset / "model.weights.h5").exists():
        log(args, f"building the tiny presets into {preset.parent} ...")
        run([sys.executable, str(ROOT / "tests" / "hub_presets.py"), str(preset.parent)], args,
            "tests/hub_presets.py")  # fmt: skip
    data = WORK / "data"
    if not (data / "chat.schema.json").exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from hub_presets import prompt_response_pairs, sentences

        # Question, answer and a few more sentences: ~100-130 tokens of the tiny vocabulary,
        # so that most records fill a 128-token sequence.
        extra = sentences(RECORDS, seed=5)
        rows = [
            {"text": f"{p} {r} {extra[i]} {extra[i - 1]} {extra[i - 2]}"}
            for i, (p, r) in enumerate(prompt_response_pairs(RECORDS, seed=4))
        ]
        data.mkdir(parents=True, exist_ok=True)
        source = WORK / "chat.jsonl"
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
        run([str(BIN / "tpurun"), "data", "write", str(source), str(data / "chat"),
             "--overwrite", "--plain"], args, "tpurun data write")  # fmt: skip
    return preset, data


def run_tpurun(args: argparse.Namespace, preset: Path, data: Path, out: Path) -> dict:
    config = {
        "name": "finetune",
        "seed": 0,
        "model": {
            "preset": str(preset),
            "lora": {"rank": 4},
            "sequence_length": args.sequence_length,
        },  # fmt: skip
        "data": {"train": str(data / "chat-*.tfrecord")},
        "train": {
            "per_core_batch_size": args.per_core_batch,
            "epochs": args.epochs,
            "steps_per_epoch": args.steps_per_epoch,
            "steps_per_execution": args.steps_per_execution,
            "learning_rate": {"base": args.learning_rate, "base_batch_size": None},
        },
        "runtime": {"backend": "jax", "accelerator": "cpu", "cpu_devices": args.devices},
        "output": {"dir": str(out)},
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / "finetune.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    _, wall = run([str(BIN / "tpurun"), "train", str(path), "--plain"], args, "tpurun train")
    summary = json.loads((out / "finetune" / "summary.json").read_text())
    expected = {"status": "completed", "replicas": args.devices,
                "global_batch_size": args.per_core_batch * args.devices,
                "steps_per_epoch": args.steps_per_epoch,
                "steps_per_execution": args.steps_per_execution}  # fmt: skip
    for key, value in expected.items():
        if summary.get(key) != value:
            raise SystemExit(f"error: tpurun ran with {key}={summary.get(key)!r}, expected "
                             f"{value!r}; the two runs would not be comparable")  # fmt: skip
    log_csv = (out / "finetune" / "log.csv").read_text().splitlines()
    header = log_csv[0].split(",")
    losses = [float(line.split(",")[header.index("loss")]) for line in log_csv[1:]]
    return {"epoch_seconds": summary["epoch_seconds"], "loss": losses, "wall": wall}


def run_hand(args: argparse.Namespace, preset: Path, data: Path, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hand", "--preset", str(preset),
           "--data", str(data), "--devices", str(args.devices),
           "--per-core-batch", str(args.per_core_batch),
           "--sequence-length", str(args.sequence_length),
           "--steps-per-epoch", str(args.steps_per_epoch),
           "--steps-per-execution", str(args.steps_per_execution),
           "--epochs", str(args.epochs), "--learning-rate", repr(args.learning_rate),
           *(["--no-loss-reads"] if args.no_loss_reads else [])]  # fmt: skip
    stdout, wall = run(cmd, args, "the hand-written script")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall": wall}


def tokens_per_second(args: argparse.Namespace, runs: list[dict]) -> dict:
    tokens = args.steps_per_epoch * args.per_core_batch * args.devices * args.sequence_length
    steady = [seconds for r in runs for seconds in r["epoch_seconds"][1:]]
    per_run = [tokens / statistics.median(r["epoch_seconds"][1:]) for r in runs]
    return {
        "tokens_per_sec": round(tokens / statistics.median(steady), 1),
        "tokens_per_sec_per_run": [round(v, 1) for v in per_run],
        "steady_epoch_median": round(statistics.median(steady), 4),
        "first_epoch_median": round(statistics.median(r["epoch_seconds"][0] for r in runs), 3),
        "wall_median": round(statistics.median(r["wall"] for r in runs), 2),
        "steady_epochs": len(steady),
    }


def load_average() -> list[float]:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return []


# ------------------------------------------------------------------------- --packing: chat data
CHAT_PRESET = """import os, sys
os.environ.setdefault("KERAS_BACKEND", "jax"); os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, "tests")
from pathlib import Path
from tpurun import frameworks
frameworks.activated("jax")
from hub_presets import chat_gemma
chat_gemma(Path(sys.argv[1]))
"""
CHAT = {"conversations": 1024, "most_turns": 6, "sequence_length": 256, "devices": 2,
        "per_core_batch": 8, "epochs": 3}  # fmt: skip


def ensure_chat(args: argparse.Namespace) -> tuple[Path, Path]:
    """The tiny Gemma with Gemma's turn markers, and the chat records written twice."""
    preset = WORK / "presets" / "tiny_gemma_chat"
    if not (preset / "model.weights.h5").exists():
        log(args, f"building the chat preset into {preset} ...")
        run([sys.executable, "-c", CHAT_PRESET, str(preset)], args, "the chat preset")
    data, source = WORK / "chat-data", WORK / "chat-messages.jsonl"
    if not source.exists():
        sys.path.insert(0, str(ROOT / "tests"))
        from hub_presets import conversations

        rows = conversations(CHAT["conversations"], seed=6, most_turns=CHAT["most_turns"])
        source.write_text("".join(json.dumps({"messages": t}) + "\n" for t in rows))
    for name, extra in (("unpacked", []), ("packed", ["--packing"])):
        if not (data / f"{name}.schema.json").exists():
            run([str(BIN / "tpurun"), "data", "write", str(source), str(data / name),
                 "--tokenize", str(preset), "--sequence-length", str(CHAT["sequence_length"]),
                 "--overwrite", "--plain", *extra], args, "tpurun data write")  # fmt: skip
    return preset, data


def run_chat(args: argparse.Namespace, preset: Path, data: Path, name: str, i: int) -> dict:
    out = WORK / "runs" / f"chat-{name}-{i}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    config = {
        "name": name, "seed": 0,
        "model": {"preset": str(preset), "lora": {"rank": 4},
                  "sequence_length": CHAT["sequence_length"]},
        "data": {"train": str(data / f"{name}-*.tfrecord")},
        "train": {"per_core_batch_size": CHAT["per_core_batch"], "epochs": CHAT["epochs"],
                  "learning_rate": {"base": 1e-3, "base_batch_size": None}},
        "runtime": {"backend": "jax", "accelerator": "cpu", "cpu_devices": CHAT["devices"]},
        "output": {"dir": str(out)},
    }  # fmt: skip
    (out / "chat.yaml").write_text(json.dumps(config))
    run([str(BIN / "tpurun"), "train", str(out / "chat.yaml"), "--plain"], args, "tpurun train")
    summary = json.loads((out / name / "summary.json").read_text())
    positions = summary["steps_per_epoch"] * summary["global_batch_size"] * CHAT["sequence_length"]
    seconds = statistics.median(summary["epoch_seconds"][1:])
    return {"steps_per_epoch": summary["steps_per_epoch"], "steady_epoch_seconds": seconds,
            "positions_per_sec": positions / seconds}  # fmt: skip


def packing_main(args: argparse.Namespace) -> None:
    preset, data = ensure_chat(args)
    packing = json.loads((data / "packed.schema.json").read_text())["tokenized"]["packing"]
    padding = {"unpacked": packing["padding_unpacked"], "packed": packing["padding"]}
    result: dict = {"setup": {**CHAT, "cpu_count": os.cpu_count()}, "packing": packing}
    for name in ("unpacked", "packed"):
        runs = [run_chat(args, preset, data, name, i) for i in range(args.repeats)]
        positions = statistics.median(r["positions_per_sec"] for r in runs)
        result[name] = {"padding": padding[name], "runs": runs,
                        "positions_per_sec": round(positions, 1),
                        "tokens_per_sec": round(positions * (1 - padding[name]), 1)}  # fmt: skip
        log(args, f"{name}: {runs}")
    result["tokens_per_sec_ratio"] = round(
        result["packed"]["tokens_per_sec"] / result["unpacked"]["tokens_per_sec"], 3
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"\nchat records: {packing['examples']} conversations, {CHAT['sequence_length']}-token "
          f"sequences, {CHAT['devices']} CPU devices x {CHAT['per_core_batch']}, "
          f"{args.repeats} run(s) each, steady epochs")  # fmt: skip
    print(f"{'':14s}{'records':>9s}{'padding':>9s}{'steps':>7s}{'epoch s':>9s}{'positions/s':>13s}"
          f"{'tokens/s':>10s}")  # fmt: skip
    for name in ("unpacked", "packed"):
        r, first = result[name], result[name]["runs"][0]
        records = packing["records"] if name == "packed" else packing["examples"]
        print(f"{name:14s}{records:9d}{r['padding']:9.1%}{first['steps_per_epoch']:7d}"
              f"{statistics.median(x['steady_epoch_seconds'] for x in r['runs']):9.2f}"
              f"{r['positions_per_sec']:13,.0f}{r['tokens_per_sec']:10,.0f}")  # fmt: skip
    print(f"packed / unpacked tokens/s: {result['tokens_per_sec_ratio']:.2f}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.hand:
        hand(args)
        return
    if args.packing:
        packing_main(args)
        return
    started = time.monotonic()
    preset, data = ensure_inputs(args)
    kinds = {"tpurun": run_tpurun, "hand": run_hand}
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    loads = [load_average()]
    for i in range(args.repeats):
        for kind, fn in kinds.items():
            out = WORK / "runs" / f"{kind}-{i}"
            shutil.rmtree(out, ignore_errors=True)  # a fresh run, never a resume
            result = fn(args, preset, data, out)
            runs[kind].append(result)
            loads.append(load_average())
            log(args, f"[{i + 1}/{args.repeats}] {kind:6s} epochs "
                + " ".join(f"{s:.2f}" for s in result["epoch_seconds"])
                + f" s, loss {result['loss'][0]:.3f} -> {result['loss'][-1]:.3f}, wall "
                f"{result['wall']:.0f} s, load {loads[-1][0] if loads[-1] else '?'}")  # fmt: skip
    t, h = (tokens_per_second(args, runs[kind]) for kind in kinds)
    ratio = t["tokens_per_sec"] / h["tokens_per_sec"]
    # Each tpurun run against the hand-written run right after it, under about the same load.
    paired = [a / b for a, b in zip(t["tokens_per_sec_per_run"], h["tokens_per_sec_per_run"],
                                    strict=True)]  # fmt: skip
    result = {
        "setup": {
            "devices": args.devices,
            "per_core_batch_size": args.per_core_batch,
            "global_batch_size": args.per_core_batch * args.devices,
            "sequence_length": args.sequence_length,
            "steps_per_epoch": args.steps_per_epoch,
            "steps_per_execution": args.steps_per_execution,
            "epochs": args.epochs,
            "repeats": args.repeats,
            "cpu_count": os.cpu_count(),
        },  # fmt: skip
        "tpurun": t,
        "hand": h,
        "ratio": round(ratio, 4),
        "paired_ratios": [round(r, 4) for r in paired],
        "paired_ratio_median": round(statistics.median(paired), 4),
        "goal": GOAL,
        "met": ratio >= GOAL,
        "load_average_1m": [load[0] for load in loads if load],
        "runs": runs,
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    s = result["setup"]
    print(f"\nLoRA (rank 4) fine-tune of the tiny Gemma, {s['devices']} CPU devices, global batch "
          f"{s['global_batch_size']} x {s['sequence_length']} tokens, {s['steps_per_epoch']} "
          f"steps/epoch, steps_per_execution {s['steps_per_execution']}, {s['epochs']} epochs x "
          f"{s['repeats']} runs each ({t['steady_epochs']} steady epochs per side)\n")  # fmt: skip
    print(f"{'':34s}{'tpurun':>12s}{'hand':>12s}")
    for label, key in (("tokens/s, steady", "tokens_per_sec"),
                       ("steady epoch seconds, median", "steady_epoch_median"),
                       ("first epoch seconds, median", "first_epoch_median"),
                       ("process wall seconds, median", "wall_median")):  # fmt: skip
        print(f"{label:34s}{t[key]:12,.2f}{h[key]:12,.2f}")
    print(f"\ntokens/s per run: tpurun {t['tokens_per_sec_per_run']} | hand "
          f"{h['tokens_per_sec_per_run']}")  # fmt: skip
    print(f"load average (1 min) between runs: {result['load_average_1m']}")
    print("tpurun / hand-written, run by run: "
          + " ".join(f"{r:.3f}" for r in paired) + f" (median {statistics.median(paired):.3f})")  # fmt: skip
    print(f"tpurun / hand-written: {ratio:.3f}  goal >= {GOAL}  {'met' if ratio >= GOAL else 'MISSED'}"
          f"  ({result['seconds']:.0f} s in all)")  # fmt: skip


if __name__ == "__main__":
    main()
