# mirrors: keras-io guides/transfer_learning.py (a keras.applications base with weights=None, frozen, called with
# training=False under new layers, then unfrozen and fine-tuned in the kernel)
# call: model.fit(
# kind: fit

# %%
import keras
import numpy as np

rng = np.random.default_rng(9)
images = rng.integers(0, 255, size=(64, 32, 32, 3)).astype("float32")
labels = (images[:, :16].mean(axis=(1, 2, 3)) > images[:, 16:].mean(axis=(1, 2, 3))).astype("float32")

# %%
base_model = keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), include_top=False, alpha=0.35)
base_model.trainable = False
inputs = keras.Input(shape=(32, 32, 3))
x = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)(inputs)
x = base_model(x, training=False)
x = keras.layers.GlobalAveragePooling2D()(x)
outputs = keras.layers.Dense(1)(keras.layers.Dropout(0.2)(x))
model = keras.Model(inputs, outputs)
model.compile(
    optimizer=keras.optimizers.Adam(),
    loss=keras.losses.BinaryCrossentropy(from_logits=True),
    metrics=[keras.metrics.BinaryAccuracy()],
)

# %%
history = model.fit(images, labels, epochs=2, batch_size=16)

# %%
base_model.trainable = True
model.compile(optimizer=keras.optimizers.Adam(1e-5), loss=keras.losses.BinaryCrossentropy(from_logits=True))
model.fit(images, labels, epochs=1, batch_size=16, verbose=0)
print("FINE-TUNED", len(model.trainable_weights))
