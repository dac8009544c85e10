"""The two ways the repositories write: every write runs in `transaction`, and every `UPDATE ... SET` of a row's
columns is written by `update_row`.

The store's connection is in autocommit mode (`isolation_level=None`), so nothing is in a transaction unless this
module opens one; the repositories share that one connection, on the event loop's thread."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """Several writes in one commit: a reader (another process, a test) sees all of them or none. Inside an open
    transaction it is a savepoint instead, rolled back alone when its block raises (one batch of a group commit)."""
    if db.in_transaction:
        db.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            db.execute("ROLLBACK TO nested")
            db.execute("RELEASE nested")
            raise
        db.execute("RELEASE nested")
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:  # a failed COMMIT may have rolled back already
            db.execute("ROLLBACK")
        raise


def write(db: sqlite3.Connection, sql: str, args: Sequence[Any] = ()) -> sqlite3.Cursor:
    """One writing statement in its own transaction (or the one open): its cursor, for rowcount and lastrowid."""
    with transaction(db):
        return db.execute(sql, args)


def update_row(
    db: sqlite3.Connection, table: str, key: dict[str, Any], fields: dict[str, Any], now: float | None = None
) -> None:
    """Set `fields` and `updated` (now) on the row of `table` whose columns equal `key`."""
    fields = {**fields, "updated": time.time() if now is None else now}
    cols = ", ".join(f"{col}=?" for col in fields)
    where = " AND ".join(f"{col}=?" for col in key)
    write(db, f"UPDATE {table} SET {cols} WHERE {where}", (*fields.values(), *key.values()))


def marks(values: Sequence[Any]) -> str:
    """The `?, ?, ...` an `IN (...)` of these values takes."""
    return ",".join("?" * len(values))


def row_by_id(db: sqlite3.Connection, table: str, row_id: str, user_id: int | None = None) -> sqlite3.Row | None:
    """The row of `table` with this id (and of this user, when one is given)."""
    if user_id is None:
        return db.execute(f"SELECT * FROM {table} WHERE id=?", (row_id,)).fetchone()
    return db.execute(f"SELECT * FROM {table} WHERE id=? AND user_id=?", (row_id, user_id)).fetchone()


def owned_rows(
    db: sqlite3.Connection, table: str, user_id: int | None = None, statuses: Sequence[str] | None = None
) -> list[sqlite3.Row]:
    """The rows of `table` of one user (or of all) in these statuses (or in any), oldest first."""
    sql, args = f"SELECT * FROM {table} WHERE 1=1", []
    if user_id is not None:
        sql += " AND user_id=?"
        args.append(user_id)
    if statuses:
        sql += f" AND status IN ({marks(statuses)})"
        args.extend(statuses)
    return db.execute(sql + " ORDER BY created", args).fetchall()
