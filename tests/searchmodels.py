"""A build function as a user writes one for KerasTuner: the search's tests import it, and it travels as code."""

import keras
import keras_tuner as kt


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


def build_model_no_input(hp):
    """As build_model, with no Input: Keras builds it on its first call (a Hyperband round must build it first)."""
    model = keras.Sequential(
        [
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


def halve(epoch, lr):
    """A LearningRateScheduler's schedule: each epoch at half the last one's rate."""
    return lr if epoch == 0 else lr * 0.5


class TunedFit(kt.HyperModel):
    """A HyperModel as KerasTuner's guide writes one: build() tunes the model, an overridden fit() tunes how it
    trains (the batch size and shuffling, registered there, and a preprocessing step of x)."""

    def __init__(self, widen=1, **kwargs):
        super().__init__(**kwargs)
        self.widen = widen

    def build(self, hp):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(hp.Int("units", 8, 32, step=8) * self.widen, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    def fit(self, hp, model, x, y, validation_data=None, **kwargs):
        if hp.Boolean("center"):
            x = x - x.mean(axis=0)
        return model.fit(
            x,
            y,
            batch_size=hp.Choice("batch_size", [16, 128]),
            shuffle=hp.Boolean("shuffle"),
            validation_data=validation_data,
            **kwargs,
        )


class ScoredFit(kt.HyperModel):
    """A HyperModel whose fit scores the model itself and returns the metrics to track, or with `as_value` the one
    value to minimize (KerasTuner's guide's custom evaluation): no History to read the objective from."""

    def __init__(self, as_value=False, **kwargs):
        super().__init__(**kwargs)
        self.as_value = as_value

    def build(self, hp):
        model = keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(hp.Int("units", 8, 32, step=8), activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        return model

    def fit(self, hp, model, x, y, validation_data, **kwargs):
        model.fit(x, y, **kwargs)
        x_val, y_val = validation_data
        loss = float(model.evaluate(x_val, y_val, verbose=0))
        return loss if self.as_value else {"metric_a": -loss, "metric_b": 2 * loss}


class CroppedFit(kt.HyperModel):
    """A HyperModel whose fit crops x before training (KerasTuner's guide preprocesses data in fit): the search's x
    has more features than the model it builds takes; and it sets the epochs itself (the search gives none)."""

    def build(self, hp):
        return build_model(hp)

    def fit(self, hp, model, x, y, **kwargs):
        return model.fit(x[:, :64], y, epochs=2, **kwargs)


class LoopFit(kt.HyperModel):
    """KerasTuner's custom-tuner guide's shape: build() returns a model it does not compile, and fit() trains it with
    a loop of its own, hands each epoch's metric to the callbacks it was given, and returns the value to minimize."""

    def build(self, hp):
        return keras.Sequential(
            [keras.Input((64,)), keras.layers.Dense(hp.Int("units", 8, 16, step=8)), keras.layers.Dense(10)]
        )

    def fit(self, hp, model, x, y, validation_data, callbacks=None, **kwargs):
        import tensorflow as tf

        optimizer = keras.optimizers.Adam(hp.Float("learning_rate", 1e-3, 1e-2, sampling="log"))
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for callback in callbacks or []:
            callback.set_model(model)
        best = float("inf")
        for epoch in range(2):
            for start in range(0, len(x), 64):
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[start : start + 64], model(x[start : start + 64], training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            x_val, y_val = validation_data
            val_loss = float(loss_fn(y_val, model(x_val)))
            for callback in callbacks or []:
                callback.on_epoch_end(epoch, logs={"val_loss": val_loss})
            best = min(best, val_loss)
        return best


class SquaredGap(keras.metrics.Metric):
    """KerasTuner's guide's CustomMetric: unregistered, and its **kwargs go on to a super().__init__ given name=."""

    def __init__(self, **kwargs):
        super().__init__(name="custom_metric", **kwargs)
        self.sum = self.add_weight(name="sum", initializer="zeros")
        self.count = self.add_weight(name="count", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.sum.assign_add(keras.ops.sum(keras.ops.square(keras.ops.cast(y_true, "float32") - y_pred)))
        self.count.assign_add(keras.ops.cast(keras.ops.shape(y_true)[0], "float32"))

    def result(self):
        return self.sum / self.count


def build_regressor(hp):
    model = keras.Sequential(
        [keras.layers.Dense(hp.Int("units", 8, 16, step=8), activation="relu"), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mean_squared_error", metrics=[SquaredGap()])
    return model
