"""%%cloud_fit in a real kernel: local statements, remote fit, History, the model back in place, and attach
from a new kernel after the first one died."""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest
from kernel_helpers import CellResult, click, digits_setup, drain, run_cell, start_kernel

from helpers import wait_for

SETUP = digits_setup(then="model = build()\nmodel_id = id(model)")


@pytest.fixture(scope="module")
def kernel(aibro_home: Path, client):  # noqa: ANN001 - client starts the shared backend first
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    res = run_cell(kc, SETUP, timeout=180)
    assert not res.error, res.error
    kc.manager = km  # the tests that interrupt the kernel need it
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_cloud_fit_runs_fit_remotely_and_the_rest_locally(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        """%%cloud_fit --machine local-cpu --cool-down 600 --description "magic digits"
x_scaled = x_train * 1.0
history = model.fit(x_scaled, y_train, epochs=3, batch_size=32, validation_data=(x_val, y_val))
acc = model.evaluate(x_val, y_val, verbose=0)[1]
print("FINAL", round(acc, 4), round(history.history["val_accuracy"][-1], 4), id(model) == model_id)
print("STEPS", int(model.optimizer.iterations.numpy()))
""",
    )
    assert not res.error, res.error
    assert "Epoch 3/3" in res.stdout
    final = re.search(r"FINAL (\S+) (\S+) (\S+)", res.stdout)
    assert final and final.group(1) == final.group(2) and final.group(3) == "True", res.stdout
    assert "STEPS 132" in res.stdout  # 44 batches x 3 epochs: optimizer state came back
    job = next(j for j in reversed(client.jobs()) if j.description == "magic digits")
    assert job.status == "COMPLETED" and job.meta == {"variable": "model"}
    shown = [d for d in res.data if "application/vnd.jupyter.widget-view+json" in d]
    assert len(shown) == 1, "the progress panel is displayed once, from the cell"
    progress = {cid: st for cid, st in res.widgets.items() if st.get("_model_name") == "IntProgressModel"}
    epoch_bar = next(cid for cid, st in progress.items() if st["description"] == "epoch")
    values = [st["value"] for cid, st in res.updates if cid == epoch_bar and "value" in st]
    assert values and values == sorted(values) and values[-1] == 3, f"then only its traits change: {values}"
    costs = [str(st["value"]) for _cid, st in res.updates if "elapsed" in str(st.get("value", ""))]
    assert costs and costs[-1].startswith("cost free · elapsed"), f"local-cpu is free, as the sidebar says: {costs}"
    assert not any("$" in c for c in costs), costs


def test_cloud_machines_predicts_a_fit_from_the_earlier_jobs_of_its_model(kernel) -> None:  # noqa: ANN001
    """After the first test's job of this model (x_scaled has x_train's shape), the same fit is predicted from it."""
    res = run_cell(kernel, "%cloud_machines --predict model.fit(x_train, y_train, epochs=5, batch_size=32)")
    assert not res.error, res.error
    (row,) = [line for line in res.stdout.splitlines() if line.startswith("local-cpu")]
    assert re.search(r"free  history: \d+ earlier jobs? of this model on local-cpu", row), res.stdout
    res = run_cell(kernel, "%cloud_machines --predict print(1)")
    said = res.stdout + res.error
    assert "UsageError: --predict takes a fit call, e.g. model.fit(x, y, epochs=5), not 'print(1)'" in said, said


@pytest.mark.parametrize(
    "cell, message",
    [
        ("%%cloud_fit -m local-cpu\nprint('no fit here')", "no `.fit(...)` call"),
        ("%%cloud_fit -m local-cpu\nmodel.fit(x_train, y_train)\nmodel.fit(x_train, y_train)", "2 `.fit(...)` calls"),
        ("%%cloud_fit -m local-cpu\nnot_a_model = [1]\nnot_a_model.fit(x_train)", "not a Keras model"),
        (
            "%%cloud_fit -m local-cpu\nfor i in range(2):\n    model.fit(x_train)\n    model.fit(x_train)",
            "2 `.fit(...)` calls",
        ),
        ("%%cloud_fit -m local-cpu\nfor i in range(2):\n    [1].fit(x_train)", "`[1]` is a builtins.list, not a Keras"),
        ("%%cloud_fit -m local-cpu\ndef train():\n    model.fit(x_train, y_train)", "inside the def train on line 1"),
        ("%%cloud_fit -m local-cpu\nhs = (model.fit(x_train, y_train) for _ in range(2))", "the generator expression"),
        ("%%cloud_fit -m local-cpu --detach\nif True:\n    model.fit(x_train, y_train)", "leave --detach out"),
        ("%%cloud_fit -m nope\nmodel.fit(x_train, y_train)", "unknown machine 'nope'"),
    ],
)
def test_cloud_fit_errors(kernel, cell: str, message: str) -> None:  # noqa: ANN001
    res = run_cell(kernel, cell)
    assert message in res.stdout + res.error, res.stdout + res.error


def test_help_text_for_every_magic(kernel) -> None:  # noqa: ANN001
    for magic in (
        "%%cloud_fit",
        "%%cloud_tune",
        "%cloud_machines",
        "%cloud_jobs",
        "%cloud_attach",
        "%cloud_result",
        "%cloud_cancel",
        "%cloud_timeline",
    ):
        res = run_cell(
            kernel,
            f"print(get_ipython().find_magic('{magic.lstrip('%')}', "
            f"'{'cell' if magic.startswith('%%') else 'line'}').__doc__)",
        )
        assert not res.error and len(res.stdout.strip()) > 20, (magic, res.stdout)


def test_kernel_dies_mid_training_then_attach_in_a_new_kernel(aibro_home: Path, client) -> None:  # noqa: ANN001
    km, kc = start_kernel({"AIBRO_HOME": str(aibro_home)})
    assert not run_cell(kc, SETUP, timeout=180).error
    big = "xb = np.repeat(x_train, 4, axis=0); yb = np.repeat(y_train, 4, axis=0)\n"
    assert not run_cell(kc, big).error
    res = run_cell(
        kc,
        "%%cloud_fit -m local-cpu --cool-down 600\n"
        "history = model.fit(xb, yb, epochs=6, batch_size=16, validation_data=(x_val, y_val))",
        until="Epoch 2/6",
    )
    km.shutdown_kernel(now=True)
    kc.stop_channels()
    job_id = next(j.job_id for j in reversed(client.jobs()) if j.epochs == 6)
    assert client.job(job_id).status in ("QUEUING", "TRAINING"), "the job outlives its kernel"
    assert "Epoch 2/6" in res.stdout

    km2, kc2 = start_kernel({"AIBRO_HOME": str(aibro_home)})
    try:
        assert not run_cell(kc2, SETUP, timeout=180).error
        res = run_cell(
            kc2,
            f"%cloud_attach {job_id} --into model\n"
            "panel = get_ipython().magics_manager.registry['CloudMagics'].last_panel\n"
            "print('POINTS', panel.curve_points, 'SAME', id(model) == model_id)\n"
            "print('ACC', round(model.evaluate(x_val, y_val, verbose=0)[1], 4), "
            "round(model_history.history['val_accuracy'][-1], 4))",
        )
        assert not res.error, res.error
        for k in range(1, 7):
            assert res.stdout.count(f"Epoch {k}/6 ") == 1, res.stdout
        assert "POINTS 6 SAME True" in res.stdout, res.stdout
        acc = re.search(r"ACC (\S+) (\S+)", res.stdout)
        assert acc and acc.group(1) == acc.group(2)
    finally:
        kc2.stop_channels()
        km2.shutdown_kernel(now=True)


def _detached(kernel, rest: str) -> str:  # noqa: ANN001
    """Run `%%cloud_fit -m local-cpu --cool-down 900 --detach REST`; the job id the cell names."""
    res = run_cell(kernel, f"%%cloud_fit -m local-cpu --cool-down 900 --detach {rest}")
    assert not res.error, res.error
    found = re.search(r"(job-\S+) started on local-cpu; follow it with %cloud_attach \1", res.stdout)
    assert found, res.stdout
    return found.group(1)


def test_options_ckpt_dir_log_dir_into_and_detach(kernel, client, tmp_path: Path) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        f"%%cloud_fit -m local-cpu --cool-down 600 --ckpt-dir {tmp_path}/ck --log-dir {tmp_path}/tb --into trained "
        "--description 'options test' --quiet\n"
        "model.fit(x_train[:300], y_train[:300], epochs=2, batch_size=50)\n"
        "print('SAME', trained is model)",
    )
    assert not res.error, res.error
    assert "SAME True" in res.stdout and "Epoch 1/2" not in res.stdout, "--quiet leaves only the panel"
    job = next(j for j in reversed(client.jobs()) if j.description == "options test")
    ckpts = sorted(p.name for p in (tmp_path / "ck" / job.job_id / "checkpoints").iterdir())
    assert ckpts == ["epoch-0001.keras", "epoch-0002.keras"]
    assert list((tmp_path / "tb" / "logs" / job.job_id).rglob("events.out.tfevents.*")), "TensorBoard logs"

    job_id = _detached(kernel, "-d detached\nh = model.fit(x_train[:300], y_train[:300], epochs=2)")
    assert client.job(job_id).status in ("QUEUING", "TRAINING", "COMPLETED")
    res = run_cell(
        kernel,
        f"%cloud_attach {job_id} --into fresh\nprint('NEW', fresh is not model, len(fresh_history.history['loss']))",
    )
    assert not res.error, res.error
    assert "NEW True 2" in res.stdout and "loaded into `fresh` (as a new model)" in res.stdout


def test_picker_appears_and_its_button_starts_the_job(kernel, client) -> None:  # noqa: ANN001
    res = CellResult(
        msg_id=kernel.execute(
            "%%cloud_fit --cool-down 45 -d picked\nhistory = model.fit(x_train[:300], y_train[:300], epochs=1)"
        )
    )
    deadline = time.monotonic() + 120
    while not any(st.get("description") == "Start training" for st in res.widgets.values()):
        assert time.monotonic() < deadline and not res.done, "the picker, with its Start training button"
        with contextlib.suppress(AssertionError):  # drain's "not finished yet": the cell waits for the click
            drain(kernel, res, timeout=2)
    assert not res.done and not res.error
    assert "press Start training" in " ".join(str(st.get("value", "")) for st in res.widgets.values()), "its hint"
    assert "<code>local-cpu</code>" in " ".join(str(st.get("value", "")) for st in res.widgets.values()), (
        "the marketplace table"
    )
    assert not [j for j in client.jobs() if j.description == "picked"], "nothing starts before the click"
    click(kernel, res, "Start training")
    drain(kernel, res)
    assert not res.error, res.error
    assert "Epoch 1/1" in res.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "picked")
    assert job.status == "COMPLETED" and job.machines == ["local-cpu"] and job.cool_down_s == 45


def test_ctrl_c_detaches_and_never_cancels(kernel, client) -> None:  # noqa: ANN001
    assert not run_cell(kernel, "xb = np.repeat(x_train, 6, axis=0); yb = np.repeat(y_train, 6, axis=0)").error
    res = run_cell(
        kernel,
        "%%cloud_fit -m local-cpu --cool-down 600 -d interrupted\n"
        "history = model.fit(xb, yb, epochs=30, batch_size=16)",
        until="Epoch 1/30",
    )
    kernel.manager.interrupt_kernel()
    drain(kernel, res, timeout=60)
    assert not res.error, f"Ctrl-C is not an error here: {res.error}"
    job = next(j for j in reversed(client.jobs()) if j.description == "interrupted")
    assert f"Attach again with: %cloud_attach {job.job_id}" in res.stdout
    assert any("DETACHED" in str(st.get("value", "")) for _cid, st in res.updates), "the panel says it is detached"
    time.sleep(2)
    assert client.job(job.job_id).status == "TRAINING", "the job keeps training"
    client.cancel(job.job_id)


def test_panel_buttons_work_while_the_cell_runs(kernel, client) -> None:  # noqa: ANN001
    """Cancel and Detach are clicked mid-training, the way the browser sends them."""
    assert not run_cell(kernel, "xb = np.repeat(x_train, 6, axis=0); yb = np.repeat(y_train, 6, axis=0)").error
    res = run_cell(
        kernel,
        "%%cloud_fit -m local-cpu --cool-down 600 -d detach-button\nhistory = model.fit(xb, yb, epochs=30)",
        until="Epoch 1/30",
    )
    click(kernel, res, "Detach")
    drain(kernel, res, timeout=60)
    job = next(j for j in reversed(client.jobs()) if j.description == "detach-button")
    assert f"Attach again with: %cloud_attach {job.job_id}" in res.stdout and not res.error
    assert client.job(job.job_id).status == "TRAINING", "Detach leaves the job training"

    res = run_cell(kernel, f"%cloud_attach {job.job_id}", until="Epoch ")
    click(kernel, res, "Cancel")
    drain(kernel, res, timeout=60)
    assert client.job(job.job_id).status == "CANCELED"
    assert f"job {job.job_id} did not complete: it was canceled" in res.stdout, res.stdout[-500:]


def test_spec_options_and_the_line_magics(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        "%%cloud_fit -m local-cpu --cool-down 900 --wait-request 45 --wait-slot 30 --no-record -d 'not recorded'\n"
        "h = model.fit(x_train[:300], y_train[:300], epochs=2, validation_data=(x_val, y_val))\n"
        "print('EPOCHS', h.epoch)",
    )
    assert not res.error, res.error
    assert "EPOCHS [0, 1]" in res.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "not recorded")
    assert (job.cool_down_s, job.wait_request_s, job.record) == (900, 45, False)
    job_id = job.job_id

    res = run_cell(kernel, f"from aibro_jupyter import Training\nTraining.replay_job('{job_id}')")
    assert "was not recorded (record=False), so it cannot be replayed" in res.error + res.stdout

    res = run_cell(
        kernel,
        f"%cloud_result {job_id} --into r\n"
        "print('R', r is not model, r_history.epoch, round(r.evaluate(x_val, y_val, verbose=0)[1], 4))",
    )
    assert not res.error, res.error
    found = re.search(r"R True \[0, 1\] (\S+)", res.stdout)
    assert found and float(found.group(1)) == pytest.approx(job.history[-1].val_accuracy, abs=1e-4), res.stdout

    res = run_cell(kernel, f"%cloud_timeline {job_id} --chart funnel")
    assert not res.error, res.error
    assert any("application/vnd.jupyter.widget-view+json" in d for d in res.data), "a bqplot figure shows"

    long_id = _detached(kernel, "-d 'to cancel'\nmodel.fit(x_train, y_train, epochs=500, batch_size=8)")
    res = run_cell(kernel, f"%cloud_cancel {long_id}")
    assert not res.error and f"{long_id}: cancel requested" in res.stdout, res.stdout + res.error
    wait_for(client, long_id, lambda evs: any(e["type"] == "status" and e["data"]["status"] == "CANCELED" for e in evs))

    res = run_cell(kernel, "%cloud_jobs")
    assert not res.error, res.error
    rows = {line.split()[0]: line.split()[1] for line in res.stdout.splitlines()[1:] if line.startswith("job-")}
    assert rows[job_id] == "COMPLETED" and rows[long_id] == "CANCELED", res.stdout


def test_unsafe_trains_a_lambda_model(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        "lam = keras.Sequential([keras.Input((64,)), keras.layers.Lambda(lambda t: t * 2.0),\n"
        "                        keras.layers.Dense(10, activation='softmax')])\n"
        "lam.compile(optimizer='adam', loss='sparse_categorical_crossentropy', metrics=['accuracy'])\n"
        "lam_id = id(lam)",
    )
    assert not res.error, res.error
    res = run_cell(kernel, "%%cloud_fit -m local-cpu --cool-down 900 -d 'lambda safe'\nlam.fit(x_train, y_train)")
    assert "--unsafe" in res.error + res.stdout, "safe mode refuses a Lambda layer and names the opt-out"
    res = run_cell(
        kernel,
        "%%cloud_fit -m local-cpu --cool-down 900 --unsafe -d 'lambda unsafe'\n"
        "h = lam.fit(x_train, y_train, epochs=2, validation_data=(x_val, y_val))\n"
        "print('LAM', id(lam) == lam_id, round(lam.evaluate(x_val, y_val, verbose=0)[1], 4),"
        " round(h.history['val_accuracy'][-1], 4))",
    )
    assert not res.error, res.error
    found = re.search(r"LAM True (\S+) (\S+)", res.stdout)
    assert found and found.group(1) == found.group(2), res.stdout
    job = next(j for j in reversed(client.jobs()) if j.description == "lambda unsafe")
    assert job.status == "COMPLETED"


def test_the_same_cell_without_the_magic_does_the_same_locally(kernel) -> None:  # noqa: ANN001
    body = (
        "m = build()\n"
        "h = m.fit(x_train[:320], y_train[:320], epochs=2, batch_size=32, validation_data=(x_val, y_val), verbose=0)\n"
        "print('SHAPE', type(h).__name__, h.epoch, sorted(h.history), h.params['epochs'], h.params['steps'],"
        " h.model is m, int(m.optimizer.iterations.numpy()))"
    )
    local = run_cell(kernel, body)
    remote = run_cell(kernel, "%%cloud_fit -m local-cpu --cool-down 900 --quiet\n" + body)
    assert not local.error and not remote.error, local.error + remote.error
    shapes = [re.search(r"SHAPE .*", r.stdout).group(0) for r in (local, remote)]
    assert (
        shapes[0] == shapes[1] == ("SHAPE History [0, 1] ['accuracy', 'loss', 'val_accuracy', 'val_loss'] 2 10 True 20")
    ), shapes


def test_what_the_cell_itself_defines_travels_and_model_history_is_set(kernel) -> None:  # noqa: ANN001
    """A callback class, the function it calls and a lambda written in the %%cloud_fit cell itself, before its fit
    (keras.io's callbacks guide does so) travel as that cell's source; `model.history` is the History afterwards, as
    Keras' own fit leaves it."""
    res = run_cell(
        kernel,
        """%%cloud_fit -m local-cpu --cool-down 900 --quiet
class Says(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        print("SAYS", epoch, tenfold(2))

def tenfold(v):
    return v * 10

m2 = build()
m2.fit(x_train[:320], y_train[:320], epochs=2, batch_size=32, verbose=0,
       callbacks=[Says(), keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: print("LAMBDA", e))])
print("HIST", sorted(m2.history.history), m2.history.epoch, m2.history.model is m2)
""",
    )
    assert not res.error, res.error
    shown = [line for line in res.stdout.splitlines() if line.startswith(("SAYS", "LAMBDA", "HIST"))]
    assert shown == [
        "SAYS 0 20",
        "LAMBDA 0",
        "SAYS 1 20",
        "LAMBDA 1",
        "HIST ['accuracy', 'loss'] [0, 1] True",
    ], res.stdout


LOOP = """%%cloud_fit -m local-cpu -d 'looped fits'
lm = build()
lm_id = id(lm)
for it in range(3):
    print("ITER", it)
    h = lm.fit(x_train[:320], y_train[:320], epochs=1, batch_size=32, validation_data=(x_val, y_val))
    acc = lm.evaluate(x_val, y_val, verbose=0)[1]
    print("AFTER", it, h.epoch, h is lm.history, round(acc, 4) == round(h.history["val_accuracy"][-1], 4))
print("STEPS", int(lm.optimizer.iterations.numpy()), id(lm) == lm_id)
"""


def test_a_fit_in_a_loop_runs_each_pass_as_a_job_on_the_warm_machine(kernel, client) -> None:  # noqa: ANN001
    """keras.io's addition RNN trains so: a loop of fit(epochs=1), the model used in the kernel after each. Each pass
    is a job of its own on the same warm worker, its History and its trained state back before the next statement."""
    res = run_cell(kernel, LOOP)
    assert not res.error, res.error
    shown = [ln for ln in res.stdout.splitlines() if ln.startswith(("ITER", "Epoch", "AFTER", "STEPS"))]
    assert [ln.split(" - ")[0] for ln in shown] == [
        *[line for k in range(3) for line in (f"ITER {k}", "Epoch 1/1", f"AFTER {k} [0] True True")],
        "STEPS 30 True",  # 10 batches a pass, the optimizer's state carried from one job to the next
    ], res.stdout
    assert res.stdout.count("its machine stays warm 300 s for the next") == 1, res.stdout
    jobs = [j for j in client.jobs() if j.description == "looped fits"]
    assert [j.status for j in jobs] == ["COMPLETED"] * 3 and {j.cool_down_s for j in jobs} == {300}
    assert len({j.instance_id for j in jobs}) == 1, "every pass lands on the warm worker of the one before"
    panels = [d for d in res.data if "application/vnd.jupyter.widget-view+json" in d]
    assert len(panels) == 1, "one place for the panels: each job's replaces the last one's"
    headers = " ".join(str(st.get("value", "")) for st in res.widgets.values())
    assert all(f"fit {k} of this cell" in headers for k in (1, 2, 3)), "each job has its own panel"
    assert any("CELL DONE" in str(st.get("value", "")) for _cid, st in res.updates), "the last panel says so"


def test_a_fit_in_an_if_and_the_cells_last_value(kernel, client) -> None:  # noqa: ANN001
    res = run_cell(
        kernel,
        "%%cloud_fit -m local-cpu --cool-down 900 -d 'fit in an if' --quiet\n"
        "if len(x_train) > 10:\n"
        "    h2 = model.fit(x_train[:320], y_train[:320], epochs=2, verbose=0)\n"
        "else:\n"
        "    h2 = None\n"
        "h2.epoch, model.history is h2",
    )
    assert not res.error, res.error
    assert {"text/plain": "([0, 1], True)"} in res.data, res.data
    job = next(j for j in reversed(client.jobs()) if j.description == "fit in an if")
    assert job.status == "COMPLETED" and job.cool_down_s == 900


def test_cancel_or_ctrl_c_in_a_loop_stops_the_loop(kernel, client) -> None:  # noqa: ANN001
    """Neither starts the next pass's job, even past the cell's own `except Exception`."""
    assert not run_cell(kernel, "xb = np.repeat(x_train, 6, axis=0); yb = np.repeat(y_train, 6, axis=0)").error
    body = (
        "for it in range(3):\n"
        "    try:\n"
        "        model.fit(xb, yb, epochs=30, batch_size=16)\n"
        "    except Exception as exc:\n"
        "        print('SWALLOWED', exc)\n"
    )
    res = run_cell(kernel, "%%cloud_fit -m local-cpu --cool-down 600 -d loop-cancel\n" + body, until="Epoch 1/30")
    click(kernel, res, "Cancel")
    drain(kernel, res, timeout=60)
    assert "it was canceled; the cell stopped at its fit on line 3 (fit 1)" in res.stdout, res.error + res.stdout
    assert "SWALLOWED" not in res.stdout
    assert [j.status for j in client.jobs() if j.description == "loop-cancel"] == ["CANCELED"]

    res = run_cell(kernel, "%%cloud_fit -m local-cpu --cool-down 600 -d loop-ctrl-c\n" + body, until="Epoch 1/30")
    kernel.manager.interrupt_kernel()
    drain(kernel, res, timeout=60)
    assert not res.error, f"Ctrl-C is not an error here: {res.error}"
    assert "Attach again with: %cloud_attach" in res.stdout, res.stdout
    assert "the cell stopped at its fit on line 3 (fit 1)" in res.stdout
    jobs = [j for j in client.jobs() if j.description == "loop-ctrl-c"]
    assert len(jobs) == 1 and jobs[0].status == "TRAINING", "the job goes on; no next one started"
    client.cancel(jobs[0].job_id)
