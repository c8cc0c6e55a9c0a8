"""Model factories the tests name by path ("tests/factories.py:mlp")."""

import keras


def mlp(units: int = 16) -> keras.Model:
    inputs = keras.Input(shape=(8,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(inputs)
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32")(hidden)
    return keras.Model(inputs, outputs)


def two_inputs() -> keras.Model:
    a = keras.Input(shape=(8,), name="a")
    b = keras.Input(shape=(1,), name="b")
    merged = keras.layers.Concatenate()([a, b])
    return keras.Model([a, b], keras.layers.Dense(1, activation="sigmoid")(merged))


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
