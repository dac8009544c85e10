"""A fit that is following its job on the embedded backend when the backend dies says so, starts the backend
again itself, and carries on with every epoch exactly once: from a script (Training.online_fit) and from a
%%cloud_fit cell in a real kernel (text line and progress panel). Each test has its own AIBRO_HOME."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from kernel_helpers import drain, run_cell, start_kernel

from aibro_core import vocabulary as v
from aibro_jupyter import Training, config
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest
from aibro_jupyter.progress import JobView, local_notice
from aibro_jupyter.training import connect

from conftest import kill_workers, make_model
from helpers import slow_data, user_env

TESTS = str(Path(__file__).parent)
EPOCHS = 6

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from conftest import make_model
    from helpers import slow_data
    from aibro_jupyter import Training
    x, y = slow_data(6000)
    model = make_model()
    job_id, trained, history = Training.online_fit(model, x, y, machine_ids="local-cpu", batch_size=16,
                                                   epochs={epochs})
    print("HISTORY", history.epoch, "SAME", trained is model)
    print("STEPS", int(model.optimizer.iterations.numpy()))
    """
)


def _backend_pid(home: Path) -> int:
    return int(json.loads((home / "backend.json").read_text())["pid"])


def _alive(pid: int) -> bool:
    return config._pid_alive(pid)


def _kill_backend(home: Path) -> int:
    pid = _backend_pid(home)
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.fixture
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A user of our own: whatever backends and workers run under this home are gone after the test."""
    home = tmp_path / "aibro"
    yield home
    monkeypatch.setenv("AIBRO_HOME", str(home))
    config.stop_embedded()
    kill_workers(home)


def _assert_every_epoch_once(out: str) -> None:
    for k in range(1, EPOCHS + 1):
        assert len(re.findall(rf"^Epoch {k}/{EPOCHS} ", out, re.M)) == 1, f"epoch {k}:\n{out}"


def test_online_fit_restarts_the_embedded_backend_and_carries_on(own_home: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(tests=TESTS, epochs=EPOCHS)],
        env=user_env(own_home, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(240, proc.kill)  # the old code waited forever
    watchdog.start()
    lines: list[str] = []
    killed = None
    try:
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith("Epoch 2/"):
                killed = _kill_backend(own_home)
                killed_at = len(lines)
        rc = proc.wait()
    finally:
        watchdog.cancel()
        proc.kill()
    out = "".join(lines)
    assert killed is not None, out
    assert rc == 0, out
    after_kill = "".join(lines[killed_at:])
    assert "backend unreachable, restarting" in after_kill, out
    assert "backend is back" in after_kill, out
    _assert_every_epoch_once(out)
    assert f"HISTORY {list(range(EPOCHS))} SAME True" in out, out
    assert f"STEPS {EPOCHS * 375}" in out, out  # 6000 / 16 batches per epoch: the optimizer state came back whole
    pid = _backend_pid(own_home)
    assert pid != killed and _alive(pid) and not _alive(killed), "backend.json names the new, live daemon"


CELL = """%%cloud_fit --machine local-cpu
history = model.fit(x, y, epochs={epochs}, batch_size=16)
print("HISTORY", history.epoch, "STEPS", int(model.optimizer.iterations.numpy()))
"""


def test_cloud_fit_cell_says_so_in_text_and_panel_and_carries_on(own_home: Path) -> None:
    km, kc = start_kernel(user_env(own_home))
    try:
        setup = run_cell(
            kc,
            f"import sys; sys.path.insert(0, {TESTS!r})\n"
            "from conftest import make_model\nfrom helpers import slow_data\n"
            "x, y = slow_data(6000)\nmodel = make_model()\n%load_ext aibro_jupyter\n",
            timeout=180,
        )
        assert not setup.error, setup.error
        res = run_cell(kc, CELL.format(epochs=EPOCHS), timeout=300, until="Epoch 2/")
        killed = _kill_backend(own_home)
        res = drain(kc, res, timeout=240)
        assert not res.error, res.error + res.stdout
        assert "backend unreachable, restarting" in res.stdout and "backend is back" in res.stdout, res.stdout
        _assert_every_epoch_once(res.stdout)
        assert f"HISTORY {list(range(EPOCHS))} STEPS {EPOCHS * 375}" in res.stdout, res.stdout
        shown = [str(st.get("value", "")) for _cid, st in res.updates]
        assert any("backend unreachable, restarting" in s for s in shown), "the panel says the backend is gone"
        assert any("backend is back" in s for s in shown), "and that it is back"
        pid = _backend_pid(own_home)
        assert pid != killed and _alive(pid)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_collect_right_after_a_restart_finds_the_backend_on_its_new_port(
    own_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The backend dies between the end of the job and the model download, and cannot have its old port back:
    the download restarts it, says so, follows it to its new URL, and gets the model."""
    monkeypatch.setenv("AIBRO_HOME", str(own_home))
    client = connect()
    trainer = Training(client)
    x, y = slow_data(600)
    view = trainer.watch(trainer.submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=2)).job_id)
    assert view.status == v.COMPLETED, view.errors
    old_url = client.url
    killed = _kill_backend(own_home)
    with socket.socket() as taken:  # the port it would come back on is someone else's by now
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        (own_home / "state" / "last_port").write_text(str(taken.getsockname()[1]))
        capsys.readouterr()
        model, history = trainer.collect(view, make_model(3))
    err = capsys.readouterr().err
    assert "backend unreachable, restarting…" in err and f"backend is back at {client.url}" in err, err
    assert client.url != old_url and client.health().user
    assert history.epoch == [0, 1] and int(model.optimizer.iterations.numpy()) == 2 * 19
    assert _backend_pid(own_home) != killed


def test_a_configured_backend_is_retried_with_backoff(tmp_path: Path) -> None:
    """A backend this client did not start (AIBRO_BACKEND_URL, `aibro login`) is never started by it: the follower
    says it retries, tries again with backoff until the backend is back, and loses or repeats no event."""
    home = tmp_path / "server"
    cmd = [sys.executable, "-m", "aibro_backend", "--home", str(home)]
    env = user_env(home)

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not ((home / "backend.json").exists() and _backend_pid(home) == proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError("the backend did not start")
            time.sleep(0.1)
        return proc

    procs = [start()]
    restarter = threading.Timer(3.0, lambda: procs.append(start()))
    try:
        url = json.loads((home / "backend.json").read_text())["url"]
        client = BackendClient(url, json.loads((home / "credentials.json").read_text())["token"])
        x, y = slow_data(3000)
        job_id = (
            Training(client)
            .submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", batch_size=16, epochs=4))
            .job_id
        )
        seen: list[dict] = []
        for ev in client.follow(job_id):
            seen.append(ev)
            if ev["type"] == v.EV_EPOCH and len(procs) == 1 and not restarter.is_alive():
                procs[0].kill()
                procs[0].wait()
                restarter.start()  # the backend is down for 3 s and more: tries at once, then after 1, 2, 4 s
    finally:
        restarter.cancel()
        if restarter.is_alive():
            restarter.join()
        for proc in procs:
            proc.kill()
            proc.wait()
        kill_workers(home)
    notices = [(i, local_notice(ev)) for i, ev in enumerate(seen) if local_notice(ev)]
    messages = [n for _, n in notices]
    assert messages[0].startswith(f"backend unreachable, retrying… (cannot reach the aibro backend at {url}"), notices
    assert [n for _, n in notices][1:] == [f"backend is back at {url}; carrying on"], notices
    for i, _ in notices:
        assert seen[i]["seq"] == seen[i - 1]["seq"], "a notice carries the last seq seen"
    real = [ev for ev in seen if not local_notice(ev)]
    assert [ev["seq"] for ev in real] == list(range(1, len(real) + 1)), "no event lost or repeated"
    assert [ev["data"]["epoch"] for ev in real if ev["type"] == v.EV_EPOCH] == [0, 1, 2, 3]
    view = JobView(job_id)
    for ev in seen:
        view.apply(ev)
    assert view.last_seq == real[-1]["seq"] and view.status == v.COMPLETED and sorted(view.history) == [0, 1, 2, 3]
