# mirrors: keras-io's Lambda layers written as Python lambdas (e.g. examples/vision/siamese_contrastive.py's merge
# layer, written inline), without --unsafe: Keras itself refuses to load a lambda's bytecode under safe_mode=True, so
# the one refusal expected is before upload, naming the fix (--unsafe)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np
from keras import layers

rng = np.random.default_rng(4)
x = rng.normal(size=(128, 6)).astype("float32")
y = (x.sum(axis=1) > 0).astype("float32")

inputs = keras.Input((6,))
outputs = layers.Dense(1, activation="sigmoid")(layers.Lambda(lambda t: t * 2.0)(inputs))
model = keras.Model(inputs, outputs)
model.compile(optimizer="adam", loss="binary_crossentropy")

# %%
history = model.fit(x, y, epochs=2, batch_size=32)
