"""S3 uploads are their user's at once and everyone's once proven: the bytes cross the network once.

A finished S3 upload is indexed as its user's under the SHA-256 the client computed while sending (a claim), read
from the upload's own key (`uploads/<user>/new-<id>`), and published in the background (`S3Backing.publish`: S3
hashes a frozen copy; only a match reaches the shared `blobs/<sha>`). A proven claim moves its user to the shared
copy; a false one is dropped from their index (their next upload of that name sends the bytes again) and logged.
Either way the upload's key is deleted once no presigned URL handed out for it can still be in use. A claim whose
publish did not happen (S3 unreachable, a backend restart) is published again by `upkeep`.

Every upload (a user's, or a worker's artifact) is due to go from its start (`unfinished`): one that is never
finished (its client or worker killed, S3 failing past every retry) leaves neither its key nor the multipart upload
it began once its URLs have expired; finishing it takes it off that list. So is a publish's frozen copy, should the
publish be cut short (the backend killed, S3 failing at its delete).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tornado.ioloop import IOLoop

from .s3blobs import URL_TTL_S, S3Backing, S3BlobError
from .store import Store

log = logging.getLogger(__name__)
UNFINISHED_SLACK_S = 600.0  # past its URLs' lifetime: a part sent at the last second has landed, a finish arrived
VERIFY_S = 900.0  # a publish's frozen copy (S3Backing.publish) left behind goes after this: no publish takes that long
_in_flight: set[tuple[str, int, str]] = set()


async def publish(store: Store, s3: S3Backing, sha: str, user_id: int, key: str) -> bool:
    """Prove the user's claim that `key` holds `sha` and share it; True when it held. Runs once at a time per
    claim; S3 errors leave the claim for `upkeep`."""
    claim = (sha, user_id, key)
    if claim in _in_flight:
        return False
    _in_flight.add(claim)
    frozen = s3.verify_key()
    store.blobs.doom_s3_key(frozen, time.time() + VERIFY_S)  # if the publish is cut short, its frozen copy still goes
    try:
        await IOLoop.current().run_in_executor(s3.pool, s3.publish, key, sha, frozen)
    except S3BlobError as exc:
        store.blobs.forget_doomed(frozen)  # publish deleted it
        with store.transaction():
            if store.blobs.s3_key(sha, user_id) == key:
                store.blobs.drop(sha, user_id)
            store.blobs.doom_s3_key(key, time.time() + URL_TTL_S)
            store.users.bump(user_id, "blob_claims_refused", 1)
        log.warning("user %d's upload %s is not the blob %s it was named (%s): dropped", user_id, key, sha, exc)
        return False
    except Exception as exc:  # noqa: BLE001 - S3 unreachable or refusing: the claim stays, upkeep tries again
        log.warning("could not publish user %d's upload of %s yet: %s", user_id, sha, exc)
        return False
    finally:
        _in_flight.discard(claim)
    with store.transaction():  # a reader never sees the move without its key's deletion planned
        store.blobs.set_s3_key(sha, user_id, None, was=key)
        store.blobs.doom_s3_key(key, time.time() + URL_TTL_S)  # a worker may still hold a URL to it
        store.blobs.forget_doomed(frozen)  # publish deleted it
    return True


def drop(store: Store, sha: str, user_id: int) -> bool:
    """Forget the user's `sha` (their own upload's key goes later); True when no user holds it any more."""
    with store.transaction():
        key = store.blobs.s3_key(sha, user_id)
        if key is not None:
            store.blobs.doom_s3_key(key, time.time() + URL_TTL_S)
        return store.blobs.drop(sha, user_id)


def replace(store: Store, sha: str, user_id: int, key: str) -> None:
    """The user uploaded `sha` again while holding it: read their new upload from now on, the old one goes."""
    old = store.blobs.s3_key(sha, user_id)
    if old == key:
        return
    with store.transaction():
        store.blobs.set_s3_key(sha, user_id, key, was=old)
        if old is not None:
            store.blobs.doom_s3_key(old, time.time() + URL_TTL_S)


def unfinished(store: Store, key: str, upload_id: str | None) -> None:
    """An upload to `key` starts (its plan's multipart `upload_id`, if any): unless it is finished (which forgets
    this), its key and its multipart upload go once the URLs handed out for it have expired."""
    store.blobs.doom_s3_key(key, time.time() + URL_TTL_S + UNFINISHED_SLACK_S, upload_id)


async def upkeep(store: Store, s3: S3Backing) -> dict[str, Any]:
    """Publish the claims not yet proven and delete the upload keys that are due (aborting the multipart upload an
    unfinished one began); what it did, for the log."""
    published = deleted = 0
    for sha, user_id, key in store.blobs.claims():
        published += await publish(store, s3, sha, user_id, key)
    for key, upload_id in store.blobs.doomed_s3_keys(time.time()):
        try:
            if upload_id:
                await IOLoop.current().run_in_executor(s3.pool, s3.abort, key, upload_id)
            await IOLoop.current().run_in_executor(s3.pool, s3.delete, key)
        except Exception as exc:  # noqa: BLE001 - tried again at the next upkeep
            log.warning("could not delete %s from the bucket yet: %s", key, exc)
            continue
        store.blobs.forget_doomed(key)
        deleted += 1
    return {"published": published, "deleted": deleted}
