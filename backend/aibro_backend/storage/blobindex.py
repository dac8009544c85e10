"""Which blobs each user holds (the bytes are in blobs.py or s3blobs.py), their use, and the S3 keys to delete
once no presigned URL to them can be in use (claims.py)."""

from __future__ import annotations

import sqlite3
import time

from .sql import marks, write


class BlobIndex:
    """The `blobs` and `s3_doomed` tables."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def add(self, sha: str, user_id: int, size: int, s3_key: str | None = None) -> None:
        """Index `sha` as the user's: shared bytes, or (`s3_key`) their own upload not yet verified."""
        now = time.time()
        write(
            self.db,
            "INSERT OR IGNORE INTO blobs (sha, user_id, size, created, used, s3_key) VALUES (?, ?, ?, ?, ?, ?)",
            (sha, user_id, size, now, now, s3_key),
        )

    def s3_key(self, sha: str, user_id: int) -> str | None:
        """The key of the user's own unverified copy of `sha`, None when they read the shared one (or none)."""
        row = self.db.execute("SELECT s3_key FROM blobs WHERE sha=? AND user_id=?", (sha, user_id)).fetchone()
        return row["s3_key"] if row else None

    def set_s3_key(self, sha: str, user_id: int, key: str | None, was: str | None) -> bool:
        """Move the user's `sha` from key `was` to `key` (None: the shared, verified copy); False when it was not at
        `was` any more (dropped, or moved by another upload meanwhile)."""
        cur = write(
            self.db, "UPDATE blobs SET s3_key=? WHERE sha=? AND user_id=? AND s3_key IS ?", (key, sha, user_id, was)
        )
        return cur.rowcount > 0

    def claims(self) -> list[tuple[str, int, str]]:
        """Every (sha, user, key) still read from its user's own upload: what `claims.publish` has yet to prove."""
        rows = self.db.execute("SELECT sha, user_id, s3_key FROM blobs WHERE s3_key IS NOT NULL").fetchall()
        return [(r["sha"], int(r["user_id"]), r["s3_key"]) for r in rows]

    def doom_s3_key(self, key: str, after: float, upload_id: str | None = None) -> None:
        """Delete `key` from the bucket once `after` (a time) has passed, and abort the multipart upload
        `upload_id` that was writing it, if any (an upload started and never finished)."""
        write(
            self.db,
            "INSERT OR REPLACE INTO s3_doomed (key, after, upload_id) VALUES (?, ?, ?)",
            (key, after, upload_id),
        )

    def doomed_s3_keys(self, now: float) -> list[tuple[str, str | None]]:
        """(key, multipart upload id or None) due for deletion, none of them read by any blob row (a key in use
        again is spared)."""
        rows = self.db.execute(
            "SELECT key, upload_id FROM s3_doomed WHERE after <= ? AND key NOT IN "
            "(SELECT s3_key FROM blobs WHERE s3_key IS NOT NULL)",
            (now,),
        ).fetchall()
        return [(r["key"], r["upload_id"]) for r in rows]

    def forget_doomed(self, key: str) -> None:
        write(self.db, "DELETE FROM s3_doomed WHERE key=?", (key,))

    def size(self, sha: str, user_id: int) -> int | None:
        row = self.db.execute("SELECT size FROM blobs WHERE sha=? AND user_id=?", (sha, user_id)).fetchone()
        return int(row["size"]) if row else None

    def touch(self, user_id: int, shas: list[str]) -> None:
        """The user is using these blobs now (asked for them, submitted a job that reads them)."""
        write(
            self.db,
            f"UPDATE blobs SET used=? WHERE user_id=? AND sha IN ({marks(shas)})",
            (time.time(), user_id, *shas),
        )

    def stored_bytes(self, user_id: int) -> int:
        row = self.db.execute("SELECT COALESCE(SUM(size), 0) AS n FROM blobs WHERE user_id=?", (user_id,)).fetchone()
        return int(row["n"])

    def by_use(self, user_id: int) -> list[tuple[str, int]]:
        """The user's blobs as (sha, size), the least recently used first."""
        rows = self.db.execute(
            "SELECT sha, size FROM blobs WHERE user_id=? ORDER BY COALESCE(used, created), created", (user_id,)
        ).fetchall()
        return [(r["sha"], int(r["size"])) for r in rows]

    def held(self, sha: str) -> bool:
        """Whether any user holds `sha`."""
        return self.db.execute("SELECT 1 FROM blobs WHERE sha=? LIMIT 1", (sha,)).fetchone() is not None

    def drop(self, sha: str, user_id: int) -> bool:
        """Forget that the user holds `sha`; True when no user holds it any more (its bytes may go)."""
        write(self.db, "DELETE FROM blobs WHERE sha=? AND user_id=?", (sha, user_id))
        return not self.held(sha)
