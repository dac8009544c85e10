"""One access-log line per answered request, whichever server answered it (tornado's routes, the event port), and
every log line with its secrets blanked."""

from __future__ import annotations

import logging
import re

import tornado.httpserver
import tornado.web

access_log = logging.getLogger("tornado.access")
# the client's mistake, answered with the problem and the fix: nothing to act on here
CLIENT_MISTAKES = (400, 404, 405, 409, 413, 422, 429, 431)


def log_access(status: int, method: str, path: str, remote_ip: str, seconds: float, note: str = "") -> None:
    """The path without its query string (a token put there by mistake never lands here), at a level that says
    whether anyone needs to act: INFO for answers and the client's mistakes, WARNING for refusals, ERROR for 5xx."""
    level = logging.INFO if status < 400 else logging.WARNING if status < 500 else logging.ERROR
    if status in CLIENT_MISTAKES:
        level = logging.INFO
    if method == "HEAD" and status == 404:
        level = logging.DEBUG  # "not uploaded yet": the normal answer a content-addressed upload starts with
    if access_log.isEnabledFor(level):
        extra = f" {note}" if note else ""
        access_log.log(level, "%d %s %s (%s) %.1fms%s", status, method, path, remote_ip, 1000.0 * seconds, extra)


def log_tornado(status: int, request: tornado.httpserver.HTTPServerRequest, note: str = "") -> None:
    log_access(status, request.method or "", request.path, request.remote_ip or "", request.request_time(), note)


def log_request(handler: tornado.web.RequestHandler) -> None:
    log_tornado(handler.get_status(), handler.request)


class RedactingFormatter(logging.Formatter):
    """Every log line with bearer tokens and `token=` values blanked, whoever wrote it (tornado included)."""

    PATTERNS = (
        (re.compile(r"(?i)\b((?:access_)?token=)[^&\s'\"]+"), r"\1[redacted]"),
        (re.compile(r"(?i)(Bearer\s+)[^\s'\",]+"), r"\1[redacted]"),
        (re.compile(r"\baibro_[uw]_[A-Za-z0-9_-]{8,}"), "aibro_[redacted]"),
    )

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        for pattern, repl in self.PATTERNS:
            text = pattern.sub(repl, text)
        return text
