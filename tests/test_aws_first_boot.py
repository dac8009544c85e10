"""An EC2 instance's own first boot, really run (issue 26 item 3): the user data the backend gave moto runs as
root in a machine played by bubblewrap (tests/firstboot.py) that has the system's Python but no aibro and no test
venv, reaching only the backend and S3. The machine downloads the agent the backend serves, checks its SHA-256,
installs it with the image's pip (a local wheelhouse, no index) beside the image's TensorFlow (a deep-learning
image: a machine without one installs the kernel's, tests/test_agent_install.py), enrolls with its one-time token and
trains; after a reboot the enabled unit brings the agent back with its per-instance token, and it trains the next
job."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import boto3
import firstboot
import pytest
import tensorflow as tf
from aws_moto import REGION, make_account, moto_server, write_config
from backend_proc import own_backend

from aibro_backend.providers import shipping
from aibro_backend.providers.aws_config import load_aws_config
from aibro_core import vocabulary as v
from aibro_jupyter import Training
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model, scratch
from helpers import slow_data

WHY_NOT = firstboot.usable()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)), pytest.mark.timeout(1800)]
PUBLIC = "http://backend.aibro.test:8888"  # a name the machine resolves to its own 127.0.0.1 (its route)


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory, wheels: Path, machine_site: Path) -> Iterator[dict[str, Any]]:
    with scratch(tmp_path_factory, "first-boot") as root, moto_server() as env:
        account = make_account()
        config = write_config(root / "aws.toml", account, backend_public_url=PUBLIC)
        backend_id = load_aws_config(config).backend_id
        with own_backend(root / "home", "--provider", "aws", "--aws-config", str(config), **env) as b:
            s3_port = int(urlsplit(env["AWS_ENDPOINT_URL"]).port or 0)
            routes = {8888: int(urlsplit(b.url).port or 0), s3_port: s3_port}  # the machine's port -> the host's
            yield {
                "backend": b,
                "backend_id": backend_id,
                "wheels": wheels,
                "root": root,
                "routes": routes,
                "site": machine_site,
            }


def _running_instance(backend_id: str, within_s: float = 300) -> tuple[str, str]:
    """(EC2 id, user data) of the instance moto runs for this backend."""
    ec2 = boto3.Session(region_name=REGION).client("ec2")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        pages = ec2.describe_instances(Filters=[{"Name": "tag:aibro:backend", "Values": [backend_id]}])
        for inst in (i for r in pages["Reservations"] for i in r["Instances"]):
            if inst["State"]["Name"] == "running":
                raw = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")
                return inst["InstanceId"], base64.b64decode(raw["UserData"]["Value"]).decode()
        time.sleep(0.5)
    raise AssertionError("moto never ran an instance for this backend")


def _wait_done(client: Any, job_id: str, machine: firstboot.Machine, within_s: float = 1200) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        job = client.job(job_id)
        if job.status in (v.COMPLETED, v.CANCELED):
            return job
        time.sleep(1)
    raise AssertionError(
        f"{job_id} is still {job.status}: cloud-init said\n{machine.log('cloud-init-output.log')[-3000:]}\n"
        f"the agent said\n{machine.log('aibro-worker.log')[-3000:]}"
    )


def test_a_bare_instance_installs_the_served_agent_enrolls_trains_and_comes_back_after_a_reboot(
    cloud: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = cloud["backend"]
    client = b.client()
    monkeypatch.setenv("AIBRO_BACKEND_URL", b.url)
    monkeypatch.setenv("AIBRO_TOKEN", b.token)
    x, y = slow_data(300)
    first = Training(client).submit(
        FitRequest(make_model(), x, y, machine_ids="g4dn.xlarge.od", epochs=2, batch_size=32, cool_down_period_s=900)
    )
    ec2_id, user_data = _running_instance(cloud["backend_id"])
    served = shipping.served(b.home)
    assert served.sha256 in user_data and 'd="/opt/aibro"' in user_data
    installs = [line for line in user_data.splitlines() if "pip install" in line]
    assert installs and all(line.endswith(f'"$d/{served.filename}" $pin') for line in installs), installs
    kernel_tf = ".".join(tf.__version__.split(".")[:2])
    assert f'pin="tensorflow~={kernel_tf}.0"' in user_data, "a machine without TensorFlow gets the kernel's"

    machine = firstboot.Machine(
        cloud["root"] / ec2_id, cloud["wheels"], ["backend.aibro.test"], cloud["routes"], site=cloud["site"]
    )
    try:
        booted = time.monotonic()
        machine.boot(user_data)
        job = _wait_done(client, first.job_id, machine)
        took = time.monotonic() - booted
        assert job.status == v.COMPLETED, (job, machine.log("aibro-worker.log")[-3000:])
        print(f"\n[first boot] from power-on to a trained job: {took:.0f} s")
        installed = machine.disk["/opt/aibro"]
        assert (installed / "agent-version").read_text().strip() == served.version
        assert (installed / served.filename).read_bytes() == served.path.read_bytes()
        assert not list(installed.glob("venv/lib/python3*/site-packages/tensorflow")), "the image's was used"
        token_file = machine.disk["/var/lib/aibro"] / "worker-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        agent_log = machine.log("aibro-worker.log")
        assert agent_log.count("enrolled as ") == 1, agent_log[-3000:]

        # a reboot: cloud-init does not run the user data again; the enabled unit starts the agent, which comes
        # back with its per-instance token (the enrollment token is burnt) and trains the next job, warm
        machine.power_off()
        machine.boot(None)
        second = Training(client).submit(
            FitRequest(make_model(), x, y, machine_ids="g4dn.xlarge.od", epochs=1, batch_size=32)
        )
        job2 = _wait_done(client, second.job_id, machine)
        assert job2.status == v.COMPLETED, (job2, machine.log("aibro-worker.log")[-3000:])
        assert job2.instance_id == job.instance_id, "the rebooted machine trained it"
        agent_log = machine.log("aibro-worker.log")
        assert agent_log.count("systemctl shim: starting") == 2, "the agent was started by each boot"
        assert agent_log.count("enrolled as ") == 1, "no second enrollment after the reboot"
    finally:
        machine.close()
