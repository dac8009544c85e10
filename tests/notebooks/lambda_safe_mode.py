# mirrors: keras-io examples/vision/siamese_contrastive.py's Lambda layer, without --unsafe: Keras itself cannot load a
# Lambda under safe_mode=True, so the one refusal expected is before upload, naming the fix (--unsafe)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np
from keras import layers

rng = np.random.default_rng(4)
x = rng.normal(size=(128, 6)).astype("float32")
y = (x.sum(axis=1) > 0).astype("float32")


def double(t):
    return t * 2.0


inputs = keras.Input((6,))
outputs = layers.Dense(1, activation="sigmoid")(layers.Lambda(double)(inputs))
model = keras.Model(inputs, outputs)
model.compile(optimizer="adam", loss="binary_crossentropy")

# %%
history = model.fit(x, y, epochs=2, batch_size=32)
