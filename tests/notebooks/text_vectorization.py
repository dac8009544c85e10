# mirrors: keras-io examples/nlp/text_classification_from_scratch.py (an adapted TextVectorization with a custom
# standardization function, applied in the tf.data pipeline; the trained model is then wrapped to take raw strings)
# call: model.fit(
# kind: fit

# %%
import re
import string

import keras
import numpy as np
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(6)
good, bad, filler = ["great", "superb", "fun"], ["awful", "dull", "bad"], ["the", "film", "was", "a", "plot"]
texts, labels = [], []
for _ in range(256):
    label = int(rng.integers(0, 2))
    words = list(rng.choice(filler, size=8)) + list(rng.choice(good if label else bad, size=2))
    texts.append(" ".join(words) + "<br />")
    labels.append(label)
raw_train_ds = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(32)


def custom_standardization(input_data):
    lowercase = tf.strings.lower(input_data)
    stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
    return tf.strings.regex_replace(stripped_html, f"[{re.escape(string.punctuation)}]", "")


vectorize_layer = layers.TextVectorization(
    standardize=custom_standardization, max_tokens=100, output_mode="int", output_sequence_length=12
)
vectorize_layer.adapt(raw_train_ds.map(lambda x, y: x))
train_ds = raw_train_ds.map(lambda x, y: (vectorize_layer(tf.expand_dims(x, -1)), y))

# %%
inputs = keras.Input(shape=(None,), dtype="int64")
h = layers.Embedding(100, 8)(inputs)
h = layers.GlobalAveragePooling1D()(h)
model = keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h))
model.compile(loss="binary_crossentropy", optimizer="adam", metrics=["accuracy"])

# %%
history = model.fit(train_ds, epochs=2)

# %%
string_input = keras.Input(shape=(1,), dtype="string")
end_to_end = keras.Model(string_input, model(vectorize_layer(string_input)))
print("END TO END", end_to_end.predict(tf.constant([["a great fun film"]]), verbose=0).shape)
