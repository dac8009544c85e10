"""A worker never sees the client's files, and the worker agent installs and trains on a bare host.

Every local worker runs `python -I -m aibro_backend.worker` in a fresh private directory with an environment built
from an allow-list: no PYTHONPATH, none of the backend's state or credentials. The agent is its own distribution:
the wheel the backend builds of itself (providers/shipping.py), installed into a fresh venv with only what it
declares and no package index (tests/wheelhouse.py), holds none of the notebook stack, and a backend whose
AIBRO_WORKER_PYTHON names that venv trains a real job there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from backend_proc import own_backend

from aibro_backend.providers import shipping
from aibro_backend.providers.local import FROM_SCHEDULER, INHERITED, pid_alive
from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.client import BackendClient
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model, scratch
from helpers import instance_pid, run_as_user, slow_data, worker_process

NEVER = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "AIBRO_HOME", "AIBRO_TOKEN", "AIBRO_BACKEND_URL")
NOTEBOOK_STACK = ("jupyterlab", "ipywidgets", "bqplot", "aibro_jupyter", "tornado")


def proc_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def proc_cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")


def allowed(name: str) -> bool:
    """What a worker's environment may hold (providers/local.py's allow-lists, spelled out again here)."""
    return (
        name == "PWD"  # bubblewrap sets it to the directory it starts the worker in (checked below)
        or name in INHERITED
        or name in FROM_SCHEDULER
        or name.startswith(("TF_", "CUDA_", "NVIDIA_", "XLA_", "AIBRO_WORKER_"))
    )


def assert_isolated(pid: int, home: Path, instance_id: str) -> dict[str, str]:
    """The worker `pid` runs isolated, in its own fresh directory under the backend's state; returns its env."""
    assert pid_alive(pid), "the worker must still be cooling (alive) to be inspected"
    env = proc_environ(pid)
    for name in NEVER:
        assert name not in env, f"the worker's environment holds {name}={env[name]!r}"
    assert sorted(k for k in env if not allowed(k)) == [], "only allow-listed variables reach a worker"
    workdir = (home / "state" / "workers" / instance_id).resolve()
    assert Path(env["AIBRO_WORKER_DIR"]).resolve() == workdir  # a spare's own directory, linked under the instance
    assert env["AIBRO_INSTANCE_ID"] == instance_id
    assert Path(os.readlink(f"/proc/{pid}/cwd")).resolve() == workdir, "cwd is the worker's own private directory"
    assert env.get("PWD", str(workdir)) == str(workdir)
    cmd = proc_cmdline(pid)
    assert cmd[1:] == ["-I", "-m", "aibro_backend.worker"], cmd
    if shutil.which("bwrap") and os.geteuid() == 0:  # the README's test command installs bubblewrap
        assert os.stat(f"/proc/{pid}").st_uid >= 200_000, "a sandboxed worker runs as an unprivileged uid"
        assert os.stat(f"/proc/{pid}/ns/mnt").st_ino != os.stat("/proc/self/ns/mnt").st_ino, "own mount namespace"
    return env


# -- the session's embedded backend --------------------------------------------------------------------------
def test_worker_runs_isolated_in_its_own_directory(client: BackendClient, aibro_home: Path, digits) -> None:  # noqa: ANN001
    x, y, xv, yv = digits
    job_id, _, history = Training.online_fit(
        make_model(),
        x,
        y,
        machine_ids="local-cpu",
        batch_size=64,
        epochs=1,
        validation_data=(xv, yv),
        description="isolation",
        cool_down_period_s=600,
    )
    job = client.job(job_id)
    assert job.status == v.COMPLETED
    instance_id = job.instance_id
    pid = worker_process(instance_pid(aibro_home, instance_id))
    env = assert_isolated(pid, aibro_home, instance_id)
    # The filter is what keeps these out: the backend that started the worker does hold AIBRO_HOME.
    backend_pid = json.loads((aibro_home / "backend.json").read_text())["pid"]
    assert "AIBRO_HOME" in proc_environ(backend_pid)
    assert env["CUDA_VISIBLE_DEVICES"] == "-1", "local-cpu hides the GPUs"
    assert len(history.epoch) == 1


# -- the agent alone, in a fresh venv ------------------------------------------------------------------------
def _pip_env() -> dict[str, str]:
    return {k: val for k, val in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PIP_USER")}


@pytest.fixture(scope="module")
def agent_venv(tmp_path_factory: pytest.TempPathFactory, wheels: Path, machine_site: Path) -> Iterator[Path]:
    """A fresh venv (no system site packages) holding the agent wheel the backend builds of itself and only what
    that wheel declares: those packages as a machine image has them (the session's machine site, the closure of the
    agent's requirements, on the venv's path), the wheel installed with no package index."""
    with scratch(tmp_path_factory, "agent-venv") as root:
        agent = shipping.build(root / "agent")
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_pip_env())
        (site,) = venv.glob("lib/python3*/site-packages")
        (site / "machine-image.pth").write_text(f"{machine_site}\n")
        python = venv / "bin" / "python"
        start = time.monotonic()
        install = [str(python), "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "--no-index"]
        pip = subprocess.run(
            [*install, "--find-links", str(wheels), str(agent.path)],
            capture_output=True,
            text=True,
            timeout=1500,
            env=_pip_env(),
        )
        took = time.monotonic() - start
        print(f"\n[worker isolation] the agent installed in {took:.0f} s")
        assert pip.returncode == 0, f"pip install of the agent wheel failed:\n{pip.stdout[-3000:]}{pip.stderr[-3000:]}"
        assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
        yield python


@pytest.mark.timeout(1800)
def test_agent_installs_without_the_notebook_stack(agent_venv: Path) -> None:
    script = textwrap.dedent(
        """
        import importlib, json, sys
        missing = {}
        for name in sys.argv[1:]:
            try:
                importlib.import_module(name)
                missing[name] = False
            except ImportError:
                missing[name] = True
        import aibro_backend, aibro_backend.worker.agent, aibro_backend.worker.callbacks
        import aibro_backend.worker.datatree, aibro_backend.worker.envs, aibro_backend.worker.pipeline
        import aibro_backend.worker.usercode
        print(json.dumps({
            "missing": missing,
            "agent": aibro_backend.__file__,
            "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("tornado", "aibro_jupyter")
                             or m.startswith(("aibro_backend.api", "aibro_backend.server", "aibro_backend.storage"))),
        }))
        """
    )
    venv = agent_venv.parent.parent
    out = subprocess.run(
        [str(agent_venv), "-I", "-c", script, *NOTEBOOK_STACK],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(venv),
        env={**_pip_env(), "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["missing"] == {name: True for name in NOTEBOOK_STACK}, (
        "the agent's venv holds part of the notebook stack"
    )
    assert Path(got["agent"]).is_relative_to(venv), "the agent imported is the venv's own copy"
    assert got["loaded"] == [], "the worker path imports nothing of the service or the notebook package"


CLIENT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from conftest import make_model, scratch
    from sklearn.datasets import load_digits
    from aibro_jupyter import Training
    d = load_digits()
    x, y = (d.data / 16.0).astype("float32"), d.target.astype("int32")
    job_id, _, history = Training.online_fit(make_model(), x[:1400], y[:1400], machine_ids="local-cpu",
                                             batch_size=32, epochs=2, validation_data=(x[1400:], y[1400:]),
                                             description="agent venv", cool_down_period_s=600)
    print("RESULT " + json.dumps({{"job_id": job_id, "val_accuracy": history.history["val_accuracy"][-1]}}))
    """
)

CANARY = textwrap.dedent(
    """
    import os
    open(os.path.join(os.path.dirname(__file__), "imported-by-%d" % os.getpid()), "w").close()
    """
)


@pytest.mark.timeout(1800)
def test_backend_trains_a_job_through_the_agent_venv(agent_venv: Path, machine_site: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    # The client's own files: a folder on the backend's PYTHONPATH whose sitecustomize leaves a mark in every
    # process that imports it. The backend does; its worker must not.
    client_files = tmp_path / "client-files"
    client_files.mkdir()
    (client_files / "sitecustomize.py").write_text(CANARY)
    with own_backend(
        home,
        AIBRO_WORKER_PYTHON=str(agent_venv),
        PYTHONPATH=str(client_files),
        AIBRO_TOKEN="aibro_u_must_not_reach_a_worker",
        AIBRO_BACKEND_URL="http://must-not-reach-a-worker.invalid",
        AIBRO_ISOLATION_CANARY="must-not-reach-a-worker",
    ) as backend:
        proc, info, token = backend.proc, {"url": backend.url}, backend.token
        assert (client_files / f"imported-by-{proc.pid}").exists(), "the canary works: the backend imported it"

        script = tmp_path / "client.py"
        script.write_text(CLIENT.format(tests=str(Path(__file__).parent)))
        # Named explicitly, so the client can only ever reach this backend (never start an embedded one).
        res = run_as_user(
            home, [sys.executable, str(script)], timeout=900, AIBRO_BACKEND_URL=info["url"], AIBRO_TOKEN=token
        )
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
        assert res.returncode == 0 and lines, f"client failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
        result = json.loads(lines[-1].removeprefix("RESULT "))

        client = BackendClient(info["url"], token)
        job = client.job(result["job_id"])
        assert job.status == v.COMPLETED, job
        assert result["val_accuracy"] > 0.5, result
        instance_id = job.instance_id
        pid = worker_process(instance_pid(home, instance_id))
        env = assert_isolated(pid, home, instance_id)
        assert "AIBRO_ISOLATION_CANARY" not in env
        assert proc_cmdline(pid)[0] == str(agent_venv), "the worker runs the interpreter AIBRO_WORKER_PYTHON names"
        site = str(agent_venv.parent.parent / "lib" / f"python3.{sys.version_info.minor}" / "site-packages")
        mapped = {ln.split()[-1] for ln in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/" in ln}
        image = f"{machine_site}/"
        assert any(p.startswith(f"{image}tensorflow/") for p in mapped), "it trained with the image's TensorFlow"
        foreign = sorted(p for p in mapped if "-packages/" in p and not p.startswith((f"{site}/", image)))
        assert foreign == [], "the worker loaded libraries from outside its venv and the machine's image"
        assert not (client_files / f"imported-by-{pid}").exists(), "the worker imported the client's files"


@pytest.mark.timeout(900)
@pytest.mark.backend_log(r"aibro\.scheduler WARNING inst-\w+: agent 0\.\S+ is not this backend's")
def test_an_agent_of_other_code_never_runs_a_job(agent_venv: Path, tmp_path: Path) -> None:
    """Issue 26 item 2: the agent venv with one line of its code changed reports another version; the backend
    refuses it a job, closes its instance with both versions in its state, and the job fails naming them."""
    from aibro_backend.worker.version import agent_version

    site = next((agent_venv.parent.parent / "lib").glob("python3*/site-packages"))
    agent_py = site / "aibro_backend" / "worker" / "agent.py"
    original = agent_py.read_text()
    agent_py.write_text(original + "\n# another build of the agent\n")
    try:
        with own_backend(tmp_path / "home", AIBRO_WORKER_PYTHON=str(agent_venv), AIBRO_SPARE_WORKER="0") as b:
            client = b.client()
            x, y = slow_data(64)
            job_id = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="local-cpu", epochs=1)).job_id
            deadline = time.monotonic() + 600
            while client.job(job_id).status not in (v.COMPLETED, v.CANCELED):
                assert time.monotonic() < deadline, client.job(job_id)
                time.sleep(0.5)
            job = client.job(job_id)
            expected = agent_version()
            assert job.status == v.CANCELED and job.epochs_done == 0, job
            assert f"is not this backend's {expected}" in job.error and "GET /worker/agent" in job.error
            (inst,) = client.instances()
            refusal = [h[1] for h in inst.history if "is not this backend's" in h[1]]
            assert refusal and refusal[0].startswith("agent 0.") and expected in refusal[0], inst.history
            assert refusal[0].split()[1] != expected, "the refused agent reported its own, other version"
            _sidebar_names_both_versions(b.home, tmp_path, job_id, inst.id, refusal[0].split()[1], expected)
    finally:
        agent_py.write_text(original)


def _sidebar_names_both_versions(
    home: Path, tmp_path: Path, job_id: str, instance_id: str, reported: str, expected: str
) -> None:
    """What the user sees of the refusal in JupyterLab's sidebar: the job's error and the closed instance's state
    both name the agent's version and the backend's."""
    from browser import chromium_page, jupyterlab, open_sidebar, outside_their_box, wait_until

    from conftest import ARTIFACTS

    ARTIFACTS.mkdir(exist_ok=True)
    env = {"AIBRO_HOME": str(home), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg")}
    with (
        jupyterlab(tmp_path, env, ARTIFACTS / "jupyterlab-agent-refused.log") as (url, token),
        chromium_page() as page,
    ):
        shot = ARTIFACTS / "sidebar-agent-refused-timeout.png"
        open_sidebar(page, url, token)
        error = page.locator(f'.aibro-job[data-job-id="{job_id}"] .aibro-job-error')
        wait_until(page, lambda: error.count() == 1 and expected in error.inner_text(), "the job's error", 60, shot)
        assert reported in error.inner_text(), error.inner_text()
        page.locator("#aibro-cloud-training .aibro-tab", has_text="Instances").click()
        state = page.locator(f'.aibro-instance[data-instance-id="{instance_id}"] .aibro-substatus')
        wait_until(page, lambda: state.count() == 1, "the closed instance's state", 60, shot)
        assert reported in state.inner_text() and expected in state.inner_text(), state.inner_text()
        bad = outside_their_box(page, "#aibro-cloud-training", clip=".aibro-machine-scroll")
        assert not bad, f"the reason overflows the sidebar at its default width: {bad}"
        page.screenshot(path=str(ARTIFACTS / "sidebar-agent-refused.png"))
