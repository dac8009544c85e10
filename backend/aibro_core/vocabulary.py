"""The one event and state vocabulary shared by the backend, the worker and every client."""

from __future__ import annotations

# Job states (seed vocabulary).
QUEUING = "QUEUING"
TRAINING = "TRAINING"
COMPLETED = "COMPLETED"
CANCELED = "CANCELED"
JOB_STATUSES = (QUEUING, TRAINING, COMPLETED, CANCELED)
JOB_ACTIVE = (QUEUING, TRAINING)
JOB_FINAL = (COMPLETED, CANCELED)

# Hyperparameter studies (issue 27) and their trials: each trial runs as one job.
STUDY_RUNNING = "RUNNING"
STUDY_COMPLETED = "COMPLETED"
STUDY_CANCELED = "CANCELED"
STUDY_FAILED = "FAILED"
STUDY_STATUSES = (STUDY_RUNNING, STUDY_COMPLETED, STUDY_CANCELED, STUDY_FAILED)
TRIAL_RUNNING = "RUNNING"
TRIAL_COMPLETED = "COMPLETED"
TRIAL_FAILED = "FAILED"
TRIAL_CANCELED = "CANCELED"
TRIAL_STATUSES = (TRIAL_RUNNING, TRIAL_COMPLETED, TRIAL_FAILED, TRIAL_CANCELED)

# Job substatuses, in the order a job normally walks through them.
REQUESTING_SERVER = "REQUESTING SERVER"
CONNECTING_SERVER = "CONNECTING SERVER"
GEARING_UP_ENV = "GEARING UP ENV"
SENDING_MODEL_DATA = "SENDING MODEL & DATA"
SUB_TRAINING = "TRAINING"
RETURNING = "RETURNING"
SUB_COMPLETED = "COMPLETED"
SUB_CANCELED = "CANCELED"
SUBSTATUS_ORDER = (
    REQUESTING_SERVER,
    CONNECTING_SERVER,
    GEARING_UP_ENV,
    SENDING_MODEL_DATA,
    SUB_TRAINING,
    RETURNING,
    SUB_COMPLETED,
)
JOB_SUBSTATUSES = (*SUBSTATUS_ORDER, SUB_CANCELED)
WORKER_SUBSTATUSES = (GEARING_UP_ENV, SENDING_MODEL_DATA, SUB_TRAINING, RETURNING)  # the ones a worker may set

# Instance states.
LAUNCHING = "LAUNCHING"
EXECUTING = "EXECUTING"
COOLING = "COOLING"
CLOSING = "CLOSING"
CLOSED = "CLOSED"
INSTANCE_STATUSES = (LAUNCHING, EXECUTING, COOLING, CLOSING, CLOSED)
INSTANCE_LIVE = (LAUNCHING, EXECUTING, COOLING)
STOPPING, STOPPED = "STOPPING", "STOPPED"
TERMINATING, TERMINATED = "TERMINATING", "TERMINATED"

# Event types.
EV_STATUS = "status"
EV_EPOCH = "epoch"
EV_BATCH = "batch"
EV_LOG = "log"
EV_ERROR = "error"
EV_ARTIFACT = "artifact"
EVENT_TYPES = (EV_STATUS, EV_EPOCH, EV_BATCH, EV_LOG, EV_ERROR, EV_ARTIFACT)
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
