# mirrors: keras-io examples/generative/vae.py (a VAE(encoder, decoder) with its own train_step and no get_config)
# call: vae.fit(
# kind: fit

# %%
import keras
import numpy as np
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(0)
images = (rng.random((256, 12, 12, 1)) < 0.3).astype("float32")


# %%
class Sampling(layers.Layer):
    def call(self, inputs):
        z_mean, z_log_var = inputs
        eps = keras.random.normal(shape=tf.shape(z_mean))
        return z_mean + tf.exp(0.5 * z_log_var) * eps


latent_dim = 2
enc_in = keras.Input(shape=(12, 12, 1))
h = layers.Flatten()(enc_in)
h = layers.Dense(16, activation="relu")(h)
z_mean = layers.Dense(latent_dim, name="z_mean")(h)
z_log_var = layers.Dense(latent_dim, name="z_log_var")(h)
encoder = keras.Model(enc_in, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")

dec_in = keras.Input(shape=(latent_dim,))
g = layers.Dense(12 * 12, activation="sigmoid")(dec_in)
decoder = keras.Model(dec_in, layers.Reshape((12, 12, 1))(g), name="decoder")


# %%
class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            rec = tf.reduce_mean(tf.reduce_sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl = tf.reduce_mean(tf.reduce_sum(-0.5 * (1 + z_log_var - tf.square(z_mean) - tf.exp(z_log_var)), axis=1))
            total = rec + kl
        grads = tape.gradient(total, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total)
        self.kl_loss_tracker.update_state(kl)
        return {"loss": self.total_loss_tracker.result(), "kl_loss": self.kl_loss_tracker.result()}


# %%
vae = VAE(encoder, decoder)
vae.compile(optimizer=keras.optimizers.Adam())
vae.fit(images, epochs=2, batch_size=64)

# %%
# what the example does next: use the trained parts, and read the fit's History from the model
z_mean, _, _ = vae.encoder.predict(images[:8], verbose=0)
print("LATENT", z_mean.shape, "LAST LOSS", round(float(vae.history.history["loss"][-1]), 3))
