"""Errors a user sees (defined in the shared core, so the backend and the worker raise the same ones)."""

from __future__ import annotations

from aibro_core.errors import (
    AibroError,
    ApiError,
    AuthError,
    BackendUnreachable,
    JobFailed,
    StudyFailed,
    ValidationError,
)

__all__ = ["AibroError", "ApiError", "AuthError", "BackendUnreachable", "JobFailed", "StudyFailed", "ValidationError"]
