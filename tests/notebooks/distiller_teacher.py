# mirrors: keras-io examples/vision/knowledge_distillation.py (a Distiller(student, teacher) whose teacher is trained
# in the kernel first, with compile() taking its own loss functions)
# call: distiller.fit(
# kind: fit

# %%
import keras
import numpy as np
import tensorflow as tf
from keras import layers

rng = np.random.default_rng(1)
x = rng.normal(size=(384, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("int32") + 2 * (x[:, 4] > 0).astype("int32")


# %%
class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                tf.nn.softmax(student_predictions / self.temperature, axis=1),
            ) * (self.temperature**2)
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        grads = tape.gradient(loss, self.student.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.student.trainable_variables))
        for m in self.metrics:
            if m.name != "loss":
                m.update_state(y, student_predictions)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results


# %%
teacher = keras.Sequential([keras.Input((16,)), layers.Dense(64, activation="relu"), layers.Dense(4)], name="teacher")
student = keras.Sequential([keras.Input((16,)), layers.Dense(8, activation="relu"), layers.Dense(4)], name="student")
teacher.compile(
    optimizer="adam",
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
)
teacher.fit(x, y, epochs=2, verbose=0)

# %%
distiller = Distiller(student=student, teacher=teacher)
distiller.compile(
    optimizer=keras.optimizers.Adam(),
    metrics=[keras.metrics.SparseCategoricalAccuracy()],
    student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    distillation_loss_fn=keras.losses.KLDivergence(),
    alpha=0.1,
    temperature=10,
)
history = distiller.fit(x, y, epochs=2, batch_size=32)

# %%
# the trained student is used on its own afterwards
print("STUDENT", student.predict(x[:4], verbose=0).shape, round(float(history.history["student_loss"][-1]), 3))
