"""A small convolutional classifier for the 8x8 handwritten digits of the quickstart."""

import keras


def build(
    filters: int = 32, units: int = 128, dropout: float = 0.2, classes: int = 10
) -> keras.Model:
    inputs = keras.Input(shape=(8, 8, 1), name="image")
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(units, activation="relu")(x)
    x = keras.layers.Dropout(dropout)(x)
    # float32 output keeps the softmax stable under mixed precision.
    outputs = keras.layers.Dense(classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="digits")
