# mirrors: keras-io guides/customizing_what_happens_in_fit.py, "an end-to-end GAN example" (two optimizers passed to
# its own compile(), a loss function, and no call())
# call: gan.fit(
# kind: fit

# %%
import keras
import numpy as np
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(2)
real = rng.normal(loc=2.0, size=(256, 8)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices(real).batch(32)

latent_dim = 4
discriminator = keras.Sequential([keras.Input((8,)), layers.Dense(16, activation="relu"), layers.Dense(1)], name="d")
generator = keras.Sequential(
    [keras.Input((latent_dim,)), layers.Dense(16, activation="relu"), layers.Dense(8)], name="g"
)


# %%
class GAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        noise = tf.random.normal(shape=(batch_size, self.latent_dim))
        fake = self.generator(noise)
        combined = tf.concat([fake, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


# %%
gan = GAN(discriminator=discriminator, generator=generator, latent_dim=latent_dim)
gan.compile(
    d_optimizer=keras.optimizers.Adam(learning_rate=0.001),
    g_optimizer=keras.optimizers.Adam(learning_rate=0.001),
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)
history = gan.fit(dataset, epochs=2)

# %%
samples = gan.generator.predict(np.zeros((3, latent_dim), "float32"), verbose=0)
print("GENERATED", samples.shape, "D STEPS", int(gan.d_optimizer.iterations.numpy()))
