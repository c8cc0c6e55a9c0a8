"""The hand-written Keras 3 script that benchmarks/runner_overhead.py compares tpurun against.

What a careful practitioner writes without tpurun, for the NAIC-like data: the same backend and
simulated devices (``keras.distribution.DataParallel`` on JAX, ``MirroredStrategy`` over logical
CPU devices on TensorFlow), the same global batch, steps and ``steps_per_execution``, a tf.data
pipeline as good as tpurun's, the recipe's per-epoch callbacks (``ModelCheckpoint`` saving the
weights every epoch, ``CSVLogger``, ``ReduceLROnPlateau`` on the loss), and ``verbose=0``. The
model is the example's own factory (configs/models/recognizer.py).

It prints one JSON line: per-epoch seconds (``on_epoch_begin`` to ``on_epoch_end``, as tpurun's
``epoch_seconds``), the time to the first step from ``on_train_begin`` (as tpurun's
``time_to_first_step``) and from the process start.

    .venv/bin/python benchmarks/baseline_keras.py --data benchmarks/_work/data --out /tmp/base
"""

import time

PROCESS_START = time.monotonic()

# ruff: noqa: E402  (the clock starts before the heavy imports, and the backend is set before keras)
import argparse
import glob
import json
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Hand-written Keras 3 baseline for runner_overhead.py")
    p.add_argument("--data", required=True, help="folder with naic-{train,validation}-* shards")
    p.add_argument("--out", required=True, help="folder for checkpoints and log.csv")
    p.add_argument("--backend", choices=["jax", "tensorflow"], default="jax")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (replicas)")
    p.add_argument("--per-core-batch", type=int, default=16)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps-per-epoch", type=int, default=64)
    p.add_argument("--validation-steps", type=int, default=8)
    p.add_argument("--steps-per-execution", type=int, default=32)
    p.add_argument("--units", type=int, default=256)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--shuffle-buffer", type=int, default=10000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--launched-at",
        type=float,
        default=None,
        help="time.monotonic() when the parent launched this process (same clock on Linux)",
    )
    return p.parse_args(argv)


def setup_devices(args):
    """Backend and simulated devices; must run before keras (and jax) are imported."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["KERAS_BACKEND"] = args.backend
    if args.backend == "jax":
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
        )
        import jax

        devices = jax.devices("cpu")[: args.devices]
        import keras

        if args.devices > 1:
            keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        return None
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    cpu = tf.config.list_physical_devices("CPU")[0]
    if args.devices > 1:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * args.devices
        )
        names = [d.name for d in tf.config.list_logical_devices("CPU")][: args.devices]
        return tf.distribute.MirroredStrategy(devices=names)
    return None  # one device: TF's default strategy, nothing to distribute


def make_dataset(files, batch_size, *, training, seed, shuffle_buffer, take=None, repeat=False):
    """TFRecords -> (x, y) batches: interleaved reads, shuffle, batch, parse whole batches."""
    import tensorflow as tf

    autotune = tf.data.AUTOTUNE
    spec = {
        "x": tf.io.FixedLenFeature([], tf.string),
        "y": tf.io.FixedLenFeature([], tf.string),
    }

    def parse(serialized):
        parsed = tf.io.parse_example(serialized, spec)
        x = tf.reshape(tf.io.decode_raw(parsed["x"], tf.float32), [-1, 1024])
        y = tf.reshape(tf.io.decode_raw(parsed["y"], tf.float32), [-1, 1])
        return x, y

    ds = tf.data.Dataset.from_tensor_slices(files)
    if training:
        ds = ds.shuffle(len(files), seed=seed).repeat()
    ds = ds.interleave(
        tf.data.TFRecordDataset,
        cycle_length=min(len(files), 16),
        num_parallel_calls=autotune,
        deterministic=not training,
    )
    if training:
        ds = ds.shuffle(shuffle_buffer, seed=seed)
    ds = ds.batch(batch_size, drop_remainder=True)
    if take is not None:
        ds = ds.take(take)
        if repeat:
            ds = ds.repeat()
    ds = ds.map(parse, num_parallel_calls=autotune, deterministic=not training)
    options = tf.data.Options()
    options.deterministic = not training
    return ds.with_options(options).prefetch(autotune)


def main(argv=None):
    args = parse_args(argv)
    strategy = setup_devices(args)
    import keras

    sys.path.insert(0, str(ROOT / "configs" / "models"))
    from recognizer import build

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.epoch_seconds = []
            self.first_step = None
            self.first_step_from_process = None

        def on_train_begin(self, logs=None):
            self.train_begin = time.monotonic()

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch_begin = time.monotonic()

        def on_train_batch_end(self, batch, logs=None):
            if self.first_step is None:
                now = time.monotonic()
                self.first_step = now - self.train_begin
                self.first_step_from_process = now - (args.launched_at or PROCESS_START)

        def on_epoch_end(self, epoch, logs=None):
            self.epoch_seconds.append(time.monotonic() - self.epoch_begin)

    keras.utils.set_random_seed(args.seed)
    replicas = strategy.num_replicas_in_sync if strategy is not None else args.devices
    global_batch = args.per_core_batch * replicas
    train_files = sorted(glob.glob(os.path.join(args.data, "naic-train-*.tfrecord")))
    val_files = sorted(glob.glob(os.path.join(args.data, "naic-validation-*.tfrecord")))
    # Under a tf.distribute strategy Keras needs a repeated validation set and validation_steps
    # (it miscounts metrics at the end of a finite one); on JAX the finite set is exact.
    tf_strategy = strategy is not None
    train_ds = make_dataset(
        train_files, global_batch, training=True, seed=args.seed, shuffle_buffer=args.shuffle_buffer
    )
    val_ds = make_dataset(
        val_files, global_batch, training=False, seed=args.seed,
        shuffle_buffer=0, take=args.validation_steps, repeat=tf_strategy,
    )  # fmt: skip

    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = build(units=args.units)
        model.compile(
            optimizer=keras.optimizers.Adam(args.learning_rate),
            loss="binary_crossentropy",
            metrics=["accuracy"],
            steps_per_execution=args.steps_per_execution,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer()
    callbacks = [
        timer,
        keras.callbacks.CSVLogger(str(out / "log.csv"), append=True),
        keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.666, patience=5, min_lr=1e-5),
        keras.callbacks.ModelCheckpoint(str(out / "latest.weights.h5"), save_weights_only=True),
    ]
    with warnings.catch_warnings():
        # The finite validation set "runs out" at the end of each pass, on purpose.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        history = model.fit(
            train_ds,
            epochs=args.epochs,
            steps_per_epoch=args.steps_per_epoch,
            validation_data=val_ds,
            validation_steps=args.validation_steps if tf_strategy else None,
            callbacks=callbacks,
            shuffle=False,
            verbose=0,
        )
    result = {
        "epoch_seconds": [round(s, 4) for s in timer.epoch_seconds],
        "time_to_first_step": round(timer.first_step, 4),
        "process_to_first_step": round(timer.first_step_from_process, 4),
        "final_metrics": {k: float(v[-1]) for k, v in history.history.items()},
        "global_batch_size": global_batch,
    }
    print(json.dumps(result))


def _null():
    import contextlib

    return contextlib.nullcontext()


if __name__ == "__main__":
    main()
