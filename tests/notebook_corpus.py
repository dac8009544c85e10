"""Run a notebook twice in real kernels, once locally and once with its one designated `.fit(...)` (or
`tuner.search(...)`) under `%%cloud_fit` / `%%cloud_tune`, and say whether the remote run trains like the local one.

Used by benchmarks/keras_io_corpus.py (keras-io's examples with stand-in data) and tests/test_notebook_corpus.py
(our own notebooks of the same shapes). What is compared is what a user would check: the History's keys and number
of epochs, the final loss, that the very object the fit was called on holds the trained weights afterwards, and that
nothing the backend stored is a pickle. Observation is by probe cells run between the notebook's own cells, and by
wrapping `keras.Model.fit` (local run) or `Training.submit` (remote run) to note which object was trained and its
weights when training began; the notebook's own cells run as written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kernel_helpers import CellResult  # noqa: E402

MARK = "__CORPUS__"
CELL_TIMEOUT = 900.0
# Two final losses are "the same" within this relative difference. A seeded notebook fitting arrays gets the same
# History remotely (README, Seeds); what may move it is documented: a tf.data pipeline that shuffles or augments is
# drawn once in the kernel (remote epochs see that one pass), and multi-threaded CPU reductions may sum in another
# order. After one or two short epochs on small stand-in data those move the loss by well under 5 %; a remote fit that
# trained a different model, lost the optimizer state or the data is off by far more.
LOSS_RTOL = 0.05
LOSS_ATOL = 1e-4  # losses this close are both numerically zero for these tasks, whatever their ratio

TRAINS = "trains like local"
DIFFERS = "trains, differs"
REFUSED = "refused before upload"
FAILS = "fails after upload"
LOCAL_FAILS = "local fails"


class CorpusError(Exception):
    """A recipe or notebook that does not fit its original (a substitution's text not found, no designated call)."""


@dataclass
class Notebook:
    """A notebook as cells, with the one call that runs remotely named by a snippet of its text."""

    name: str
    cells: list[str]
    call: str  # e.g. "vae.fit(" or "tuner.search(": the first cell holding it gets the magic
    kind: str = "fit"  # "fit" (%%cloud_fit) or "tune" (%%cloud_tune)
    flags: str = ""  # more magic flags, e.g. "--unsafe"
    setup: str = ""  # code run in the set-up cell, after the seed and before the notebook's first cell
    files: dict[str, bytes] = field(default_factory=dict)  # written into the kernel's folder before it starts
    nth: int = 0  # the designated call is in the nth cell (from 0) holding `call`

    def call_cell(self) -> int:
        holding = [i for i, cell in enumerate(self.cells) if self.call in cell]
        if len(holding) <= self.nth:
            raise CorpusError(f"{self.name}: fewer than {self.nth + 1} cells hold the designated call {self.call!r}")
        return holding[self.nth]

    def receiver(self) -> str:
        """The expression the designated call is made on (`vae` in `vae.fit(`)."""
        m = re.search(r"([A-Za-z_][\w.]*)\.(fit|search)\(", self.call.strip())
        if not m:
            raise CorpusError(f"{self.name}: the designated call {self.call!r} is not `NAME.fit(` / `NAME.search(`")
        return m.group(1)


# -- notebooks from files ------------------------------------------------------------------------------------------


def split_keras_io(text: str) -> list[str]:
    """keras-io's .py format: code alternates with top-level `\"\"\"` markdown blocks; each code block is a cell."""
    cells: list[str] = []
    code: list[str] = []
    in_md = False
    for line in text.splitlines():
        if in_md:
            if '"""' in line:
                in_md = False
            continue
        if line.startswith('"""') or line.startswith('r"""'):
            rest = line.split('"""', 1)[1]
            in_md = '"""' not in rest
            if "".join(code).strip():
                cells.append("\n".join(code).strip("\n"))
            code = []
            continue
        code.append(line)
    if "".join(code).strip():
        cells.append("\n".join(code).strip("\n"))
    return cells


def split_percent(text: str) -> list[str]:
    """Our own notebooks: cells separated by `# %%` lines (the first line of each may say more after it)."""
    cells: list[str] = []
    cur: list[str] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            if "".join(cur).strip():
                cells.append("\n".join(cur).strip("\n"))
            cur = []
            continue
        cur.append(line)
    if "".join(cur).strip():
        cells.append("\n".join(cur).strip("\n"))
    return cells


def load_notebook(path: Path, extra_flags: str = "") -> Notebook:
    """One of our own notebooks (tests/notebooks/*.py): `# key: value` header lines (mirrors, call, kind, flags)
    before the first `# %%`, then the cells."""
    text = path.read_text()
    header: dict[str, str] = {}
    for line in text.split("# %%", 1)[0].splitlines():
        m = re.match(r"#\s*(\w+):\s*(.*)$", line)
        if m:
            header[m.group(1)] = m.group(2).strip()
    if "call" not in header:
        raise CorpusError(f"{path.name}: no '# call: NAME.fit(' header line")
    return Notebook(
        name=path.stem,
        cells=split_percent(text.split("# %%", 1)[1] if "# %%" in text else text),
        call=header["call"],
        kind=header.get("kind", "fit"),
        flags=f"{header.get('flags', '')} {extra_flags}".strip(),
    )


def substitute(text: str, subs: Iterable[tuple[str, str]], where: str = "") -> str:
    """Apply exact-string substitutions in order; one whose old text is not there fails loudly (the original moved)."""
    for old, new in subs:
        if old not in text:
            raise CorpusError(f"{where}: substitution text not found: {old[:120]!r}")
        text = text.replace(old, new)
    return text


def drop_cells(cells: list[str], drop: Iterable[str] = (), stop_after: str | None = None) -> list[str]:
    """Cells without those holding any `drop` snippet; with `stop_after`, none after the cell holding it."""
    drop = list(drop)
    out = []
    for cell in cells:
        if any(d in cell for d in drop):
            continue
        out.append(cell)
        if stop_after is not None and stop_after in cell:
            break
    else:
        if stop_after is not None:
            raise CorpusError(f"no cell holds {stop_after!r}")
    missing = [d for d in drop if not any(d in c for c in cells)]
    if missing:
        raise CorpusError(f"no cell holds {missing[0]!r} (to drop)")
    return out


# -- probes (run in the kernel) --------------------------------------------------------------------------------------


def setup_cell(extra: str = "") -> str:
    """The first cell of every run: quiet TensorFlow, one seed so both runs start from the same weights, the magics,
    and the hooks that note which object a fit trained."""
    return f"""
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["MPLBACKEND"] = "Agg"
import keras
keras.utils.set_random_seed(1234)
%load_ext aibro_jupyter
{PROBE_DEFS}
{extra}
"""


PROBE_DEFS = r"""
def __corpus_defs():
    import functools, hashlib, json
    import numpy as np
    import keras

    state = {"fits": [], "hist_ids": set()}

    def digest(m):
        h = hashlib.sha256()
        for w in m.weights:
            h.update(np.ascontiguousarray(np.asarray(w)).tobytes())
        return h.hexdigest()[:16], len(m.weights)

    def note(m):
        try:
            d, n = digest(m)
        except Exception as exc:  # a model that cannot be read yet: say so
            d, n = f"unreadable: {exc}", -1
        state["fits"].append({"id": id(m), "digest": d, "n_weights": n})

    orig_fit = keras.Model.fit

    @functools.wraps(orig_fit)
    def fit(self, *a, **k):
        note(self)
        return orig_fit(self, *a, **k)

    def hook(mode):
        if mode == "local":
            keras.Model.fit = fit
        else:
            from aibro_jupyter.training import Training
            orig_submit = Training.submit

            @functools.wraps(orig_submit)
            def submit(self, request, *a, **k):
                note(request.model)
                return orig_submit(self, request, *a, **k)

            Training.submit = submit

    def before(ns):
        state["fits"].clear()
        state["hist_ids"] = {id(v) for v in list(ns.values()) if isinstance(v, keras.callbacks.History)}
        state["ns_names"] = set(ns)

    def after_fit(ns, receiver, weights_path):
        out = {"fits": list(state["fits"])}
        try:
            m = eval(receiver, ns)
        except Exception as exc:
            out["receiver_error"] = f"{type(exc).__name__}: {exc}"
            print("__CORPUS__" + json.dumps(out))
            return
        out["model_id"] = id(m)
        try:
            out["digest"], out["n_weights"] = digest(m)
            np.savez(weights_path, *[np.asarray(w) for w in m.weights])
        except Exception as exc:
            out["digest"] = f"unreadable: {type(exc).__name__}: {exc}"
        hist, src = None, None
        for name, v in list(ns.items()):
            if isinstance(v, keras.callbacks.History) and id(v) not in state["hist_ids"] and not name.startswith("_"):
                hist, src = v, name
        last = ns.get("_")
        if hist is None and isinstance(last, keras.callbacks.History) and id(last) not in state["hist_ids"]:
            hist, src = last, "the cell's value"
        mh = getattr(m, "history", None)
        out["model_history_set"] = isinstance(mh, keras.callbacks.History) and id(mh) not in state["hist_ids"]
        if hist is None and out["model_history_set"]:
            hist, src = mh, f"{receiver}.history"
        if hist is not None:
            h = {k: [float(x) for x in np.ravel(np.asarray(v, dtype="float64"))[-1:]] for k, v in hist.history.items()}
            out["history"] = {"source": src, "keys": sorted(hist.history), "epochs": len(hist.epoch),
                              "last": {k: v[0] if v else None for k, v in h.items()}}
        print("__CORPUS__" + json.dumps(out))

    def after_tune(ns, receiver):
        out = {}
        try:
            t = eval(receiver, ns)
            trials = list(t.oracle.trials.values())
            done = [tr for tr in trials if str(tr.status).upper().endswith("COMPLETED")]
            best = t.oracle.get_best_trials(1)
            out["trials"] = len(trials)
            out["completed"] = len(done)
            out["statuses"] = sorted({str(tr.status) for tr in trials})
            out["objective"] = getattr(t.oracle.objective, "name", str(t.oracle.objective))
            out["hp_names"] = sorted(hp.name for hp in t.oracle.hyperparameters.space)
            out["best_score"] = float(best[0].score) if best and best[0].score is not None else None
        except Exception as exc:
            out["tuner_error"] = f"{type(exc).__name__}: {exc}"
        print("__CORPUS__" + json.dumps(out))

    return hook, before, after_fit, after_tune


__corpus_hook, __corpus_before, __corpus_after_fit, __corpus_after_tune = __corpus_defs()
"""


# -- one run -------------------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    mode: str  # "local" or "remote"
    ok: bool = True
    error_cell: int | None = None  # the notebook cell (0-based) that failed first
    error: str = ""
    call_cell: int = -1
    call_error: str = ""  # the designated cell's error, if any
    call_output: str = ""  # the designated cell's output (tail)
    after_errors: list[str] = field(default_factory=list)  # errors of cells after the designated one
    probe: dict[str, Any] = field(default_factory=dict)
    jobs: list[dict[str, Any]] = field(default_factory=list)  # the backend's jobs after the run (remote)
    blobs: list[str] = field(default_factory=list)  # what each blob the backend stored is
    blob_findings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    call_seconds: float = 0.0
    weights: str = ""  # the .npz of the receiver's weights after the designated call


def _first_line(text: str) -> str:
    """An error as one line: its name and the start of its message (a message may begin with a line break)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    return re.sub(r"\s+", " ", text).strip()[:300]


def _probe(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    return {}


def magic_line(nb: Notebook) -> str:
    if nb.kind == "tune":
        return f"%%cloud_tune --machine local-cpu --quiet {nb.flags}".rstrip()
    return f"%%cloud_fit --machine local-cpu --quiet {nb.flags}".rstrip()


def kernel_env(home: Path) -> dict[str, str]:
    env = {
        "AIBRO_HOME": str(home),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
        "MPLBACKEND": "Agg",
        "AIBRO_SPARE_WORKER": "0",  # one TensorFlow process fewer on a small box
        "PYTHONHASHSEED": "0",
    }
    return env


def run_cell(kc: Any, code: str, timeout: float = CELL_TIMEOUT) -> CellResult:
    """Execute `code` and collect its output; an error keeps the end of its traceback (where Keras says why)."""
    import queue

    res = CellResult(msg_id=kc.execute(code))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != res.msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            res.stdout += content["text"]
        elif kind == "error" and not res.error:  # the first error is the cell's (later ones repeat it)
            res.error = f"{content['ename']}: {content['evalue']}"
            if not content["evalue"].strip():  # a bare exception: where it was raised says more
                tb = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(content.get("traceback", [])))
                res.error += " (raised at " + " | ".join(tb.strip().splitlines()[-4:]) + ")"
        elif kind == "status" and content["execution_state"] == "idle":
            res.done = True
            # a magic's refusal is a UsageError IPython prints on stderr, not an error message
            refused = re.search(r"^UsageError: (.*)$", res.stdout, re.M)
            if refused and not res.error:
                res.error = f"UsageError: {refused.group(1)}"
            return res
    raise CorpusError(f"cell did not finish in {timeout:.0f} s; output so far: {res.stdout[-1000:]} {res.error}")


def _run_or_time_out(kc: Any, code: str, timeout: float) -> CellResult:
    try:
        return run_cell(kc, code, timeout)
    except CorpusError as exc:
        return CellResult(error=f"TimeoutError: {exc}")


def start_kernel(env: dict[str, str], cwd: Path) -> tuple[Any, Any]:
    """A real kernel in `cwd`, its native chatter (TensorFlow's start-up lines) in cwd/kernel.log, not on our screen."""
    from jupyter_client.manager import KernelManager

    full = {k: v for k, v in os.environ.items() if k not in ("AIBRO_BACKEND_URL", "AIBRO_TOKEN")}
    full.update(env)
    km = KernelManager(kernel_name="python3")
    logf = open(cwd / "kernel.log", "ab")  # noqa: SIM115 - the kernel writes it for its whole life
    km.start_kernel(env=full, cwd=str(cwd), stdout=logf, stderr=subprocess.STDOUT)
    logf.close()
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=180)
    return km, kc


def run_notebook(
    nb: Notebook, mode: str, workdir: Path, home: Path, timeout: float = CELL_TIMEOUT, log: Any = None
) -> RunResult:
    """Run every cell of `nb` in a fresh kernel whose folder is `workdir`; in "remote" mode the designated call's
    cell starts with the magic. Stops at the first failing cell before the call (or the call's own)."""
    res = RunResult(mode=mode)
    workdir.mkdir(parents=True, exist_ok=True)
    for rel, data in nb.files.items():
        target = workdir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    km, kc = start_kernel(kernel_env(home), workdir)
    started = time.monotonic()
    call_at = nb.call_cell()
    res.call_cell = call_at
    res.weights = str(workdir / f"weights_{mode}.npz")
    try:
        setup = run_cell(kc, setup_cell(nb.setup) + f"\n__corpus_hook({mode!r})\n", timeout=timeout)
        if setup.error:
            res.ok, res.error_cell, res.error = False, -1, _first_line(setup.error)
            return res
        for i, cell in enumerate(nb.cells):
            if log:
                log(f"  [{mode}] cell {i + 1}/{len(nb.cells)}{' (designated)' if i == call_at else ''}")
            if i == call_at:
                run_cell(kc, "__corpus_before(globals())", timeout=60)
                code = f"{magic_line(nb)}\n{cell}" if mode == "remote" else cell
                t0 = time.monotonic()
                out = _run_or_time_out(kc, code, timeout)
                res.call_seconds = time.monotonic() - t0
                res.call_output = (out.stdout + out.error)[-4000:]
                if out.error:
                    res.ok, res.error_cell = False, i
                    res.call_error = res.error = _first_line(out.error) or _first_line(out.stdout)
                    # what the magic printed before failing (a worker's traceback) helps more than the exception
                    return res
                if nb.kind == "tune":
                    probe = run_cell(kc, f"__corpus_after_tune(globals(), {nb.receiver()!r})", timeout=120)
                else:
                    probe = run_cell(
                        kc, f"__corpus_after_fit(globals(), {nb.receiver()!r}, {res.weights!r})", timeout=120
                    )
                res.probe = _probe(probe.stdout)
                if probe.error:
                    res.probe["probe_error"] = _first_line(probe.error)
                continue
            out = _run_or_time_out(kc, cell, timeout)
            if out.error:
                if i < call_at:
                    res.ok, res.error_cell, res.error = False, i, _first_line(out.error)
                    return res
                res.after_errors.append(f"cell {i + 1}: {_first_line(out.error)}")
        return res
    finally:
        res.seconds = time.monotonic() - started
        with contextlib.suppress(Exception):
            kc.stop_channels()
        with contextlib.suppress(Exception):
            km.shutdown_kernel(now=True)


# -- the backend's side: jobs, blobs -----------------------------------------------------------------------------------


def backend_jobs(home: Path) -> list[dict[str, Any]]:
    """The jobs the run's embedded backend holds (none when it never started: nothing was uploaded)."""
    try:
        info = json.loads((home / "backend.json").read_text())
        token = json.loads((home / "credentials.json").read_text())["token"]
    except (OSError, ValueError, KeyError):
        return []
    from aibro_jupyter.client import BackendClient

    try:
        client = BackendClient(info["url"], token)
        jobs = client.jobs()
        out = []
        for j in jobs:
            full = client.job(j.job_id)
            out.append(
                {
                    "job_id": full.job_id,
                    "status": full.status,
                    "error": full.error or "",
                    "history": [r.model_dump() for r in full.history],
                }
            )
        return out
    except Exception as exc:  # a backend that went away: say so rather than guess
        return [{"job_id": "?", "status": "UNKNOWN", "error": f"cannot list jobs: {exc}"}]


KERAS_MEMBERS = {"config.json", "metadata.json", "model.weights.h5"}


def blob_kind(path: Path) -> tuple[str, str | None]:
    """What a stored blob is, and a finding when it is not one of the formats that cannot carry a pickle."""
    head = path.open("rb").read(512)
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "pickle", f"{path.name[:12]}: a pickle"
    if head.startswith(b"\x93NUMPY"):
        try:
            arr = np.load(path, allow_pickle=False, mmap_mode="r")
        except ValueError as exc:
            return "npy", f"{path.name[:12]}: .npy that needs pickle ({exc})"
        if arr.dtype.hasobject:
            return "npy", f"{path.name[:12]}: object-dtype array"
        return f"npy {arr.dtype}{list(arr.shape)}", None
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except zipfile.BadZipFile as exc:
            return "zip?", f"{path.name[:12]}: unreadable zip ({exc})"
        if "model.weights.h5" in names or "config.json" in names:
            extra = [n for n in names if n not in KERAS_MEMBERS and not n.startswith("assets/")]
            return "keras", (f"{path.name[:12]}: .keras with {extra}" if extra else None)
        odd = [n for n in names if not (n.endswith((".py", ".json", ".txt")) or n.endswith("/"))]
        return "zip of code", (f"{path.name[:12]}: code zip holds {odd[:5]}" if odd else None)
    if len(head) > 262 and head[257:262] == b"ustar" or _is_tar(path):
        with tarfile.open(path) as t:
            names = t.getnames()
        odd = [n for n in names if n.endswith((".pkl", ".pickle"))]
        return "tar (tf.data dataset)", (f"{path.name[:12]}: tar holds {odd[:5]}" if odd else None)
    try:
        json.loads(path.read_text())
        return "json", None
    except (UnicodeDecodeError, ValueError):
        pass
    return "unknown", f"{path.name[:12]}: not a .keras, .npy, JSON or dataset tar (starts {head[:16]!r})"


def _is_tar(path: Path) -> bool:
    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def blobs_of(home: Path) -> list[Path]:
    """Every file the backend stored for its users: uploaded blobs (storage/blobs.py: state/blobs/blobs/<sha>) and
    each job's artifacts (state/blobs/artifacts/<job>/...: checkpoints, the trained model, callbacks' files)."""
    root = home / "state" / "blobs"
    out = []
    for sub in ("blobs", "artifacts"):
        if (root / sub).is_dir():
            out += sorted(p for p in (root / sub).rglob("*") if p.is_file())
    return out


def check_blobs(paths: Iterable[Path]) -> tuple[list[str], list[str]]:
    """What each stored file is, and the findings: an uploaded blob must be a .keras zip of config, metadata and
    weights, a .npy without objects, JSON, a zip of code or a dataset tar; an artifact (a file a job wrote, such as
    a callback's image or TensorBoard events) may be anything but a pickle, an object array or an odd .keras."""
    kinds, findings = [], []
    for p in paths:
        kind, finding = blob_kind(p)
        if finding and "artifacts" in p.parts and kind == "unknown":
            kind, finding = f"file {p.suffix or p.name[:20]}", None
        kinds.append(kind if "artifacts" not in p.parts else f"artifact {kind}")
        if finding:
            findings.append(finding)
    return kinds, findings


def stop_backend(home: Path) -> None:
    """`aibro backend stop` for this home, then any worker left under it (nothing stays behind)."""
    env = {**os.environ, "AIBRO_HOME": str(home)}
    env.pop("AIBRO_BACKEND_URL", None)
    env.pop("AIBRO_TOKEN", None)
    aibro = Path(sys.executable).with_name("aibro")
    cmd = [str(aibro)] if aibro.exists() else [sys.executable, "-m", "aibro_jupyter.cli"]
    with contextlib.suppress(Exception):
        subprocess.run([*cmd, "backend", "stop"], env=env, capture_output=True, timeout=60)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if f"AIBRO_WORKER_DIR={home}".encode() in environ or f"AIBRO_HOME={home}\0".encode() in environ:
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)


# -- both runs and the verdict -----------------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    category: str = ""
    outcome: str = ""
    reason: str = ""
    epochs_local: int | None = None
    epochs_remote: int | None = None
    keys_local: list[str] = field(default_factory=list)
    keys_remote: list[str] = field(default_factory=list)
    loss_local: float | None = None
    loss_remote: float | None = None
    loss_rel_diff: float | None = None
    weights_max_diff: float | None = None
    same_object: bool | None = None
    trained_in_place: bool | None = None
    blobs: list[str] = field(default_factory=list)
    blob_findings: list[str] = field(default_factory=list)
    jobs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds_local: float = 0.0
    seconds_remote: float = 0.0
    local: dict[str, Any] = field(default_factory=dict)
    remote: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _loss_of(probe: dict[str, Any]) -> float | None:
    last = (probe.get("history") or {}).get("last") or {}
    if "loss" in last:
        return last["loss"]
    for k in sorted(last):
        if k.endswith("loss") and not k.startswith("val_"):
            return last[k]
    return None


def _weights_diff(a: str, b: str) -> float | None:
    try:
        with np.load(a) as wa, np.load(b) as wb:
            if len(wa.files) != len(wb.files):
                return None
            worst = 0.0
            for k in wa.files:
                x, y = wa[k], wb[k]
                if x.shape != y.shape:
                    return None
                if x.size and np.issubdtype(x.dtype, np.number):
                    worst = max(worst, float(np.max(np.abs(x.astype("float64") - y.astype("float64")))))
            return worst
    except (OSError, ValueError):
        return None


def judge(nb: Notebook, local: RunResult, remote: RunResult, category: str = "") -> Outcome:
    """Classify the pair of runs: trains like local, trains but differs, refused before upload, fails after upload,
    or local fails (the notebook itself does not run with its data: the recipe's to fix)."""
    o = Outcome(name=nb.name, category=category, seconds_local=local.seconds, seconds_remote=remote.seconds)
    o.local, o.remote = asdict(local), asdict(remote)
    o.blobs, o.blob_findings, o.jobs = remote.blobs, remote.blob_findings, remote.jobs
    if not local.ok:
        where = "set-up" if local.error_cell == -1 else f"cell {(local.error_cell or 0) + 1}"
        o.outcome, o.reason = LOCAL_FAILS, f"{where}: {local.error}"
        return o
    if local.after_errors:
        o.notes.append(f"local: {local.after_errors[0]}")
    if nb.kind == "tune":
        lp, rp = local.probe, remote.probe
        o.epochs_local, o.loss_local = lp.get("completed"), lp.get("best_score")
        o.keys_local = [lp.get("objective", "?"), *lp.get("hp_names", [])]
    else:
        lh = local.probe.get("history") or {}
        o.epochs_local, o.keys_local, o.loss_local = lh.get("epochs"), lh.get("keys", []), _loss_of(local.probe)
    if not remote.ok:
        if remote.error_cell is not None and remote.error_cell < remote.call_cell:
            o.outcome, o.reason = (
                LOCAL_FAILS,
                f"remote run, cell {remote.error_cell + 1} before the fit: {remote.error}",
            )
            return o
        uploaded = bool(remote.jobs) or bool(remote.blobs)
        failed_jobs = [j for j in remote.jobs if j.get("status") != "COMPLETED"]
        if remote.jobs:
            o.outcome = FAILS
            detail = failed_jobs[0].get("error") if failed_jobs else ""
            o.reason = f"{remote.call_error}" + (f" | job: {_first_line(str(detail))}" if detail else "")
        else:
            o.outcome = REFUSED if not uploaded or nb.kind == "fit" else FAILS
            o.reason = remote.call_error
        return o
    if nb.kind == "tune":
        rp = remote.probe
        o.epochs_remote, o.loss_remote = rp.get("completed"), rp.get("best_score")
        o.keys_remote = [rp.get("objective", "?"), *rp.get("hp_names", [])]
        problems = []
        if rp.get("tuner_error") or lp.get("tuner_error"):
            problems.append(rp.get("tuner_error") or lp.get("tuner_error"))
        if o.epochs_remote != o.epochs_local:
            problems.append(f"completed trials {o.epochs_local} local vs {o.epochs_remote} remote")
        if o.keys_remote != o.keys_local:
            problems.append(f"objective/space {o.keys_local} vs {o.keys_remote}")
    else:
        rh = remote.probe.get("history") or {}
        problems = []
        if not rh and remote.jobs:
            # a bare `model.fit(...)`: locally its History is the cell's value and model.history; remotely neither
            # is set, so compare with the job's own record of its epochs and say so
            o.notes.append(
                "no History object after the remote fit (the cell has no value and model.history is unset); "
                "keys and epochs read from the backend's job record"
            )
            rows = remote.jobs[-1].get("history") or []
            keys = sorted({k for r in rows for k in r if k != "epoch"})
            last = {k: (rows[-1].get(k) if rows else None) for k in keys}
            rh = {"source": "job record", "keys": keys, "epochs": len(rows), "last": last}
            remote.probe["history"] = rh
        o.epochs_remote, o.keys_remote, o.loss_remote = rh.get("epochs"), rh.get("keys", []), _loss_of(remote.probe)
        if not rh:
            problems.append("no History reachable after the remote fit (no variable, cell value or model.history)")
        elif o.keys_remote != o.keys_local:
            problems.append(f"History keys {o.keys_local} local vs {o.keys_remote} remote")
        if rh and o.epochs_remote != o.epochs_local:
            problems.append(f"epochs {o.epochs_local} local vs {o.epochs_remote} remote")
        fits = remote.probe.get("fits") or []
        if remote.probe.get("receiver_error"):
            problems.append(f"the model variable: {remote.probe['receiver_error']}")
        elif not fits:
            problems.append("Training.submit was not called")
        else:
            sub = fits[-1]
            o.same_object = sub["id"] == remote.probe.get("model_id")
            o.trained_in_place = o.same_object and sub["digest"] != remote.probe.get("digest")
            if not o.same_object:
                problems.append("the model variable is not the object that was submitted")
            elif not o.trained_in_place:
                problems.append("the model's weights are the same as before the fit (not trained in place)")
        if (
            local.probe.get("model_history_set")
            and not remote.probe.get("model_history_set")
            and rh.get("source") != "job record"
        ):
            o.notes.append("model.history is set after the local fit but not after the remote one")
        o.weights_max_diff = _weights_diff(local.weights, remote.weights)
    if o.loss_local is not None and o.loss_remote is not None:
        denom = max(abs(o.loss_local), abs(o.loss_remote), 1e-12)
        o.loss_rel_diff = abs(o.loss_local - o.loss_remote) / denom
        if abs(o.loss_local - o.loss_remote) > LOSS_ATOL + LOSS_RTOL * denom:
            o.notes.append(f"final loss differs by {o.loss_rel_diff:.1%} (over {LOSS_RTOL:.0%})")
    if remote.blob_findings:
        problems.append("pickled/unknown blob: " + "; ".join(remote.blob_findings[:3]))
    if remote.after_errors and not local.after_errors:
        problems.append(f"after the remote fit, {remote.after_errors[0]}")
    if problems:
        o.outcome, o.reason = DIFFERS, "; ".join(problems)
    else:
        o.outcome = TRAINS
    return o


def run_both(
    nb: Notebook,
    root: Path,
    category: str = "",
    home: Path | None = None,
    timeout: float = CELL_TIMEOUT,
    log: Any = None,
) -> Outcome:
    """Local run, then remote run, each in a fresh kernel and folder under `root`. With no `home`, each run gets an
    AIBRO_HOME of its own (its backend started on first use and stopped at the end); with one, the remote run uses
    it (a shared backend, e.g. a test module's) and only the blobs it added are judged."""
    own_home = home is None
    local_home = root / "home-local"
    local = run_notebook(nb, "local", root / "local", local_home, timeout, log)
    stop_backend(local_home)
    if not local.ok:  # the notebook itself does not run here: nothing to compare
        return judge(nb, local, RunResult(mode="remote", ok=False), category)
    remote_home = root / "home-remote" if own_home else home
    assert remote_home is not None
    before = set(blobs_of(remote_home))
    jobs_before = {j["job_id"] for j in backend_jobs(remote_home)} if not own_home else set()
    remote = RunResult(mode="remote")
    try:
        remote = run_notebook(nb, "remote", root / "remote", remote_home, timeout, log)
        remote.jobs = [j for j in backend_jobs(remote_home) if j["job_id"] not in jobs_before]
        new = [p for p in blobs_of(remote_home) if p not in before]
        remote.blobs, remote.blob_findings = check_blobs(new)
    finally:
        if own_home:
            stop_backend(remote_home)
    return judge(nb, local, remote, category)


def scratch_root(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def table(outcomes: list[Outcome]) -> str:
    """The table the benchmark prints: one row per example."""

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    head = ["example", "category", "outcome", "epochs l/r", "loss local", "loss remote", "rel diff", "s l/r"]
    rows = []
    for o in outcomes:
        rows.append(
            [
                o.name,
                o.category,
                o.outcome,
                f"{o.epochs_local if o.epochs_local is not None else '-'}/"
                f"{o.epochs_remote if o.epochs_remote is not None else '-'}",
                num(o.loss_local),
                num(o.loss_remote),
                "-" if o.loss_rel_diff is None else f"{o.loss_rel_diff:.2%}",
                f"{o.seconds_local:.0f}/{o.seconds_remote:.0f}",
            ]
        )
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    buf = io.StringIO()
    for r in [head, ["-" * w for w in widths], *rows]:
        buf.write("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    reasons = [o for o in outcomes if o.reason or o.notes]
    if reasons:
        buf.write("\n")
        for o in reasons:
            if o.reason:
                buf.write(f"{o.name}: {o.outcome}: {o.reason}\n")
            for n in o.notes:
                buf.write(f"{o.name}: note: {n}\n")
    return buf.getvalue()
