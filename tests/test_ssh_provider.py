"""The user's own machines over SSH (issue 26 item 5), against real OpenSSH servers the test starts on 127.0.0.1
(Debian's openssh-server, which the README's test command installs): each with its own host key, an unprivileged
user of its own and an authorized_keys file. The hosts' Python is the system's, with no aibro and with the
TensorFlow a lab machine's image has (the session's machine site, mounted on its dist-packages in sshd's own mount
namespace); pip there is configured with a local wheelhouse (no index), as a lab machine's mirror would be. The
backend installs the agent it serves into a venv in the user's home, trains on the host, resumes a job on the second
host when the first one's sshd goes away, refuses a host whose key changed, and stops its workers when it stops."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import firstboot
import pytest
from backend_proc import OwnBackend, own_backend
from ray_cluster import free_port

from aibro_backend.providers import shipping
from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model, scratch
from helpers import slow_data

SSHD = "/usr/sbin/sshd"
HOSTS = ("a", "b")  # each a user of its own, named per test process: a second run on the box meets none of them
GPUS = ["NVIDIA A10G", "NVIDIA A10G"]  # host a's, as its nvidia-smi names them; b's hosts entry says gpus = 0
pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.skipif(os.geteuid() != 0, reason="the test makes users of its own for the SSH hosts (needs root)"),
    pytest.mark.backend_log(r"aibro\.ssh WARNING", r"aibro\.scheduler WARNING"),
]


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


class Sshd:
    """One OpenSSH server on 127.0.0.1:port for one user, with its own host key."""

    def __init__(
        self, root: Path, user: str, client_pub: str, wheels: Path, site: Path, gpus: list[str] | None = None
    ) -> None:
        self.root, self.user, self.port, self.site = root, user, free_port(), site
        root.mkdir(parents=True, exist_ok=True)
        self.new_host_key()
        try:
            pwd.getpwnam(user)
        except KeyError:
            _run("useradd", "--create-home", "--shell", "/bin/sh", user)
        _run("usermod", "--password", "*", user)  # no password at all, but not locked: sshd lets its keys in
        home = Path(pwd.getpwnam(user).pw_dir)
        for sub in (".ssh", ".config/pip"):
            (home / sub).mkdir(parents=True, exist_ok=True)
        (home / ".ssh" / "authorized_keys").write_text(client_pub)
        (home / ".config" / "pip" / "pip.conf").write_text(f"[global]\nno-index = true\nfind-links = {wheels}\n")
        shutil.rmtree(home / ".aibro", ignore_errors=True)  # a fresh host: no agent installed yet
        self.path = "/usr/local/bin:/usr/bin:/bin"
        if gpus:  # what nvidia-smi says on a host with these GPUs (this box has none: the one stand-in part)
            (home / "bin").mkdir(exist_ok=True)
            smi = home / "bin" / "nvidia-smi"
            smi.write_text("#!/bin/sh\nprintf '" + "\\n".join(gpus) + "\\n'\n")
            smi.chmod(0o755)
            self.path = f"{home / 'bin'}:{self.path}"
        _run("chown", "-R", f"{user}:{user}", str(home))
        os.chmod(home / ".ssh", 0o700)
        os.chmod(home / ".ssh" / "authorized_keys", 0o600)
        self.home = home
        self.proc: subprocess.Popen[bytes] | None = None

    def new_host_key(self) -> None:
        key = self.root / "host_ed25519"
        for path in (key, key.with_suffix(".pub")):
            path.unlink(missing_ok=True)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))

    def start(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation folder
        config = self.root / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.root / 'host_ed25519'}\n"
            f"PidFile {self.root / 'sshd.pid'}\nUsePAM no\nPasswordAuthentication no\n"
            f"KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nAllowUsers {self.user}\n"
            f"SetEnv PATH={self.path}\n"
        )
        log = open(self.root / "sshd.log", "ab")  # noqa: SIM115 - handed to the child
        image = 'mount --bind -o ro "$0" "$1" && exec "$2" -D -e -f "$3"'  # the host's image: its system site
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", image]
        argv += [str(self.site), firstboot.system_site(), SSHD, str(config)]
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 60
        while "Server listening" not in (self.root / "sshd.log").read_text():
            assert self.proc.poll() is None, (self.root / "sshd.log").read_text()
            assert time.monotonic() < deadline, "sshd did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def agents(self) -> list[str]:
        """The user's agent processes on this 'host'."""
        done = subprocess.run(["pgrep", "-u", self.user, "-f", "aibro_backend.worker"], capture_output=True, text=True)
        return done.stdout.split()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, wheels: Path, machine_site: Path) -> Iterator[dict[str, Any]]:
    if shutil.which("sshd") is None and not Path(SSHD).exists():
        pytest.fail("openssh-server is not installed (the README's test command installs it)")
    with scratch(tmp_path_factory, "ssh") as root:
        yield from _hosts(root, wheels, machine_site)


def _hosts(root: Path, wheels: Path, site: Path) -> Iterator[dict[str, Any]]:
    key = root / "id_ed25519"
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    pub = key.with_suffix(".pub").read_text()
    users = {name: f"aibro-ssh-{name}-{os.getpid()}" for name in HOSTS}
    servers = {n: Sshd(root / u, u, pub, wheels, site, GPUS if n == "a" else None) for n, u in users.items()}
    for server in servers.values():
        server.start()
    lines = []
    for name, server in servers.items():
        lines += ["[[host]]", f'name = "{name}"', 'host = "127.0.0.1"', f"port = {server.port}"]
        lines += [f'user = "{server.user}"', f'identity_file = "{key}"', "max_jobs = 1"]
        lines += [] if server.path.startswith(str(server.home)) else ["gpus = 0"]  # a: found by nvidia-smi
        lines.append("")
    hosts_file = root / "hosts.toml"
    hosts_file.write_text("\n".join(lines))
    try:
        yield {"root": root, "servers": servers, "file": hosts_file, "key": key}
    finally:
        for server in servers.values():
            server.stop()
            subprocess.run(["pkill", "-KILL", "-u", server.user], capture_output=True)
            subprocess.run(["userdel", "--force", "--remove", server.user], capture_output=True)


@pytest.fixture(scope="module")
def backend(hosts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBackend]:
    home = tmp_path_factory.mktemp("ssh-backend") / "home"
    with own_backend(home, "--provider", "ssh", "--ssh-hosts", str(hosts["file"]), AIBRO_SSH_UNREACHABLE_S="10") as b:
        yield b


def _serve(home: Path, hosts_file: Path) -> subprocess.CompletedProcess[str]:
    from helpers import user_env

    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0"]
    cmd += ["--provider", "ssh", "--ssh-hosts", str(hosts_file)]
    return subprocess.run(cmd, env=user_env(home), capture_output=True, text=True, timeout=120)


def test_a_wrong_key_file_is_named_at_serve(hosts: dict[str, Any], tmp_path: Path) -> None:
    not_a_key = tmp_path / "not-a-key"
    not_a_key.write_text("hello\n")
    bad = tmp_path / "hosts.toml"
    bad.write_text(hosts["file"].read_text().replace(str(hosts["key"]), str(not_a_key), 1))
    done = _serve(tmp_path / "home", bad)
    assert done.returncode == 2 and f"the identity file {not_a_key} is not a private key" in done.stderr, done.stderr
    other = tmp_path / "other_key"
    _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other))
    bad.write_text(hosts["file"].read_text().replace(str(hosts["key"]), str(other), 1))
    done = _serve(tmp_path / "home2", bad)
    assert done.returncode == 2 and "cannot reach a over SSH" in done.stderr and "Permission denied" in done.stderr


def test_a_cloud_fit_cell_trains_on_an_ssh_hosts_two_gpus_with_the_served_agent(
    backend: OwnBackend, hosts: dict[str, Any], tmp_path: Path
) -> None:
    """The marketplace offers host a's GPUs as nvidia-smi names them; a %%cloud_fit cell in a real kernel asks for
    both, its worker runs with CUDA_VISIBLE_DEVICES=0,1 from the agent the backend installed, and the trained
    model comes back into the kernel."""
    from kernel_helpers import digits_setup, run_cell, start_kernel

    client = backend.client()
    machines = {m.machine_id: m for m in client.machines()}
    assert {"ssh:a", "ssh:a-gpu1", "ssh:a-gpu2", "ssh:b"} <= set(machines), sorted(machines)
    assert not any(m.startswith("ssh:b-gpu") for m in machines), "b's hosts entry says gpus = 0"
    assert (machines["ssh:a-gpu2"].gpu_type, machines["ssh:a-gpu2"].gpu_count) == ("NVIDIA A10G", 2)
    assert machines["ssh:a"].price_per_hour == 0.0
    km, kc = start_kernel({"AIBRO_HOME": str(tmp_path / "kernel"), "AIBRO_BACKEND_URL": backend.url,
                           "AIBRO_TOKEN": backend.token})  # fmt: skip
    envs = EnvFiles(hosts["servers"]["a"].home / ".aibro" / "workers")  # read while the worker runs: then it goes
    try:
        assert not (res := run_cell(kc, digits_setup(), timeout=300)).error, res.error
        cell = (
            '%%cloud_fit --machine ssh:a-gpu2 --description "on a"\n'
            "model = build()\n"
            "history = model.fit(x_train, y_train, epochs=2, batch_size=32, validation_data=(x_val, y_val))\n"
            "print('FINAL', round(model.evaluate(x_val, y_val, verbose=0)[1], 4), "
            "round(history.history['val_accuracy'][-1], 4))\n"
        )
        res = run_cell(kc, cell, timeout=900)
        assert not res.error, res.error + res.stdout[-3000:]
    finally:
        envs.stop()
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    final = re.search(r"FINAL (\S+) (\S+)", res.stdout)
    assert final and final.group(1) == final.group(2) and float(final.group(1)) > 0.5, res.stdout[-3000:]
    job = next(j for j in reversed(client.jobs()) if j.description == "on a")
    assert job.status == v.COMPLETED and job.machine_id == "ssh:a-gpu2" and job.epochs_done == 2, job
    served = shipping.served(backend.home)
    installed = hosts["servers"]["a"].home / ".aibro" / "agent" / served.version
    assert (installed / "agent-version").read_text().strip() == served.version
    assert (installed / served.filename).read_bytes() == served.path.read_bytes()
    mode, text = envs.seen[job.instance_id]
    assert mode & 0o077 == 0, "the worker's secrets are 0600"
    assert "CUDA_VISIBLE_DEVICES=0,1\n" in text, "the job's worker holds both of a's GPUs"


class EnvFiles:
    """Each worker's env file under `workers` as it was while its worker ran: (mode, text) by instance id."""

    def __init__(self, workers: Path) -> None:
        import threading

        self.workers, self.seen = workers, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for env in self.workers.glob("*/env"):
                try:
                    self.seen.setdefault(env.parent.name, (env.stat().st_mode, env.read_text()))
                except OSError:
                    pass  # it went meanwhile

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def test_an_ended_workers_folder_goes_and_its_log_stays_on_the_host(backend: OwnBackend, hosts: dict[str, Any]) -> None:
    """What a job leaves on the host after it ends: its worker's folder goes (token, data, code, outputs) and its
    log stays as ~/.aibro/worker-logs/<instance>.log (0600, in a 0700 folder), as the local provider keeps it;
    and a start there removes what ended workers left before (a crashed backend's, an older version's) but the
    folder of a worker still running (another backend's)."""
    server = hosts["servers"]["b"]
    root = server.home / ".aibro"
    workers = root / "workers"
    workers.mkdir(parents=True, exist_ok=True)
    ended = subprocess.Popen(["true"])
    ended.wait()
    other = subprocess.Popen(["sleep", "600"], user=server.user)
    try:
        for name in ("inst-crashed", "inst-older", "inst-other"):
            (workers / name / "cache").mkdir(parents=True, exist_ok=True)
            (workers / name / "cache" / "data.npy").write_bytes(b"a user's data")
            (workers / name / "worker.log").write_text(f"{name} printed this")
        (workers / "inst-crashed.pid").write_text(f"{ended.pid}\n")
        (workers / "inst-other.pid").write_text(f"{other.pid}\n")
        _run("chown", "-R", f"{server.user}:{server.user}", str(root))
        old = time.time() - 3600
        os.utime(workers / "inst-older", (old, old))  # an older version's: no pid file, and not starting now

        client = backend.client()
        x, y = slow_data(64)
        job = Training(client).submit(
            FitRequest(make_model(), x, y, machine_ids="ssh:b", epochs=1, cool_down_period_s=0)
        )
        done = _wait(client, job.job_id)
        assert done.status == v.COMPLETED, done
        inst = done.instance_id
        deadline = time.monotonic() + 120
        while (workers / inst).exists() or client.job(job.job_id).status != v.COMPLETED:
            assert time.monotonic() < deadline, sorted(p.name for p in workers.iterdir())
            time.sleep(0.5)
        left = sorted(p.name for p in workers.iterdir())
        assert left == ["inst-other", "inst-other.pid"], left
        logs = root / "worker-logs"
        assert "aibro.worker" in (logs / f"{inst}.log").read_text(), "its worker's log is kept on the host"
        assert (logs / "inst-crashed.log").read_text() == "inst-crashed printed this"
        assert (logs / "inst-older.log").read_text() == "inst-older printed this"
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in [logs, *logs.iterdir()]}
        assert modes == {"worker-logs": "0o700", **{p.name: "0o600" for p in logs.iterdir()}}, modes
    finally:
        other.kill()
        other.wait()


def test_a_host_whose_sshd_goes_away_has_its_job_resumed_on_the_next_host(
    backend: OwnBackend, hosts: dict[str, Any]
) -> None:
    client = backend.client()
    x, y = slow_data(3000)
    job = Training(client).submit(
        FitRequest(make_model(), x, y, machine_ids=["ssh:a", "ssh:b"], epochs=6, batch_size=16)
    )
    deadline = time.monotonic() + 600
    while client.job(job.job_id).epochs_done < 1:
        assert time.monotonic() < deadline, client.job(job.job_id)
        time.sleep(0.5)
    server = hosts["servers"]["a"]
    server.stop()  # the host drops off the network: no SSH, and its worker (frozen) reaches nobody either
    subprocess.run(["pkill", "-STOP", "-u", server.user], capture_output=True)
    try:
        done = _wait(client, job.job_id)
    finally:
        subprocess.run(["pkill", "-KILL", "-u", server.user], capture_output=True)
    assert done.status == v.COMPLETED and done.machine_id == "ssh:b", done
    messages = [e["data"].get("message", "") for e in client.events(job.job_id, 0)["events"]]
    assert any("was lost (cannot reach a over SSH" in m and "resuming from epoch" in m for m in messages), messages
    epochs = [e["data"]["epoch"] for e in client.events(job.job_id, 0)["events"] if e["type"] == v.EV_EPOCH]
    assert sorted(set(epochs)) == list(range(6))
    server.start()


def test_a_host_whose_key_changed_is_refused_naming_it(backend: OwnBackend, hosts: dict[str, Any]) -> None:
    server = hosts["servers"]["a"]
    server.stop()
    server.new_host_key()
    server.start()
    client = backend.client()
    x, y = slow_data(64)
    job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="ssh:a", epochs=1))
    done = _wait(client, job.job_id)
    messages = " ".join(e["data"].get("message", "") for e in client.events(job.job_id, 0)["events"])
    assert done.status == v.CANCELED and "SSH host key of a (127.0.0.1" in messages and "changed" in messages


def test_stopping_the_backend_stops_its_workers(hosts: dict[str, Any], tmp_path: Path) -> None:
    server = hosts["servers"]["b"]
    home = tmp_path / "home"
    with own_backend(home, "--provider", "ssh", "--ssh-hosts", str(hosts["file"])) as b:
        client = b.client()
        x, y = slow_data(3000)
        job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="ssh:b", epochs=50, batch_size=16))
        deadline = time.monotonic() + 600
        while client.job(job.job_id).status != v.TRAINING:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        instance_id = client.job(job.job_id).instance_id
        remote = json.loads((home / "state" / "ssh" / "instances.json").read_text())[instance_id]
        pid = int(remote["pid"])  # the 'host' is this machine: its pid is one here
        assert str(pid) in server.agents(), "the worker runs on the host"
    deadline = time.monotonic() + 60
    while _running(pid):
        assert time.monotonic() < deadline, "the backend stopped but its worker on b still runs"
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(client: Any, job_id: str, within_s: float = 900) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while client.job(job_id).status not in (v.COMPLETED, v.CANCELED):
        assert time.monotonic() < deadline, client.job(job_id)
        time.sleep(0.5)
    return client.job(job_id)


def test_a_restarted_backend_finds_its_running_worker_and_the_job_completes(
    hosts: dict[str, Any], tmp_path: Path
) -> None:
    """A crash (kill -9) leaves the worker on the host running; the backend started again on the same home and
    port finds it (state/ssh/instances.json), and the job completes there without a new instance."""
    import signal
    from urllib.parse import urlsplit

    home = tmp_path / "home"
    args = ("--provider", "ssh", "--ssh-hosts", str(hosts["file"]))
    with own_backend(home, *args) as b:
        port = str(urlsplit(b.url).port)
        client = b.client()
        x, y = slow_data(2000)
        job = Training(client).submit(FitRequest(make_model(), x, y, machine_ids="ssh:b", epochs=8, batch_size=16))
        deadline = time.monotonic() + 600
        while client.job(job.job_id).epochs_done < 1:
            assert time.monotonic() < deadline, client.job(job.job_id)
            time.sleep(0.5)
        instance_id = client.job(job.job_id).instance_id
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(timeout=30)
    with own_backend(home, *args, "--port", port) as again:
        done = _wait(again.client(), job.job_id)
        assert done.status == v.COMPLETED and done.instance_id == instance_id, done
        assert done.attempt == 0, "no resume: the same worker went on"
