"""Every request and response body of the v1 API, declared once (pydantic v2).

The handlers validate what comes in with these models, and `openapi.py` generates the OpenAPI document from
them, so the document cannot drift from what the backend accepts. Request models are strict (no "1" for 1, no
1 for true), refuse NaN/Infinity and unknown fields, and bound every list, string and mapping; their errors name
the field, the problem and the fix (see `explain`). Response models describe what the handlers send; they allow
fields added later, so an older client keeps working.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    JsonValue,
    Tag,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from . import vocabulary as v
from .bounds import (
    MAX_BATCH_SIZE,
    MAX_COOL_DOWN_S,
    MAX_DESCRIPTION_CHARS,
    MAX_EPOCHS,
    MAX_WAIT_REQUEST_S,
    MAX_WORKERS,
)
from .datatree import MAX_KEY_CHARS, MAX_TREE_DEPTH, MAX_TREE_ITEMS, tree_depth
from .errors import ValidationError as RequirementsError
from .requirements import check_requirements

SHA_PATTERN = r"^[0-9a-f]{64}$"
MODULE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
CODE_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*){0,15}\.py$"
ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
UPLOAD_ID_PATTERN = r"^[0-9a-f]{32}$"
ARTIFACT_NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127}){0,7}$"
ENV_KEY_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,119}$"  # worker/envs.env_key: requirements hash, python, machine, base
INT64_MAX = 2**63 - 1
MAX_EVENT_BATCH = 500
MAX_MESSAGE = 8000
MAX_STEPS = 1_000_000_000  # batches in one epoch or validation: over 11 days at 1 ms a batch
MAX_LOG_KEYS = 256
MAX_LOG_KEY_CHARS = 200
MAX_TIMESTAMP = 1e11  # seconds since 1970: year 5138, so a timestamp in ms (or garbage) is refused
CALLBACK_CLASSES = ("EarlyStopping", "ReduceLROnPlateau", "TerminateOnNaN")
UNION_TAGS = frozenset((*CALLBACK_CLASSES, *v.WORKER_EVENT_TYPES))


# -- errors that name the field, the problem and the fix -------------------------------------------------------
def _fail(message: str) -> PydanticCustomError:
    """An error shown as it is (it names its field itself)."""
    return PydanticCustomError("aibro", "{message}", {"message": message})


def _fail_here(message: str) -> PydanticCustomError:
    """An error shown after the path of the field it is about ("data.x.list[0].blob must be ...")."""
    return PydanticCustomError("aibro_here", "{message}", {"message": message})


def show(value: Any) -> str:
    """A short, safe rendering of a bad value for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def described(annotation: Any, message: str, here: bool = True) -> Any:
    """`annotation`, whose errors all read `message` (plus the value it got): one clear sentence per field."""

    def check(value: Any, handler: Any, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError:
            text = f"{message}, got {show(value)}"
            raise (_fail_here(text) if here else _fail(text)) from None

    return Annotated[annotation, WrapValidator(check)]


def where(loc: tuple[Any, ...]) -> str:
    """('data', 'x', 'list', 0, 'blob') -> 'data.x.list[0].blob'."""
    out, key_next, prev = "", False, None
    for part in loc:
        tag = isinstance(prev, int) and part in UNION_TAGS  # pydantic names the union member a list item matched
        prev = part
        if tag:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif not key_next and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(part)):
            out += ("." if out else "") + str(part)
        else:
            out += f"[{str(part)[:60]!r}]"
        key_next = part in ("dict", "mapping")
    return out


def explain(exc: ValidationError, what: str = "the request body") -> str:
    """The first problem of a validation error as one sentence a user can act on."""
    err = exc.errors(include_url=False)[0]
    loc = where(tuple(err.get("loc", ())))
    if err["type"] == "aibro":
        return str(err["ctx"]["message"])
    if err["type"] == "aibro_here":
        return f"{loc or what} {err['ctx']['message']}"
    if err["type"] == "missing":
        return f"'{loc}' is required in {what}"
    msg = err["msg"][:1].lower() + err["msg"][1:]
    return f"'{loc or what}': {msg}, got {show(err.get('input'))}"


def _integral(value: Any) -> Any:
    """JSON Schema's "integer" includes 3.0: a float with no fraction is that integer (bool and "3" stay refused)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


INTEGRAL = BeforeValidator(_integral)  # last in an Annotated, so the constraints before it reach the JSON Schema
Int = Annotated[int, INTEGRAL]


class Request(BaseModel):
    """A request body: strict types, no NaN/Infinity, no unknown fields (named with the allowed ones)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid", populate_by_name=False)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail_here(f"must be an object, got {show(data)}")
        allowed = [f.alias or name for name, f in cls.model_fields.items()]
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise _fail_here(f"has unknown fields {unknown}; allowed: {allowed}")
        return data


class Response(BaseModel):
    """A response body: what the handlers send. Fields may be added later; clients ignore what they do not know."""

    model_config = ConfigDict(extra="allow")


Sha256 = described(Annotated[str, Field(pattern=SHA_PATTERN)], "must be a sha256 hex digest (64 lowercase hex)")
FiniteNumber = Annotated[float, Field(allow_inf_nan=False)]
ShortText = Annotated[str, Field(max_length=200)]


# -- the job spec: POST /jobs ------------------------------------------------------------------------------------
NAME_KEY = Annotated[str, Field(min_length=1, max_length=200)]  # a Python name: checked by _python_names
PYTHON_NAME = Annotated[str, Field(max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


def _python_names(value: dict[str, Any]) -> dict[str, Any]:
    """The keys (a closure's variables, a constructor's arguments) are Python names; JSON Schema cannot say so of an
    object's keys, so it is said here."""
    bad = next((k for k in value if not k.isidentifier()), None)
    if bad is not None:
        raise ValueError(f"{bad!r} is not a Python name")
    return value


class DataNode(Request):
    """One array ({"blob", "shape", "dtype"}), or a list or dict of nodes: exactly one of blob, list, dict."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["blob"]}, {"required": ["list"]}, {"required": ["dict"]}]}
    )

    blob: Sha256 = None
    shape: described(
        Annotated[list[Annotated[int, Field(ge=0), INTEGRAL]], Field(max_length=32)] | None,
        "must be a list of at most 32 non-negative integers (the array's shape)",
    ) = None
    dtype: described(Annotated[str, Field(max_length=32)] | None, "must be a numpy dtype name") = None
    items: Annotated[list[DataNode], Field(max_length=MAX_TREE_ITEMS)] = Field(None, alias="list")
    mapping: Annotated[
        dict[Annotated[str, Field(max_length=MAX_KEY_CHARS)], DataNode], Field(max_length=MAX_TREE_ITEMS)
    ] = Field(None, alias="dict")

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "dataset" in data and cls is DataNode:
                raise _fail_here("cannot be a dataset: only data.x and data.validation.x can")
            kinds = [k for k in ("blob", "list", "dict", "dataset") if k in data]
            if len(kinds) != 1:
                raise _fail_here("must hold exactly one of 'blob', 'list' or 'dict'")
        return data

    def blobs(self) -> list[str]:
        if self.blob is not None:
            return [self.blob]
        if self.items is not None:
            return [s for t in self.items for s in t.blobs()]
        return [s for t in (self.mapping or {}).values() for s in t.blobs()]


class DataTop(DataNode):
    """data.x and data.validation.x may also be {"dataset": sha}: a tar of tf.data's Dataset.save."""

    model_config = ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["blob"]},
                {"required": ["list"]},
                {"required": ["dict"]},
                {"required": ["dataset"]},
            ]
        }
    )

    dataset: Sha256 = None
    repeat: described(bool | None, "must be true or false") = Field(
        None, description="the dataset repeats without end (the kernel's .repeat()); steps_per_epoch bounds an epoch"
    )
    shuffle_batches: described(bool | None, "must be true or false") = Field(
        None, description="its batches come in a new order each epoch, as fit shuffles a keras.utils.PyDataset's"
    )

    def blobs(self) -> list[str]:
        return [self.dataset] if self.dataset is not None else super().blobs()


class DataPart(Request):
    """Training (or validation) inputs, targets and sample weights as data trees; a dataset `x` yields its own
    targets, so then y and sample_weight are null."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"x": {"not": {"required": ["dataset"]}}}},
                {"properties": {"y": {"type": "null"}, "sample_weight": {"type": "null"}}},
            ]
        }
    )

    x: DataTop
    y: DataNode | None = None
    sample_weight: DataNode | None = None

    @field_validator("x", "y", "sample_weight", mode="before")
    @classmethod
    def _shallow(cls, tree: Any) -> Any:
        if tree_depth(tree) > MAX_TREE_DEPTH:
            raise _fail_here(
                f"nests lists and dicts more than {MAX_TREE_DEPTH} levels deep: pass a flatter structure "
                "(a dict of arrays, or a list of arrays)"
            )
        return tree

    @model_validator(mode="after")
    def _dataset_alone(self) -> DataPart:
        if self.x.dataset is not None and (self.y is not None or self.sample_weight is not None):
            raise _fail_here("holds a dataset, which yields its own targets: y and sample_weight must be null")
        return self

    def blobs(self) -> list[str]:
        return [s for t in (self.x, self.y, self.sample_weight) if t is not None for s in t.blobs()]


class Data(DataPart):
    validation: DataPart | None = None
    globals_: Annotated[dict[NAME_KEY, DataNode], Field(max_length=64), AfterValidator(_python_names)] | None = Field(
        None,
        alias="globals",
        description="the notebook's arrays its travelling definitions read (a callback reading x_test), by name",
    )

    @model_validator(mode="before")
    @classmethod
    def _x_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("x") is None:
            raise _fail("'data.x' is required: the training inputs")
        return data

    def blobs(self) -> list[str]:
        arrays = [b for node in (self.globals_ or {}).values() for b in node.blobs()]
        return super().blobs() + (self.validation.blobs() if self.validation else []) + arrays


PositiveInt = Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL]
BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE), INTEGRAL]
Steps = Annotated[int, Field(ge=1, le=MAX_STEPS), INTEGRAL]
BATCH_SIZE_RULE = f"must be a positive integer of at most {MAX_BATCH_SIZE} (samples in one batch), or null"
STEPS_RULE = f"must be a positive integer of at most {MAX_STEPS} (batches), or null"


class FitArgs(Request):
    """The model.fit keyword arguments that travel to the worker as they are."""

    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS), INTEGRAL] = 1
    batch_size: described(BatchSize | None, BATCH_SIZE_RULE) = None
    shuffle: described(bool, "must be true or false") = True
    class_weight: described(
        Annotated[
            dict[
                Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                Annotated[float, Field(ge=0, allow_inf_nan=False)],
            ],
            Field(max_length=100_000, json_schema_extra={"additionalProperties": False}),
        ]
        | None,
        'must map class indices ("0", "1", ...) to finite non-negative weights',
    ) = None
    initial_epoch: described(
        Annotated[int, Field(ge=0, le=MAX_EPOCHS, description="where training starts; less than epochs"), INTEGRAL],
        "must be a non-negative integer",
    ) = 0
    steps_per_epoch: described(Steps | None, STEPS_RULE) = None
    validation_steps: described(Steps | None, STEPS_RULE) = None
    validation_batch_size: described(BatchSize | None, BATCH_SIZE_RULE) = None
    validation_freq: described(PositiveInt, "must be a positive integer") = 1
    validation_split: described(
        Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)], "must be a number in [0, 1)"
    ) = 0.0

    @model_validator(mode="before")
    @classmethod
    def _travelling(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise _fail("'fit' must be an object of model.fit keyword arguments")
        unknown = sorted(str(k) for k in data if k not in v.FIT_KWARGS)
        if unknown:
            raise _fail(f"fit arguments {unknown} cannot travel; allowed: {list(v.FIT_KWARGS)}")
        epochs = _integral(data.get("epochs", 1))
        if not isinstance(epochs, int) or isinstance(epochs, bool) or not 0 < epochs <= MAX_EPOCHS:
            raise _fail(f"epochs must be a positive integer, got {show(data.get('epochs'))}")
        return data

    @model_validator(mode="after")
    def _initial_before_epochs(self) -> FitArgs:
        if self.initial_epoch >= self.epochs:
            raise _fail(f"fit.initial_epoch ({self.initial_epoch}) must be less than epochs ({self.epochs})")
        return self


Verbosity = Annotated[int, Field(ge=0, le=2), INTEGRAL]


class EarlyStoppingConfig(Request):
    monitor: ShortText = "val_loss"
    verbose: Verbosity = 0
    min_delta: FiniteNumber = 0.0
    patience: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL] = 0
    mode: Literal["auto", "min", "max"] = "auto"
    baseline: FiniteNumber | None = None
    restore_best_weights: bool = False
    start_from_epoch: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL] = 0


class ReduceLROnPlateauConfig(Request):
    monitor: ShortText = "val_loss"
    verbose: Verbosity = 0
    factor: Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)] = 0.1
    patience: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL] = 10
    mode: Literal["auto", "min", "max"] = "auto"
    min_delta: FiniteNumber = 1e-4
    cooldown: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL] = 0
    min_lr: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0


class TerminateOnNaNConfig(Request):
    raise_error: bool = False


CALLBACK_CONFIGS: dict[str, type[Request]] = {  # what the worker hands to keras.callbacks.CLASS(**config)
    "EarlyStopping": EarlyStoppingConfig,
    "ReduceLROnPlateau": ReduceLROnPlateauConfig,
    "TerminateOnNaN": TerminateOnNaNConfig,
}


# Keras callbacks the kernel sends by class name (aibro_jupyter/rebuildplan.py); the user's own name a module.
KERAS_CALLBACKS = (
    *CALLBACK_CONFIGS,
    "LearningRateScheduler",
    "LambdaCallback",
    "ModelCheckpoint",
    "CSVLogger",
    "TensorBoard",
    "SwapEMAWeights",
)
MAX_CALLBACK_CONFIG_CHARS = 512 * 1024  # a text generator's vocabulary of 20,000 words fits
MAX_SPEC_CHARS = 960 * 1024  # the whole job spec as JSON, under the backend's 1 MiB request body


def _callback(value: Any, handler: Any) -> Any:
    """One sentence for a bad callback: an unknown class, or the first problem of its config."""
    if not isinstance(value, dict) or not isinstance(value.get("class"), str):
        raise _fail("a callback must be an object {class, config, module?}")
    if not value.get("module") and value["class"] not in KERAS_CALLBACKS:
        raise _fail(f"Keras callbacks that can travel: {list(KERAS_CALLBACKS)}; a class of your own names its module")
    if not isinstance(value.get("config", {}), dict):
        raise _fail("a callback's config must be an object")
    try:
        return handler(value)
    except ValidationError as exc:
        if value["class"] in CALLBACK_CONFIGS and not value.get("module"):
            try:
                CALLBACK_CONFIGS[value["class"]].model_validate(value.get("config", {}))
            except ValidationError as inner:
                raise _fail(f"{value['class']} config: {explain(inner, 'the config')}") from None
        raise _fail(f"a callback {explain(exc, 'callback')}") from None


class EarlyStoppingCallback(Request):
    cls: Literal["EarlyStopping"] = Field(alias="class")
    config: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)


class ReduceLROnPlateauCallback(Request):
    cls: Literal["ReduceLROnPlateau"] = Field(alias="class")
    config: ReduceLROnPlateauConfig = Field(default_factory=ReduceLROnPlateauConfig)


class TerminateOnNaNCallback(Request):
    cls: Literal["TerminateOnNaN"] = Field(alias="class")
    config: TerminateOnNaNConfig = Field(default_factory=TerminateOnNaNConfig)


def _json_within(value: Any, chars: int, levels: int) -> Any:
    if len(json.dumps(value)) > chars:
        raise ValueError(f"is over {chars} characters as JSON")

    def depth(v: Any) -> int:
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        return 0

    if depth(value) > levels:
        raise ValueError(f"nests more than {levels} levels deep")
    return value


def _bounded_json(value: dict[str, Any]) -> dict[str, Any]:
    """Arguments are plain JSON with marked forms (argcodec.py: {"__path__"}, {"__function__"}, {"__float__"}...);
    the worker rebuilds the callback from them. Bounded here: 512 KiB and 10 levels."""
    return _json_within(value, MAX_CALLBACK_CONFIG_CHARS, 10)


CallbackConfig = Annotated[
    dict[Annotated[str, Field(max_length=200)], JsonValue], Field(max_length=64), AfterValidator(_bounded_json)
]


class KerasCallback(Request):
    """Another Keras callback, by its name in keras.callbacks, with its arguments (rebuilt on the worker)."""

    cls: Literal[tuple(KERAS_CALLBACKS[len(CALLBACK_CONFIGS) :])] = Field(alias="class")  # type: ignore[valid-type]
    config: CallbackConfig = Field(default_factory=dict)


class OwnCallback(Request):
    """The user's own Callback subclass: its class in `module`, which is travelling code (or an installed package)."""

    cls: Annotated[str, Field(max_length=200, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] = Field(alias="class")
    module: Annotated[str, Field(max_length=200, pattern=MODULE_PATTERN)]
    config: CallbackConfig = Field(default_factory=dict)


def _callback_kind(value: Any) -> str:
    """Which member of the union a callback is: read from its JSON when it is validated, and from the model it
    already is when a spec is written out again (a spec the kernel sends, a row the store keeps)."""
    if isinstance(value, (OwnCallback, KerasCallback)):
        return "own" if isinstance(value, OwnCallback) else "keras"
    if isinstance(value, Request):
        return str(getattr(value, "cls", "keras"))  # EarlyStopping, ReduceLROnPlateau or TerminateOnNaN
    if isinstance(value, dict) and value.get("module"):
        return "own"
    if isinstance(value, dict) and value.get("class") in CALLBACK_CONFIGS:
        return str(value["class"])
    return "keras"


Callback = Annotated[
    Annotated[EarlyStoppingCallback, Tag("EarlyStopping")]
    | Annotated[ReduceLROnPlateauCallback, Tag("ReduceLROnPlateau")]
    | Annotated[TerminateOnNaNCallback, Tag("TerminateOnNaN")]
    | Annotated[KerasCallback, Tag("keras")]
    | Annotated[OwnCallback, Tag("own")],
    Discriminator(_callback_kind),
    WrapValidator(_callback),
]


class CodeFile(Request):
    path: Annotated[str, Field(pattern=CODE_PATH_PATTERN)]
    bytes: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
    sha256: Annotated[str, Field(pattern=SHA_PATTERN)]


class Code(Request):
    """The user's own code that travels: a blob of sources (never loaded by the backend), modules to import."""

    blob: Annotated[str, Field(pattern=SHA_PATTERN)]
    modules: described(
        Annotated[list[Annotated[str, Field(max_length=200, pattern=MODULE_PATTERN)]], Field(max_length=64)],
        "'code.modules' must be a list of at most 64 importable module names",
        here=False,
    ) = Field(default_factory=list)
    files: described(
        Annotated[list[CodeFile], Field(max_length=200)],
        "each of 'code.files' must be {path: relative .py path, bytes: int, sha256: hex}, at most 200",
        here=False,
    ) = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _blob_given(cls, data: Any) -> Any:
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("blob"), str)
            or not re.match(SHA_PATTERN, data["blob"])
        ):
            raise _fail("'code' must be an object whose 'blob' is the sha256 of the uploaded code")
        return data


def _requirements(value: Any) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _fail(f"'requirements' must be a list of requirement strings (e.g. [\"pandas>=2\"]), got {show(value)}")
    try:
        return check_requirements(value, "'requirements'")
    except RequirementsError as exc:
        raise _fail(str(exc)) from None


def _machines(value: Any, handler: Any) -> Any:
    if isinstance(value, list) and len(value) > 16:
        raise _fail("at most 16 machines may be listed for one job")
    try:
        return handler(value)
    except ValidationError:
        raise _fail(
            f"'machines' must be a non-empty list of machine ids (see GET /machines), got {show(value)}"
        ) from None


MachineList = Annotated[
    list[Annotated[str, Field(min_length=1, max_length=100)]],
    Field(min_length=1, max_length=16),
    WrapValidator(_machines),
]
Description = described(
    Annotated[str, Field(max_length=MAX_DESCRIPTION_CHARS)],
    f"'description' must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
    False,
)


BUILD_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
TRIAL_ID_PATTERN = r"^[0-9]{1,6}$"
FIT_ARG_PATTERN = r"^[a-z_]{1,40}$"
BoundedJson = Annotated[
    dict[Annotated[str, Field(max_length=200)], JsonValue], Field(max_length=256), AfterValidator(_bounded_json)
]


class TrialBuild(Request):
    """A trial of a hyperparameter study (issue 27): the worker builds the model by calling the user's
    `build_model(hp)` (which travels in 'code', as a model's own code does) with KerasTuner's HyperParameters of
    this space set to these values, as KerasTuner builds each trial's model; the job then fits it as usual."""

    build: described(
        Annotated[str, Field(max_length=300, pattern=BUILD_PATTERN)],
        "'trial.build' must name the build function as 'module:function' (e.g. '__aibro_main__:build_model')",
        here=False,
    )
    hyperparameters: BoundedJson
    values: BoundedJson
    study_id: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    trial_id: Annotated[str, Field(pattern=TRIAL_ID_PATTERN)] | None = None
    resume_job: Annotated[str, Field(pattern=ID_PATTERN)] | None = Field(
        None, description="the job of the earlier trial whose trained weights this one starts from (Hyperband)"
    )
    resume_epoch: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL] | None = Field(
        None,
        description="the epoch (0-based) of `resume_job` whose checkpoint it starts from: that trial's best, as "
        "KerasTuner's Hyperband reloads the checkpoint its SaveBestEpoch kept; absent, the job's final model",
    )
    arguments: BoundedJson | None = Field(
        None,
        description="when `build` names a keras_tuner.HyperModel subclass rather than a function: the constructor "
        "arguments its object was made with (the worker calls its build(hp), as KerasTuner does)",
    )
    fit_args: Annotated[list[Annotated[str, Field(pattern=FIT_ARG_PATTERN)]], Field(max_length=64)] | None = Field(
        None,
        description="when the HyperModel overrides fit(hp, model, *args, **kwargs): the names of the arguments the "
        "search was given, which the worker passes on to it (with its own callbacks) as KerasTuner does",
    )


REF_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$"
MAX_OBJECTS_CHARS = 1 << 20


def _bounded_values(value: Any) -> Any:
    """A closure's values (small arrays included) and defaults: 1 MiB of JSON and 12 levels at most."""
    return _json_within(value, MAX_OBJECTS_CHARS, 12)


ClosureValues = Annotated[
    dict[NAME_KEY, JsonValue], Field(max_length=256), AfterValidator(_python_names), AfterValidator(_bounded_values)
]


class Closure(Request):
    """A function made inside another (`def loss(margin): def contrastive_loss(...)`): the enclosing function in the
    travelling code, the inner one's name and line within it, and the values it closed over in the kernel."""

    ref: Annotated[str, Field(max_length=400, pattern=REF_PATTERN)]
    name: Annotated[str, Field(max_length=200, pattern=r"^([A-Za-z_][A-Za-z0-9_]*|<lambda>)$")]
    line: Annotated[int, Field(ge=0, le=1_000_000), INTEGRAL]
    nth: Annotated[int, Field(ge=0, le=1000), INTEGRAL] = Field(
        0, description="which of the functions of that name on that line (two lambdas on one line)"
    )
    cells: ClosureValues = Field(default_factory=dict)
    defaults: Annotated[list[JsonValue], Field(max_length=256), AfterValidator(_bounded_values)] | None = None
    kwdefaults: ClosureValues | None = None


class ObjectRef(Request):
    """A class or function the model names (by the name Keras records), as the worker finds it: `ref` in the
    travelling code or an installed package, or a `closure`; `init` and `config_args` make a class Keras cannot
    describe or rebuild (a model made of models) rebuildable from its constructor arguments, read from these
    attributes and from its own config."""

    ref: Annotated[str, Field(max_length=400, pattern=REF_PATTERN)] | None = None
    closure: Closure | None = None
    init: Annotated[dict[NAME_KEY, PYTHON_NAME], Field(max_length=64), AfterValidator(_python_names)] | None = None
    config_args: Annotated[list[PYTHON_NAME], Field(max_length=64)] | None = Field(
        None, description="constructor arguments the rebuildable class reads from the class's own config"
    )

    @model_validator(mode="after")
    def _one_way(self) -> ObjectRef:
        if (self.ref is None) == (self.closure is None):
            raise _fail("an object reference needs either 'ref' (module:name) or 'closure', not both")
        return self


ObjectRefs = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=200)], ObjectRef],
    Field(max_length=256),
    BeforeValidator(_bounded_values),
]


FINGERPRINT_PATTERN = r"^[0-9a-f]{16,64}$"


class ModelProfile(Request):
    """What a time prediction knows of a fit before it runs (issue 38), and what a job keeps for the next one's:
    the model's fingerprint and its training FLOPs per sample. Made in the kernel (aibro_jupyter/modelprofile.py)."""

    fingerprint: described(
        Annotated[str, Field(pattern=FINGERPRINT_PATTERN)],
        "'fingerprint' must be 16 to 64 lowercase hex digits (the kernel's digest of the model's architecture, its "
        "input shapes and the batch size)",
        False,
    ) = Field(description="a digest of the model's architecture, its input shapes and the batch size")
    flops_per_sample: described(
        Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)] | None,
        "'flops_per_sample' must be a number of FLOPs from 0 to 1e18, or null",
        False,
    ) = Field(None, description="one training step's floating-point operations per sample (forward and backward)")


GANG_CALLBACKS = ("EarlyStopping", "ReduceLROnPlateau", "TerminateOnNaN", "LearningRateScheduler")
"""The callbacks a job of several workers runs: ones that only read an epoch's logs and set the model's state, so each
worker runs its own and, the logs being the gang's, all decide alike (the others write files or hold state that one
process must own: not yet)."""


class JobSpec(Request):
    """A job: the model and data (uploaded blobs), how to fit, where to train, and what to keep."""

    model: described(
        Annotated[str, Field(pattern=SHA_PATTERN)] | None,
        "'model' must be the sha256 of an uploaded .keras file",
        False,
    ) = None
    trial: TrialBuild | None = None
    data: Data
    fit: FitArgs = Field(default_factory=FitArgs)
    machines: MachineList
    description: Description = ""
    profile: ModelProfile | None = Field(
        None, description="the model's fingerprint and FLOPs: what later predictions of the same model learn from"
    )
    cool_down_s: described(
        Annotated[float, Field(ge=0, le=MAX_COOL_DOWN_S, allow_inf_nan=False)],
        "'cool_down_s' must be a number of seconds between 0 and one week (604800)",
        False,
    ) = 0.0
    wait_request_s: described(
        Annotated[float, Field(ge=0, le=MAX_WAIT_REQUEST_S, allow_inf_nan=False)] | None,
        "'wait_request_s' must be a number of seconds between 0 and 30 days (how long to wait for a machine "
        "before trying the next one)",
        False,
    ) = 60.0
    custom_modules: described(
        Annotated[list[Annotated[str, Field(max_length=200, pattern=MODULE_PATTERN)]], Field(max_length=64)],
        "'custom_modules' must be a list of at most 64 importable module names",
        False,
    ) = Field(default_factory=list)
    callbacks: Annotated[list[Callback], Field(max_length=16)] = Field(default_factory=list)
    code: Code | None = None
    requirements: Annotated[list[Annotated[str, Field(max_length=200)]], Field(max_length=64)] | None = None
    versions: described(
        Annotated[dict[Annotated[str, Field(max_length=32)], Annotated[str, Field(max_length=64)]], Field(max_length=8)]
        | None,
        "'versions' must be an object of at most 8 short strings (the kernel's versions)",
        False,
    ) = None
    meta: described(
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=256)]], Field(max_length=8)
        ]
        | None,
        "'meta' must be an object of at most 8 short strings",
        False,
    ) = None
    safe_mode: described(bool, "'safe_mode' must be true or false", False) = True
    record: described(bool, "'record' must be true or false", False) = True
    compile: (
        Annotated[
            dict[Annotated[str, Field(max_length=200)], JsonValue], Field(max_length=32), AfterValidator(_bounded_json)
        ]
        | None
    ) = Field(None, description="arguments for a compile() the model's class overrides, called again on the worker")
    cwd: described(
        Annotated[str, Field(max_length=4096, pattern=r"^/[^\x00]*$")] | None,
        "'cwd' must be the kernel's working directory, an absolute path",
        False,
    ) = Field(None, description="the kernel's working directory: what the job's code writes in its own returns there")
    objects: ObjectRefs = Field(
        default_factory=dict,
        description="each class or function Keras records by name in the model, found on the worker (kerasnames.py)",
    )
    seed: described(
        Annotated[int, Field(ge=0, le=2**32 - 1), INTEGRAL] | None,
        "'seed' must be the kernel's keras.utils.set_random_seed value, an integer from 0 to 2**32-1, or null",
        False,
    ) = Field(None, description="the worker calls keras.utils.set_random_seed(seed) before fit, as the kernel did")
    workers: described(
        Annotated[int, Field(ge=1, le=MAX_WORKERS), INTEGRAL],
        f"'workers' must be an integer from 1 to {MAX_WORKERS}: the processes that train the job together",
        False,
    ) = Field(1, description="more than 1: one data-parallel fit by that many workers, on Keras' JAX backend")

    @field_validator("callbacks", mode="before")
    @classmethod
    def _callbacks_list(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise _fail("'callbacks' must be a list")
        return value

    @field_validator("requirements", mode="before")
    @classmethod
    def _requirements(cls, value: Any) -> Any:
        return _requirements(value)

    @model_validator(mode="before")
    @classmethod
    def _within_bounds(cls, data: Any) -> Any:
        size = len(json.dumps(data, default=str)) if isinstance(data, dict) else 0
        if size > MAX_SPEC_CHARS:
            raise _fail(
                f"the job spec is {size} characters as JSON, over {MAX_SPEC_CHARS}: the arguments written into it (a "
                "callback's, a custom compile()'s, a closure's values) are too big to travel inline; load big "
                "values where they are used, or pass them as the fit's data"
            )
        return data

    @model_validator(mode="after")
    def _model_or_trial(self) -> JobSpec:
        if (self.model is None) == (self.trial is None):
            raise _fail(
                "a job needs either 'model' (the sha256 of an uploaded .keras file) or 'trial' (a build function and "
                "its hyperparameter values, with the function's 'code'), not both"
            )
        if self.trial is not None and self.code is None:
            raise _fail("a 'trial' job needs 'code': the uploaded sources of its build function")
        if self.trial is not None and self.workers > 1:
            raise _fail("a study's trials run on one worker each: 'workers' must be 1 for a 'trial' job")
        other = [c.cls for c in self.callbacks if isinstance(c, OwnCallback) or c.cls not in GANG_CALLBACKS]
        if self.workers > 1 and other:
            raise _fail(
                f"a job of {self.workers} workers runs the callbacks {', '.join(GANG_CALLBACKS)}, not yet {other[0]}: "
                "leave it out, or set 'workers' to 1"
            )
        return self

    def blobs(self) -> list[str]:
        """Every blob this job reads: the model, its code and its data."""
        return [*([self.model] if self.model else []), *([self.code.blob] if self.code else []), *self.data.blobs()]


ORACLE_ARGS: dict[str, set[str]] = {
    "*": {"seed", "max_retries_per_trial", "max_consecutive_failed_trials"},
    "RandomSearch": {"max_trials"},
    "GridSearch": {"max_trials"},
    "BayesianOptimization": {"max_trials", "num_initial_points", "alpha", "beta"},
    "Hyperband": {"max_epochs", "factor", "hyperband_iterations"},
}


HP_KINDS = ("Boolean", "Choice", "Fixed", "Float", "Int")


def hyperparameters_config(value: dict[str, Any], where: str) -> dict[str, Any]:
    """KerasTuner's HyperParameters config, and nothing else: its five kinds, whose conditions name parents (what
    the oracle host deserializes, from the kernel's space or a trial's report alike)."""
    space, values = value.get("space"), value.get("values", {})
    if set(value) - {"space", "values"} or not isinstance(space, list) or not isinstance(values, dict):
        raise _fail(f"'{where}' must be KerasTuner's HyperParameters.get_config(): {{space, values}}")
    for entry in space:
        config = entry.get("config") if isinstance(entry, dict) else None
        if set(entry) - {"class_name", "config"} or entry.get("class_name") not in HP_KINDS:
            raise _fail(f"'{where}.space' holds {str(entry)[:80]}: each must be one of {HP_KINDS}")
        conditions = config.get("conditions", []) if isinstance(config, dict) else None
        if not isinstance(conditions, list) or any(
            not isinstance(c, dict) or set(c) != {"class_name", "config"} or c["class_name"] != "Parent"
            for c in conditions
        ):
            raise _fail(f"'{where}.space' conditions must be KerasTuner's Parent conditions")
    return value


class Objective(Request):
    name: Annotated[str, Field(min_length=1, max_length=200)]
    direction: Literal["min", "max"]


class OracleSpec(Request):
    """What the kernel's tuner says about its search: its oracle's kind and arguments, and the space its
    `build_model(hp)` registered (KerasTuner's HyperParameters config). The backend runs that oracle as it is."""

    kind: Literal["RandomSearch", "BayesianOptimization", "Hyperband", "GridSearch"]
    objective: Annotated[list[Objective], Field(min_length=1, max_length=16)]
    hyperparameters: BoundedJson
    max_trials: Annotated[int, Field(ge=1, le=10_000), INTEGRAL] | None = None
    seed: Annotated[int, Field(ge=0, le=2**32 - 1), INTEGRAL] | None = None
    max_retries_per_trial: Annotated[int, Field(ge=0, le=100), INTEGRAL] = 0
    max_consecutive_failed_trials: Annotated[int, Field(ge=1, le=10_000), INTEGRAL] = 3
    max_epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS), INTEGRAL] | None = None
    factor: Annotated[int, Field(ge=2, le=100), INTEGRAL] | None = None
    hyperband_iterations: Annotated[int, Field(ge=1, le=100), INTEGRAL] | None = None
    num_initial_points: Annotated[int, Field(ge=1, le=10_000), INTEGRAL] | None = None
    alpha: Annotated[float, Field(gt=0, le=1e6)] | None = None
    beta: Annotated[float, Field(gt=0, le=1e6)] | None = None

    @field_validator("hyperparameters")
    @classmethod
    def _a_space(cls, value: dict[str, Any]) -> dict[str, Any]:
        return hyperparameters_config(value, "oracle.hyperparameters")

    @model_validator(mode="after")
    def _arguments_of_its_kind(self) -> OracleSpec:
        named = set().union(*ORACLE_ARGS.values())
        given = {k for k in named if getattr(self, k) is not None}
        wrong = sorted(given - ORACLE_ARGS["*"] - ORACLE_ARGS[self.kind])
        if wrong:
            raise _fail(f"a {self.kind} oracle takes no {', '.join(wrong)}: leave them out")
        return self


MAX_EXECUTIONS = 100


class StudySpec(Request):
    """POST /studies: a hyperparameter search. Each trial is a job made from `job` (whose `trial` names the build
    function and the space; its values are the oracle's), at most `parallel` at once; with `executions_per_trial`
    N, N such jobs one after another, the trial scored as KerasTuner scores its N executions."""

    oracle: OracleSpec
    job: JobSpec
    parallel: described(
        Annotated[int, Field(ge=1, le=64), INTEGRAL], "'parallel' must be a whole number of trials from 1 to 64"
    ) = 1
    executions_per_trial: described(
        Annotated[int, Field(ge=1, le=MAX_EXECUTIONS), INTEGRAL],
        f"'executions_per_trial' must be a whole number from 1 to {MAX_EXECUTIONS} (the tuner's own)",
    ) = 1
    description: Description = ""

    @model_validator(mode="after")
    def _job_is_a_trial(self) -> StudySpec:
        if self.job.trial is None:
            raise _fail("a study's 'job' must have a 'trial' (its build function and space), not a 'model'")
        return self


class ReplayOverrides(Request):
    """What a replay may change; the rest of the recorded spec is kept."""

    machines: MachineList | None = None
    description: Description | None = None


# -- query parameters -------------------------------------------------------------------------------------------
class EventsQuery(BaseModel):
    """?after=&wait= of the event long-polls (query strings: numbers are read from text)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    after: int = Field(0, ge=0, le=INT64_MAX, description="return events after this seq (job) or gid (user)")
    wait: float = Field(
        0, ge=0, allow_inf_nan=False, description="seconds to wait for a new event when there is none (at most 60)"
    )


class BlobQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")

    offset: int = Field(0, ge=0, le=INT64_MAX, description="where this chunk starts in the blob")
    total: int = Field(ge=0, le=INT64_MAX, description="the whole blob's size in bytes")


class AttemptQuery(BaseModel):
    model_config = ConfigDict(extra="ignore")

    attempt: int = Field(ge=0, le=INT64_MAX, description="the job attempt this worker runs")


class ArtifactChunkQuery(AttemptQuery):
    offset: int = Field(0, ge=0, le=INT64_MAX, description="where this chunk starts (0 starts the upload over)")
    total: int | None = Field(
        None, ge=0, le=INT64_MAX, description="the whole artifact's size (default: this chunk is all of it)"
    )


# -- worker bodies ----------------------------------------------------------------------------------------------
Logs = Annotated[
    dict[Annotated[str, Field(max_length=MAX_LOG_KEY_CHARS)], Annotated[float, Field(allow_inf_nan=False)] | None],
    Field(max_length=MAX_LOG_KEYS),
]
Timestamp = Annotated[float, Field(ge=0, le=MAX_TIMESTAMP, allow_inf_nan=False)]
Message = Annotated[str, Field(max_length=MAX_MESSAGE)]
MetricFloat = Annotated[float, Field(allow_inf_nan=False)] | None  # None: the value was NaN or infinite


class StatusData(Request):
    status: Literal[v.TRAINING]  # type: ignore[valid-type]
    substatus: Literal[v.WORKER_SUBSTATUSES]  # type: ignore[valid-type]
    message: Message | None = None


class EpochData(Request):
    epoch: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL]
    epochs: Annotated[int, Field(ge=1, le=MAX_EPOCHS), INTEGRAL]
    logs: Logs
    seconds: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    samples_per_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    ended: Timestamp | None = None
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS), INTEGRAL] | None = None  # a job of several (JobSpec.workers)


class BatchData(Request):
    epoch: Annotated[int, Field(ge=0, le=MAX_EPOCHS), INTEGRAL]
    batch: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
    steps: Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL] | None = None
    logs: Logs = Field(default_factory=dict)


def _relative_path(value: str) -> str:
    if value.startswith("/") or "\x00" in value or ".." in value.split("/"):
        raise ValueError("must be a relative path inside its folder (no leading '/', no '..')")
    return value


class LogData(Request):
    message: Message
    stage: Literal[v.GEARING_UP_ENV] | None = None  # type: ignore[valid-type]
    warning: Message | None = None
    versions: Annotated[dict[ShortText, ShortText], Field(max_length=16)] | None = None
    stream: Literal["stdout", "stderr"] | None = Field(
        None, description="a line the job's own code printed, and where it printed it"
    )
    replicas: Annotated[int, Field(ge=2, le=1024), INTEGRAL] | None = Field(
        None, description="the devices a multi-device fit trains on (MirroredStrategy)"
    )
    replica_batch: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE), INTEGRAL] | None = Field(
        None, description="the samples of each batch one device trains on"
    )
    file: Annotated[str, Field(pattern=ARTIFACT_NAME_PATTERN)] | None = Field(
        None, description="the artifact files/<callback>/<argument>/... a callback's file came back as"
    )
    path: Annotated[str, Field(min_length=1, max_length=1000), AfterValidator(_relative_path)] | None = Field(
        None, description="that file's path under the kernel-side folder of its callback argument"
    )
    trial: TrialReport | None = Field(None, description="a study trial's report at the end of its fit")
    timings: Annotated[dict[ShortText, Annotated[float, Field(ge=0, le=1e7)]], Field(max_length=16)] | None = Field(
        None, description="seconds of the job's start on the worker, by part (data, build, load)"
    )


class TrialReport(Request):
    """What a trial's worker says after the fit (issue 35): the trial's hyperparameters as the fit left them (a
    HyperModel.fit may register more), and what a HyperModel.fit returned when that was not a History."""

    hyperparameters: Annotated[
        BoundedJson, AfterValidator(lambda value: hyperparameters_config(value, "trial.hyperparameters"))
    ]
    metrics: Annotated[dict[Annotated[str, Field(max_length=200)], MetricFloat], Field(max_length=200)] | None = None
    value: MetricFloat = None


class ErrorData(Request):
    message: Message


WORKER_EVENT_DATA: dict[str, type[Request]] = {
    v.EV_STATUS: StatusData,
    v.EV_EPOCH: EpochData,
    v.EV_BATCH: BatchData,
    v.EV_LOG: LogData,
    v.EV_ERROR: ErrorData,
}


def _worker_event(value: Any, handler: Any) -> Any:
    """One sentence for a bad worker event: its type, or the first problem of its data."""
    if not isinstance(value, dict):
        raise _fail_here(f"must be an object, got {show(value)}")
    type_, data = value.get("type"), value.get("data")
    if type_ not in WORKER_EVENT_DATA:
        raise _fail(f"event type {show(type_)} is not accepted from a worker; types: {list(WORKER_EVENT_DATA)}")
    try:
        return handler(value)
    except ValidationError as exc:
        first = exc.errors()[0]["loc"]
        if len(first) < 2 or first[1] != "data" or not isinstance(data, dict):
            raise  # wseq, ts, or data not an object: the path says which
        try:
            WORKER_EVENT_DATA[type_].model_validate(data)
        except ValidationError as inner:
            fields = {e["loc"][0] for e in inner.errors() if e.get("loc")}
            if type_ == v.EV_STATUS and "status" in fields:
                raise _fail(f"a worker may not set status {show(data.get('status'))}; it sets TRAINING") from None
            if type_ == v.EV_STATUS and "substatus" in fields:
                raise _fail(
                    f"a worker may not set substatus {show(data.get('substatus'))}; "
                    f"it sets {[str(s) for s in v.WORKER_SUBSTATUSES]}"
                ) from None
            raise _fail(f"a {type_} event's {explain(inner, 'data')}") from None
        raise


class _Event(Request):
    wseq: Annotated[int, Field(ge=1, le=INT64_MAX), INTEGRAL]
    ts: Timestamp | None = None

    def payload(self) -> dict[str, Any]:
        return self.data.model_dump(exclude_unset=True)  # type: ignore[attr-defined]


class StatusEvent(_Event):
    type: Literal["status"]
    data: StatusData


class EpochEvent(_Event):
    type: Literal["epoch"]
    data: EpochData


class BatchEvent(_Event):
    type: Literal["batch"]
    data: BatchData


class LogEvent(_Event):
    type: Literal["log"]
    data: LogData


class ErrorEvent(_Event):
    type: Literal["error"]
    data: ErrorData


WorkerEvent = Annotated[
    StatusEvent | EpochEvent | BatchEvent | LogEvent | ErrorEvent,
    Field(discriminator="type"),
    WrapValidator(_worker_event),
]


class WorkerEvents(Request):
    attempt: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
    events: Annotated[list[WorkerEvent], Field(max_length=MAX_EVENT_BATCH)]


class WorkerEnroll(Request):
    """POST /worker/enroll: the one-time enrollment token from the instance's user data (or send it as the
    bearer token and no body)."""

    enroll_token: Annotated[str, Field(min_length=16, max_length=256)] | None = None


class WorkerFinish(Request):
    attempt: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
    outcome: Literal[v.OUTCOMES] = Field(  # type: ignore[valid-type]
        description="how the attempt ended; spot_interrupted: the cloud is reclaiming the machine, resume elsewhere"
    )
    error: Annotated[str, Field(max_length=1_000_000)] | None = Field(
        None, description="why it failed, or the interruption notice in words"
    )


class UploadedPart(Request):
    number: Annotated[int, Field(ge=0, le=10_000), INTEGRAL]
    etag: Annotated[str, Field(min_length=1, max_length=200)]


class NameUpload(Request):
    """POST /blobs/uploads/{upload_id}/finish: the unnamed upload of `size` bytes is complete. The backend names it
    by its own digest; a client that hashed the bytes too may send `sha256`, which must then agree."""

    sha256: Sha256 | None = None
    size: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]


class S3Upload(Request):
    """POST /blobs/uploads/{upload_id}/upload and /worker/jobs/{job_id}/uploads/{name} when the backend keeps bytes
    in S3: `start` answers presigned URLs (an UploadPlan) for `size` bytes; after PUTting every part there, `finish`
    with the plan's upload_id, each part's ETag and the bytes' `sha256` has the backend complete and record the
    upload (a blob is proven by S3's digest before anyone else shares it: storage/claims.py)."""

    action: Literal["start", "finish"]
    size: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL]
    sha256: Sha256 | None = None
    attempt: Annotated[int, Field(ge=0, le=INT64_MAX), INTEGRAL] | None = None
    upload_id: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    parts: Annotated[list[UploadedPart], Field(max_length=10_000)] = []


# -- responses ---------------------------------------------------------------------------------------------------
JobStatus = Literal[v.JOB_STATUSES]  # type: ignore[valid-type]
JobSubstatus = Literal[v.JOB_SUBSTATUSES]  # type: ignore[valid-type]
InstanceStatus = Literal[v.INSTANCE_STATUSES]  # type: ignore[valid-type]


class ErrorBody(Response):
    """Every 4xx answer: one sentence naming the problem and the fix."""

    error: str
    status: int | None = None
    wseq: int | None = Field(None, description="the worker event that was refused (worker event batches)")


class Quota(Response):
    """What the user holds of the backend's storage, and its limits per user."""

    stored_bytes: int = Field(description="finished blobs this user holds")
    max_stored_bytes: int = Field(description="beyond it a new blob drops the least recently used ones no job reads")
    pending_bytes: int = Field(description="bytes received by this user's unfinished uploads")
    max_pending_bytes: int
    pending_uploads: int = Field(description="this user's unfinished uploads")
    max_pending_uploads: int


class JobMemory(Response):
    """The memory one job may hold (its worker and every process it starts); a job over it ends naming it."""

    set_by: Literal["setting", "share", "none"] = Field(
        description="`setting`: the operator's AIBRO_JOB_MAX_MEMORY_BYTES; `share`: unset on a backend of several "
        "users, so each job's share of its machine; `none`: no limit"
    )
    local_bytes: int | None = Field(None, description="the limit of a job on this backend's own host (null: none)")
    summary: str = Field(description="the limit in words, with the setting that changes it")


class Health(Response):
    ok: bool
    user: str
    version: str
    sandbox: Literal["bwrap", "none"] = Field(
        "none", description="how this backend confines the workers that run users' code on its own host"
    )
    sandbox_warning: str | None = Field(None, description="present when workers run unconfined: what that means")
    quota: Quota
    job_memory: JobMemory | None = Field(None, description="the memory each job may hold on this backend")
    events_port: int | None = Field(
        None,
        description="the port of this host where the event long-polls are also answered, at less CPU (absent: "
        "use this port)",
    )
    spare: str | None = Field(
        None, description="the machine id of a spare worker (TensorFlow loaded) waiting for this user's next job"
    )


class Machine(Response):
    machine_id: str
    provider: str
    gpu_type: str | None
    gpu_count: int
    vcpus: int
    memory_gib: float
    price_per_hour: float
    on_demand_price_per_hour: float
    spot: bool = False
    availability: str
    capacity: int | None = None


class Machines(Response):
    machines: list[Machine]


class PredictionRequest(Request):
    """A fit to predict on each machine before it starts (POST /predictions)."""

    profile: ModelProfile
    epochs: described(
        Annotated[int, Field(ge=1, le=MAX_EPOCHS), INTEGRAL],
        f"'epochs' must be an integer from 1 to {MAX_EPOCHS}",
        False,
    )
    samples: described(
        Annotated[int, Field(ge=1, le=2**53), INTEGRAL] | None,
        "'samples' must be the number of samples in the fit's x (a positive integer), or null when unknown",
        False,
    ) = None
    batch_size: described(
        Annotated[int, Field(ge=1, le=2**31), INTEGRAL] | None,
        "'batch_size' must be a positive integer, or null",
        False,
    ) = None
    machines: described(
        Annotated[list[Annotated[str, Field(min_length=1, max_length=100)]], Field(max_length=256)] | None,
        "'machines' must be a list of machine ids (see GET /machines), or null for every one",
        False,
    ) = None


class Prediction(Response):
    """One machine's predicted training time and cost for a fit, and where the numbers came from."""

    machine_id: str
    seconds: float | None = Field(description="the fit's predicted training time; null where nothing is known")
    cost: float | None = Field(description="USD at the machine's price for those seconds; null with them")
    source: Literal[v.PREDICTION_SOURCES] | None = Field(  # type: ignore[valid-type]
        description="where the step time came from, best first: history (earlier jobs of this model on this machine "
        "type), flops (the model's FLOPs against the machine's nominal throughput: a rough guess); null: nothing"
    )
    basis: str = Field(description="what the number rests on, in words (the jobs, epochs or FLOPs it used)")


class Predictions(Response):
    predictions: list[Prediction]


class Policy(Response):
    max_active_jobs: int
    max_active_instances: int
    max_stopped_instances: int
    max_job_bytes: int
    max_attempts: int
    cancel_grace_s: float


class Stats(Response):
    counters: dict[str, int]


class TokenMint(Request):
    """POST /auth/tokens: an optional lifetime; without one the token lives until revoked."""

    expires_in_s: Annotated[float, Field(gt=0, le=10 * 365 * 86400, allow_inf_nan=False)] | None = None


class TokenMinted(Response):
    """The new token's secret, shown this once, with its public id (what `aibro token revoke` takes)."""

    id: str
    token: str
    created: float
    expires: float | None


class TokenInfo(Response):
    id: str
    created: float
    expires: float | None
    last_used: float | None
    current: bool = Field(False, description="the token this request was made with")


class Tokens(Response):
    tokens: list[TokenInfo]


class TokenRevoked(Response):
    revoked: str


class OpenApiDocument(Response):
    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]
    components: dict[str, Any]


class BlobProgress(Response):
    complete: bool
    received: int


class BlobNamed(BlobProgress):
    sha256: str = Field(description="the blob's name: the SHA-256 of the bytes as the backend received them")


class PlanPart(Response):
    number: int = Field(description="0 for a single PUT, else the multipart part number")
    offset: int
    size: int
    url: str = Field(description="a presigned S3 URL: PUT these bytes there, with `headers`, and no bearer token")
    headers: dict[str, str]


class UploadPlan(Response):
    """`start`: where the bytes go instead of this backend (S3: one presigned PUT, or one per part of a multipart
    upload); `finish`: complete and received (a worker's artifact also its name, size and sha256)."""

    via: Literal["s3"] | None = None
    upload_id: str | None = None
    parts: list[PlanPart] | None = None
    complete: bool | None = None
    received: int | None = None


class BlobDropped(Response):
    dropped: bool = Field(description="whether there was an unfinished upload to drop")


class TimelineEntry(Response):
    status: JobStatus
    substatus: JobSubstatus
    ts: float | None


class HistoryRow(Response):
    """One epoch (numbered from 1) with every Keras log of it; a log that was not finite is null."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": {"type": ["number", "null"]}})

    epoch: int


class CodeListing(Response):
    path: str
    bytes: int
    sha256: str


class CallbackFiles(Response):
    """Where the files a callback argument names come back to in the kernel (the worker sends files/<slot>/...)."""

    slot: str = Field(description="'<callback index>/<argument>', or 'job/cwd' for the job's working directory")
    kind: Literal["file", "dir"]
    kernel: str = Field(description="the kernel-side path as the job was submitted: a file name pattern or a folder")


class Job(Response):
    """What a client sees of a job: states, progress, timeline and cost."""

    job_id: str
    status: JobStatus
    substatus: JobSubstatus
    description: str
    machine_id: str | None
    instance_id: str | None
    machines: list[str]
    cool_down_s: float
    wait_request_s: float
    epochs: int
    epochs_done: int
    attempt: int
    created: float
    updated: float
    cancel_requested: bool
    replay_of: str | None
    record: bool
    meta: dict[str, str]
    code: list[CodeListing]
    requirements: list[str]
    files: list[CallbackFiles] = Field(default_factory=list)
    cost: float = Field(
        description="USD: the seconds its instances held it at their start price, plus the 60 s minimum of a start "
        "it caused; cooling afterwards is the instance's (costs.py)"
    )
    timeline: list[TimelineEntry]
    history: list[HistoryRow]
    error: str | None
    study_id: str | None = Field(None, description="the hyperparameter study this job is a trial of")
    trial_id: str | None = Field(None, description="which of the study's trials it is")
    workers: int = Field(1, description="the processes that train it together (JobSpec.workers)")


class TrialExecution(Response):
    """One fit of a trial (KerasTuner's execution): its own job, and what it reported at its best epoch."""

    job_id: str
    status: Literal[v.TRIAL_STATUSES]  # type: ignore[valid-type]
    metrics: dict[str, float] = Field(default_factory=dict, description="its metrics at its best epoch")
    best_step: int | None = Field(None, description="its best epoch (0-based), by the objective")


class TrialCheckpoint(Response):
    """Where a trial's checkpoint is, as KerasTuner's SaveBestEpoch keeps one per trial: the epoch with the best
    objective of all its executions."""

    job_id: str
    epoch: int | None = Field(description="its checkpoints/epoch-NNNN.keras (0-based); None: the job's model.keras")


class StudyTrial(Response):
    trial_id: str
    job_id: str = Field(description="the job of its latest execution (the only one unless executions_per_trial > 1)")
    status: Literal[v.TRIAL_STATUSES]  # type: ignore[valid-type]
    values: dict[str, Any]
    score: float | None
    message: str | None
    metrics: dict[str, float] = Field(
        default_factory=dict,
        description="what the trial reported: its executions' metrics at their best epochs, averaged as KerasTuner "
        "averages them",
    )
    best_step: int | None = Field(None, description="the trial's best epoch (0-based), by the objective")
    executions: list[TrialExecution] = Field(default_factory=list, description="each fit, in order, as its own job")
    checkpoint: TrialCheckpoint | None = Field(
        None, description="the weights get_best_models and Hyperband's next round start from"
    )
    hyperparameters: dict[str, Any] | None = Field(
        None,
        description="its KerasTuner HyperParameters config as the oracle ended it (with any hyperparameter its "
        "HyperModel.fit registered)",
    )


class Study(Response):
    """What a client sees of a study: its state, its trials (each a job), the best one so far."""

    study_id: str
    status: Literal[v.STUDY_STATUSES]  # type: ignore[valid-type]
    description: str
    message: str | None
    kind: str
    objective: list[dict[str, str]]
    max_trials: int | None
    parallel: int
    executions_per_trial: int = Field(1, description="fits per trial (KerasTuner's), each its own job")
    created: float
    updated: float
    trials: list[StudyTrial]
    best_trial_id: str | None = Field(description="the completed trial with the best score so far, by the objective")
    cost: float = Field(0.0, description="USD: what its trials' jobs cost so far, each as a job's cost is counted")


class Studies(Response):
    studies: list[Study]


class Jobs(Response):
    jobs: list[Job]
    cursor: int = Field(description="the user's newest event gid: follow GET /events?after=cursor from here")


class Event(Response):
    """One event of a job's log (or of a study's: its `study` events); `seq` is gap-free per log, `gid` orders all
    of a user's events."""

    gid: int
    job_id: str = Field(description="whose log it is: the job's id, or the study's for a `study` event")
    seq: int
    type: Literal["status", "epoch", "batch", "log", "error", "artifact", "study"]
    ts: float
    data: dict[str, Any]


class StudyEventData(Response):
    """A `study` event's data (vocabulary.StudyEvent): what the study's driver did."""

    event: Literal[v.STUDY_EVENTS]  # type: ignore[valid-type]
    trial_id: str | None = Field(None, description="the trial started or ended")
    job_id: str | None = Field(None, description="the job a trial's execution runs as (trial started)")
    execution: int | None = Field(None, description="which of the trial's executions (from 0) the job is")
    status: str | None = Field(None, description="how the trial (TrialStatus) or the study (StudyStatus) ended")
    score: float | None = Field(None, description="the ended trial's score, by the objective")
    message: str | None = None
    best_trial_id: str | None = Field(None, description="the best trial so far (trial ended, study ended)")
    slot: str | None = Field(None, description="the study's slot the trial runs in (KerasTuner's tuner_id)")
    oracle_s: float | None = Field(None, description="seconds the oracle took to hand the trial out, or to end it")


class StudyEvents(Response):
    events: list[Event]
    status: Literal[v.STUDY_STATUSES]  # type: ignore[valid-type]


class JobEvents(Response):
    events: list[Event]
    status: JobStatus
    substatus: JobSubstatus


class UserEvents(Response):
    events: list[Event]
    cursor: int


class Artifact(Response):
    name: str
    size: int
    sha: str
    created: float


class Artifacts(Response):
    artifacts: list[Artifact]


class Instance(Response):
    id: str
    user_id: int
    provider: str
    machine_id: str
    status: InstanceStatus
    substatus: str
    job_id: str | None
    cool_down_s: float
    cooling_until: float | None
    created: float
    updated: float
    last_seen: float | None
    history: list[list[Any]] = Field(
        description="[status, substatus, ts, job_id] for every transition: job_id is the job it holds from then on "
        "(null while cooling or closed; absent in rows stored before it was recorded)"
    )
    cooling_left_s: float = 0.0
    price_per_hour: float | None = Field(None, description="USD per hour it was (re)started at; 0 for local machines")
    cost: float = Field(0.0, description="USD so far: per-second billing, 60 s minimum per start (costs.py)")
    cooling_cost: float = Field(0.0, description="the part of `cost` no job paid: cooling, billed to the instance")
    billed_s: float = Field(0.0, description="seconds billed so far over all its starts")
    placement: dict[str, Any] | None = Field(
        None, description="where its provider runs it, if it says (Ray: node_id, node_ip, hostname, waiting)"
    )


class Instances(Response):
    instances: list[Instance]


class InstanceAnswer(Response):
    instance: Instance


class Assignment(Response):
    """What a worker does next: exit, wait (cooling), or train a job."""

    action: Literal["exit", "wait", "train"]
    cooling_until: float | None = None
    job_id: str | None = None
    attempt: int | None = None
    spec: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None
    cancel: bool | None = None


class EventsAck(Response):
    acked: int = Field(description="every worker event up to this wseq is stored")
    cancel: bool


class WorkerEnrolled(Response):
    """The instance's own worker token, answered once: keep it (mode 0600) for every later boot."""

    instance_id: str
    token: str


class Ok(Response):
    ok: bool


class ArtifactStored(Response):
    """A chunk taken: `complete` once the whole artifact is here, with its name, size and sha256."""

    complete: bool = True
    received: int | None = None
    name: str | None = None
    size: int | None = None
    sha256: str | None = None


def finite(value: Any, default: float = 0.0) -> float:
    """A number fit for JSON from a stored value (an old row may hold NaN or a string)."""
    try:
        f = float(value)
    except (TypeError, ValueError):
        return default
    return f if math.isfinite(f) else default


DataNode.model_rebuild()
DataTop.model_rebuild()
