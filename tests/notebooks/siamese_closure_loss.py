# mirrors: keras-io examples/vision/siamese_contrastive.py (two towers sharing one embedding network, a Lambda over a
# named distance function, and a contrastive loss made by a closure `loss(margin=1)`); Lambda needs --unsafe
# call: siamese.fit(
# kind: fit
# flags: --unsafe

# %%
import keras
import numpy as np
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(3)
left = rng.normal(size=(320, 10)).astype("float32")
same = rng.random(320) < 0.5
right = np.where(same[:, None], left + rng.normal(scale=0.1, size=left.shape), rng.normal(size=left.shape))
right = right.astype("float32")
labels = same.astype("float32")


# %%
def euclidean_distance(vects):
    x, y = vects
    sum_square = tf.math.reduce_sum(tf.math.square(x - y), axis=1, keepdims=True)
    return tf.math.sqrt(tf.math.maximum(sum_square, keras.backend.epsilon()))


inp = layers.Input((10,))
embedding_network = keras.Model(inp, layers.Dense(6, activation="tanh")(layers.Dense(16, activation="relu")(inp)))
input_1 = layers.Input((10,))
input_2 = layers.Input((10,))
merged = layers.Lambda(euclidean_distance)([embedding_network(input_1), embedding_network(input_2)])
output = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(merged))
siamese = keras.Model(inputs=[input_1, input_2], outputs=output)


# %%
def loss(margin=1):
    def contrastive_loss(y_true, y_pred):
        square_pred = tf.math.square(y_pred)
        margin_square = tf.math.square(tf.math.maximum(margin - (y_pred), 0))
        return tf.math.reduce_mean((1 - y_true) * square_pred + (y_true) * margin_square)

    return contrastive_loss


siamese.compile(loss=loss(margin=1), optimizer="RMSprop", metrics=["accuracy"])

# %%
history = siamese.fit([left, right], labels, validation_split=0.25, batch_size=32, epochs=2)

# %%
print("TEST", siamese.evaluate([left[:64], right[:64]], labels[:64], verbose=0))
