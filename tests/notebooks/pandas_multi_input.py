# mirrors: keras-io examples/structured_data/structured_data_classification_from_scratch.py (a pandas DataFrame turned
# into a tf.data dataset of named feature columns, numeric features normalized and a string feature looked up inside
# a multi-input model)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np
import pandas as pd
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(7)
n = 300
dataframe = pd.DataFrame(
    {
        "age": rng.integers(29, 77, n).astype("float64"),
        "chol": rng.integers(126, 564, n).astype("float64"),
        "thal": rng.choice(["fixed", "normal", "reversible"], n),
    }
)
dataframe["target"] = ((dataframe["age"] > 55) & (dataframe["thal"] != "normal")).astype("int64")
val_dataframe = dataframe.sample(frac=0.2, random_state=1337)
train_dataframe = dataframe.drop(val_dataframe.index)


def dataframe_to_dataset(dataframe):
    dataframe = dataframe.copy()
    labels = dataframe.pop("target")
    return tf.data.Dataset.from_tensor_slices((dict(dataframe), labels)).batch(32)


train_ds = dataframe_to_dataset(train_dataframe)
val_ds = dataframe_to_dataset(val_dataframe)


# %%
def encoded(feature, name, layer):
    layer.adapt(train_ds.map(lambda x, y: tf.expand_dims(x[name], -1)))
    return layer(feature)


age = keras.Input(shape=(1,), name="age")
chol = keras.Input(shape=(1,), name="chol")
thal = keras.Input(shape=(1,), name="thal", dtype="string")
features = layers.concatenate(
    [
        encoded(age, "age", layers.Normalization()),
        encoded(chol, "chol", layers.Normalization()),
        encoded(thal, "thal", layers.StringLookup(output_mode="one_hot")),
    ]
)
output = layers.Dense(1, activation="sigmoid")(layers.Dense(16, activation="relu")(features))
model = keras.Model([age, chol, thal], output)
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])

# %%
history = model.fit(train_ds, validation_data=val_ds, epochs=2)

# %%
sample = {"age": 60.0, "chol": 233.0, "thal": "fixed"}
input_dict = {name: tf.convert_to_tensor([value]) for name, value in sample.items()}
print("PREDICTION", model.predict(input_dict, verbose=0).shape)
