"""Issue 35 item 5, the test subset of the keras-io corpus: our own notebooks of the shapes keras-io's examples have
(tests/notebooks/, each naming the example it mirrors), each run in a real kernel locally and then with its one fit
(or search) under %%cloud_fit / %%cloud_tune, through the runner benchmarks/keras_io_corpus.py uses
(tests/notebook_corpus.py). Each test asserts what the user would check: the remote History has the local one's keys
and epochs, the very model object was trained in place, the cells after the fit work on it, and nothing the backend
stored is a pickle. Written to the real expectation: a notebook the product cannot train remotely yet fails here.

Not in the fast tier: each notebook is two kernels and a training job (tiny data, 2 epochs). One backend serves the
module (its own AIBRO_HOME, stopped at the end) with a cool-down, so a warm worker takes the next job.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import notebook_corpus as nc
import pytest

from conftest import scratch

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"
pytestmark = pytest.mark.timeout(900)

FIT_NOTEBOOKS = [
    "vae_train_step",
    "distiller_teacher",
    "gan_two_optimizers",
    "siamese_closure_loss",
    "text_vectorization",
    "pandas_multi_input",
    "lstm_timeseries_tfdata",
    "frozen_applications_base",
]


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's folder: a backend home shared by its notebooks' remote runs, a folder per run beside it."""
    with scratch(tmp_path_factory, "notebook-corpus") as root:
        try:
            yield root
        finally:
            nc.stop_backend(root / "home")


def run(name: str, root: Path) -> nc.Outcome:
    nb = nc.load_notebook(NOTEBOOKS / f"{name}.py", extra_flags="--cool-down 120")
    outcome = nc.run_both(nb, root / name, home=root / "home")
    print(nc.table([outcome]))
    return outcome


def assert_trains_like_local(o: nc.Outcome) -> None:
    assert o.outcome == nc.TRAINS, f"{o.outcome}: {o.reason} {o.notes}"
    assert o.keys_remote == o.keys_local, (o.keys_local, o.keys_remote)
    assert o.epochs_remote == o.epochs_local, (o.epochs_local, o.epochs_remote)
    assert o.same_object and o.trained_in_place, "the notebook's model object holds the remote training"
    assert o.blobs and not o.blob_findings, (o.blobs, o.blob_findings)


@pytest.mark.parametrize("name", FIT_NOTEBOOKS)
def test_notebook_trains_remotely_like_locally(name: str, corpus_root: Path) -> None:
    o = run(name, corpus_root)
    assert_trains_like_local(o)
    assert not [n for n in o.notes if "model.history" in n or "no History object" in n], o.notes


def test_callback_prints_show_in_the_cell(corpus_root: Path) -> None:
    o = run("callback_prints", corpus_root)
    assert_trains_like_local(o)
    printed = [line for line in o.remote["call_output"].splitlines() if line.startswith("The average loss for epoch")]
    assert len(printed) == 2, o.remote["call_output"][-2000:]


def test_hypermodel_subclass_search(corpus_root: Path) -> None:
    o = run("hypermodel_fit", corpus_root)
    assert o.outcome == nc.TRAINS, f"{o.outcome}: {o.reason}"
    assert o.epochs_remote == o.epochs_local == 2, "both trials completed remotely, as locally"
    assert o.keys_remote == o.keys_local  # the objective and the space (units, shuffle)
    assert not o.blob_findings, o.blob_findings


def test_lambda_under_safe_mode_is_refused_before_upload_naming_the_fix(corpus_root: Path) -> None:
    o = run("lambda_safe_mode", corpus_root)
    assert o.outcome == nc.REFUSED, f"{o.outcome}: {o.reason}"
    assert "--unsafe" in o.reason or "safe_mode" in o.reason, o.reason
    assert not o.jobs, "nothing was submitted"
