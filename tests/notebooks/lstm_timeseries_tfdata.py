# mirrors: keras-io examples/timeseries/timeseries_weather_forecasting.py (windows from
# timeseries_dataset_from_array feeding an LSTM, with ModelCheckpoint and EarlyStopping callbacks)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np

rng = np.random.default_rng(8)
t = np.arange(1200)
series = np.stack([np.sin(t / 12.0), np.cos(t / 30.0), rng.normal(0, 0.1, t.size)], axis=1).astype("float32")
past, future, step = 48, 6, 2
x_data = series[: -(past + future)]
y_data = series[past + future :, :1]
dataset_train = keras.utils.timeseries_dataset_from_array(
    x_data[:800], y_data[:800], sequence_length=past // step, sampling_rate=step, batch_size=64
)
dataset_val = keras.utils.timeseries_dataset_from_array(
    x_data[800:], y_data[800:], sequence_length=past // step, sampling_rate=step, batch_size=64
)

# %%
inputs = keras.layers.Input(shape=(past // step, 3))
outputs = keras.layers.Dense(1)(keras.layers.LSTM(16)(inputs))
model = keras.Model(inputs=inputs, outputs=outputs)
model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse")
callbacks = [
    keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=0, patience=5),
    keras.callbacks.ModelCheckpoint(
        monitor="val_loss", filepath="model_checkpoint.weights.h5", save_weights_only=True, save_best_only=True
    ),
]

# %%
history = model.fit(dataset_train, epochs=2, validation_data=dataset_val, callbacks=callbacks)

# %%
# the checkpoint the callback wrote is read back in the kernel
model.load_weights("model_checkpoint.weights.h5")
for x, _y in dataset_val.take(1):
    print("PREDICTION", model.predict(x, verbose=0).shape)
