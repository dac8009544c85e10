"""Issue 38 item 1 (first slice): a fit's time and cost on each machine before it starts. A model never run is
guessed from its FLOPs (said to be a rough guess); once a job of the same model fingerprint ran on a machine type,
the next fit of that model there is predicted from the epochs it measured, and a second real job lands within a
sane factor of that prediction. Real backend, real training; the numbers are printed for the record."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from aibro_core import vocabulary as v
from aibro_core.errors import ApiError
from aibro_core.models import Machine, PredictionRequest
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.modelprofile import fingerprint, train_flops_per_sample
from aibro_jupyter.predictions import format_predictions, prediction_request
from aibro_jupyter.training import Training

from helpers import slow_data

WIDTH = 83  # a width no other test's model has: this module's fingerprint is its own on the shared backend


def _model(width: int = WIDTH) -> keras.Model:
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(10, activation="softmax")]
    )
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


def _fit_seconds(client: BackendClient, job_id: str) -> float:
    """What the job's epochs took on the worker, as its epoch events say."""
    return sum(ev["data"]["seconds"] for ev in client.events(job_id)["events"] if ev["type"] == v.EV_EPOCH)


@pytest.mark.fast
def test_the_fingerprint_is_the_architecture_the_input_and_the_batch_not_the_names() -> None:
    x = np.zeros((10, 64), "float32")
    first, second = _model(), _model()
    assert first.layers[0].name != second.layers[0].name, "Keras numbered the second model's layers anew"
    assert fingerprint(first, x, 32) == fingerprint(second, x, 32)
    assert fingerprint(first, x, 64) != fingerprint(first, x, 32), "the batch size"
    assert fingerprint(_model(84), x, 32) != fingerprint(first, x, 32), "the architecture"
    assert fingerprint(first, np.zeros((10, 64, 1)), 32) != fingerprint(first, x, 32), "the input shapes"
    dense = 2 * (64 * WIDTH + WIDTH * 10)  # a multiply and an add per weight, once per sample
    assert train_flops_per_sample(first) == pytest.approx(3 * (dense + WIDTH + 10 + 64), rel=0.01)
    conv = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Conv2D(8, 3), keras.layers.Flatten()])
    assert train_flops_per_sample(conv) >= 3 * 2 * (3 * 3 * 8) * 26 * 26, "a kernel once per output position"
    lstm = keras.Sequential([keras.Input((20, 8)), keras.layers.LSTM(16)])
    assert train_flops_per_sample(lstm) >= 3 * 2 * (8 * 64 + 16 * 64) * 20, "a cell once per time step"


def test_a_model_never_run_is_a_flops_guess_and_its_second_run_is_predicted_from_its_first(
    client: BackendClient,
) -> None:
    training = Training(client)
    x, y = slow_data(6000, seed=11)
    offers = {m.machine_id: m for m in client.machines()}

    never = training.predictions(FitRequest(_model(), x, y, "local-cpu", batch_size=32, epochs=4), verbose=False)
    (guess,) = never
    assert guess.source == v.PredictionSource.FLOPS and guess.seconds and guess.seconds > 0, guess
    assert guess.cost == 0.0 and "rough guess" in guess.basis, "local-cpu is free; a guess says it is one"
    every = client.predict(prediction_request(FitRequest(_model(), x, y, batch_size=32, epochs=4)))
    assert [p.machine_id for p in every] == list(offers), "no list: every machine offered, in the marketplace order"
    with pytest.raises(ApiError, match="unknown machine 'nope': GET /machines lists the ones offered"):
        client.predict(prediction_request(FitRequest(_model(), x, y, epochs=4), ["nope"]))

    first = training.submit(FitRequest(_model(), x[:3000], y[:3000], "local-cpu", batch_size=32, epochs=3))
    assert training.watch(first.job_id).status == v.COMPLETED

    request = FitRequest(_model(), x, y, "local-cpu", batch_size=32, epochs=4)  # a new model object, twice the data
    (predicted,) = training.predictions(request, verbose=False)
    assert predicted.source == v.PredictionSource.HISTORY, predicted
    assert "1 earlier job of this model on local-cpu" in predicted.basis and predicted.cost == 0.0
    second = training.submit(request)
    assert training.watch(second.job_id).status == v.COMPLETED
    measured = _fit_seconds(client, second.job_id)
    print(f"\nflops guess {guess.seconds:.2f}s, history {predicted.seconds:.2f}s, measured {measured:.2f}s")
    assert measured / 3 < predicted.seconds < measured * 3, (predicted.seconds, measured)

    (again,) = training.predictions(request, verbose=False)
    assert "2 earlier jobs" in again.basis, "each job of the model teaches the next prediction"
    other = training.predictions(FitRequest(_model(84), x, y, "local-cpu", batch_size=32), verbose=False)
    assert other[0].source == v.PredictionSource.FLOPS, "another architecture learns nothing from these jobs"
    text = format_predictions([predicted, *other])
    assert "free  history: 1 earlier job" in text and "~" in text.splitlines()[3], text


@pytest.mark.fast
def test_the_text_says_dash_where_nothing_is_known_and_prices_a_priced_machine() -> None:
    from aibro_backend.scheduling.predict import predict

    gpu = Machine(
        machine_id="g4dn.xlarge",
        provider="aws",
        gpu_type="T4",
        gpu_count=1,
        vcpus=4,
        memory_gib=16,
        price_per_hour=0.526,
        on_demand_price_per_hour=0.526,
        availability="available",
    )
    request = PredictionRequest.model_validate(
        {"profile": {"fingerprint": "0" * 32, "flops_per_sample": 2e9}, "epochs": 10, "samples": 50000}
    )

    class NoJobs:
        class jobs:  # noqa: N801 - the store's repository, as predict reads it
            @staticmethod
            def list(user_id: int) -> list:
                return []

    (priced,) = predict(NoJobs(), 1, [gpu], request).predictions  # type: ignore[arg-type]
    assert priced.cost == pytest.approx(0.526 * priced.seconds / 3600) and priced.cost > 0.01
    unknown = request.model_copy(update={"samples": None})
    (nothing,) = predict(NoJobs(), 1, [gpu], unknown).predictions  # type: ignore[arg-type]
    assert (nothing.seconds, nothing.cost, nothing.source) == (None, None, None)
    text = format_predictions([priced, nothing])
    assert f"~${priced.cost:.2f}" in text and "rough guess" in text
    row = text.splitlines()[3].split()
    assert row[:3] == ["g4dn.xlarge", "—", "—"] and "nothing known" in text
