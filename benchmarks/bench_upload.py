"""Upload speed: arrays to the embedded backend vs np.save + fsync to the same disk, side by side in one run.

Issue 14 item 2. A fresh embedded backend in a temporary AIBRO_HOME (the disk its blobs land on); the same
1 GiB float32 array (a numpy array and a memmap of it) is
  * written with `np.save` + fsync into that home (the disk's yardstick),
  * hashed alone (SHA-256 over the array's buffer: the ceiling of any upload that must name its bytes),
  * uploaded through `BackendClient.upload_array` (what `Training.submit` does for every array), first time,
  * uploaded again (the resubmit: deciding "already there"): the writable array by its xxh3-128 fingerprint, the
    read-only memmap by its file's identity (aibro_jupyter/hashcache.py).
Client memory overhead is the peak anonymous RSS during the upload minus the one before (the array is resident
already; a memmap's pages are page cache, not counted).

`--s3`: the same against a backend that keeps bytes in S3 (moto's server, the tests' AWS account): the first upload
goes in parts, in parallel, to S3, hashed on a thread as they go; its ceilings are one SHA-256 pass and the S3
endpoint alone (boto3's own parallel multipart upload of the same bytes, the same part size and threads). The
backend's proof of the upload (S3 hashing a copy, before other users share it) runs after it; the seconds until
it is done are printed below the ratio.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import contextlib
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from aibro_jupyter import config
from aibro_jupyter.blobsource import CHUNK, ArraySource
from aibro_jupyter.client import BackendClient

UPLOAD_TARGET = 0.8  # × the ceiling: the slower of np.save+fsync and one SHA-256 pass
RESUBMIT_TARGET = 0.05  # × the first upload's time


def say(msg: str = "") -> None:
    print(msg, flush=True)


def anon_kib() -> int:
    """Anonymous resident memory (RssAnon): what the upload allocates. A memmap's pages, read to send them, are
    file-backed page cache (RssFile), the kernel's to drop, so they are not counted."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return 0


class PeakAnon:
    """Samples RssAnon every 2 ms on a thread while the block runs; `extra_mib` is the peak over the start."""

    def __enter__(self) -> PeakAnon:
        self.start = self.peak = anon_kib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, anon_kib())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_kib())

    @property
    def extra_mib(self) -> float:
        return max(0, self.peak - self.start) / 1024


def save_fsync(arr: np.ndarray, path: Path) -> float:
    t = time.perf_counter()
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t


def hash_alone(arr: np.ndarray) -> float:
    t = time.perf_counter()
    ArraySource(arr).sha256()
    return time.perf_counter() - t


def upload(client: BackendClient, arr: np.ndarray) -> tuple[float, int, float]:
    """(seconds, bytes sent, peak extra anonymous memory MiB) of one upload of `arr`."""
    with PeakAnon() as mem:
        t = time.perf_counter()
        _sha, sent = client.upload_array(arr)
        took = time.perf_counter() - t
    return took, sent, mem.extra_mib


def first_and_again(client: BackendClient, arr: np.ndarray, prefix: str, add: Callable[[str, float], None]) -> None:
    """The first upload of `arr` (its time and extra memory) and its resubmit (time and bytes sent)."""
    took, sent, extra = upload(client, arr)
    assert sent >= arr.nbytes, f"the first upload sent {sent} bytes"
    add(prefix + "first", took)
    add(prefix + "first_mib", extra)
    took, sent, _ = upload(client, arr)
    add(prefix + "again", took)
    add(prefix + "again_sent", sent)


def s3_alone(s3: object, bucket: str, arr: np.ndarray, key: str) -> float:
    """boto3's multipart upload of the array's bytes to the same endpoint: what S3 (here moto) itself takes."""
    import io

    from boto3.s3.transfer import TransferConfig

    from aibro_core.presigned import PARALLEL_PARTS

    part = 64 << 20
    data = io.BytesIO(memoryview(arr.reshape(-1).view(np.uint8)))
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=PARALLEL_PARTS)
    t = time.perf_counter()
    s3.upload_fileobj(data, bucket, key, Config=config)  # type: ignore[attr-defined]
    return time.perf_counter() - t


def shared_after(s3: object, bucket: str, sha: str) -> float:
    """Seconds from now until the backend's background proof of the upload (storage/claims.py) has written
    `blobs/<sha>` with S3's checksum: off the upload's path, printed so that its cost is seen."""
    t = time.perf_counter()
    while True:
        try:
            head = s3.head_object(Bucket=bucket, Key=f"jobs/blobs/{sha}", ChecksumMode="ENABLED")  # type: ignore[attr-defined]
            if head.get("ChecksumSHA256"):
                return time.perf_counter() - t
        except s3.exceptions.ClientError:  # type: ignore[attr-defined]
            pass
        time.sleep(0.05)


def run_s3(args: argparse.Namespace, n: int, rows: dict[str, list[float]]) -> None:
    """Rounds against a backend with the AWS provider (bytes in moto's S3)."""

    def add(key: str, value: float) -> None:
        rows.setdefault(key, []).append(value)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from aws_moto import make_account, moto_server, write_config
    from backend_proc import own_backend

    root = Path(tempfile.mkdtemp(prefix="aibro-bench-s3-"))
    try:
        with moto_server() as env:
            account = make_account()
            config = write_config(root / "aws.toml", account)
            with own_backend(root / "home", "--provider", "aws", "--aws-config", str(config), **env) as b:
                client, s3 = b.client(), account["session"].client("s3")
                for rnd in range(args.rounds):
                    arr = np.random.default_rng(2 * rnd).random(n, dtype=np.float32)
                    add("hash", hash_alone(arr))
                    add("s3", s3_alone(s3, account["bucket"], arr, f"bench/alone-{rnd}"))
                    first_and_again(client, arr, "", add)
                    add("shared", shared_after(s3, account["bucket"], ArraySource(arr).sha256()))
                    say(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def s3_table(rows: dict[str, list[float]], size: int) -> list[tuple[str, str, str, bool | None]]:
    best = {k: min(v) for k, v in rows.items()}
    gbs = {k: size / best[k] / 1e9 for k in ("hash", "s3", "first")}
    return [
        ("SHA-256 pass alone GB/s (the hash)", f"{gbs['hash']:.2f}", "-", None),
        ("S3 endpoint alone GB/s (boto3 multipart)", f"{gbs['s3']:.2f}", "-", None),
        ("first upload GB/s, numpy array, to S3", f"{gbs['first']:.2f}", "-", None),
        ratio_row(gbs["first"] / min(gbs["hash"], gbs["s3"]), UPLOAD_TARGET, at_least=True),
        ("  then shared (S3 proves it, background) s later", f"{max(rows['shared']):.1f}", "-", None),
        ("resubmit s, numpy array (bytes sent)", f"{best['again']:.3f} ({max(rows['again_sent']):.0f})", "-", None),
        ratio_row(best["again"] / best["first"], RESUBMIT_TARGET, at_least=False),
    ]


def ratio_row(value: float, target: float, at_least: bool) -> tuple[str, str, str, bool]:
    ok = value >= target if at_least else value <= target
    return (
        "  / the ceiling (the slower of the two above it)" if at_least else "  / first upload",
        f"{value:.3f}",
        f"{'>=' if at_least else '<='} {target}",
        ok,
    )


def print_table(table: list[tuple[str, str, str, bool | None]]) -> None:
    w = max(len(r[0]) for r in table)
    say()
    say(f"{'metric':<{w}} | {'value':>14} | {'target':<16} | ok")
    say("-" * (w + 40))
    for metric, value, tgt, ok in table:
        mark = "-" if ok is None else ("yes" if ok else "NO")
        say(f"{metric:<{w}} | {value:>14} | {tgt:<16} | {mark}")


# Issue 36 item 5: how the backend reads an upload's body. "into": server/bodyinto.py reads it from the socket into
# the writer's buffers (a replacement of tornado's private HTTP1Connection._read_fixed_body); "public": tornado's
# own reader hands it to the handler's `data_received` (`@stream_request_body`, public API) and the writer copies it.
READERS = {
    "into": "",
    "public": "from aibro_backend.server import bodyinto\nbodyinto.install = lambda conn: None\n",
}


def run_readers(args: argparse.Namespace, n: int, rows: dict[str, list[float]]) -> None:
    """Rounds against one backend per reader, side by side: each round, for each backend in turn, writes the disk's
    yardstick (a new array's np.save + fsync), then uploads another new array and that file as a memmap, twice
    each, counting the backend's CPU seconds (2 GiB received per GiB of array: the array and the memmap)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from backend_proc import own_backend

    root = Path(tempfile.mkdtemp(prefix="aibro-bench-readers-"))
    try:
        with contextlib.ExitStack() as stack:
            backends = {}
            for name in args.readers:
                site = root / f"site-{name}"
                site.mkdir()
                (site / "sitecustomize.py").write_text(READERS[name])
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
                backends[name] = stack.enter_context(own_backend(root / f"home-{name}", **env))

            def add(key: str, value: float) -> None:
                rows.setdefault(key, []).append(value)

            for rnd in range(args.rounds):
                for i, (name, backend) in enumerate(backends.items()):
                    client = backend.client()
                    seed = 10 * rnd + 2 * i
                    mm_path = root / f"mm-{rnd}-{name}.npy"  # each its own file: the client knows a file it sent
                    add("save", save_fsync(np.random.default_rng(seed + 1).random(n, dtype=np.float32), mm_path))
                    arr = np.random.default_rng(seed).random(n, dtype=np.float32)
                    cpu = backend.cpu_s()
                    first_and_again(client, arr, f"{name}_", add)
                    del arr
                    mm = np.load(mm_path, mmap_mode="r")
                    first_and_again(client, mm, f"{name}_mm_", add)
                    del mm
                    add(f"{name}_cpu", backend.cpu_s() - cpu)
                    mm_path.unlink()
                say(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


Row = tuple[str, str, str, bool | None]


def readers_table(rows: dict[str, list[float]], size: int, readers: list[str]) -> list[Row]:
    best = {k: min(v) for k, v in rows.items()}
    disk = size / best["save"] / 1e9
    table: list[Row] = [("np.save + fsync GB/s (the disk)", f"{disk:.2f}", "-", None)]
    for name in readers:
        for kind, key in (("numpy array", f"{name}_first"), ("memmap", f"{name}_mm_first")):
            gbs = size / best[key] / 1e9
            table.append((f"{name}: first upload GB/s, {kind}", f"{gbs:.2f}", "-", None))
            table.append(("  / the disk", f"{gbs / disk:.3f}", f">= {UPLOAD_TARGET}", gbs / disk >= UPLOAD_TARGET))
        cpu = min(rows[f"{name}_cpu"]) / (2 * size / (1 << 30))
        table.append((f"{name}: backend CPU s per GiB received", f"{cpu:.2f}", "-", None))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="array size in GiB (default 1)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; each number is the best round (default 3)")
    parser.add_argument("--keep", action="store_true", help="keep the benchmark's AIBRO_HOME")
    parser.add_argument("--s3", action="store_true", help="to a backend that keeps bytes in S3 (moto)")
    parser.add_argument(
        "--readers",
        type=lambda text: text.split(","),
        help=f"compare the backend's body readers side by side, e.g. {','.join(READERS)}",
    )
    args = parser.parse_args(argv)
    if args.readers:
        n = int(args.gib * (1 << 30)) // 4
        say(f"aibro upload benchmark, body readers {args.readers}: {n * 4 / (1 << 30):.2f} GiB, {args.rounds} rounds")
        started = time.perf_counter()
        rows = {}
        run_readers(args, n, rows)
        print_table(readers_table(rows, n * 4, args.readers))
        say(f"\nbest of {args.rounds} rounds; total {time.perf_counter() - started:.0f} s")
        return 0
    if args.s3:
        n = int(args.gib * (1 << 30)) // 4
        say(f"aibro upload benchmark to S3 (moto): {n * 4 / (1 << 30):.2f} GiB float32, {args.rounds} rounds")
        started = time.perf_counter()
        rows: dict[str, list[float]] = {}
        run_s3(args, n, rows)
        print_table(s3_table(rows, n * 4))
        say(f"\nbest of {args.rounds} rounds; total {time.perf_counter() - started:.0f} s")
        return 0

    home = Path(tempfile.mkdtemp(prefix="aibro-bench-upload-"))
    for var in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN"):
        os.environ.pop(var, None)
    os.environ.update(AIBRO_HOME=str(home), AIBRO_SPARE_WORKER="0")
    n = int(args.gib * (1 << 30)) // 4
    say(
        f"aibro upload benchmark: {n * 4 / (1 << 30):.2f} GiB float32, {args.rounds} rounds, AIBRO_HOME={home}, "
        f"{os.cpu_count()} CPUs, chunk {CHUNK >> 20} MiB"
    )
    started = time.perf_counter()
    try:
        target = config.resolve()
        client = BackendClient(target.url, target.token)
        client.health()
        rows: dict[str, list[float]] = {}

        def add(key: str, value: float) -> None:
            rows.setdefault(key, []).append(value)

        for rnd in range(args.rounds):
            arr = np.random.default_rng(2 * rnd).random(n, dtype=np.float32)
            mm_path = home / f"mm-{rnd}.npy"
            add("save", save_fsync(np.random.default_rng(2 * rnd + 1).random(n, dtype=np.float32), mm_path))
            add("hash", hash_alone(arr))
            first_and_again(client, arr, "", add)
            del arr
            mm = np.load(mm_path, mmap_mode="r")
            first_and_again(client, mm, "mm_", add)
            del mm
            mm_path.unlink()
            say(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in rows.items()))
    finally:
        config.stop_embedded()
        if args.keep:
            say(f"kept {home}")
        else:
            shutil.rmtree(home, ignore_errors=True)
    size = n * 4
    best = {k: min(v) for k, v in rows.items()}
    gbs = {k: size / best[k] / 1e9 for k in ("save", "hash", "first", "mm_first")}
    ceiling = min(gbs["save"], gbs["hash"])
    table = [
        ("np.save + fsync GB/s (the disk)", f"{gbs['save']:.2f}", "-", None),
        ("SHA-256 pass alone GB/s (the hash)", f"{gbs['hash']:.2f}", "-", None),
        ("first upload GB/s, numpy array", f"{gbs['first']:.2f}", "-", None),
        ratio_row(gbs["first"] / ceiling, UPLOAD_TARGET, at_least=True),
        ("first upload GB/s, memmap", f"{gbs['mm_first']:.2f}", "-", None),
        ratio_row(gbs["mm_first"] / ceiling, UPLOAD_TARGET, at_least=True),
        (
            "client peak extra memory MiB (RssAnon), array / memmap",
            f"{max(rows['first_mib']):.0f} / {max(rows['mm_first_mib']):.0f}",
            f"<= {CHUNK >> 20} (a chunk)",
            max(rows["first_mib"] + rows["mm_first_mib"]) <= CHUNK >> 20,
        ),
        ("resubmit s, numpy array (bytes sent)", f"{best['again']:.3f} ({max(rows['again_sent']):.0f})", "-", None),
        ratio_row(best["again"] / best["first"], RESUBMIT_TARGET, at_least=False),
        ("resubmit s, memmap (bytes sent)", f"{best['mm_again']:.3f} ({max(rows['mm_again_sent']):.0f})", "-", None),
        ratio_row(best["mm_again"] / best["mm_first"], RESUBMIT_TARGET, at_least=False),
    ]
    print_table(table)
    say(f"\nbest of {args.rounds} rounds; total {time.perf_counter() - started:.0f} s")
    say("first upload: new data, sent once with no client-side hash (the backend names it); resubmit: 0 bytes sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
