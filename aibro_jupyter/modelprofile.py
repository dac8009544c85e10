"""What a time prediction knows of a fit before it runs (issue 38): the model's fingerprint and its training FLOPs
per sample, as `aibro_core.models.ModelProfile`. A job carries its profile, so the backend can predict the next fit
of the same model from what this one measured (backend/aibro_backend/scheduling/predict.py)."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from aibro_core.compat import keras as keras_compat
from aibro_core.models import ModelProfile

from .dataset_blob import is_dataset

TRAIN_FLOPS_PER_FORWARD = 3  # a training step: the forward pass, and a backward pass of about twice its work


def model_profile(model: Any, x: Any, batch_size: int | None) -> ModelProfile:
    """The fingerprint of (architecture, input shapes, batch size) and the training FLOPs per sample of a built
    model fitted on `x`."""
    return ModelProfile(fingerprint=fingerprint(model, x, batch_size), flops_per_sample=train_flops_per_sample(model))


def fingerprint(model: Any, x: Any, batch_size: int | None) -> str:
    """One digest for the same architecture (each layer's class, its configuration without names, its weights'
    shapes, in order), the same per-sample input shapes and the same batch size: two models built by the same
    code have one fingerprint, whatever Keras named their layers."""
    layers = [
        [f"{type(layer).__module__}.{type(layer).__qualname__}", _unnamed(_config(layer)), _weight_shapes(layer)]
        for layer in keras_compat.nested_layers(model)
    ]
    described = {
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "layers": layers,
        "inputs": input_shapes(x),
        "batch_size": batch_size,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def input_shapes(x: Any) -> Any:
    """The shape of one sample of each input (a dataset: its element spec)."""
    if is_dataset(x):
        return str(x.element_spec)
    if isinstance(x, dict):
        return {str(k): input_shapes(val) for k, val in x.items()}
    if isinstance(x, (list, tuple)):
        return [input_shapes(val) for val in x]
    shape = getattr(x, "shape", None)
    return [int(d) for d in shape[1:]] if shape is not None else type(x).__name__


def samples(x: Any) -> int | None:
    """The samples in `x`, as the worker counts them for its epochs' samples per second (before a validation_split
    takes its share, so that earlier jobs and this fit are measured alike), or None where the data does not say (a
    dataset, a generator)."""
    if is_dataset(x):
        return None
    first = x
    while isinstance(first, (dict, list, tuple)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    shape = getattr(first, "shape", None)
    if not shape:
        return None
    return max(1, int(shape[0]))


def train_flops_per_sample(model: Any) -> float:
    """About how many floating-point operations one sample costs a training step: every weight matrix or kernel
    twice (a multiply and an add) per place it is applied (a Dense layer once per sample or per time step, a
    convolution once per output position, a recurrent cell once per time step), attention's scores, one operation
    per output value for everything else, and the backward pass twice the forward one. A layer whose output shape
    is not known (a subclassed model's) counts its weights once."""
    inside: set[int] = set()
    for layer in keras_compat.nested_layers(model):
        if _whole(layer):
            inside |= {id(sub) for sub in keras_compat.nested_layers(layer)}
    forward = 0.0
    for layer in keras_compat.nested_layers(model):
        if id(layer) in inside or (keras_compat.nested_layers(layer) and not _whole(layer)):
            continue  # counted inside its container, or counted by the layers it holds
        forward += _forward_flops(layer)
    return float(TRAIN_FLOPS_PER_FORWARD * forward)


def _whole(layer: Any) -> bool:
    """A layer whose sublayers run inside its own loop or its own arithmetic: counted as one."""
    import keras

    return isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional, keras.layers.MultiHeadAttention))


def _forward_flops(layer: Any) -> float:
    import keras

    out = _shape(layer, "output")
    matrices = sum(math.prod(w.shape) for w in layer.weights if len(w.shape) >= 2)
    elementwise = math.prod(out) if out else 0
    if isinstance(layer, keras.layers.Embedding):
        return float(elementwise)  # a lookup
    if isinstance(layer, (keras.layers.RNN, keras.layers.Bidirectional)):
        inp = _shape(layer, "input")
        steps = inp[0] if inp and len(inp) >= 2 else 1
        return 2.0 * matrices * steps + elementwise
    if isinstance(layer, keras.layers.MultiHeadAttention):
        inp = _shape(layer, "input")
        steps = inp[0] if inp and len(inp) >= 2 else 1
        width = layer.num_heads * layer.key_dim
        return 2.0 * matrices * steps + 4.0 * steps * steps * width + elementwise
    if out is None:
        return 2.0 * matrices
    positions = math.prod(out[:-1]) if len(out) > 1 else 1
    return 2.0 * matrices * positions + elementwise


def _shape(layer: Any, which: str) -> list[int] | None:
    """A layer's output (or first input) shape without the batch, where its graph says (None when unknown)."""
    try:
        tensor = getattr(layer, which)
    except (AttributeError, ValueError, RuntimeError):  # never called in a graph, or called at several places
        return None
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0] if tensor else None
    if isinstance(tensor, dict):
        tensor = next(iter(tensor.values()), None)
    shape = getattr(tensor, "shape", None)
    if shape is None or any(d is None for d in shape[1:]):
        return None
    return [int(d) for d in shape[1:]]


def _config(layer: Any) -> Any:
    try:
        return layer.get_config()
    except (NotImplementedError, TypeError):  # a custom layer with no get_config: its class and weights say a lot
        return {}


def _unnamed(value: Any) -> Any:
    """A configuration without the names Keras numbers per session (dense, dense_1, ...)."""
    if isinstance(value, dict):
        return {k: _unnamed(val) for k, val in value.items() if k != "name"}
    if isinstance(value, (list, tuple)):
        return [_unnamed(val) for val in value]
    return value


def _weight_shapes(layer: Any) -> list[list[int]]:
    return [[int(d) for d in w.shape] for w in layer.weights]
