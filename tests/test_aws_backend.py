"""The backend with the AWS provider on (issue 11 item 2), against moto's server mode: `--provider aws
--aws-config FILE` is validated before the backend listens, naming every problem; the local provider runs beside
it and GET /machines lists both; a job on an AWS machine launches an EC2 instance tagged for this backend whose
user data holds only a one-time enrollment token; `aibro backend aws-policy FILE` prints the least policy."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import flask  # noqa: E402, F401  (the test extra has it: missing fails, never skips)
import pytest
from aws_moto import make_account, moto_server, write_config  # noqa: E402
from backend_proc import own_backend  # noqa: E402

from aibro_backend.providers.aws import parse_user_data_env, tag_map  # noqa: E402
from aibro_backend.providers.aws_config import least_policy, load_aws_config  # noqa: E402
from aibro_core import vocabulary as v  # noqa: E402
from aibro_jupyter import Training  # noqa: E402
from aibro_jupyter.fitrequest import FitRequest

from conftest import make_model  # noqa: E402
from helpers import aibro_cli, slow_data, user_env  # noqa: E402


@pytest.fixture(scope="module")
def moto() -> Iterator[dict[str, Any]]:
    with moto_server() as env:
        yield {"env": env, "account": make_account()}


def _serve(home: Path, *args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    home.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "aibro_backend", "--home", str(home), "--port", "0", *args]
    return subprocess.run(cmd, env=user_env(home, **env), capture_output=True, text=True, timeout=timeout)


def test_a_bad_config_is_refused_before_listening_with_every_problem_named(moto: dict, tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "bad.toml",
        moto["account"],
        subnet_id=None,
        region="mars-1",
        backend_public_url="http://127.0.0.1:8888",
        instance_profle="typo",
    )
    done = _serve(tmp_path / "home", "--provider", "aws", "--aws-config", str(config), env=moto["env"])
    assert done.returncode == 2, done.stdout + done.stderr
    for named in ("'subnet_id' is missing", "mars-1", "backend_public_url", "'instance_profle' is not a setting"):
        assert named in done.stderr, (named, done.stderr)
    assert not (tmp_path / "home" / "backend.json").exists(), "it never listened"


def test_a_config_naming_what_the_account_lacks_is_refused(moto: dict, tmp_path: Path) -> None:
    config = write_config(tmp_path / "gone.toml", moto["account"], subnet_id="subnet-0123456789abcdef0")
    done = _serve(tmp_path / "home", "--provider", "aws", "--aws-config", str(config), env=moto["env"])
    assert done.returncode == 2 and "subnet-0123456789abcdef0" in done.stderr, done.stderr
    missing = _serve(tmp_path / "home", "--provider", "aws", env=moto["env"])
    assert missing.returncode == 2 and "--provider aws needs --aws-config FILE" in missing.stderr, missing.stderr


def test_aws_policy_prints_the_least_policy(moto: dict, tmp_path: Path) -> None:
    config = write_config(tmp_path / "policy.toml", moto["account"])
    done = aibro_cli(tmp_path / "home", "backend", "aws-policy", str(config), timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == least_policy(load_aws_config(config))
    bad = aibro_cli(tmp_path / "home", "backend", "aws-policy", str(tmp_path / "nope.toml"), timeout=60)
    assert bad.returncode == 1 and "nope.toml" in bad.stderr, bad.stderr


def test_the_cli_serves_aws_beside_local(moto: dict, tmp_path: Path) -> None:
    """`aibro backend serve --provider aws --aws-config FILE`: both providers' machines in GET /machines."""
    from aibro_jupyter.client import BackendClient

    home = tmp_path / "cli-home"
    home.mkdir()
    config = write_config(tmp_path / "serve.toml", moto["account"])
    cmd = [sys.executable, "-m", "aibro_jupyter.cli", "backend", "serve", "--provider", "aws", "--aws-config"]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(
        [*cmd, str(config)], env=user_env(home, **moto["env"]), stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 300  # a hang, not a slow start: a crash ends it at once
        while not (home / "backend.json").exists() or not (home / "credentials.json").exists():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        time.sleep(0.2)
        url = json.loads((home / "backend.json").read_text())["url"]
        client = BackendClient(url, json.loads((home / "credentials.json").read_text())["token"])
        machines = {m.machine_id: m for m in client.machines()}
        assert machines["local-cpu"].provider == "local"
        assert machines["g4dn.xlarge"].provider == "aws" and machines["g4dn.xlarge"].spot is True
        assert machines["g4dn.xlarge.od"].spot is False and machines["g4dn.xlarge.od"].gpu_count == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_a_job_on_an_aws_machine_launches_a_tagged_instance_with_only_an_enrollment_token(
    moto: dict, tmp_path: Path
) -> None:
    config = write_config(tmp_path / "launch.toml", moto["account"])
    backend_id = load_aws_config(config).backend_id
    ec2 = moto["account"]["ec2"]
    with own_backend(tmp_path / "home", "--provider", "aws", "--aws-config", str(config), **moto["env"]) as b:
        client = b.client()
        x, y = slow_data(200)
        job = Training(client).submit(
            FitRequest(make_model(), x, y, machine_ids="g4dn.xlarge.od", epochs=1, wait_request_s=0)
        )
        deadline = time.monotonic() + 60
        found: list[dict[str, Any]] = []
        while not found and time.monotonic() < deadline:
            pages = ec2.describe_instances(Filters=[{"Name": "tag:aibro:backend", "Values": [backend_id]}])
            found = [i for r in pages["Reservations"] for i in r["Instances"]]
            time.sleep(0.2)
        assert len(found) == 1, found
        inst = found[0]
        tags = tag_map(inst)
        assigned = client.job(job.job_id)
        assert tags["aibro:instance"] == assigned.instance_id and tags["aibro:job"] == job.job_id
        assert inst["InstanceType"] == "g4dn.xlarge" and "InstanceLifecycle" not in inst, "on-demand"
        raw = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"], Attribute="userData")["UserData"]
        env = parse_user_data_env(base64.b64decode(raw["Value"]).decode())
        assert env["AIBRO_ENROLL_TOKEN"].startswith("aibro_e_") and "AIBRO_WORKER_TOKEN" not in env
        instances = {i.id: i for i in client.instances()}
        assert instances[assigned.instance_id].status == v.LAUNCHING, "no worker has enrolled yet"
        assert instances[assigned.instance_id].provider == "aws"
        client.cancel(job.job_id)


@pytest.fixture
def aws_backend(moto: dict, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A backend with the AWS provider, and the harness that plays its instances."""
    from aws_moto import PlayedInstances

    config = write_config(tmp_path / "played.toml", moto["account"])
    backend_id = load_aws_config(config).backend_id
    with own_backend(tmp_path / "home", "--provider", "aws", "--aws-config", str(config), **moto["env"]) as b:
        with PlayedInstances(backend_id, b.url, tmp_path / "machines", moto["env"]) as played:
            yield {"backend": b, "played": played, "backend_id": backend_id}


def test_online_fit_on_g4dn_xlarge_od_trains_on_a_played_instance(
    aws_backend: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real agent on a played EC2 instance enrolls with its one-time token, trains, returns the model."""
    import numpy as np

    b, played = aws_backend["backend"], aws_backend["played"]
    monkeypatch.setenv("AIBRO_BACKEND_URL", b.url)
    monkeypatch.setenv("AIBRO_TOKEN", b.token)
    x, y = slow_data(400)
    model = make_model()
    before = [w.copy() for w in model.get_weights()]
    job_id, trained, history = Training.online_fit(
        model, x, y, machine_ids="g4dn.xlarge.od", batch_size=32, epochs=2, description="played", record=False
    )
    assert trained is model and len(history.history["loss"]) == 2
    assert any(not np.allclose(a, c) for a, c in zip(before, model.get_weights()))
    client = b.client()
    job = client.job(job_id)
    assert job.status == v.COMPLETED and job.machine_id == "g4dn.xlarge.od"
    (ec2_id,) = played.envs
    log = played.log(ec2_id)
    assert "enrolled as " + job.instance_id in log, log
    token_file = Path(played.envs[ec2_id]["AIBRO_WORKER_TOKEN_FILE"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    history_states = [h[0] for h in {i.id: i for i in client.instances()}[job.instance_id].history]
    assert history_states[:2] == [v.LAUNCHING, v.EXECUTING], history_states
    # No cool-down: the instance closes after its job, the agent is told to exit, and the on-demand machine is
    # stopped (kept for a fast restart: see the next test), not terminated.
    ec2 = boto3_client()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = ec2.describe_instances(InstanceIds=[ec2_id])["Reservations"][0]["Instances"][0]["State"]["Name"]
        inst = {i.id: i for i in client.instances()}[job.instance_id]
        if state == "stopped" and (inst.status, inst.substatus) == (v.CLOSED, v.STOPPED):
            break
        time.sleep(0.5)
    assert (state, inst.status, inst.substatus) == ("stopped", v.CLOSED, v.STOPPED)


def boto3_client() -> Any:
    from aws_moto import REGION

    return boto3.Session(region_name=REGION).client("ec2")


def test_an_on_demand_machine_is_stopped_after_its_cool_down_and_restarted_for_the_next_job(
    aws_backend: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 11 item 6 through moto: the job's machine cools, is STOPPED (not terminated), and the next job on the
    same machine id starts it again; its agent comes back with the token it kept (no second enrollment)."""
    b, played = aws_backend["backend"], aws_backend["played"]
    monkeypatch.setenv("AIBRO_BACKEND_URL", b.url)
    monkeypatch.setenv("AIBRO_TOKEN", b.token)
    client = b.client()
    x, y = slow_data(300)
    first, _, _ = Training.online_fit(
        make_model(), x, y, machine_ids="g4dn.xlarge.od", epochs=1, cool_down_period_s=1, record=False
    )
    instance_id = client.job(first).instance_id
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        inst = {i.id: i for i in client.instances()}[instance_id]
        if (inst.status, inst.substatus) == (v.CLOSED, v.STOPPED):
            break
        time.sleep(0.5)
    assert (inst.status, inst.substatus) == (v.CLOSED, v.STOPPED), inst
    (ec2_id,) = played.envs
    ec2 = boto3_client()
    state = ec2.describe_instances(InstanceIds=[ec2_id])["Reservations"][0]["Instances"][0]["State"]["Name"]
    assert state == "stopped"

    second, trained, history = Training.online_fit(
        make_model(1), x, y, machine_ids="g4dn.xlarge.od", epochs=1, record=False
    )
    job = client.job(second)
    assert job.status == v.COMPLETED and job.instance_id == instance_id, "the stopped machine was reused"
    assert list(played.envs) == [ec2_id], "no new EC2 instance was launched"
    log = played.log(ec2_id)
    assert log.count("enrolled as") == 1, "after the restart the agent used the token it kept"
    states = [(h[0], h[1]) for h in {i.id: i for i in client.instances()}[instance_id].history]
    assert (v.CLOSED, v.STOPPED) in states and states.index((v.CLOSED, v.STOPPED)) < len(states) - 1


def test_after_a_sigkill_the_restarted_backend_adopts_its_machine_and_the_job_finishes_on_it(
    moto: dict, tmp_path: Path
) -> None:
    """Issue 11 item 8: the backend is SIGKILLed while a played machine trains; restarted on the same home and
    config, it adopts the machine by tag (no terminate, no second launch) and the job completes there."""
    from aws_moto import PlayedInstances

    from helpers import wait_for

    config = write_config(tmp_path / "restart.toml", moto["account"])
    backend_id = load_aws_config(config).backend_id
    home, args = tmp_path / "home", ("--provider", "aws", "--aws-config", str(config))
    x, y = slow_data(3000)
    with own_backend(home, *args, **moto["env"]) as first:
        url = first.url
        with PlayedInstances(backend_id, url, tmp_path / "machines", moto["env"]) as played:
            client = first.client()
            job = Training(client).submit(
                FitRequest(make_model(), x, y, machine_ids="g4dn.xlarge.od", epochs=4, batch_size=16)
            )
            wait_for(client, job.job_id, lambda evs: any(e["type"] == "epoch" for e in evs), timeout=300)
            first.proc.kill()
            first.proc.wait(timeout=30)
            before = first.log.stat().st_size  # the restarted backend appends to the same log
            with own_backend(home, *args, **moto["env"]) as second:
                assert second.url == url, "the restarted backend comes back on its port, where its workers look"
                client = second.client()
                events = wait_for(
                    client,
                    job.job_id,
                    lambda evs: any(e["type"] == "status" and e["data"]["status"] in v.JOB_FINAL for e in evs),
                    timeout=300,
                )
                done = client.job(job.job_id)
                assert done.status == v.COMPLETED, [e["data"] for e in events if e["type"] in ("error", "log")]
                epochs = [e["data"]["epoch"] for e in events if e["type"] == "epoch"]
                assert epochs == [0, 1, 2, 3], epochs
                assert len(played.envs) == 1, "no second machine was launched"
                (ec2_id,) = played.envs
                ec2 = boto3_client()
                described = ec2.describe_instances(InstanceIds=[ec2_id])["Reservations"][0]["Instances"][0]
                assert described["State"]["Name"] in ("running", "stopped"), "never terminated by the restart"
                restarted_log = second.log.read_bytes()[before:].decode()
                adopted = re.search(r"adopted: \[(.*)\]", restarted_log)
                assert adopted and f"instance_id='{done.instance_id}'" in adopted[1], restarted_log[-2000:]


def test_the_running_backend_terminates_a_tagged_machine_its_store_does_not_know(moto: dict, tmp_path: Path) -> None:
    """Issue 11 item 8, first part: a machine tagged for this backend that no row of its store knows (a launch
    whose answer was lost with a crash, a copy of the tags by hand) is terminated by the reconciler."""
    config = write_config(tmp_path / "reconcile.toml", moto["account"])
    backend_id = load_aws_config(config).backend_id
    ec2, account = moto["account"]["ec2"], moto["account"]
    args = ("--provider", "aws", "--aws-config", str(config))
    with own_backend(tmp_path / "home", *args, AIBRO_RECONCILE_S="1", **moto["env"]) as b:
        stray = ec2.run_instances(
            ImageId=account["ami"],
            InstanceType="g4dn.xlarge",
            MinCount=1,
            MaxCount=1,
            SubnetId=account["subnet"],
            TagSpecifications=[
                {
                    "ResourceType": "instance",
                    "Tags": [
                        {"Key": "aibro:backend", "Value": backend_id},
                        {"Key": "aibro:instance", "Value": "inst-stray"},
                        {"Key": "aibro:expires-at", "Value": "2999-01-01T00:00:00Z"},
                    ],
                }
            ],
        )["Instances"][0]["InstanceId"]
        deadline = time.monotonic() + 60
        state = ""
        said = False
        while time.monotonic() < deadline and not (state == "terminated" and said):
            time.sleep(0.5)
            state = ec2.describe_instances(InstanceIds=[stray])["Reservations"][0]["Instances"][0]["State"]["Name"]
            said = "(inst-stray): unknown to the store" in b.log.read_text()  # logged just after the call
        assert state == "terminated" and said, b.log.read_text()[-2000:]
