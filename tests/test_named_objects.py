"""What a model names by class or function travels without registration (issue 35 items 1 and 2), checked in one
process: the kernel's plan (kerasnames.plan_names), the references as the worker resolves them
(aibro_core.objectrefs) and the saved file as Keras loads it with them. The remote fits of the same shapes are in
tests/test_models_of_models.py; here each rule and each refusal, fast."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pandas as pd
import pytest
from composite_models import loss as contrastive
from keras import ops

from aibro_core.errors import ValidationError
from aibro_core.kerasfile import keras_notes_quiet, restore_optimizers, saved_notes
from aibro_core.objectrefs import decode, resolve
from aibro_jupyter.argcodec import encode
from aibro_jupyter.bundle import Bundle, load_into, save_model
from aibro_jupyter.kerasnames import plan_names

pytestmark = pytest.mark.fast


def halved_relu(x: Any) -> Any:
    return ops.relu(x) * 0.5


def mean_gap(y_true: Any, y_pred: Any) -> Any:
    return ops.mean(ops.abs(y_true - y_pred))


def doubled(t: Any) -> Any:
    return t * 2.0


class Scale(keras.layers.Layer):
    """Unregistered, and its config is Keras' own automatic one."""

    def __init__(self, factor: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x: Any) -> Any:
        return x * self.factor


class NoKwargs(keras.layers.Layer):
    """As several published examples print it: a get_config that adds name and dtype, an __init__ without
    **kwargs, so Keras' own load cannot rebuild it (the kernel's fit never needs to)."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.units = units
        self.dense = keras.layers.Dense(units)

    def call(self, x: Any) -> Any:
        return self.dense(x)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


class WeightedError(keras.losses.Loss):
    """Keras' Loss.get_config keeps name, reduction and dtype only: Keras' own save would rebuild this loss with
    weight=1.0, silently, where the kernel's fit used the weight given."""

    def __init__(self, weight: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.weight = weight

    def call(self, y_true: Any, y_pred: Any) -> Any:
        return ops.mean(ops.square(y_true - y_pred), axis=-1) * self.weight


class Pair(keras.Model):
    """A model made of models, as a VAE or a distiller is: its __init__ takes two models, it has no get_config, and
    one of them is kept under another name."""

    def __init__(self, first: keras.Model, second: keras.Model, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.head = first
        self.second = second
        self.scale = scale

    def call(self, x: Any) -> Any:
        return self.second(self.head(x)) * self.scale


class TwoOptimizers(keras.Model):
    """A GAN's shape: no call(), its own compile() and optimizers, trained only by train_step."""

    def __init__(self, net: keras.Model) -> None:
        super().__init__()
        self.net = net
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> list[Any]:
        return [self.tracker]

    def compile(self, net_optimizer: Any) -> None:
        super().compile()
        self.net_optimizer = net_optimizer

    def train_step(self, data: Any) -> dict[str, Any]:
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = ops.mean(ops.square(self.net(x) - y))
        grads = tape.gradient(loss, self.net.trainable_weights)
        self.net_optimizer.apply_gradients(zip(grads, self.net.trainable_weights))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def _dense(units: int = 3, name: str | None = None) -> keras.Model:
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(units)], name=name)


def _save_and_load(model: keras.Model, tmp_path: Path) -> keras.Model:
    """As the job does: the kernel's save, then a load with the objects resolved from the references alone."""
    names = plan_names(model)
    bundle = Bundle(tmp_path)
    save_model(model, bundle, names)
    with keras_notes_quiet():
        return keras.saving.load_model(tmp_path / "model.keras", custom_objects=resolve(names.refs))


def test_unregistered_functions_and_a_closure_load_by_the_names_keras_records(tmp_path: Path) -> None:
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, activation=halved_relu),
            keras.layers.Lambda(doubled),
            Scale(3.0),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    model.compile(optimizer="adam", loss=contrastive(margin=2.5), metrics=[mean_gap])
    names = plan_names(model)
    assert set(names.refs) == {"halved_relu", "doubled", "Scale", "contrastive_loss", "mean_gap"}
    closure = names.refs["contrastive_loss"]["closure"]
    assert closure["ref"] == "composite_models:loss" and closure["cells"] == {"margin": 2.5}
    assert contrastive in names.travel and halved_relu in names.travel and Scale in names.travel

    loaded = _save_and_load(model, tmp_path)
    assert loaded.layers[0].activation is halved_relu and loaded.layers[2].factor == 3.0
    y, p = np.array([[1.0], [0.0]], "float32"), np.array([[0.4], [0.9]], "float32")
    made_again = loaded.loss
    assert made_again is not contrastive(2.5) and made_again.__name__ == "contrastive_loss"
    assert np.allclose(made_again(y, p), contrastive(2.5)(y, p))
    assert not np.allclose(made_again(y, p), contrastive()(y, p))


def test_a_model_made_of_models_saves_and_loads_whole(tmp_path: Path) -> None:
    model = Pair(_dense(3, "first"), keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), scale=0.5)
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"), epochs=1, verbose=0)
    names = plan_names(model)
    assert names.refs["Pair"]["init"] == {"first": "head", "second": "second", "scale": "scale", "name": "name"}
    loaded = _save_and_load(model, tmp_path)
    assert type(loaded).__name__ == "Pair" and isinstance(loaded, Pair) and loaded.scale == 0.5
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
    assert int(loaded.optimizer.iterations.numpy()) == 1 == int(model.optimizer.iterations.numpy())
    assert type(model) is Pair, "the kernel's object is left as the user's class"


def test_a_layer_keras_cannot_rebuild_from_its_own_config_is_rebuilt_from_its_arguments(tmp_path: Path) -> None:
    model = keras.Sequential([keras.Input((4,)), NoKwargs(3)])
    model.compile("adam", "mse")
    assert plan_names(model).refs["NoKwargs"]["init"] == {"units": "units"}
    loaded = _save_and_load(model, tmp_path)
    assert loaded.layers[0].units == 3
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))


def test_a_loss_whose_config_forgets_an_argument_is_rebuilt_with_it(tmp_path: Path) -> None:
    model = _dense(1)
    model.compile("adam", loss=WeightedError(weight=5.0))
    assert plan_names(model).refs["WeightedError"]["init"] == {"weight": "weight", "name": "name"}
    assert _save_and_load(model, tmp_path).loss.weight == 5.0
    assert type(model.loss) is WeightedError


def test_every_optimizer_comes_back_built_over_the_weights_it_steps(tmp_path: Path) -> None:
    """The file says which weights each optimizer steps; the kernel's object, whose optimizers were never used,
    gets their state (a GAN's d_optimizer after a remote fit)."""
    trained = TwoOptimizers(_dense(2, "net"))
    trained.compile(net_optimizer=keras.optimizers.Adam(0.01))
    trained.fit(np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"), epochs=2, batch_size=4, verbose=0)
    names = plan_names(trained)
    save_model(trained, Bundle(tmp_path), names)
    path = tmp_path / "model.keras"
    assert set(saved_notes(path)["optimizers"]) == {"net_optimizer"}

    fresh = TwoOptimizers(_dense(2, "net"))
    fresh.compile(net_optimizer=keras.optimizers.Adam(0.01))
    load_into(fresh, path, names.local)
    assert all(np.array_equal(a, b) for a, b in zip(trained.get_weights(), fresh.get_weights()))
    assert int(fresh.net_optimizer.iterations.numpy()) == 4
    assert all(
        np.array_equal(a.numpy(), b.numpy())
        for a, b in zip(trained.net_optimizer.variables, fresh.net_optimizer.variables)
    )
    assert restore_optimizers(fresh, path) == []


def test_values_decode_as_they_were(tmp_path: Path) -> None:
    objects: list[Any] = []
    value = {
        "t": (1, "a", None),
        "arr": np.arange(6, dtype="int16").reshape(2, 3),
        "inf": float("inf"),
        "fn": halved_relu,
        "loss": keras.losses.Huber(delta=2.0),
    }
    back = decode(json.loads(json.dumps(encode(value, "v", objects, None))), None, "v")
    assert back["t"] == (1, "a", None) and back["inf"] == float("inf") and back["fn"] is halved_relu
    assert back["arr"].dtype == np.int16 and np.array_equal(back["arr"], value["arr"])
    assert isinstance(back["loss"], keras.losses.Huber) and back["loss"].get_config() == value["loss"].get_config()


# -- refused before anything is uploaded, naming the fix -------------------------------------------------
def test_a_closure_over_something_that_cannot_travel_names_the_variable() -> None:
    frame = pd.DataFrame({"a": [1.0]})

    def weighted(table: Any) -> Any:
        def weighted_mse(y_true: Any, y_pred: Any) -> Any:
            return ops.mean(ops.square(y_true - y_pred)) * float(table["a"][0])

        return weighted_mse

    model = _dense(1)
    model.compile("adam", loss=weighted(frame))
    with pytest.raises(ValidationError, match=r"closes over `table`: a pandas.*DataFrame.*cannot travel"):
        plan_names(model, {"weighted": weighted})


def test_two_functions_with_the_name_keras_records_are_refused() -> None:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2), keras.layers.Dense(1)])
    model.compile("adam", loss=contrastive(1.0), metrics=[contrastive(2.0)])
    with pytest.raises(ValidationError, match=r"two different functions named contrastive_loss.*rename one"):
        plan_names(model)


def test_a_class_defined_inside_a_function_is_refused() -> None:
    class Inner(keras.layers.Layer):
        def call(self, x: Any) -> Any:
            return x

    model = keras.Sequential([keras.Input((4,)), Inner(), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    with pytest.raises(ValidationError, match=r"Inner.* is defined inside another function.*top level of a cell"):
        plan_names(model)


def test_a_model_made_of_models_that_keeps_an_argument_nowhere_is_refused() -> None:
    class Forgets(keras.Model):
        def __init__(self, inner: keras.Model) -> None:
            super().__init__()
            self.layers_ = [inner]

        def call(self, x: Any) -> Any:
            return self.layers_[0](x)

    model = Forgets(_dense(1))
    model.compile("adam", "mse")
    with pytest.raises(ValidationError, match=r"Forgets takes the argument 'inner'.*self.inner = inner"):
        plan_names(model)


def test_a_lambda_layer_over_a_named_function_needs_no_unsafe_mode(tmp_path: Path) -> None:
    """Keras saves a named function by name and loads it in safe mode; only a lambda's bytecode needs --unsafe."""
    from aibro_jupyter.bundle import check_model

    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(doubled), keras.layers.Dense(1)])
    model.compile("adam", "mse")
    check_model(model, safe_mode=True)
    lam = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: t * 2.0), keras.layers.Dense(1)])
    lam.compile("adam", "mse")
    with pytest.raises(ValidationError, match=r"Lambda layer over a lambda.*--unsafe"):
        check_model(lam, safe_mode=True)
    saved = _save_and_load(model, tmp_path)
    with zipfile.ZipFile(tmp_path / "model.keras") as z:
        assert "doubled" in z.read("config.json").decode()
    assert saved.layers[0].function is doubled


def test_a_lambda_in_a_lambda_layer_travels_as_source_with_its_globals(tmp_path: Path) -> None:
    """With --unsafe Keras would save the lambda's bytecode and load it with its own module's globals (no `ops`
    there); it travels as source instead, so it runs on the worker as in the kernel."""
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: ops.square(t) + 1.0)])
    model.compile("adam", "mse")
    names = plan_names(model)
    (name,) = names.refs
    assert name.startswith("_lambda_") and names.refs[name]["closure"]["name"] == "<lambda>"
    assert not isinstance(model.layers[0].function, type(None)) and model.layers[0].function.__name__ == "<lambda>"
    bundle = Bundle(tmp_path)
    save_model(model, bundle, names, safe_mode=False)
    with zipfile.ZipFile(tmp_path / "model.keras") as z:
        assert "__lambda__" not in z.read("config.json").decode()
    with keras_notes_quiet():
        loaded = keras.saving.load_model(tmp_path / "model.keras", custom_objects=resolve(names.refs), safe_mode=True)
    x = np.arange(8, dtype="float32").reshape(2, 4)
    assert np.allclose(loaded.predict(x, verbose=0), x**2 + 1.0)


def _saved_with_a_lambda(path: Path) -> Path:
    model = keras.Sequential([keras.Input((4,)), keras.layers.Lambda(lambda t: t * 3.0)])
    model.compile("adam", "mse")
    model.save(path)
    return path


def test_a_lambda_keras_loaded_from_bytecode_travels_as_bytecode_again(tmp_path: Path) -> None:
    """`aibro fit model.keras --unsafe`: the model file's lambda was made inside a function no one can find again
    (Keras made it from bytecode, with no source); it travels as Keras saved it, and trains as it did."""
    loaded = keras.saving.load_model(_saved_with_a_lambda(tmp_path / "in.keras"), safe_mode=False)
    assert "<locals>" in loaded.layers[0].function.__qualname__
    names = plan_names(loaded)
    assert names.refs == {} and names.lambdas == []
    save_model(loaded, Bundle(tmp_path), names, safe_mode=False)
    with zipfile.ZipFile(tmp_path / "model.keras") as z:
        assert "__lambda__" in z.read("config.json").decode()
    again = keras.saving.load_model(tmp_path / "model.keras", safe_mode=False)
    x = np.ones((2, 4), "float32")
    assert np.allclose(again.predict(x, verbose=0), 3.0)


def test_lambdas_given_to_compile_travel_as_source_with_unsafe_only(tmp_path: Path) -> None:
    from aibro_jupyter.bundle import check_model

    model = _dense(1)
    model.compile("adam", loss=lambda y, p: ops.mean(ops.square(y - p)), metrics=[lambda y, p: ops.max(p)])
    with pytest.raises(ValidationError, match=r"compile\(\)'s loss holds a lambda.*--unsafe"):
        check_model(model, safe_mode=True)
    names = plan_names(model)
    assert len(names.refs) == 2 and all(ref["closure"]["name"] == "<lambda>" for ref in names.refs.values())
    save_model(model, Bundle(tmp_path), names, safe_mode=False)
    with zipfile.ZipFile(tmp_path / "model.keras") as z:
        assert "__lambda__" not in z.read("config.json").decode()
    with keras_notes_quiet():
        loaded = keras.saving.load_model(tmp_path / "model.keras", custom_objects=resolve(names.refs))
    y, p = np.zeros((2, 1), "float32"), np.full((2, 1), 3.0, "float32")
    assert float(loaded.loss(y, p)) == 9.0
    assert model.loss.__name__ == "<lambda>", "the kernel's own compile is left as it was"


class Residual(keras.layers.Layer):
    """A layer made of a layer, inside a functional model: no get_config, its sub-layer a constructor argument."""

    def __init__(self, inner: keras.layers.Layer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x: Any) -> Any:
        return x + self.inner(x)


def test_a_layer_made_of_a_layer_inside_a_functional_model_loads_whole(tmp_path: Path) -> None:
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1)(Residual(keras.layers.Dense(4, activation=halved_relu))(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("adam", "mse")
    model.fit(np.ones((8, 4), "float32"), np.zeros((8, 1), "float32"), epochs=1, verbose=0)
    names = plan_names(model)
    assert names.refs["Residual"]["init"] == {"inner": "inner", "name": "name"}
    loaded = _save_and_load(model, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    assert np.allclose(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


class TokenAndPosition(keras.layers.Layer):
    """As keras.io's text transformer printed it: plain arguments kept nowhere but in Keras' automatic config, and an
    __init__ without **kwargs, so Keras' own load fails on the name and dtype its config adds."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int) -> None:
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        positions = ops.arange(0, ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class Counting(keras.metrics.Metric):
    """KerasTuner's guide's metric: its **kwargs go on to a super().__init__ that is given name= too, so Keras' own
    from_config (and a rebuild that passed the name) fails with 'multiple values for name'."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(name="counting", **kwargs)
        self.count = self.add_weight(name="count", initializer="zeros")

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        self.count.assign_add(ops.cast(ops.shape(y_true)[0], "float32"))

    def result(self) -> Any:
        return self.count


def test_a_layer_whose_arguments_only_its_own_config_holds_is_rebuilt_from_them(tmp_path: Path) -> None:
    inputs = keras.Input((6,), dtype="int32")
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(TokenAndPosition(6, 20, 4)(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile("adam", "mse", metrics=[Counting()])
    names = plan_names(model)
    ref = names.refs["TokenAndPosition"]
    assert ref["init"] == {} and sorted(ref["config_args"]) == ["embed_dim", "maxlen", "vocab_size"], ref
    assert names.refs["Counting"]["init"] == {}, "name= is not passed on to a **kwargs that sets its own"
    loaded = _save_and_load(model, tmp_path)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))
    assert loaded.metrics[-1].name == "compile_metrics" or loaded.compiled
