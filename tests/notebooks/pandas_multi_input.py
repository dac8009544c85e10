# mirrors: keras-io examples/structured_data/structured_data_classification_from_scratch.py (a pandas DataFrame turned
# into a dict of named inputs, numeric features normalized and a string feature looked up inside the model)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np
import pandas as pd
from keras import layers

rng = np.random.default_rng(7)
n = 300
dataframe = pd.DataFrame(
    {
        "age": rng.integers(29, 77, n),
        "chol": rng.integers(126, 564, n).astype("float64"),
        "thal": rng.choice(["fixed", "normal", "reversible"], n),
    }
)
dataframe["target"] = ((dataframe["age"] > 55) & (dataframe["thal"] != "normal")).astype("int64")
val_dataframe = dataframe.sample(frac=0.2, random_state=1337)
train_dataframe = dataframe.drop(val_dataframe.index)


def to_inputs(df):
    return {
        "age": df["age"].to_numpy("float32")[:, None],
        "chol": df["chol"].to_numpy("float32")[:, None],
        "thal": df["thal"].to_numpy(str)[:, None],
    }


# %%
age = keras.Input(shape=(1,), name="age")
chol = keras.Input(shape=(1,), name="chol")
thal = keras.Input(shape=(1,), name="thal", dtype="string")
norm_age = layers.Normalization()
norm_age.adapt(train_dataframe["age"].to_numpy("float32")[:, None])
norm_chol = layers.Normalization()
norm_chol.adapt(train_dataframe["chol"].to_numpy("float32")[:, None])
lookup = layers.StringLookup(output_mode="one_hot")
lookup.adapt(train_dataframe["thal"].to_numpy(str))
features = layers.concatenate([norm_age(age), norm_chol(chol), lookup(thal)])
output = layers.Dense(1, activation="sigmoid")(layers.Dense(16, activation="relu")(features))
model = keras.Model([age, chol, thal], output)
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])

# %%
history = model.fit(
    to_inputs(train_dataframe),
    train_dataframe["target"].to_numpy(),
    validation_data=(to_inputs(val_dataframe), val_dataframe["target"].to_numpy()),
    epochs=2,
    batch_size=32,
)

# %%
sample = {"age": np.array([[60.0]], "float32"), "chol": np.array([[233.0]], "float32"), "thal": np.array([["fixed"]])}
print("PREDICTION", model.predict(sample, verbose=0).shape)
