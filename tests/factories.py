"""Model factories the tests name by path ("tests/factories.py:mlp")."""

import os

import keras


def mlp(units: int = 16) -> keras.Model:
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(inputs)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def mlp_after_a_signal(signal: str = "SIGTERM") -> keras.Model:
    """The toy MLP, built after sending this process ``signal``: a signal during start-up, before
    any step, wherever the machine's speed puts the first step (tests/cli/test_boundary.py)."""
    import os
    import signal as signals

    os.kill(os.getpid(), getattr(signals, signal))
    return mlp()


def mlp_dropout(units: int = 16) -> keras.Model:
    """An MLP with dropout: its masks come from a seed generator's state, which a resume must
    carry on from."""
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(units, activation="relu")(inputs))
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def two_inputs() -> keras.Model:
    a = keras.Input(shape=(8,), name="a")
    b = keras.Input(shape=(1,), name="b")
    merged = keras.layers.Concatenate()([a, b])
    return keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid")(merged))


def five_inputs() -> keras.Model:
    """Expects 5 values per example where the toy data has 8."""
    inputs = keras.Input(shape=(5,), name="x")
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))


def image_input() -> keras.Model:
    """Expects 8x8x1 images where the toy data has flat vectors of 8."""
    inputs = keras.Input(shape=(8, 8, 1), name="x")
    flat = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(flat))


def three_outputs() -> keras.Model:
    """Predicts 3 values per example where the toy targets hold 1."""
    inputs = keras.Input(shape=(8,), name="x")
    return keras.Model(inputs, keras.layers.Dense(3, activation="sigmoid")(inputs))


def two_outputs() -> keras.Model:
    """Two output heads where the toy config gives one target."""
    inputs = keras.Input(shape=(8,), name="x")
    heads = [keras.layers.Dense(1, activation="sigmoid")(inputs) for _ in range(2)]
    return keras.Model(inputs, heads)


def not_a_model():
    return "a string"


def raises():
    raise RuntimeError("the factory broke on purpose")


def uses_tensorflow_ops():
    import tensorflow as tf

    inputs = keras.Input(shape=(8,))
    return keras.Model(inputs, tf.reduce_sum(inputs, axis=1, keepdims=True))


class Exploding(keras.callbacks.Callback):
    """A user callback that fails in an unexpected way (for the exit-code-1 path)."""

    def on_epoch_end(self, epoch, logs=None):
        raise RuntimeError("boom")


class SignalAt(keras.callbacks.Callback):
    """Sends this process a signal after batch ``step`` (1-based, as Keras counts it in this fit)
    of epoch ``epoch`` (1-based), once: ``marker`` records that it fired, so a resumed run is not
    stopped again."""

    def __init__(self, epoch: int, step: int, marker: str, signal: str = "SIGTERM", times: int = 1):
        super().__init__()
        self.epoch, self.step, self.marker, self.signal = epoch, step, marker, signal
        self.times = times
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1

    def on_train_batch_end(self, batch, logs=None):
        import os
        import signal

        if (self._epoch, batch + 1) >= (self.epoch, self.step) and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            for _ in range(self.times):
                os.kill(os.getpid(), getattr(signal, self.signal))


class WatchLatest(keras.callbacks.Callback):
    """Records, after each batch, the (epoch, step, reason) of the run's latest.json in ``out``."""

    def __init__(self, folder: str, out: str):
        super().__init__()
        self.folder, self.out = folder, out

    def on_train_batch_end(self, batch, logs=None):
        import json
        import os

        path = os.path.join(self.folder, "latest.json")
        if os.path.exists(path):
            with open(path) as f:
                state = json.load(f)
            with open(self.out, "a") as f:
                f.write(json.dumps([state["epoch"], state["step"], state["reason"]]) + "\n")


class RecordLearningRate(keras.callbacks.Callback):
    """Appends the optimizer's learning rate at the start of each ``fit`` to ``out``."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_begin(self, logs=None):
        with open(self.out, "a") as f:
            f.write(f"{float(self._model.optimizer.learning_rate):.6g}\n")


def mean_prediction(y_true, y_pred):
    """A custom metric function: Keras cannot know whether it should go up or down."""
    return keras.ops.mean(y_pred)


def mlp_l2(units: int = 16) -> keras.Model:
    """The mlp with a weight regulariser: its penalty is part of every batch's loss."""
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(units, activation="relu", kernel_regularizer="l2")(inputs)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def softmax3() -> keras.Model:
    """Three classes, one softmax unit each."""
    inputs = keras.Input(shape=(8,), name="x")
    return keras.Model(inputs, keras.layers.Dense(3, activation="softmax")(inputs))


class NeedsAMissingPackage(keras.callbacks.Callback):
    """A user callback that needs a package this machine lacks (as Keras' TensorBoard does
    without tensorboard): it fails at the first epoch's end."""

    def on_epoch_end(self, epoch, logs=None):
        try:
            import tpurun_test_package_that_does_not_exist  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("cannot write the summary") from exc


def compiled_sgd_mse() -> keras.Model:
    """A factory that compiles its model itself, as many notebooks do."""
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5, momentum=0.9), loss="mse",
                  metrics=["mae"])  # fmt: skip
    return model


@keras.saving.register_keras_serializable(package="tpurun_tests")
class ResidualBlock(keras.layers.Layer):
    """A block of layers, what ``train.remat`` recomputes; its dropout (a seed state) and batch
    normalization (moving statistics) update state inside it."""

    def __init__(self, units: int = 16, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.inner = keras.layers.Dense(units * 4, activation="gelu")
        self.outer = keras.layers.Dense(units)
        self.dropout = keras.layers.Dropout(0.2)
        self.norm = keras.layers.BatchNormalization()

    def build(self, input_shape):
        self.inner.build(input_shape)
        self.outer.build((*input_shape[:-1], self.units * 4))
        self.norm.build((*input_shape[:-1], self.units))

    def call(self, x, training=None):
        update = self.dropout(self.outer(self.inner(x)), training=training)
        return self.norm(x + update, training=training)

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def residual_blocks(units: int = 16, blocks: int = 2) -> keras.Model:
    """An MLP of ``blocks`` residual blocks (each a Layer holding layers)."""
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(units)(inputs)
    for _ in range(blocks):
        hidden = ResidualBlock(units)(hidden)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


class FillDisk(keras.callbacks.Callback):
    """At the end of epoch ``epoch`` (1-based), before tpurun's own epoch-end writes (user
    callbacks run first), fills the disk holding ``folder`` with one file, leaving ``leave``
    bytes free (tests/storage/test_disk_full.py)."""

    def __init__(self, folder: str, epoch: int, leave: int = 0):
        super().__init__()
        self.folder, self.epoch, self.leave = folder, epoch, leave

    def on_epoch_end(self, epoch, logs=None):
        import shutil

        if epoch + 1 == self.epoch:
            free = shutil.disk_usage(self.folder).free
            with open(f"{self.folder}/filler", "wb") as f:
                f.write(b"\0" * max(0, free - self.leave))


class RecordBatches(keras.callbacks.Callback):
    """Appends to ``out`` one line per training batch the model is fed, in order: a digest of
    its arrays (inputs, targets, weights). A resumed run's lines, session after session, equal
    an unbroken run's when it kept its place in the data: a proof that does not depend on the
    numbers the model computes (which another mesh may round differently)."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_begin(self, logs=None):
        # A second fit of the session finds its train_function wrapped already, by this and by
        # tpurun's input-wait measure: wrapped again, the outer recorder records each batch, and
        # an inner one (``self._pulling`` set) lets it through.
        function = self._model.train_function
        self._pulling = False

        def recording(iterator):
            import hashlib

            import numpy as np

            iterator = iter(iterator)
            while True:
                nested, self._pulling = self._pulling, True
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
                finally:
                    self._pulling = nested
                if not nested:
                    digest = hashlib.sha1()
                    for array in keras.tree.flatten(batch):
                        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(array)).data)
                    with open(self.out, "a") as f:
                        f.write(digest.hexdigest() + "\n")
                yield batch

        if keras.backend.backend() == "jax":

            def recorded(state, iterator):
                return function(state, recording(iterator))
        else:

            def recorded(iterator):
                return function(recording(iterator))

        self._model.train_function = recorded


def recorded_batches(out) -> list[str]:
    """The digests :class:`RecordBatches` wrote (none: an empty list)."""
    import os

    return open(out).read().split() if os.path.exists(out) else []


class KeepWeights(keras.callbacks.Callback):
    """At the end of training, pickles every weight of the model in ``out``: ``{path: (dtype,
    trainable, value)}`` (bfloat16 values as their 16 bits)."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_end(self, logs=None):
        import pickle
        from pathlib import Path

        import numpy as np

        trainable = {id(v) for v in self.model.trainable_weights}
        kept = {}
        for v in self.model.weights:
            value = np.asarray(keras.ops.convert_to_numpy(v))
            dtype = keras.backend.standardize_dtype(value.dtype)
            bits = value.view(np.uint16) if dtype == "bfloat16" else value
            kept[v.path] = (dtype, id(v) in trainable, bits)
        Path(self.out).write_bytes(pickle.dumps(kept))


def compiled_sum_loss() -> keras.Model:
    """A factory that compiles its model with a loss summed over the batch (not Keras' default
    mean): tpurun cannot take validation padding back out of such a loss."""
    model = mlp()
    model.compile(optimizer="sgd", metrics=["accuracy"],
                  loss=keras.losses.BinaryCrossentropy(reduction="sum"))  # fmt: skip
    return model


class BlockFinalModel(keras.callbacks.Callback):
    """Puts a folder where the run's final model.keras goes, once the fit ends: its save fails."""

    def __init__(self, run_dir: str):
        super().__init__()
        self.run_dir = run_dir

    def on_train_end(self, logs=None):
        os.makedirs(os.path.join(self.run_dir, "model.keras", "in-the-way"), exist_ok=True)


class RecordOptimizerLayout(keras.callbacks.Callback):
    """At the end of training, writes to ``out`` (JSON) a list: for each optimizer variable in
    order, its path and shape, the partition spec of its array and its bytes on the first device
    and in all."""

    def __init__(self, out: str):
        super().__init__()
        self.out = out

    def on_train_end(self, logs=None):
        import json

        first = None
        layout = []
        for variable in self._model.optimizer.variables:
            array = variable.value
            first = first or array.sharding._device_assignment[0]
            held = sum(s.data.nbytes for s in array.addressable_shards if s.device == first)
            spec = [str(p) for p in getattr(array.sharding, "spec", [])]
            layout.append({"path": variable.path, "shape": list(variable.shape), "spec": spec,
                           "bytes": held, "whole": int(array.nbytes)})  # fmt: skip
        with open(self.out, "w") as f:
            json.dump(layout, f)
