"""A bare EC2 instance, played by a bubblewrap sandbox: its user data runs as cloud-init would run it, as root, on
a file-system view that has the system's Python but no aibro package, no test venv and no repository, and on a
network of its own whose only ways out are the routes the test gives it (the backend, S3), each a TCP port on the
machine's 127.0.0.1 carried over a Unix socket to the host's 127.0.0.1. `systemctl` is a shim that starts a unit's
ExecStart with its EnvironmentFile; pip's configuration is the image's (a local wheelhouse, no index). The image's
system Python may come with packages (TensorFlow, as on a deep-learning image): a site folder in its dist-packages."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

from aibro_backend.worker import netbridge

SYSTEMCTL = r"""#!/bin/bash
# systemctl as the played machine has it: `enable --now UNIT` and `start UNIT` run the unit's ExecStart in the
# background with its EnvironmentFile; daemon-reload and the rest do nothing.
unit=""; start=0
for arg in "$@"; do
  case "$arg" in
    --now|start) start=1 ;;
    *.service) unit="/etc/systemd/system/$arg" ;;
  esac
done
[ "$start" = 1 ] && [ -n "$unit" ] || exit 0
envfile=$(sed -n 's/^EnvironmentFile=//p' "$unit")
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
echo "systemctl shim: starting $unit" >> /var/log/aibro-worker.log
( set -a; . "$envfile"; set +a; exec setsid $exec_start >> /var/log/aibro-worker.log 2>&1 < /dev/null ) &
echo "systemctl shim: started $unit (pid $!)"
"""

IMAGE_PATH = "/srv/image/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the shims come first
SHUTDOWN = "#!/bin/sh\ntouch /var/log/shutdown-requested\n"

# inside the machine: the worker's own bridge (loopback TCP to a Unix socket, stdlib only) for each route
FORWARD = """import sys, threading
from pathlib import Path
sys.path.insert(0, "/srv/image")
import netbridge
for port in sys.argv[1:]:
    netbridge.Bridge(Path(f"/srv/net/{port}.sock"), "127.0.0.1", int(port))
print("routes up", flush=True)
threading.Event().wait()
"""


class Route:
    """The host end of one route: a Unix socket whose connections go to the host's 127.0.0.1:port."""

    def __init__(self, path: Path, port: int) -> None:
        self.path, self.port = path, port
        path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True, name=f"route-{port}").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            except OSError:
                conn.close()
                continue
            up.settimeout(None)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=netbridge.pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.sock.close()


class Machine:
    """One played instance: its disk (what survives a reboot) under `root`, its routes, and its boots."""

    def __init__(
        self, root: Path, wheels: Path, hosts: list[str], routes: dict[int, int], site: Path | None = None
    ) -> None:
        """`hosts`: names the machine resolves to its own 127.0.0.1; `routes`: its port -> the host's port; `site`:
        what the image's system Python has installed (its /usr/local dist-packages)."""
        self.root, self.wheels, self.site = root, wheels, site
        self.disk = {
            "/etc/aibro": root / "etc-aibro",
            "/etc/systemd": root / "etc-systemd",
            "/var/lib/aibro": root / "var-lib-aibro",
            "/var/log": root / "var-log",
            "/opt/aibro": root / "opt-aibro",
        }
        for path in self.disk.values():
            path.mkdir(parents=True, exist_ok=True)
        (self.disk["/etc/systemd"] / "system").mkdir(exist_ok=True)
        image = root / "image"
        image.mkdir(exist_ok=True)
        (image / "bin").mkdir(exist_ok=True)
        (image / "bin" / "systemctl").write_text(SYSTEMCTL)
        (image / "bin" / "shutdown").write_text(SHUTDOWN)
        for name in ("systemctl", "shutdown"):
            (image / "bin" / name).chmod(0o755)
        (image / "forward.py").write_text(FORWARD)
        shutil.copy(netbridge.__file__, image / "netbridge.py")
        (image / "pip.conf").write_text("[global]\nno-index = true\nfind-links = /srv/wheels\n")
        names = " ".join(hosts)
        (image / "hosts").write_text(f"127.0.0.1 localhost {names}\n::1 localhost\n")
        self.image = image
        net = root / "net"
        net.mkdir(exist_ok=True)
        self.routes = {port: Route(net / f"{port}.sock", host_port) for port, host_port in routes.items()}
        self.proc: subprocess.Popen[bytes] | None = None

    def _argv(self, then: str) -> list[str]:
        argv = ["bwrap", "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net", "--unshare-ipc"]
        argv += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/sys", "/sys", "--dev", "/dev", "--proc", "/proc"]
        if self.site is not None:
            argv += ["--ro-bind", str(self.site), system_site()]
        argv += ["--tmpfs", "/tmp"]
        for top in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        argv += ["--tmpfs", "/etc"]
        for entry in sorted(os.listdir("/etc")):  # the image's /etc, but for what this machine writes or differs in
            if entry in ("aibro", "systemd", "hosts", "pip.conf", "xdg", "pip"):
                continue
            path = f"/etc/{entry}"
            argv += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
        argv += ["--ro-bind", str(self.image / "hosts"), "/etc/hosts"]
        argv += ["--ro-bind", str(self.image / "pip.conf"), "/etc/pip.conf"]
        argv += ["--dir", "/var", "--dir", "/var/lib", "--dir", "/opt", "--dir", "/root", "--dir", "/run"]
        for inside, outside in self.disk.items():
            argv += ["--bind", str(outside), inside]
        argv += ["--ro-bind", str(self.wheels), "/srv/wheels", "--ro-bind", str(self.image), "/srv/image"]
        argv += ["--ro-bind", str(self.root / "net"), "/srv/net"]
        argv += ["--clearenv", "--setenv", "PATH", IMAGE_PATH]
        argv += ["--setenv", "HOME", "/root", "--setenv", "LANG", "C.UTF-8", "--chdir", "/"]
        routes = " ".join(str(port) for port in self.routes)
        script = (
            f"python3 -I /srv/image/forward.py {routes} > /var/log/routes.log 2>&1 &\n"
            "for i in $(seq 100); do grep -q 'routes up' /var/log/routes.log 2>/dev/null && break; sleep 0.1; done\n"
            f"{then}\nwait\n"
        )
        return [*argv, "/bin/bash", "-c", script]

    def boot(self, user_data: str | None) -> None:
        """Power on: the first boot runs the user data (cloud-init); later boots start the enabled unit only."""
        (self.root / "user-data.sh").write_text(user_data or "")
        if user_data is not None:
            shutil.copy(self.root / "user-data.sh", self.disk["/var/log"] / "user-data.sh")
            then = "bash /var/log/user-data.sh > /var/log/cloud-init-output.log 2>&1"
        else:
            then = "systemctl start aibro-worker.service"
        out = open(self.root / "console.log", "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen(
            self._argv(then), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def power_off(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait(timeout=30)
        self.proc = None

    def log(self, name: str) -> str:
        path = self.disk["/var/log"] / name
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        self.power_off()
        for route in self.routes.values():
            route.close()


def system_site() -> str:
    """The folder where the system Python (Debian's python3) finds packages installed by root with pip."""
    where = "import sys; print(f'/usr/local/lib/python3.{sys.version_info[1]}/dist-packages')"
    site = subprocess.run(["/usr/bin/python3", "-I", "-c", where], check=True, capture_output=True, text=True)
    path = site.stdout.strip()
    os.makedirs(path, exist_ok=True)  # Debian's python3 makes it when installed; a mount needs it there
    return path


def usable() -> str | None:
    """Why a machine cannot be played here, or None."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (the README's test command installs it)"
    if os.geteuid() != 0:
        return "playing a machine's first boot needs root (it writes /etc, /opt and /var/lib as cloud-init does)"
    probe = subprocess.run(
        ["bwrap", "--ro-bind", "/", "/", "--unshare-net", "--unshare-pid", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"bubblewrap cannot make namespaces here: {probe.stderr.strip()}"
