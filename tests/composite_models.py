"""Models made of models and functions no one registered, in the shapes of keras.io's examples (a VAE, knowledge
distillation, the GAN of the "customizing fit()" guide, a siamese network's contrastive loss), written here for
the tests that train them remotely (tests/test_models_of_models.py). A module of its own, so the code that travels
with their jobs is this file alone."""

from __future__ import annotations

import sys
from typing import Any

import keras
import tensorflow as tf
from keras import layers, ops


class Sampling(layers.Layer):
    """Unregistered; draws from a seed generator of its own."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs: Any) -> Any:
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(shape=ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def encoder_decoder(latent_dim: int = 2) -> tuple[keras.Model, keras.Model]:
    inputs = keras.Input(shape=(8, 8, 1))
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(8, activation="relu")(x)
    z_mean = layers.Dense(latent_dim, name="z_mean")(x)
    z_log_var = layers.Dense(latent_dim, name="z_log_var")(x)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])], name="encoder")
    latent = keras.Input(shape=(latent_dim,))
    x = layers.Dense(4 * 4 * 4, activation="relu")(latent)
    x = layers.Reshape((4, 4, 4))(x)
    outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", strides=2, padding="same")(x)
    return encoder, keras.Model(latent, outputs, name="decoder")


class VAE(keras.Model):
    """No get_config, no call(): Keras cannot save it, and fit trains it through train_step alone."""

    def __init__(self, encoder: keras.Model, decoder: keras.Model, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.total_loss_tracker, self.kl_loss_tracker]

    def train_step(self, data: Any) -> dict[str, Any]:
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        self.total_loss_tracker.update_state(total_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(), "kl_loss": self.kl_loss_tracker.result()}


class GAN(keras.Model):
    """Two optimizers of its own from a custom compile(), no call(), never called before its fit."""

    def __init__(self, discriminator: keras.Model, generator: keras.Model, latent_dim: int) -> None:
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)

    @property
    def metrics(self) -> list[Any]:
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer: Any, g_optimizer: Any, loss_fn: Any) -> None:
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    def train_step(self, real_images: Any) -> dict[str, Any]:
        batch_size = ops.shape(real_images)[0]
        noise = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        combined = ops.concatenate([self.generator(noise), real_images], axis=0)
        labels = ops.concatenate([ops.ones((batch_size, 1)), ops.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        noise = keras.random.normal(shape=(batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(ops.zeros((batch_size, 1)), self.discriminator(self.generator(noise)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def gan_parts(latent_dim: int = 4) -> tuple[keras.Model, keras.Model]:
    discriminator = keras.Sequential(
        [layers.InputLayer((8, 8, 1)), layers.Conv2D(4, 3, strides=2, padding="same"), layers.LeakyReLU(0.2),
         layers.GlobalMaxPooling2D(), layers.Dense(1)],
        name="discriminator",
    )  # fmt: skip
    generator = keras.Sequential(
        [layers.InputLayer((latent_dim,)), layers.Dense(4 * 4 * 4), layers.LeakyReLU(0.2), layers.Reshape((4, 4, 4)),
         layers.Conv2DTranspose(1, 4, strides=2, padding="same", activation="sigmoid")],
        name="generator",
    )  # fmt: skip
    return discriminator, generator


class Distiller(keras.Model):
    """A student and a teacher (trained before), its own compile() arguments, compute_loss overridden."""

    def __init__(self, student: keras.Model, teacher: keras.Model) -> None:
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(
        self,
        optimizer: Any,
        metrics: Any,
        student_loss_fn: Any,
        distillation_loss_fn: Any,
        alpha: float = 0.1,
        temperature: float = 3,
    ) -> None:
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def compute_loss(
        self, x: Any = None, y: Any = None, y_pred: Any = None, sample_weight: Any = None, allow_empty: bool = False
    ) -> Any:
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1), ops.softmax(y_pred / self.temperature, axis=1)
        ) * (self.temperature**2)
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x: Any) -> Any:
        return self.student(x)


def classifier(name: str, width: int) -> keras.Model:
    return keras.Sequential(
        [keras.Input((8, 8, 1)), layers.Conv2D(width, 3, padding="same"), layers.LeakyReLU(0.2), layers.Flatten(),
         layers.Dense(10)],
        name=name,
    )  # fmt: skip


def loss(margin: float = 1) -> Any:
    """The siamese example's loss: a closure over `margin`, compiled as loss=loss(margin=1), never registered."""

    def contrastive_loss(y_true: Any, y_pred: Any) -> Any:
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - y_pred, 0))
        return ops.mean((1 - y_true) * square_pred + y_true * margin_square)

    return contrastive_loss


def euclidean_distance(vects: Any) -> Any:
    x, y = vects
    sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def siamese() -> keras.Model:
    """Two inputs through one tower, their distance through a Lambda over a named function (loads in safe mode)."""
    tower = keras.Sequential([keras.Input((16,)), layers.Dense(8, activation="tanh")], name="tower")
    left, right = keras.Input((16,)), keras.Input((16,))
    distance = layers.Lambda(euclidean_distance, output_shape=(1,))([tower(left), tower(right)])
    out = layers.Dense(1, activation="sigmoid")(layers.BatchNormalization()(distance))
    return keras.Model([left, right], out)


class Talks(keras.callbacks.Callback):
    """Prints at each epoch's end, to stdout and to stderr."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        print(f"talks: epoch {epoch} ended")
        print(f"talks: warning at epoch {epoch}", file=sys.stderr)


class Batches(keras.utils.PyDataset):
    """A PyDataset whose items are whole batches (the last one short), as keras.io's metric learning draws its
    anchor/positive pairs: fit reads one item per step."""

    def __init__(self, x: Any, y: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i: int) -> Any:
        part = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[part], self.y[part]


class Leaves(keras.callbacks.Callback):
    """Writes into the working directory at each epoch's end, as keras.io's GAN monitors save their images (and,
    once, a .py file, which must not come back into the notebook's folder)."""

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        with open(f"generated_{epoch}.txt", "w") as f:
            f.write(f"epoch {epoch} loss {logs['loss']:.6f}")
        if epoch == 0:
            with open("sneaky.py", "w") as f:
                f.write("print('never run')\n")


class Vocabulary(keras.callbacks.Callback):
    """keras.io's miniature GPT's TextGenerator keeps its whole vocabulary (a list of 20,000 words) as an argument."""

    def __init__(self, index_to_word: list[str]) -> None:
        super().__init__()
        self.index_to_word = index_to_word
