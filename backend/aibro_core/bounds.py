"""Bounds of a job spec that the kernel checks before anything is uploaded and the backend enforces: defined once,
here, so that both sides say the same number."""

MAX_BATCH_SIZE = 1 << 24  # samples in one batch (a bigger one is no batch)
MAX_EPOCHS = 1_000_000
MAX_COOL_DOWN_S = 7 * 24 * 3600  # a week warm at most
MAX_WAIT_REQUEST_S = 30 * 24 * 3600
MAX_DESCRIPTION_CHARS = 500
MAX_WORKERS = 64  # processes (machines) of one data-parallel job
