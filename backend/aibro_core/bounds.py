"""Bounds of a job spec that the kernel checks before anything is uploaded and the backend enforces: defined once,
here, so that both sides say the same number."""

MAX_BATCH_SIZE = 1 << 24  # samples in one batch (a bigger one is no batch)
