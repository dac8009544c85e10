"""get_best_models() after a remote study, in one process: each trial's checkpoint loads whole into the model the
kernel's tuner builds (search.load_trial_model), optimizer state included, with no "Skipping variable loading"."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import keras
import keras_tuner as kt
import numpy as np
import pytest
from keras_tuner.engine.trial import Trial
from searchmodels import build_model_no_input

from aibro_core.compat import keras_tuner as kt_compat
from aibro_jupyter.search import load_trial_model

pytestmark = pytest.mark.fast


def _checkpoint(tuner: kt.Tuner, trial_id: str, hp: kt.HyperParameters, steps: int) -> keras.Model:
    """A trial's checkpoint as the study leaves it in the tuner's folder: weights, optimizer state, build config."""
    model = build_model_no_input(hp)
    x, y = np.random.default_rng(steps).random((32, 6), "float32"), np.arange(32) % 10
    model.fit(x, y, epochs=steps, batch_size=32, verbose=0)
    path = Path(kt_compat.checkpoint_path(tuner, trial_id))
    path.parent.mkdir(parents=True, exist_ok=True)
    model.save_weights(path)
    Path(kt_compat.build_config_path(tuner, trial_id)).write_text(json.dumps(model.get_build_config()))
    return model


def test_a_hyperband_trial_that_continued_another_loads_its_own_checkpoint_whole(tmp_path: Path) -> None:
    """Hyperband's own build of a trial that continued an earlier one loads that earlier checkpoint into a model
    whose optimizer is not built (Keras warns and skips its state); the kernel loads the trial's own instead."""
    tuner = kt.Hyperband(build_model_no_input, objective="val_accuracy", max_epochs=3, directory=tmp_path)
    first = tuner.oracle.hyperparameters.copy()
    _checkpoint(tuner, "0000", first, steps=1)
    later = first.copy()
    later.values["tuner/trial_id"] = "0000"
    trained = _checkpoint(tuner, "0001", later, steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = load_trial_model(tuner, Trial(hyperparameters=later, trial_id="0001"))
    assert not [str(w.message) for w in caught if "Skipping variable loading" in str(w.message)]
    assert int(model.optimizer.iterations.numpy()) == 3, "the trial's own optimizer state"
    for mine, theirs in zip(model.get_weights(), trained.get_weights()):
        np.testing.assert_array_equal(mine, theirs)
    assert later.values["tuner/trial_id"] == "0000", "the trial's hyperparameters are left as they were"
