"""A kernel killed inside one blob's upload, mid-body, and the same upload tried again from a new kernel (issue 39
item 3, the fault alone): the retry succeeds and no partial upload is left on the backend, whichever way the bytes
went (named after hashing, or new data in one pass, named by the backend at the end).

A one-pass upload's id was random, so the retry began another one and the killed one's bytes stayed until the
partial-upload sweep (hours), counted against the user's quota of unfinished uploads meanwhile. Its id now comes
from the array's fingerprint (which deciding "probably new" already computed): the retry resumes it."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from backend_proc import OwnBackend, own_backend

from aibro_jupyter.blobsource import ArraySource

from helpers import user_env

MIB = 1 << 20
# The kernel: uploads the array of `seed` and `mib` MiB; with `slow`, each MiB leaves it 0.2 s apart, so the test can
# kill it mid-body. One-pass uploads start at 4 MiB here (64 MiB by default); SENT is its last line.
KERNEL = """
import sys, time
import numpy as np
from aibro_core import presigned
from aibro_jupyter import blobsource
from aibro_jupyter.client import BackendClient
blobsource.ONE_PASS_MIN = blobsource.FINGERPRINT_MIN = 4 << 20
url, token, seed, mib, slow = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "slow"
if slow:
    read = presigned.ViewBody.read
    def slowly(self, n=-1):
        time.sleep(0.2)
        return read(self, n)
    presigned.ViewBody.read = slowly
x = np.random.default_rng(seed).random(mib * (1 << 20) // 4, dtype=np.float32)
client = BackendClient(url, token)
sha, sent = client.upload_array(x)
print("SENT", sha, sent, flush=True)
"""


def _kernel(b: OwnBackend, home: Path, seed: int, mib: int, slow: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", KERNEL, b.url, b.token, str(seed), str(mib), "slow" if slow else "fast"],
        env=user_env(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _partials(b: OwnBackend) -> dict[str, int]:
    """The backend's unfinished uploads on disk: name -> bytes."""
    root = b.home / "state" / "blobs" / "partial"
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()} if root.exists() else {}


@pytest.mark.parametrize(("mib", "way"), [(3, "named"), (12, "one pass")])
def test_a_kernel_killed_mid_body_then_the_same_upload_again_leaves_no_partial(
    tmp_path: Path, mib: int, way: str
) -> None:
    seed = 40 + mib
    x = np.random.default_rng(seed).random(mib * MIB // 4, dtype=np.float32)
    source = ArraySource(x)
    with own_backend(tmp_path / "home") as b:
        first = _kernel(b, tmp_path / "kernel1", seed, mib, slow=True)
        deadline = time.monotonic() + 120
        while not any(0 < size < source.size for size in _partials(b).values()):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "no upload began"
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # mid-body: part of the array is on the backend, the rest never comes
        first.wait(timeout=30)
        held = _partials(b)
        assert held and all(size < source.size for size in held.values()), held

        again = _kernel(b, tmp_path / "kernel2", seed, mib, slow=False)
        out, err = again.communicate(timeout=300)
        assert again.returncode == 0, err[-3000:]
        _, sha, sent = out.split()[-3:]
        assert sha == hashlib.sha256(source.read(0, source.size)).hexdigest(), "the blob is the array"
        assert 0 < int(sent) <= source.size
        assert _partials(b) == {}, f"the killed upload ({way}) left a partial"
        client = b.client()
        assert client.t.request("HEAD", f"/blobs/{sha}").status_code == 200, "the user holds it"
        quota = client.health().quota
        assert quota is not None and (quota.pending_bytes, quota.pending_uploads) == (0, 0)
