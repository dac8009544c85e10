"""One access-log line per answered request, whichever server answered it (tornado's routes, the event port)."""

from __future__ import annotations

import logging

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
