# mirrors: keras-io guides/keras_tuner/getting_started.py, "Tune model training" (a HyperModel subclass whose fit()
# tunes an argument of model.fit, searched with RandomSearch on a kt.Objective)
# call: tuner.search(
# kind: tune

# %%
import keras
import keras_tuner
import numpy as np

rng = np.random.default_rng(10)
x_train = rng.random((256, 8, 8)).astype("float32")
y_train = keras.utils.to_categorical((x_train.mean(axis=(1, 2)) > 0.5).astype("int32"), 2)
x_val, y_val = x_train[:64], y_train[:64]


# %%
class MyHyperModel(keras_tuner.HyperModel):
    def build(self, hp):
        model = keras.Sequential()
        model.add(keras.layers.Flatten())
        model.add(keras.layers.Dense(units=hp.Int("units", min_value=8, max_value=32, step=8), activation="relu"))
        model.add(keras.layers.Dense(2, activation="softmax"))
        model.compile(optimizer="adam", loss="categorical_crossentropy", metrics=["accuracy"])
        return model

    def fit(self, hp, model, *args, **kwargs):
        return model.fit(*args, shuffle=hp.Boolean("shuffle"), **kwargs)


tuner = keras_tuner.RandomSearch(
    MyHyperModel(),
    objective=keras_tuner.Objective("val_accuracy", direction="max"),
    max_trials=2,
    overwrite=True,
    directory="my_dir",
    project_name="tune_hypermodel",
    seed=1,
)

# %%
tuner.search(x_train, y_train, epochs=2, validation_data=(x_val, y_val))

# %%
best = tuner.get_best_hyperparameters()[0]
print("BEST", sorted(best.values))
