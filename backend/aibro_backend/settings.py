"""Every AIBRO_* setting of the backend process, in one class: its type, its bounds, its default and what it does.
The policy (scheduling/policy.py), the service's limits (server/limits.py) and the providers read their values
from here; the README's settings table is written from these fields (`python -m aibro_core.settingsdoc`).

Variables that are a protocol between processes rather than settings (a worker's URL, tokens and folders, handed
to it by the backend) are not here: see worker/settings.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from aibro_core.envsettings import EnvSettings

from .providers.sandbox import UID_BASE
from .worker.joblimits import JobLimits

MiB = 1024 * 1024
GiB = 1024 * MiB
Lower = BeforeValidator(lambda raw: raw.strip().lower() if isinstance(raw, str) else raw)
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Grace = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class BackendSettings(EnvSettings):
    """The backend's settings (`aibro backend serve` and the embedded backend), from AIBRO_<FIELD>."""

    # -- where it keeps its state, how it is reached -------------------------------------------------------------
    home: Path = Field(
        default_factory=lambda: Path.home() / ".aibro",
        description="The folder holding the backend's store, blobs, artifacts and logs (and the kernel's login).",
    )
    ca_bundle: str | None = Field(
        None,
        description="The PEM file that verifies this backend's TLS certificate; `serve --ca-bundle` sets it and "
        "hands it to every worker.",
    )
    events_port: str = Field(
        "",
        description="The port of the lean long-poll listener beside the main one (empty: any free port; `off`: none, "
        "long-polls go to the main port).",
    )

    # -- the policy: what one user may hold ----------------------------------------------------------------------
    max_active_jobs: int = Field(5, ge=0, description="Jobs a user may have queued or training at once (0 holds all).")
    max_active_instances: int = Field(5, ge=0, description="Machines a user may have running at once (0 holds all).")
    max_stopped_instances: int = Field(4, ge=0, description="Stopped machines a user keeps for a fast restart.")
    max_job_bytes: int = Field(2 * GiB, ge=1, description="Bytes of model and data one job may send.")
    max_attempts: int = Field(3, ge=1, description="Times a job's worker may crash before the job is canceled.")
    cancel_grace_s: Grace = Field(20.0, description="Seconds a canceled job's worker has to stop before it is killed.")
    max_cool_down_s: Grace = Field(
        3600.0, description="The longest a warm machine waits for its user's next job (like SageMaker's warm pools)."
    )
    allow_unsafe: str = Field(
        "none",
        description="Who may load models with safe_mode=False (Lambda layers run their Python on the worker): `all`, "
        "`none` or a comma-separated list of users.",
    )
    spare_worker: bool = Field(
        False, description="Keep a local worker with TensorFlow imported for the next first job (providers/spare.py)."
    )

    # -- the service's limits (server/limits.py says why each is what it is) ------------------------------------
    max_connections: int = Field(
        4096, ge=1, description="Open connections at once; kept below the descriptor limit unless set."
    )
    idle_timeout_s: Seconds = Field(60.0, description="Seconds a connection may wait for a request's headers.")
    body_timeout_s: Seconds = Field(30.0, description="Seconds a request body must arrive within (plus its size).")
    max_partial_bytes: int = Field(
        0, ge=0, description="Bytes of unfinished uploads a user may hold (0: twice AIBRO_MAX_JOB_BYTES)."
    )
    max_partial_uploads: int = Field(64, ge=1, description="Unfinished uploads a user may hold at once.")
    max_stored_bytes: int = Field(
        0, ge=0, description="Bytes of finished blobs a user holds (0: ten times AIBRO_MAX_JOB_BYTES)."
    )
    partial_ttl_s: Seconds = Field(24 * 3600.0, description="Seconds an untouched unfinished upload is kept.")
    max_tokens_per_user: int = Field(20, ge=1, description="Live tokens a user may hold.")
    chunk_max_body: int = Field(
        64 * MiB, ge=8 * MiB, description="The most bytes one upload request carries (lower it behind a proxy)."
    )

    # -- what one job may take of its machine (handed to local workers: worker/joblimits.py) ---------------------
    job_max_open_files: int = Field(JobLimits.max_open_files, ge=1, description="Files a job may hold open.")
    job_max_processes: int = Field(JobLimits.max_processes, ge=1, description="Processes and threads of a job.")
    job_max_disk_bytes: int = Field(JobLimits.max_disk_bytes, ge=1, description="Bytes a job's folder may hold.")
    job_max_memory_bytes: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="Memory one job's processes may hold; 0: no limit. Unset: on a backend of several users, each "
        "job's share of its machine (this host's memory over its local slots, or a remote machine's own memory); "
        "on a backend of one user, no limit.",
    )
    job_network: Annotated[Literal["backend", "host"], Lower] = Field(
        "backend",
        description="`backend`: sandboxed jobs reach only the backend (and the package index while their "
        "environment is built); `host`: the host's network.",
    )
    job_package_hosts: str = Field(
        "", description="More `host[:port]` names (comma-separated) pip may reach while a job's environment is built."
    )

    # -- the local provider ---------------------------------------------------------------------------------------
    sandbox: Annotated[Literal["auto", "bwrap", "none"], Lower] = Field(
        "auto", description="How local workers are confined (`serve --sandbox`): bubblewrap where it works, or none."
    )
    sandbox_uid_base: int = Field(
        UID_BASE, ge=1, description="A sandboxed job run as root drops to this uid plus its user's id."
    )
    worker_python: str | None = Field(
        None, description="The interpreter local workers run (default: the backend's own)."
    )
    local_enroll: bool = Field(
        False, description="Local workers start with a one-time enrollment token, as cloud machines do."
    )
    local_capacity: int = Field(0, ge=0, description="Jobs the local CPU machine runs at once (0: one per core).")

    # -- cloud providers and storage ------------------------------------------------------------------------------
    reconcile_s: Seconds = Field(
        300.0, description="Seconds between two reconciliations of cloud machines with the store."
    )
    ray_connect_s: Seconds = Field(90.0, description="Seconds the Ray provider waits for its cluster at start.")
    ssh_unreachable_s: Seconds = Field(
        60.0, description="Seconds an SSH host may be out of reach before its jobs resume elsewhere."
    )
    s3_part_bytes: int = Field(
        64 * MiB,
        ge=5 * MiB,  # S3's smallest part (all but the last)
        description="Data over this goes to S3 as a multipart upload of parts this size.",
    )


DEFAULTS = BackendSettings()  # the defaults alone, whatever the environment holds
