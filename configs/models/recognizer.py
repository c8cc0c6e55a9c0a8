"""A small MLP for the NAIC-like example: 1024 raw float32 values in, a 0/1 probability out.

Keras only (no TensorFlow ops), so it builds on the JAX and TensorFlow backends alike.
"""

import keras


def build(
    units: int = 256, layers: int = 2, dropout: float = 0.1, features: int = 1024
) -> keras.Model:
    inputs = keras.Input(shape=(features,), name="x")
    x = inputs
    for _ in range(layers):
        x = keras.layers.Dense(units, activation="relu")(x)
        if dropout:
            x = keras.layers.Dropout(dropout)(x)
    # float32 output keeps the sigmoid and binary_crossentropy stable under mixed precision.
    outputs = keras.layers.Dense(1, activation="sigmoid", dtype="float32", name="y")(x)
    return keras.Model(inputs, outputs, name="recognizer")
