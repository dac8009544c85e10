"""The soak's AWS world (benchmarks/soak.py --provider aws): moto's server with the account a user sets up once, the
backend's S3 reached through a fault-injecting proxy (tests/flaky_s3.py), the tests' played EC2 instances (the real
agent from each machine's user data, as a local process, tests/aws_moto.py), each with a fake instance metadata
service that can give AWS's spot notice (tests/fake_imds.py); and what is left in the bucket at the end."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPOT = "g4dn.xlarge"  # the spot machine every soak job asks for (played on this host's CPU)
RECLAIM_S = 15.0  # AWS terminates a machine two minutes after its notice; sooner here


class AwsWorld:
    def __init__(self, root: Path, seed: int, log: Callable[[str], None]) -> None:
        from aws_moto import make_account, moto_server, write_config
        from fake_imds import FakeImds
        from flaky_s3 import FlakyS3

        from aibro_backend.providers.aws_config import load_aws_config

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
        self.log = log
        self.root = root
        self.stack = contextlib.ExitStack()
        self.env: dict[str, str] = self.stack.enter_context(moto_server())
        self.account = make_account()
        self.config = write_config(root / "aws.toml", self.account)
        self.backend_id = load_aws_config(self.config).backend_id
        self.s3 = self.stack.enter_context(FlakyS3(self.env["AWS_ENDPOINT_URL"], seed=seed))
        self.imds: dict[str, Any] = {}  # ec2 id -> its FakeImds
        self._imds = FakeImds
        self.played: Any = None

    # -- the backend and its machines ------------------------------------------------------------------
    def backend_args(self) -> list[str]:
        return ["--provider", "aws", "--aws-config", str(self.config)]

    def backend_env(self) -> dict[str, str]:
        """moto's endpoint for EC2, SSM and IAM; the flaky proxy for S3 (so for every URL the backend signs)."""
        return {**self.env, "AWS_ENDPOINT_URL_S3": self.s3.url, "AIBRO_S3_PART_BYTES": str(5 << 20)}

    def start_machines(self, backend_url: str) -> None:
        """Play every EC2 instance the backend runs (its URL stays the same across restarts)."""
        from aws_moto import PlayedInstances

        def machine_env(ec2_id: str) -> dict[str, str]:
            self.imds[ec2_id] = self.stack.enter_context(self._imds())
            return {"AIBRO_IMDS_URL": self.imds[ec2_id].url, "AIBRO_SPOT_POLL_S": "0.5"}

        self.played = self.stack.enter_context(
            PlayedInstances(self.backend_id, backend_url, self.root / "machines", self.env, machine_env)
        )

    def close(self) -> None:
        self.stack.close()

    def ec2_of(self, instance_id: str) -> str | None:
        """The EC2 id of the backend's instance `instance_id`, from what its played machine runs with."""
        for ec2_id, env in dict(self.played.envs).items():
            if env.get("AIBRO_INSTANCE_ID") == instance_id:
                return ec2_id
        return None

    def agent(self, instance_id: str) -> int | None:
        """The agent's pid on the instance's played machine, while it runs."""
        ec2_id = self.ec2_of(instance_id)
        proc = self.played.procs.get(ec2_id) if ec2_id else None
        return proc.pid if proc is not None and proc.poll() is None else None

    # -- the faults -----------------------------------------------------------------------------------------
    def s3_fault(self, kind: str, seconds: float, share: float) -> None:
        self.s3.fault(kind, seconds, share)

    def spot_notice(self, instance_id: str) -> str:
        """AWS's two-minute notice on the instance's machine, then (RECLAIM_S later, on a thread) its termination."""
        import threading

        import boto3

        ec2_id = self.ec2_of(instance_id)
        if ec2_id is None or ec2_id not in self.imds:
            return f"no machine found for {instance_id}"
        self.imds[ec2_id].announce()

        def reclaim() -> None:
            time.sleep(RECLAIM_S)
            with contextlib.suppress(Exception):  # the backend may have terminated it first
                ec2 = boto3.Session(region_name=os.environ.get("AWS_DEFAULT_REGION", "us-east-1")).client("ec2")
                ec2.terminate_instances(InstanceIds=[ec2_id])
            self.log(f"fault spot: AWS reclaimed {ec2_id} ({instance_id})")

        threading.Thread(target=reclaim, daemon=True).start()
        return f"AWS's notice on {ec2_id} ({instance_id}); reclaimed in {RECLAIM_S:.0f} s"

    # -- what is left ---------------------------------------------------------------------------------------
    def leftovers(self, db: Path, ended: set[str]) -> dict[str, list[str]]:
        """Keys in the bucket that nothing accounts for, by why: a verify copy, an upload the backend neither holds
        nor plans to delete, a job's key its index does not hold and that is not due to go (for an ended job), and
        multipart uploads in progress that the backend does not plan to abort. What is due to go (its presigned URLs
        may still be in use for an hour) is accounted for: it goes by itself."""
        s3 = self.account["session"].client("s3")  # moto itself, not the flaky proxy
        bucket, prefix = self.account["bucket"], "jobs/"
        keys = [
            o["Key"]
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for o in page.get("Contents", [])
        ]
        con = sqlite3.connect(str(db), timeout=30)
        try:
            held = {k for (k,) in con.execute("SELECT s3_key FROM blobs WHERE s3_key IS NOT NULL")}
            due = con.execute("SELECT key, upload_id FROM s3_doomed").fetchall()
            doomed = {k for k, _ in due}
            aborts = {(k, u) for k, u in due if u}
            indexed = {(j, n) for j, n in con.execute("SELECT job_id, name FROM artifacts")}
        finally:
            con.close()
        out: dict[str, list[str]] = {"verify": [], "uploads": [], "jobs": [], "multipart": []}
        for key in keys:
            rest = key[len(prefix) :]
            if rest.startswith("verify/") and key not in doomed:
                out["verify"].append(key)
            elif rest.startswith("uploads/") and key not in held | doomed:
                out["uploads"].append(key)
            elif rest.startswith("jobs/"):
                job, _, name = rest[5:].partition("/")
                if job in ended and (job, name) not in indexed and key not in doomed:
                    out["jobs"].append(key)
        for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
            out["multipart"] += [u["Key"] for u in page.get("Uploads", []) if (u["Key"], u["UploadId"]) not in aborts]
        return out

    def counts(self) -> str:
        return f"S3 requests served {self.s3.served}, faulted {dict(self.s3.hits)}"
