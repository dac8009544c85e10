# mirrors: keras-io guides/writing_your_own_callbacks.py (a Callback subclass that prints in on_epoch_end, defined in
# the same cell as the fit, as the guide does)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np

rng = np.random.default_rng(5)
x_train = rng.random((320, 20)).astype("float32")
y_train = x_train @ rng.random((20, 1)).astype("float32")


def get_model():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras.optimizers.RMSprop(learning_rate=0.01),
        loss="mean_squared_error",
        metrics=["mean_absolute_error"],
    )
    return model


# %%
class LossAndErrorPrintingCallback(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print(
            "The average loss for epoch {} is {:7.2f} and mean absolute error is {:7.2f}.".format(
                epoch, logs["loss"], logs["mean_absolute_error"]
            )
        )


model = get_model()
history = model.fit(x_train, y_train, batch_size=64, epochs=2, verbose=0, callbacks=[LossAndErrorPrintingCallback()])
