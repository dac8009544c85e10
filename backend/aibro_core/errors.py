"""Errors a user sees: each names the problem and the fix."""

from __future__ import annotations


class AibroError(Exception):
    """Base of every error aibro raises on purpose."""


class BackendUnreachable(AibroError):
    pass


class AuthError(AibroError):
    pass


class ApiError(AibroError):
    """A 4xx/5xx answer: its status, its message, and the rest of its JSON body (e.g. the refused event's wseq)."""

    def __init__(self, status: int, message: str, body: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or {}


class SettingsError(ValueError):
    """One or more AIBRO_* variables hold a value the setting cannot take; the message names each."""


class ValidationError(AibroError):
    """Bad input caught before anything is uploaded."""


class JobFailed(AibroError):
    pass


class StudyFailed(AibroError):
    """A study that ended FAILED (too many failed trials in a row, as KerasTuner's search raises then): its trials
    so far are in the tuner all the same."""
