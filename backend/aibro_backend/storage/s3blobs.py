"""The blob store's S3 backing (the AWS provider on): bytes go between S3 and the client or worker on presigned
URLs, never through the backend, which only signs, completes, verifies and indexes.

Keys live under the config's prefix: `<prefix>/blobs/<sha>` for data and models every user may share,
`<prefix>/jobs/<job>/<name>` for a job's checkpoints, TensorBoard logs and trained model, and
`<prefix>/uploads/<user>/new-<id>` for one upload of one user (one presigned PUT, or a multipart upload with one
presigned URL per part when the data is over the part size). A client never gets a URL that writes `blobs/<sha>`.

An upload is its user's the moment it is complete (storage/claims.py): the client names the SHA-256 it computed
while sending, and that user's jobs read the upload's own key at once, so the bytes cross the network once and
nothing waits for S3 to read them again. Only that user can be fooled by a wrong name (and their worker checks
every blob it downloads). Sharing waits for proof: `publish` copies the upload to a key of its own that no URL
was given for, having S3 compute the SHA-256 of what it wrote (a server-side copy with ChecksumAlgorithm=SHA256,
the same for single and multipart objects up to 5 GB, and on moto), and only when it equals the name copies that
frozen copy to `blobs/<sha>`, again with S3's checksum kept beside it. So whatever `blobs/<sha>` holds hashes to
`<sha>`: a second upload racing into the user's key cannot change the bytes that were verified, and a name whose
stored checksum is not its name (written by hand, or by an older backend) is moved to `quarantine/` the next time
someone asks whether it is held. A single PUT whose name the client knows beforehand is also signed with
ChecksumSHA256, so real S3 refuses wrong bytes there (moto does not).

Every call that reaches S3 is blocking: the handlers run them in this backing's own thread pool. botocore retries
what fails for now (5xx, SlowDown, a dropped connection) MAX_ATTEMPTS times; what still fails is `transient`, and
the handlers answer 503 so the client tries again (aibro_core/presigned.py), leaving what S3 already holds as it is.
"""

from __future__ import annotations

import base64
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..settings import BackendSettings

MIB = 1024 * 1024
MAX_PARTS = 10_000
MAX_COPY_BYTES = 5 * 1024 * MIB  # one CopyObject's limit: what can be verified server-side
URL_TTL_S = 3600
MAX_ATTEMPTS = 5  # botocore's tries of one call (its "standard" mode: jittered, doubling, about 15 s at most)
_TRANSIENT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "Throttling"})


class S3BlobError(ValueError):
    """An upload S3 holds that cannot be finished: missing, the wrong size, or not hashing to its name."""


def part_bytes_from_env() -> int:
    """AIBRO_S3_PART_BYTES (default 64 MiB): data over it goes as a multipart upload of parts this size."""
    return BackendSettings.from_env().s3_part_bytes


def b64_sha(sha: str) -> str:
    """A hex sha256 as S3's ChecksumSHA256 (base64 of the 32 bytes)."""
    return base64.b64encode(bytes.fromhex(sha)).decode()


class S3Backing:
    """Presigned URLs and the few calls the backend itself makes on the bucket, under one key prefix."""

    def __init__(self, session: Any, bucket: str, prefix: str, region: str, part_bytes: int | None = None) -> None:
        from botocore.config import Config

        retries = {"mode": "standard", "max_attempts": MAX_ATTEMPTS}
        self.s3 = session.client("s3", region_name=region, config=Config(signature_version="s3v4", retries=retries))
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.part_bytes = part_bytes or part_bytes_from_env()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="aibro-s3")

    # -- keys -------------------------------------------------------------------------------------
    def blob_key(self, sha: str) -> str:
        return f"{self.prefix}blobs/{sha}"

    def upload_key(self, user_id: int, upload_id: str) -> str:
        """The key of one upload of one user (an id the client picked): theirs until published."""
        return f"{self.prefix}uploads/{user_id}/new-{upload_id}"

    def artifact_key(self, job_id: str, name: str) -> str:
        return f"{self.prefix}jobs/{job_id}/{name}"

    # -- presigning (local signing, no network) ---------------------------------------------------------
    def get_url(self, key: str) -> str:
        return self._sign("get_object", Key=key)

    def _sign(self, op: str, **params: Any) -> str:
        return self.s3.generate_presigned_url(op, Params={"Bucket": self.bucket, **params}, ExpiresIn=URL_TTL_S)

    # -- blocking calls (run them in `pool`) --------------------------------------------------------------
    def size(self, key: str) -> int | None:
        """The object's size, None when there is none (HEAD on the key)."""
        try:
            return int(self.s3.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        except self.s3.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise

    def plan_upload(self, key: str, size: int, sha: str | None) -> dict[str, Any]:
        """Where to PUT `size` bytes: one presigned PUT (signed with the sha when known, so S3 checks it), or a
        multipart upload with a URL per part of `part_bytes`. The answer the client and worker follow as is."""
        if size <= self.part_bytes:
            params: dict[str, Any] = {"Key": key, "ContentLength": size}  # signed: S3 takes no other length
            headers: dict[str, str] = {}
            if sha:
                params["ChecksumSHA256"] = headers["x-amz-checksum-sha256"] = b64_sha(sha)
            part = {"number": 0, "offset": 0, "size": size, "url": self._sign("put_object", **params)}
            return {"via": "s3", "upload_id": None, "parts": [{**part, "headers": headers}]}
        count = -(-size // self.part_bytes)
        if count > MAX_PARTS:
            raise S3BlobError(f"{size} bytes need {count} parts of {self.part_bytes}: raise AIBRO_S3_PART_BYTES")
        upload_id = self.s3.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        parts = []
        for n in range(count):
            offset = n * self.part_bytes
            length = min(self.part_bytes, size - offset)
            url = self._sign("upload_part", Key=key, UploadId=upload_id, PartNumber=n + 1, ContentLength=length)
            parts.append({"number": n + 1, "offset": offset, "size": length, "url": url, "headers": {}})
        return {"via": "s3", "upload_id": upload_id, "parts": parts}

    def complete(self, key: str, upload_id: str | None, etags: list[dict[str, Any]]) -> int:
        """Finish a multipart upload from the parts' ETags (nothing to do for a single PUT); returns its size."""
        if upload_id:
            parts = [{"PartNumber": int(p["number"]), "ETag": str(p["etag"])} for p in etags]
            try:
                self.s3.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
                )
            except self.s3.exceptions.ClientError as exc:
                if transient(exc):
                    raise  # the parts stay: the client finishes again once S3 answers
                if _code(exc) != "NoSuchUpload" or self.size(key) is None:
                    self.abort(key, upload_id)
                    raise S3BlobError(f"S3 could not complete the upload ({_code(exc)}): upload it again") from None
                # NoSuchUpload with the object there: an earlier finish completed it and its answer was lost
        size = self.size(key)
        if size is None:
            raise S3BlobError("nothing was uploaded to the URL(s) given: PUT the bytes there first, then finish")
        return size

    def copy_verified(self, source: str, dest: str, size: int) -> str:
        """Copy `source` to `dest` asking S3 for the SHA-256 of what it wrote (a full-object checksum, whatever
        the parts were): the digest of exactly the bytes `dest` now holds, however `source` changes meanwhile."""
        if size > MAX_COPY_BYTES:
            raise S3BlobError(f"{size} bytes is over the 5 GB S3 can verify in one copy: split the data")
        try:
            answer = self.s3.copy_object(
                Bucket=self.bucket,
                Key=dest,
                CopySource={"Bucket": self.bucket, "Key": source},
                ChecksumAlgorithm="SHA256",
                MetadataDirective="REPLACE",
                ContentType="application/octet-stream",
            )
        except self.s3.exceptions.ClientError as exc:
            if _code(exc) in ("404", "NoSuchKey", "NotFound"):  # another finish of the same upload took it first
                raise S3BlobError("nothing is staged to finish (finished already?): upload it again") from None
            raise
        got = answer.get("CopyObjectResult", {}).get("ChecksumSHA256")
        if not got:
            raise S3BlobError("S3 returned no SHA-256 for the uploaded object: cannot verify it")
        return base64.b64decode(got).hex()

    def stored_sha(self, key: str) -> str | None:
        """The SHA-256 S3 keeps with the object (written by copy_verified), or None when it has none or no object."""
        try:
            head = self.s3.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
        except self.s3.exceptions.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise
        got = head.get("ChecksumSHA256")
        return base64.b64decode(got).hex() if got else None

    def verified_size(self, sha: str) -> int | None:
        """The size of `blobs/<sha>` when S3's own checksum of it is `sha`; otherwise None, after moving whatever is
        there to `quarantine/` (kept for whoever looks into it), so the next upload of the real bytes replaces it."""
        key = self.blob_key(sha)
        size = self.size(key)
        if size is None:
            return None
        if self.stored_sha(key) == sha:
            return size
        hold = f"{self.prefix}quarantine/{sha}-{uuid.uuid4().hex[:8]}"
        self.s3.copy_object(Bucket=self.bucket, Key=hold, CopySource={"Bucket": self.bucket, "Key": key})
        self.s3.delete_object(Bucket=self.bucket, Key=key)
        return None

    def verify_key(self) -> str:
        """A fresh key for `publish`'s frozen copy, which no URL is ever given for."""
        return f"{self.prefix}verify/{uuid.uuid4().hex}"

    def publish(self, source: str, sha: str, frozen: str | None = None) -> int:
        """Make `blobs/<sha>` hold `source`'s bytes, proven to hash to `sha`; returns their size. The bytes are first
        copied to a key no URL was ever given for (`frozen`, default a fresh `verify_key`) and hashed there by S3,
        and `blobs/<sha>` is written only from that copy: an upload racing into `source` cannot change what was
        verified. `source` stays (its user's jobs may be reading it); the frozen copy goes. Raises S3BlobError when
        the digest is not `sha`."""
        frozen = frozen or self.verify_key()
        try:
            size = self.size(source)
            if size is None:
                raise S3BlobError("nothing was uploaded to the URL(s) given: PUT the bytes there first, then finish")
            digest = self.copy_verified(source, frozen, size)
            if digest != sha:
                raise S3BlobError(f"upload digest {digest} does not match the name {sha}: upload it again")
            if self.verified_size(sha) is None:
                written = self.copy_verified(frozen, self.blob_key(sha), size)
                if written != sha:  # S3 copied other bytes than it verified: never leave them under the name
                    self.s3.delete_object(Bucket=self.bucket, Key=self.blob_key(sha))
                    raise S3BlobError(f"S3 stored digest {written} under {sha}: upload it again")
        finally:
            self.s3.delete_object(Bucket=self.bucket, Key=frozen)
        return size

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=key)

    def abort(self, key: str, upload_id: str) -> None:
        """End a multipart upload and free its parts; one S3 no longer holds is fine, S3 failing for now is not."""
        try:
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except self.s3.exceptions.ClientError as exc:
            if transient(exc):
                raise

    def close(self) -> None:
        self.pool.shutdown(wait=False)


def transient(exc: BaseException) -> bool:
    """Whether an S3 call failed for now (5xx, SlowDown, throttling, a connection dropped or timed out) rather than
    for good (a refusal, a missing key): worth trying again in a moment."""
    from botocore.exceptions import ClientError, HTTPClientError
    from botocore.exceptions import ConnectionError as BotoConnectionError

    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return int(status) >= 500 or _code(exc) in _TRANSIENT_CODES
    return False


def _code(exc: Exception) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code") or exc)
