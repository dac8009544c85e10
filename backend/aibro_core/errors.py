"""Errors a user sees: each names the problem and the fix."""

from __future__ import annotations


class AibroError(Exception):
    """Base of every error aibro raises on purpose."""


class BackendUnreachable(AibroError):
    pass


class AuthError(AibroError):
    pass


class ApiError(AibroError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ValidationError(AibroError):
    """Bad input caught before anything is uploaded."""


class JobFailed(AibroError):
    pass
