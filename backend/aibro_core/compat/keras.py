"""Keras internals (checked with Keras 3.15.1; see tests/test_compat.py and tests/try_newest.py)."""

from __future__ import annotations

from typing import Any


def compile_config(model: Any) -> dict[str, Any]:
    """The arguments `compile()` was given, as the live objects (losses, metrics, optimizer), from Keras'
    `model._compile_config.config`: Keras' own dict, so a change to it is what Keras saves. The public
    `get_compile_config()` serializes them to configs, and a subclass's own compile() (a GAN's) leaves only this
    record of what it passed to `super().compile()`. {} (a new one) when the model was never compiled."""
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    return config if isinstance(config, dict) else {}


def nested_layers(model: Any) -> list[Any]:
    """Every layer inside `model`, nested models' layers included (not `model` itself), from Keras'
    `Layer._flatten_layers`: `model.layers` lists only the direct children, and Keras has no public recursive
    walk."""
    return list(model._flatten_layers(include_self=False, recursive=True))


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The variables an optimizer was built over, from Keras' `Optimizer._trainable_variables`: no public accessor
    says which variables `build()` was given. [] before it is built."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def inputs_struct(model: Any) -> Any:
    """The structure (dict, list or single tensor) a Functional model was given its inputs in, from Keras'
    `Functional._inputs_struct`, or None. `model.inputs` is always a flat list; `model.input` is the same
    structure for a Functional model but raises or differs for other models, where the callers want None."""
    return getattr(model, "_inputs_struct", None)


def loss_function_kwargs(loss: Any) -> dict[str, Any] | None:
    """The keyword arguments a `LossFunctionWrapper` loss passes to its function (`ignore_class`, ...), from Keras'
    `LossFunctionWrapper._fn_kwargs`; `get_config()` has them only serialized and mixed with the loss's own. None
    for other losses."""
    kwargs = getattr(loss, "_fn_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else None


def eval_epoch_iterator(model: Any) -> Any:
    """The validation iterator `fit` keeps on the model between epochs, from Keras' `Trainer._eval_epoch_iterator`
    (the TensorFlow backend's trainer), or None: nothing public holds it, and the worker keeps it to free it off
    the training thread (worker/fitframe.py)."""
    return getattr(model, "_eval_epoch_iterator", None)


def random_seed() -> Any:
    """The seed `keras.utils.set_random_seed` was last given (None if never), from
    `keras.src.utils.rng_utils.get_random_seed`: Keras 3 exports the setter but not this getter."""
    from keras.src.utils.rng_utils import get_random_seed

    return get_random_seed()


def global_seed_generator() -> tuple[str, Any]:
    """(its key, the generator) of Keras' global SeedGenerator (what unseeded layers draw their seeds from), None
    before anything drew from it, from `keras.src.random.seed_generator` and `keras.src.backend.common.global_state`:
    no public API reads or restores it. `set_global_seed_generator(key, gen)` puts it back."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    key = getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator")
    return key, global_state.get_global_attribute(key)


def set_global_seed_generator(key: str, generator: Any) -> None:
    """Put back what `global_seed_generator()` returned (Keras' `global_state.set_global_attribute`)."""
    from keras.src.backend.common import global_state

    global_state.set_global_attribute(key, generator)


def precompute_save_skipsets(kinds: tuple[str, ...]) -> None:
    """Store each of `kinds`' attribute skip-set (`keras.src.saving.saving_lib.get_attr_skipset`) under the key
    Keras' save walk reads it from (`saving_attr_skiplist_<kind>` in `keras.src.backend.common.global_state`):
    Keras 3 through 3.15 writes it under `saving_attr_skipset_<kind>`, so every save builds throwaway objects to
    compute it again. No public API touches the save walk; where a key is already set this changes nothing."""
    from keras.src.backend.common import global_state
    from keras.src.saving import saving_lib

    for kind in kinds:
        key = f"saving_attr_skiplist_{kind}"
        if global_state.get_global_attribute(key, None) is None:
            global_state.set_global_attribute(key, saving_lib.get_attr_skipset(kind))


# -- keras.callbacks.TensorBoard, whose epoch-end work worker/callbacks.py splits across threads -------------------
def tensorboard_with_learning_rate(callback: Any, logs: dict[str, Any]) -> dict[str, Any]:
    """`logs` with the optimizer's learning rate added as TensorBoard's epoch end adds it
    (`TensorBoard._collect_learning_rate`): a subclass that writes the epoch's scalars itself must add it the same
    way, and Keras exposes it only there."""
    return callback._collect_learning_rate(logs)


def tensorboard_steps_per_second(callback: Any) -> float:
    """The epoch's training steps per second as TensorBoard measures them (`TensorBoard._compute_steps_per_second`,
    from its own batch timing); not public."""
    return callback._compute_steps_per_second()


def tensorboard_log_weights(callback: Any, epoch: int) -> None:
    """TensorBoard's histograms of the model's weights for `epoch` (`TensorBoard._log_weights`), which its public
    `on_epoch_end` writes together with the scalars the subclass writes itself."""
    callback._log_weights(epoch)


def tensorboard_log_embeddings(callback: Any, epoch: int) -> None:
    """TensorBoard's embeddings checkpoint for `epoch` (`TensorBoard._log_embeddings`); see
    `tensorboard_log_weights`."""
    callback._log_embeddings(epoch)


def tensorboard_writer(callback: Any, validation: bool) -> Any:
    """TensorBoard's summary writer for the training or the validation scalars (`TensorBoard._train_writer`,
    `_val_writer`: each made, with its directory, on first use), which the callback has no public handle on."""
    return callback._val_writer if validation else callback._train_writer
