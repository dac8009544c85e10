"""A build function as a user writes one for KerasTuner: the search's tests import it, and it travels as code."""

import keras


def build_model(hp):
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(hp.Int("units", 8, 64, step=8), activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(hp.Choice("learning_rate", [1e-2, 1e-3])),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def build_model_failing_wide(hp):
    """As build_model, but a trial with more than 24 units fails on the worker (as a real build can)."""
    if hp.Int("units", 8, 64, step=8) > 24:
        raise ValueError("this machine cannot hold so many units")
    return build_model(hp)
