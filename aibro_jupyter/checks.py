"""Mistakes found in the kernel before anything is encoded, written or uploaded.

Each error names the argument the way the user typed it (`cool_down_period_s` for `Training.online_fit`,
`--cool-down` for `%%cloud_fit`), the bad value, and the fix. The order is part of the contract: argument types
and ranges first, then the job's size from `nbytes` (no byte of the data is read), and only then the scans of the
contents (feature shapes, label range, NaN/inf), which read the data in bounded chunks.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

# The backend's bounds on a job spec, checked here first so the user sees their own argument's name.
from aibro_core.bounds import MAX_BATCH_SIZE, MAX_COOL_DOWN_S, MAX_DESCRIPTION_CHARS, MAX_WAIT_REQUEST_S
from aibro_core.compat import keras as keras_compat
from aibro_core.datatree import MAX_KEY_CHARS, MAX_TREE_DEPTH, MAX_TREE_ITEMS
from aibro_core.models import Policy

from .dataset_blob import is_dataset
from .errors import ValidationError
from .fitrequest import FitRequest

# A NaN/label scan reads at most this many elements at a time, whatever the array's size (memmaps included).
CHUNK_ELEMENTS = 1 << 22

PYTHON_NAMES = {
    "machine_ids": "machine_ids",
    "cool_down_period_s": "cool_down_period_s",
    "description": "description",
    "wait_request_s": "wait_request_s",
    "wait_new_job_create_s": "wait_new_job_create_s",
    "wait_new_job_create_interval": "wait_new_job_create_interval",
    "train_X": "train_X",
    "train_Y": "train_Y",
    "sample_weight": "fit_kwargs['sample_weight']",
    "validation_data": "validation_data",
}


def typed_names(argnames: dict[str, str] | None = None) -> dict[str, str]:
    """Python argument name → what the user typed (the Python name unless told otherwise)."""
    return {**PYTHON_NAMES, **(argnames or {})}


def _example(name: str, value: str) -> str:
    """How the user would write `value` for this argument: `--cool-down 600` or `cool_down_period_s=600`."""
    return f"{name} {value}" if name.startswith("-") else f"{name}={value}"


# -- job arguments -----------------------------------------------------------------------------------------
def check_job_args(request: FitRequest) -> None:
    """Types and ranges of the job's own arguments (not the fit's), named as the user typed them."""
    n = typed_names(request.argnames)
    _check_machine_ids(request.machine_ids, n["machine_ids"])
    _check_seconds(
        request.cool_down_period_s,
        n["cool_down_period_s"],
        MAX_COOL_DOWN_S,
        f"how long the machine stays warm for the next job, between 0 and {MAX_COOL_DOWN_S} (one week), "
        f"e.g. {_example(n['cool_down_period_s'], '600')}, or 0 to release it at once",
    )
    _check_seconds(
        request.wait_request_s,
        n["wait_request_s"],
        MAX_WAIT_REQUEST_S,
        f"how long to wait for a machine before trying the next one in the list, at most {MAX_WAIT_REQUEST_S} "
        "(30 days), "
        f"e.g. {_example(n['wait_request_s'], '60')}",
    )
    _check_seconds(
        request.wait_new_job_create_s,
        n["wait_new_job_create_s"],
        None,
        "how long to wait for a job slot when you are at the job limit, "
        f"e.g. {_example(n['wait_new_job_create_s'], '600')}, or 0 to fail at once",
    )
    _check_seconds(
        request.wait_new_job_create_interval,
        n["wait_new_job_create_interval"],
        None,
        f"how often to ask for a job slot while waiting, e.g. {_example(n['wait_new_job_create_interval'], '5')}",
    )
    name, description = n["description"], request.description
    if not isinstance(description, str):
        raise ValidationError(
            f"{name} must be a string, got {_show(description)}: pass a short note shown in job lists, "
            f"e.g. {_example(name, chr(34) + 'digits cnn' + chr(34))}, or leave it out"
        )
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise ValidationError(
            f"{name} is {len(description)} characters long ({description[:40]!r}...), over the limit of "
            f"{MAX_DESCRIPTION_CHARS}: shorten it to at most {MAX_DESCRIPTION_CHARS} characters "
            "(it is a note shown in job lists; keep longer notes in the notebook)"
        )


def fit_batch_size(value: Any, name: str, x: Any) -> int | None:
    """A batch size as the backend takes it. One larger than the data is one batch of all of it, in Keras as here,
    so a size over the backend's bound is sent as the number of samples; refused only where that is over it too."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValidationError(f"{name} must be a positive integer, got {value!r}: e.g. {name}=32")
    value = int(value)
    if value <= MAX_BATCH_SIZE:
        return value
    samples = next((len(arr) for arr, _ in _leaves(x, name) if arr.ndim), None) if x is not None else None
    if samples is not None and samples <= MAX_BATCH_SIZE:
        return max(1, samples)
    raise ValidationError(
        f"{name}={value} is over the backend's limit of {MAX_BATCH_SIZE} samples in one batch: "
        f"pass a smaller {name}, e.g. {name}=1024"
    )


def _check_machine_ids(machine_ids: Any, name: str) -> None:
    if machine_ids is None or isinstance(machine_ids, str):
        return
    if isinstance(machine_ids, (list, tuple)):
        bad = [m for m in machine_ids if not isinstance(m, str) or not m.strip()]
        if not bad:
            return
        raise ValidationError(
            f"{name} must list machine ids as strings, but it holds {_show(bad[0])}: pass e.g. "
            f"{_example(name, repr(['local-cpu']) if not name.startswith('-') else 'local-cpu')} "
            "(see available_machines() or %cloud_machines)"
        )
    raise ValidationError(
        f"{name} must be a machine id, a comma-separated list of them or a list of strings, got {_show(machine_ids)}: "
        f"pass e.g. {_example(name, repr('g4dn.xlarge,g4dn.xlarge.od') if not name.startswith('-') else 'local-cpu')}"
        " (see available_machines() or %cloud_machines)"
    )


def _check_seconds(value: Any, name: str, most: float | None, what: str) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if ok and math.isfinite(float(value)) and value >= 0 and (most is None or value <= most):
        return
    if not ok:
        problem = f"must be a number of seconds, got {_show(value)}"
    elif not math.isfinite(float(value)):
        problem = f"must be a finite number of seconds, got {value}"
    elif value < 0:
        problem = f"cannot be negative, got {value}"
    else:
        problem = f"is at most {most} seconds, got {value}"
    raise ValidationError(f"{name} {problem}: it is {what}")


def _show(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


# -- structure ----------------------------------------------------------------------------------------------
def check_tree(value: Any, name: str, depth: int = 1) -> None:
    """The backend's limits on a data tree (depth, entries, key length), met before anything is read or sent."""
    if isinstance(value, dict) or _is_input_list(value):
        check_branch(value, name, depth)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            check_tree(item, f"{name}[{key!r}]", depth + 1)


def check_branch(value: dict | list | tuple, name: str, depth: int) -> None:
    """One dict or list of a data tree against the backend's limits."""
    if depth >= MAX_TREE_DEPTH:
        raise ValidationError(
            f"{name} nests lists and dicts more than {MAX_TREE_DEPTH} levels deep: pass a flatter structure "
            "(a dict of arrays, or a list of arrays)"
        )
    if len(value) > MAX_TREE_ITEMS:
        raise ValidationError(f"{name} holds {len(value)} entries, over {MAX_TREE_ITEMS}: concatenate the arrays")
    long_key = next((str(k) for k in value if len(str(k)) > MAX_KEY_CHARS), None) if isinstance(value, dict) else None
    if long_key is not None:
        raise ValidationError(f"{name} has a key over {MAX_KEY_CHARS} characters ({long_key[:40]}...): shorten it")


# -- size ------------------------------------------------------------------------------------------------
def total_nbytes(*trees: Any) -> int:
    """Bytes the arrays in `trees` hold in memory, from their `nbytes`/shape and dtype: no data is read or copied
    (a memmap stays on disk). Datasets count 0 here (they are measured once saved). Never raises."""
    return sum(_nbytes(t) for t in trees)


def _nbytes(value: Any) -> int:
    try:
        return _nbytes_unsafe(value)
    except Exception:  # noqa: BLE001 - a value we cannot measure is measured later, once written
        return 0


def _nbytes_unsafe(value: Any) -> int:
    if value is None or is_dataset(value):
        return 0
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, np.ndarray):
        return int(value.nbytes) + (_object_payload(value) if value.dtype == object else 0)
    if _is_tf(value):
        return _tf_nbytes(value)
    if isinstance(value, (list, tuple)):
        if any(hasattr(v, "shape") or isinstance(v, dict) for v in value):
            return sum(_nbytes(v) for v in value)
        try:
            arr = np.asarray(value)  # plain Python lists: already bigger in memory than the array they make
        except (ValueError, TypeError):
            return sum(_nbytes(v) for v in value)
        return _nbytes(arr)
    if isinstance(value, (str, bytes)):
        return len(value)
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, numbers.Integral):
        return int(nbytes)
    if hasattr(value, "memory_usage") and hasattr(value, "columns"):  # a pandas DataFrame
        return int(value.memory_usage(index=False, deep=False).sum())
    return 0


def _object_payload(arr: np.ndarray) -> int:
    """Estimated bytes of the Python objects (strings) an object array points at, from a sample of 1000."""
    if arr.size == 0:
        return 0
    flat = arr.reshape(-1)
    sample = flat[:: max(1, flat.size // 1000)][:1000]
    lengths = [len(s) if isinstance(s, (str, bytes)) else 8 for s in sample]
    return int(sum(lengths) / len(lengths) * flat.size)


def _is_tf(value: Any) -> bool:
    return type(value).__module__.startswith("tensorflow") and hasattr(value, "dtype") and hasattr(value, "shape")


def _tf_nbytes(value: Any) -> int:
    flat = getattr(value, "flat_values", None)  # a RaggedTensor
    if flat is not None:
        return _nbytes(flat)
    count = value.shape.num_elements()
    if count is None:
        return 0
    if value.dtype.name != "string":
        return int(count * value.dtype.size)
    if count == 0:
        return 0
    import tensorflow as tf

    sample = tf.reshape(value, [-1])[:: max(1, count // 1000)][:1000]
    return int(float(tf.reduce_mean(tf.cast(tf.strings.length(sample), tf.float64))) * count)


def data_sizes(x: Any, y: Any, sample_weight: Any, validation_data: Any, names: dict[str, str]) -> dict[str, int]:
    """Bytes per argument, keyed by the name the user typed."""
    n = typed_names(names)
    return {
        n["train_X"]: total_nbytes(x),
        n["train_Y"]: total_nbytes(y),
        n["sample_weight"]: total_nbytes(sample_weight),
        n["validation_data"]: total_nbytes(*_validation_parts(validation_data)),
    }


def check_size(
    nbytes: int, limit: int, names: dict[str, str] | None = None, parts: dict[str, int] | None = None
) -> None:
    """Refuse a job whose data is over the backend's per-job limit, before anything is read or written."""
    if nbytes <= limit:
        return
    n = typed_names(names)
    shown = {k: b for k, b in (parts or {}).items() if b}
    what = (
        "the data (" + ", ".join(f"{k} {human_bytes(b)}" for k, b in shown.items()) + ")"
        if len(shown) > 1
        else (f"{next(iter(shown))}" if shown else "the data")
    )
    raise ValidationError(
        f"{what} is {human_bytes(nbytes)} ({nbytes} bytes) but this backend takes at most {human_bytes(limit)} per "
        f"job, so it is over the {limit}-byte limit per job: train on a sample (e.g. {n['train_X']}[:100000]), "
        "use a smaller dtype (float32 instead of float64, uint8 for images), "
        "or raise the limit where the backend runs (AIBRO_MAX_JOB_BYTES)"
    )


def human_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} bytes" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- data against the model -------------------------------------------------------------------------------
def _validation_parts(validation_data: Any) -> list[Any]:
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return list(validation_data) + [None] * (3 - len(validation_data))
    return [None, None, None]


def check_fit_data(
    model: Any,
    x: Any,
    y: Any,
    sample_weight: Any,
    validation_data: Any,
    names: dict[str, str] | None = None,
) -> None:
    """Shapes and dict keys against the model's inputs, sparse labels against its output units, NaN/inf in
    labels (error) and features (warning). Reads the arrays in bounded chunks; run it after the size check."""
    n = typed_names(names)
    vname = n["validation_data"]
    vx, vy, vw = _validation_parts(validation_data)
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        for i, (part, what) in enumerate(((vx, "inputs"), (vy, "targets"))):
            if part is None:
                raise ValidationError(
                    f"{vname}[{i}] (the validation {what}) is None: pass {vname}=(x_val, y_val) with both parts, "
                    f"or leave {vname} out (a tf.data.Dataset yielding (inputs, targets) works too)"
                )
    for value, name in ((x, n["train_X"]), (y, n["train_Y"]), (vx, f"{vname}[0]"), (vy, f"{vname}[1]")):
        _refuse_python_list(value, name)
    if model is not None:  # None: what reaches the model is made later (a HyperModel's own fit)
        if not is_dataset(x):
            _check_inputs(model, x, n["train_X"])
        if vx is not None and not is_dataset(vx):
            _check_inputs(model, vx, f"{vname}[0]")
        for value, name in ((y, n["train_Y"]), (vy, f"{vname}[1]")):
            _check_targets(model, value, name)
    for value, name in (
        (x, n["train_X"]),
        (vx, f"{vname}[0]"),
        (sample_weight, n["sample_weight"]),
        (vw, f"{vname}[2]"),
    ):
        if is_dataset(value):
            continue
        for leaf, where in _leaves(value, name):
            bad = _scan(leaf).bad
            if bad:
                warnings.warn(
                    f"{where} holds {bad.count} NaN or inf value(s) (first in row {bad.row}); the remote fit will "
                    f"likely report a NaN loss. If you did not mean that, fill them (np.nan_to_num({where})) "
                    "or drop those rows",
                    stacklevel=4,
                )


# -- inputs
def _model_inputs(model: Any) -> tuple[str, list[tuple[str, tuple[Any, ...], str]]] | None:
    """('dict' | 'list' | 'single', [(name, shape, dtype), ...]) when the model's inputs are known, else None."""
    try:
        import keras

        if not isinstance(model, keras.Model):
            return None
        tensors = list(model.inputs)
        struct = keras_compat.inputs_struct(model)
    except Exception:  # noqa: BLE001 - an unbuilt Sequential or subclassed model: no known inputs
        return None
    if not tensors:
        return None
    if isinstance(struct, dict) and len(struct) == len(tensors):
        return "dict", [(str(k), _tuple(t.shape), str(t.dtype)) for k, t in struct.items()]
    kind = "list" if isinstance(struct, (list, tuple)) and len(tensors) > 1 else "single"
    return kind, [(str(t.name), _tuple(t.shape), str(t.dtype)) for t in tensors]


def _tuple(shape: Any) -> tuple[Any, ...]:
    return tuple(None if d is None else int(d) for d in shape)


def _is_input_list(value: Any) -> bool:
    """A list of arrays (one per input), as bundle.encode_tree reads it, not a list of samples."""
    return isinstance(value, (list, tuple)) and bool(value) and all(hasattr(v, "shape") for v in value)


def _check_inputs(model: Any, x: Any, name: str) -> None:
    known = _model_inputs(model)
    if known is None or x is None:
        return
    kind, inputs = known
    expected = [n for n, _, _ in inputs]
    if isinstance(x, dict):
        missing = [k for k in expected if k not in x]
        extra = [str(k) for k in x if k not in expected]
        if _is_sequential(model):
            raise ValidationError(
                f"{name} is a dict (keys {sorted(map(str, x))[:5]}), but model '{model.name}' is a Sequential, whose "
                f"one input has no name to match a key, so Keras' fit refuses it: pass the array itself "
                f"({name}={name}[{next(iter(x))!r}]), or build a functional model with keras.Input(..., name=...)"
            )
        if kind == "single" and (missing or extra):
            return  # one input of another name: Keras decides what the dict means there
        if missing or extra:
            raise ValidationError(
                f"{name} is a dict whose keys do not match the model's inputs {expected}: "
                + "; ".join(
                    p
                    for p in (
                        f"missing {missing}" if missing else "",
                        f"unexpected {extra}" if extra else "",
                    )
                    if p
                )
                + f". Pass one array per input name: {name}={{"
                + ", ".join(f"{k!r}: ..." for k in expected)
                + "}, or name the model's inputs to match (keras.Input(..., name='...'))"
            )
        if not missing:
            for input_name, shape, dtype in inputs:
                _check_shape(x[input_name], f"{name}[{input_name!r}]", input_name, shape, dtype, model)
        return
    if _is_input_list(x) and (len(inputs) > 1 or len(x) > 1):
        if len(x) != len(inputs):
            raise ValidationError(
                f"{name} is a list of {len(x)} arrays but model '{model.name}' has {len(inputs)} input(s) {expected}: "
                f"pass exactly one array per input, in that order, or a dict keyed by input name"
            )
        if kind != "dict":
            for i, (value, (input_name, shape, dtype)) in enumerate(zip(x, inputs)):
                _check_shape(value, f"{name}[{i}]", input_name, shape, dtype, model)
        return
    if len(inputs) > 1:
        raise ValidationError(
            f"{name} is a single array but model '{model.name}' has {len(inputs)} inputs {expected}: pass a dict "
            f"keyed by input name ({name}={{" + ", ".join(f"{k!r}: ..." for k in expected) + "}) or a list of "
            f"{len(inputs)} arrays in that order"
        )
    value = x[0] if _is_input_list(x) else x
    input_name, shape, dtype = inputs[0]
    _check_shape(value, name, input_name, shape, dtype, model)


def _refuse_python_list(value: Any, name: str) -> None:
    """A Python list of samples (numbers or nested lists) is data Keras' fit does not take ("Unrecognized data
    type"); a list of arrays is one array per input, which it does."""
    if isinstance(value, (list, tuple)) and value and not _is_input_list(value):
        if all(isinstance(v, dict) for v in value):
            return
        try:
            np.asarray(value)
        except (ValueError, TypeError) as exc:
            raise ValidationError(
                f"{name} is a ragged Python {type(value).__name__} ({exc}), which Keras' fit does not take: pad the "
                "sequences to one length (keras.utils.pad_sequences) and pass np.asarray(..., dtype='int32')"
            ) from None
        raise ValidationError(
            f"{name} is a Python {type(value).__name__} of {len(value)} samples, which Keras' fit does not take "
            f"(it takes arrays, one per input): pass np.asarray({name}, dtype='float32') (or the dtype it holds)"
        )


def _is_sequential(model: Any) -> bool:
    import keras

    return isinstance(model, keras.Sequential)


def _shape_of(value: Any) -> tuple[Any, ...] | None:
    shape = getattr(value, "shape", None)
    if shape is None:
        if not isinstance(value, (list, tuple)):
            return None
        try:
            shape = np.shape(value)
        except (ValueError, TypeError):  # ragged: bundle names that problem and its fix
            return None
    try:
        return tuple(None if d is None else int(d) for d in shape)
    except (TypeError, ValueError):
        return None  # a TensorShape of unknown rank


def _dims_match(have: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    return len(have) == len(want) and all(h is None or w is None or h == w for h, w in zip(have, want))


def _check_shape(value: Any, name: str, input_name: str, input_shape: tuple[Any, ...], dtype: str, model: Any) -> None:
    full = _shape_of(value)
    if full is None or len(full) == 0 or len(input_shape) == 0:
        return
    have, want = full[1:], input_shape[1:]
    # Keras adds or drops a trailing axis of 1 itself ((n,) fits an input of shape (None, 1) and back).
    if _dims_match(have, want) or (want[-1:] == (1,) and _dims_match(have, want[:-1])):
        return
    if have[-1:] == (1,) and _dims_match(have[:-1], want):
        return
    want_text = "(" + ", ".join("None" if d is None else str(d) for d in input_shape) + ")"
    sample = "(" + ", ".join("?" if d is None else str(d) for d in want) + ("," if len(want) == 1 else "") + ")"
    fix = f"pass samples of shape {sample}"
    if None not in have and None not in want and math.prod(have) == math.prod(want) and have:
        fix = f"reshape it: {name}.reshape(-1, {', '.join(str(d) for d in want)})"
    raise ValidationError(
        f"{name} has shape {full}, so each sample has shape {have}, but model '{model.name}' expects input "
        f"'{input_name}' of shape {want_text} (dtype {dtype}): {fix}, or build the model for these features "
        f"(keras.Input(shape={have}))"
    )


# -- targets
SPARSE_LOSS = "sparsecategoricalcrossentropy"


def _loss_name(loss: Any) -> str:
    if isinstance(loss, str):
        return loss.replace("_", "").lower()
    fn = getattr(loss, "fn", None)  # a LossFunctionWrapper such as keras.losses.SparseCategoricalCrossentropy()
    for obj in (fn, loss, type(loss)):
        label = getattr(obj, "__name__", None)
        if isinstance(label, str):
            label = label.replace("_", "").lower()
            if label == SPARSE_LOSS:
                return label
    return ""


def _ignore_class(loss: Any) -> Any:
    kwargs = keras_compat.loss_function_kwargs(loss)
    return None if kwargs is None else kwargs.get("ignore_class")


def _output_targets(model: Any, y: Any, name: str) -> list[tuple[Any, str, Any, tuple[Any, ...], str]]:
    """[(y part, its name, its loss, output shape, output name)] where the pairing is clear."""
    try:
        import keras

        if not isinstance(model, keras.Model):
            return []
        outputs = list(model.outputs)
        out_names = list(getattr(model, "output_names", None) or [])
        if not out_names and len(outputs) == 1:  # a Sequential: its output is its last layer's
            out_names = [model.layers[-1].name if model.layers else str(outputs[0].name)]
        loss = getattr(model, "loss", None)
        if loss is None:
            loss = keras_compat.compile_config(model).get("loss")
    except Exception:  # noqa: BLE001 - unbuilt or subclassed: outputs unknown
        return []
    if not outputs or loss is None or len(out_names) != len(outputs):
        return []
    shapes = [_tuple(t.shape) for t in outputs]
    if len(outputs) == 1:
        one = loss[0] if isinstance(loss, (list, tuple)) and len(loss) == 1 else loss
        if isinstance(one, dict):
            one = one.get(out_names[0])
        if isinstance(y, dict) and len(y) == 1:
            y = next(iter(y.values()))
        if _is_input_list(y) and len(y) == 1:
            y = y[0]
        return [(y, name, one, shapes[0], out_names[0])]
    pairs = []
    for i, out in enumerate(out_names):
        part_loss = loss.get(out) if isinstance(loss, dict) else loss[i] if isinstance(loss, (list, tuple)) else loss
        if isinstance(y, dict) and out in y:
            pairs.append((y[out], f"{name}[{out!r}]", part_loss, shapes[i], out))
        elif _is_input_list(y) and len(y) == len(out_names):
            pairs.append((y[i], f"{name}[{i}]", part_loss, shapes[i], out))
    return pairs


def _check_targets(model: Any, y: Any, name: str) -> None:
    if y is None or is_dataset(y):
        return
    checked: set[str] = set()
    for part, where, loss, out_shape, out in _output_targets(model, y, name):
        arr = _numeric(part)
        if arr is None:
            continue
        checked.add(where)
        units = out_shape[-1] if out_shape else None
        sparse = _loss_name(loss) == SPARSE_LOSS and units is not None
        ignore = _ignore_class(loss) if sparse else None
        if sparse and units > 1 and arr.ndim == len(out_shape) and _dims_match(arr.shape[1:], out_shape[1:]):
            raise ValidationError(
                f"{where} has shape {arr.shape}, which looks one-hot, but output '{out}' is trained with "
                f"sparse_categorical_crossentropy, which takes one integer class per sample: pass "
                f"{where}.argmax(axis=-1), or compile with loss='categorical_crossentropy'"
            )
        scan = _scan(arr, want_range=sparse, ignore=ignore)
        _refuse_nonfinite_targets(scan, where)
        if sparse and scan.lo is not None and (scan.lo < 0 or scan.hi >= units):
            fix = (
                f"relabel {where} to 0..{units - 1} (e.g. subtract 1 if they start at 1, or "
                f"np.unique({where}, return_inverse=True)[1]), or make the last layer Dense(N) with N = the number "
                "of classes" + (f" (at least {_num(scan.hi + 1)} here)" if scan.hi >= units else "")
            )
            if units == 1:
                fix += "; for two classes with one sigmoid unit, compile with loss='binary_crossentropy'"
            raise ValidationError(
                f"{where} holds labels from {_num(scan.lo)} to {_num(scan.hi)}, but output '{out}' has {units} "
                f"unit(s) and sparse_categorical_crossentropy needs integer labels 0..{units - 1}: {fix}"
            )
    for leaf, where in _leaves(y, name):
        if where not in checked:
            _refuse_nonfinite_targets(_scan(leaf), where)


def _refuse_nonfinite_targets(scan: _Scan, where: str) -> None:
    if scan.bad:
        raise ValidationError(
            f"{where} holds {scan.bad.count} NaN or inf label(s) (first in row {scan.bad.row}): a NaN target makes "
            f"the loss NaN and training fails. Drop those rows from the inputs and {where} alike "
            f"(keep = np.isfinite({where}).all(axis=tuple(range(1, {where}.ndim))), then x[keep], {where}[keep]) "
            "or fill them with a valid value"
        )


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


# -- scanning ---------------------------------------------------------------------------------------------
class _Bad:
    def __init__(self, count: int, row: int) -> None:
        self.count, self.row = count, row


class _Scan:
    def __init__(self) -> None:
        self.bad: _Bad | None = None
        self.lo: Any = None
        self.hi: Any = None


def _leaves(value: Any, name: str) -> Iterator[tuple[np.ndarray, str]]:
    """The numeric arrays in a value (dict/list trees included), with their names; strings are skipped."""
    if value is None or is_dataset(value):
        return
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, f"{name}[{k!r}]")
        return
    if _is_input_list(value):
        for i, v in enumerate(value):
            yield from _leaves(v, f"{name}[{i}]")
        return
    arr = _numeric(value)
    if arr is not None:
        yield arr, name


def _numeric(value: Any) -> np.ndarray | None:
    """A numpy view of a numeric array, or None for strings, objects and what cannot be an array."""
    if isinstance(value, np.ndarray):
        arr = value
    elif _is_tf(value):
        if not (value.dtype.is_floating or value.dtype.is_integer or value.dtype.is_bool):
            return None  # strings: nothing numeric to scan
        try:
            arr = np.asarray(value)
        except Exception:  # noqa: BLE001 - a symbolic or ragged tensor
            return None
    elif isinstance(value, (list, tuple)) or hasattr(value, "__array__"):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):
            return None
    else:
        return None
    if arr.dtype.kind not in "biufc" or arr.ndim == 0:
        return None
    return arr


def _chunks(arr: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    row = max(1, math.prod(arr.shape[1:]))
    step = max(1, CHUNK_ELEMENTS // row)
    for start in range(0, arr.shape[0], step):
        yield start, arr[start : start + step]


def _scan(arr: np.ndarray, want_range: bool = False, ignore: Any = None) -> _Scan:
    """One bounded pass: NaN/inf count and first row, and (when asked) the min and max label."""
    out = _Scan()
    floating = arr.dtype.kind in "fc"
    if not floating and not want_range:
        return out
    count, first = 0, -1
    for start, chunk in _chunks(arr):
        if floating:
            with np.errstate(all="ignore"):
                total = np.add.reduce(chunk, axis=None, dtype=np.complex128 if arr.dtype.kind == "c" else np.float64)
            if not np.isfinite(total):  # a finite sum proves every value finite; else look closer
                bad = ~np.isfinite(chunk)
                k = int(bad.sum())
                if k:
                    if first < 0:
                        first = start + int(np.flatnonzero(bad.reshape(len(chunk), -1).any(axis=1))[0])
                    count += k
                    continue
        if want_range and count == 0 and chunk.size:
            values = chunk if ignore is None else chunk[chunk != ignore]
            if values.size:
                lo, hi = values.min(), values.max()
                out.lo = lo if out.lo is None else min(out.lo, lo)
                out.hi = hi if out.hi is None else max(out.hi, hi)
    if count:
        out.bad = _Bad(count, first)
        out.lo = out.hi = None
    return out


# -- everything, in order ---------------------------------------------------------------------------------
def check_before_upload(policy: Callable[[], Policy], request: FitRequest) -> None:
    """Job arguments, then the size from nbytes against `policy().max_job_bytes`, then the contents against the
    model (none for a HyperModel whose own fit makes what reaches the model)."""
    names = typed_names(request.argnames)
    check_job_args(request)
    limits = policy()
    # the backend sends its cap beside the fields models.Policy declares; an older backend does not send it
    cap, cool_down = (limits.model_extra or {}).get("max_cool_down_s"), request.cool_down_period_s
    if cap is not None and cool_down > cap:
        raise ValidationError(
            f"{names['cool_down_period_s']}={cool_down:g} is over this backend's cap of {cap:g} s (a warm "
            f"machine is held at most that long): use at most {_example(names['cool_down_period_s'], f'{cap:g}')}"
        )
    x, y, validation_data = request.train_X, request.train_Y, request.validation_data
    sample_weight = request.sample_weight
    for value, name in ((x, names["train_X"]), (y, names["train_Y"]), (sample_weight, names["sample_weight"])):
        check_tree(value, name)
    for i, part in enumerate(_validation_parts(validation_data)):
        check_tree(part, f"{names['validation_data']}[{i}]")
    parts = data_sizes(x, y, sample_weight, validation_data, names)
    check_size(sum(parts.values()), int(limits.max_job_bytes), names, parts)
    check_fit_data(None if request.hypermodel_fit else request.model, x, y, sample_weight, validation_data, names)
