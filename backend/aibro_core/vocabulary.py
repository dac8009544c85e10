"""The one event and state vocabulary shared by the backend, the worker and every client.

Each kind of status is a `StrEnum`: its members are the strings that travel and are stored (a member equals its
string, so the wire and the database are unchanged); code names a status only through these.
"""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:  # Python 3.10 (a worker's machine may have it): the same behaviour, str() and format() give the value

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


class JobStatus(StrEnum):
    """Where a job is: QUEUING -> TRAINING -> COMPLETED, or CANCELED (by the user or by a failure)."""

    QUEUING = "QUEUING"
    TRAINING = "TRAINING"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"


QUEUING, TRAINING, COMPLETED, CANCELED = JobStatus
JOB_STATUSES = tuple(JobStatus)
JOB_ACTIVE = (QUEUING, TRAINING)
JOB_FINAL = (COMPLETED, CANCELED)


class StudyStatus(StrEnum):
    """A hyperparameter study (issue 27): RUNNING until its oracle is done, it is cancelled or it fails."""

    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"
    FAILED = "FAILED"


STUDY_RUNNING, STUDY_COMPLETED, STUDY_CANCELED, STUDY_FAILED = StudyStatus
STUDY_STATUSES = tuple(StudyStatus)
STUDY_FINAL = (STUDY_COMPLETED, STUDY_CANCELED, STUDY_FAILED)


class TrialStatus(StrEnum):
    """A study's trial (and each of its executions), each run as one job."""

    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    CANCELED = "CANCELED"


TRIAL_RUNNING, TRIAL_COMPLETED, TRIAL_FAILED, TRIAL_CANCELED = TrialStatus
TRIAL_STATUSES = tuple(TrialStatus)


class StudyEvent(StrEnum):
    """What a `study` event says (its `data.event`), appended to the study's own event log as the driver does it:
    a trial's job started (`trial_id`, `job_id`, `execution`, `slot`), a trial ended (`trial_id`, its `status` and
    `score`), the study ended (its `status` and `message`). Clients follow these as they follow a job's events."""

    TRIAL_STARTED = "trial started"
    TRIAL_ENDED = "trial ended"
    STUDY_ENDED = "study ended"


STUDY_EVENTS = tuple(StudyEvent)


class TunerTrialStatus(StrEnum):
    """KerasTuner's own trial statuses (`keras_tuner.engine.trial.TrialStatus`): what the oracle host reports to
    its oracle and reads back, apart from the study's `TrialStatus` that clients see."""

    RUNNING = "RUNNING"
    IDLE = "IDLE"
    INVALID = "INVALID"
    STOPPED = "STOPPED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"


class JobSubstatus(StrEnum):
    """A job's step, in the order a job normally walks through them; CANCELED ends it anywhere."""

    REQUESTING_SERVER = "REQUESTING SERVER"
    CONNECTING_SERVER = "CONNECTING SERVER"
    GEARING_UP_ENV = "GEARING UP ENV"
    SENDING_MODEL_DATA = "SENDING MODEL & DATA"
    TRAINING = "TRAINING"
    RETURNING = "RETURNING"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"


REQUESTING_SERVER = JobSubstatus.REQUESTING_SERVER
CONNECTING_SERVER = JobSubstatus.CONNECTING_SERVER
GEARING_UP_ENV = JobSubstatus.GEARING_UP_ENV
SENDING_MODEL_DATA = JobSubstatus.SENDING_MODEL_DATA
SUB_TRAINING = JobSubstatus.TRAINING
RETURNING = JobSubstatus.RETURNING
SUB_COMPLETED = JobSubstatus.COMPLETED
SUB_CANCELED = JobSubstatus.CANCELED
SUBSTATUS_ORDER = (
    REQUESTING_SERVER,
    CONNECTING_SERVER,
    GEARING_UP_ENV,
    SENDING_MODEL_DATA,
    SUB_TRAINING,
    RETURNING,
    SUB_COMPLETED,
)
JOB_SUBSTATUSES = tuple(JobSubstatus)
WORKER_SUBSTATUSES = (GEARING_UP_ENV, SENDING_MODEL_DATA, SUB_TRAINING, RETURNING)  # the ones a worker may set


class InstanceStatus(StrEnum):
    """A machine held for one user: LAUNCHING -> EXECUTING <-> COOLING -> CLOSING -> CLOSED."""

    LAUNCHING = "LAUNCHING"
    EXECUTING = "EXECUTING"
    COOLING = "COOLING"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"


LAUNCHING, EXECUTING, COOLING, CLOSING, CLOSED = InstanceStatus
INSTANCE_STATUSES = tuple(InstanceStatus)
INSTANCE_LIVE = (LAUNCHING, EXECUTING, COOLING)


class InstanceEnding(StrEnum):
    """The substatus of a CLOSING or CLOSED instance: stopped (kept for a fast restart) or terminated."""

    STOPPING = "STOPPING"
    STOPPED = "STOPPED"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"


STOPPING, STOPPED, TERMINATING, TERMINATED = InstanceEnding


class PredictionSource(StrEnum):
    """Where a prediction of a fit's time comes from (issue 38), best first: earlier jobs of the same model on that
    machine type; its FLOPs against the machine's nominal throughput, a rough guess. A calibration (a few steps on
    a warm worker of the type) is to come between them."""

    HISTORY = "history"
    FLOPS = "flops"


PREDICTION_SOURCES = tuple(PredictionSource)

# Event types.
EV_STATUS = "status"
EV_EPOCH = "epoch"
EV_BATCH = "batch"
EV_LOG = "log"
EV_ERROR = "error"
EV_ARTIFACT = "artifact"
EV_STUDY = "study"  # a study's own log (issue 40): what its driver did, `data.event` one of StudyEvent
EVENT_TYPES = (EV_STATUS, EV_EPOCH, EV_BATCH, EV_LOG, EV_ERROR, EV_ARTIFACT, EV_STUDY)
WORKER_EVENT_TYPES = (EV_STATUS, EV_EPOCH, EV_BATCH, EV_LOG, EV_ERROR)

# How a worker's attempt at a job ended (POST /worker/jobs/{id}/finish). A spot interruption is no failure: the
# cloud reclaimed the machine, the worker stopped at a batch boundary after its last epoch checkpoint, and the job
# resumes elsewhere (its log event carries the key `spot_interrupted`, which the scheduler counts apart from
# crashes).
OUTCOME_COMPLETED = "completed"
OUTCOME_CANCELED = "canceled"
OUTCOME_FAILED = "failed"
SPOT_INTERRUPTED = "spot_interrupted"
OUTCOMES = (OUTCOME_COMPLETED, OUTCOME_CANCELED, OUTCOME_FAILED, SPOT_INTERRUPTED)

# Fit keyword arguments that travel to the worker as they are.
FIT_KWARGS = (
    "epochs",
    "batch_size",
    "shuffle",
    "class_weight",
    "initial_epoch",
    "steps_per_epoch",
    "validation_steps",
    "validation_batch_size",
    "validation_freq",
    "validation_split",
)


CWD_SLOT = "job/cwd"  # the artifacts files/job/cwd/...: what the job's code wrote into its working directory


def checkpoint_name(epoch: int) -> str:
    """The artifact a worker uploads after epoch `epoch` (0-based) and a resumed attempt starts from."""
    return f"checkpoints/epoch-{epoch + 1:04d}.keras"
