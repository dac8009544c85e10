"""A job's requirements: the kernel-side check and hash (aibro_core.requirements), and the worker's cached
per-hash environments (aibro_backend.worker.envs), with real installs of small pure-Python packages from the
package index that this environment lacks (cowsay, requests-file, pyjokes)."""

from __future__ import annotations

import fcntl
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aibro_backend.worker import envs
from aibro_core.errors import ValidationError
from aibro_core.requirements import (
    MAX_REQUIREMENTS,
    check_requirements,
    parse_requirements_text,
    requirements_hash,
    runtime_versions,
    version_mismatch,
)

GOOD = {
    "cowsay==6.1": "cowsay==6.1",
    "  Cowsay ==  6.1 ": "cowsay==6.1",
    "Foo_Bar.baz": "foo-bar-baz",
    "numpy>=1.2, <2": "numpy<2,>=1.2",
    "numpy (<2,>=1.2)": "numpy<2,>=1.2",
    "requests[Socks, security]>=2.28": "requests[security,socks]>=2.28",
    "x~=1.4.2": "x~=1.4.2",
    "x==1.*": "x==1.*",
    "x!=2.0rc1": "x!=2.0rc1",
    "x==1.0+local.1": "x==1.0+local.1",
    "x>=1.0.post2.dev3": "x>=1.0.post2.dev3",
    "tomli>=1.1; python_version < '3.11'": 'tomli>=1.1; python_version < "3.11"',
    'pywin32; sys_platform == "win32" and (platform_machine=="AMD64" or os_name in "nt")': (
        'pywin32; sys_platform == "win32" and (platform_machine == "AMD64" or os_name in "nt")'
    ),
    "x; platform_system not in 'Windows Darwin'": 'x; platform_system not in "Windows Darwin"',
}

BAD = {
    "": "it is empty",
    "cowsay==latest": "'==latest' is not a version",
    "x===weird-thing": "compares text, not versions",
    "pkg===../../x-1.0-py3-none-any.whl[x]": "local paths and archive names are not supported",
    "x~=1": "needs at least two release numbers",
    "x>=1.*": "a trailing .* is allowed only after == or !=",
    "x>1.0+local": "Local version label can only be used with `==` or `!=`",
    "x 1.0": "'1.0' after the name is not a version specifier",
    "x=1.0": "'=1.0' after the name is not a version specifier",
    "x[a": "Expected matching RIGHT_BRACKET",
    "x;": "Expected a marker variable or quoted string",
    "x; foo == '1'": "Expected a marker variable or quoted string",
    "x; python_version >= '3' and": "Expected a marker variable or quoted string",
    "x; (python_version >= '3'": "Expected matching RIGHT_PARENTHESIS",
    "_x": "Expected package name",
    "x @ https://example.com/x.whl": "URLs, VCS links, local paths and archive names are not supported",
    "x @ file:/tmp/x": "URLs, VCS links, local paths and archive names are not supported",
    "git+https://github.com/a/b.git": "URLs, VCS links, local paths and archive names are not supported",
    "https://example.com/x-1.0.tar.gz": "URLs, VCS links, local paths and archive names are not supported",
    "./mypkg": "URLs, VCS links, local paths and archive names are not supported",
    "/abs/path/pkg": "URLs, VCS links, local paths and archive names are not supported",
    "mypkg-1.0-py3-none-any.whl": "URLs, VCS links, local paths and archive names are not supported",
    "-e .": "pip options (-r, -c, -e, --index-url",
    "--index-url https://example.com/simple": "pip options (-r, -c, -e, --index-url",
    "cowsay==6.1 --hash=sha256:abc": "per-requirement pip options",
    "x==${VERSION}": "environment variables are not expanded",
    "x" * 201: "more than 200",
}


# -- the check, in the kernel -----------------------------------------------------------------------------
@pytest.mark.parametrize("spec", list(GOOD))
def test_good_requirements_are_normalised(spec: str) -> None:
    assert check_requirements([spec]) == [GOOD[spec]]


@pytest.mark.parametrize("spec", list(BAD))
def test_bad_requirements_name_the_entry_the_argument_and_the_fix(spec: str) -> None:
    with pytest.raises(ValidationError) as err:
        check_requirements(["cowsay==6.1", spec], argname="reqs")
    msg = str(err.value)
    assert f"reqs[1] = {spec!r}" in msg
    assert BAD[spec] in msg
    assert "Fix:" in msg


def test_the_parser_agrees_with_packaging_where_that_is_installed() -> None:
    """The home-made parser is no looser than packaging on syntax, and its output is what packaging reads."""
    requirements = pytest.importorskip("packaging.requirements")
    utils = pytest.importorskip("packaging.utils")
    for spec, norm in GOOD.items():
        ours, theirs = requirements.Requirement(norm), requirements.Requirement(spec.strip())
        assert utils.canonicalize_name(theirs.name) == ours.name
        assert ours.specifier == theirs.specifier and ours.extras == {e.lower() for e in theirs.extras}
        assert str(ours.marker) == str(theirs.marker) if theirs.marker else ours.marker is None
    syntax_errors = ["cowsay==latest", "x~=1", "x>=1.*", "x>1.0+local", "x 1.0", "x=1.0", "x[a", "x;", "_x"]
    for spec in syntax_errors:
        with pytest.raises(requirements.InvalidRequirement):
            requirements.Requirement(spec)


def test_the_list_is_deduplicated_and_sorted() -> None:
    assert check_requirements(("b", "A==1", "a == 1", "B")) == ["a==1", "b"]
    assert check_requirements(None) == [] and check_requirements([]) == []


@pytest.mark.parametrize(
    "value, expected",
    [
        ("cowsay==6.1", "must be a list of requirement strings, got the string 'cowsay==6.1'"),
        ({"cowsay": "6.1"}, "must be a list of requirement strings, got a dict"),
        (["cowsay", 6.1], "requirements[1] is a float, not a string"),
        ([f"p{i}" for i in range(MAX_REQUIREMENTS + 1)], f"has {MAX_REQUIREMENTS + 1} entries, more than 64"),
    ],
)
def test_wrong_shapes_are_refused(value: object, expected: str) -> None:
    with pytest.raises(ValidationError, match="Fix:") as err:
        check_requirements(value)
    assert expected in str(err.value)


def test_requirements_file_text() -> None:
    text = textwrap.dedent(
        """\
        # training extras
        cowsay==6.1   # the talking cow

        pyjokes \\
            >=0.8, \\
            <0.9
        Requests[socks]; python_version >= "3.8"
        cowsay == 6.1
        """
    )
    assert parse_requirements_text(text, "req.txt") == [
        "cowsay==6.1",
        "pyjokes<0.9,>=0.8",
        'requests[socks]; python_version >= "3.8"',
    ]
    assert parse_requirements_text("# nothing\n\n") == []


@pytest.mark.parametrize(
    "line, why",
    [
        ("-r other.txt", "pip options"),
        ("-c constraints.txt", "pip options"),
        ("-e git+https://github.com/a/b.git#egg=b", "pip options"),
        ("--index-url https://example.com/simple", "pip options"),
        ("--extra-index-url https://example.com/simple", "pip options"),
        ("git+https://github.com/a/b.git", "URLs, VCS links, local paths and archive names"),
        ("http://example.com/b-1.0.tar.gz", "URLs, VCS links, local paths and archive names"),
        ("file:///tmp/b-1.0.tar.gz", "URLs, VCS links, local paths and archive names"),
        ("./b", "URLs, VCS links, local paths and archive names"),
        ("/tmp/b", "URLs, VCS links, local paths and archive names"),
        ("b==1.0 --hash=sha256:0123", "per-requirement pip options"),
    ],
)
def test_requirements_file_refuses_options_urls_and_paths_naming_the_line(line: str, why: str) -> None:
    with pytest.raises(ValidationError) as err:
        parse_requirements_text(f"# header\ncowsay==6.1\n{line}\n", "train/requirements.txt")
    msg = str(err.value)
    assert msg.startswith(f"train/requirements.txt line 3: {line!r} is not a valid requirement")
    assert why in msg and "Fix:" in msg


def test_requirements_file_bounds() -> None:
    many = "\n".join(f"p{i}" for i in range(MAX_REQUIREMENTS + 1))
    with pytest.raises(ValidationError, match="more than 64"):
        parse_requirements_text(many, "big.txt")


def test_hash_ignores_order_case_and_spelling_but_not_versions_or_python() -> None:
    h = requirements_hash(["cowsay==6.1", "Requests_File >= 2"])
    assert h == requirements_hash(["requests-file>=2", "COWSAY == 6.1", "cowsay==6.1"])
    assert len(h) == 64 and int(h, 16) >= 0
    assert h != requirements_hash(["cowsay==6.0", "requests-file>=2"])
    assert h != requirements_hash(["cowsay==6.1", "requests-file>=2"], python="3.10")
    assert h == requirements_hash(["cowsay==6.1", "requests-file>=2"], python="{}.{}".format(*sys.version_info))
    with pytest.raises(ValidationError):
        requirements_hash(["./local"])


def test_version_mismatch() -> None:
    same = {"python": "3.11.7", "tensorflow": "2.16.1", "keras": "3.3.3"}
    assert version_mismatch(same, {**same, "tensorflow": "2.16.2", "python": "3.10.1"}) is None
    assert version_mismatch(same, {"python": "3.11.7"}) is None
    msg = version_mismatch(same, {**same, "tensorflow": "2.15.0", "keras": "3.1.0"})
    assert msg and "TensorFlow 2.16.1 in the kernel but 2.15.0 on the worker" in msg
    assert "Keras 3.3.3 in the kernel but 3.1.0 on the worker" in msg and "Fix:" in msg
    only_keras = version_mismatch(same, {**same, "keras": "3.4.0.dev2024"})
    assert only_keras and "Keras" in only_keras and "TensorFlow" not in only_keras


def test_worker_versions() -> None:
    found = envs.worker_versions()
    assert found["python"] == platform.python_version()
    assert found["tensorflow"] == sys.modules["tensorflow"].__version__
    assert found["keras"] == sys.modules["keras"].__version__
    assert runtime_versions() == found


# -- pip's output, throttled, and its failures --------------------------------------------------------------
def _fake_python(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "fake-python"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(0o755)
    return script


def test_progress_is_throttled_and_the_last_line_always_reported(tmp_path: Path) -> None:
    fake = _fake_python(tmp_path, 'for i in $(seq 1 300); do echo "line $i"; done\nsleep 0.7\necho done-line\n')
    got: list[str] = []
    envs._run_pip(fake, ["x"], "env", got.append, timeout_s=30)
    assert 2 <= len(got) <= 4 and got[0] == "env: line 1" and got[-1] == "env: done-line"


def test_a_failing_pip_gives_its_tail_and_a_hung_one_is_stopped(tmp_path: Path) -> None:
    fake = _fake_python(tmp_path, 'for i in $(seq 1 100); do echo "line $i"; done\nexit 1\n')
    with pytest.raises(RuntimeError) as err:
        envs._run_pip(fake, ["x==1"], "env", lambda _: None, timeout_s=30)
    assert "pip failed on ['x==1']" in str(err.value) and "line 100" in str(err.value)
    assert "line 50" not in str(err.value)  # only the tail
    hung = _fake_python(tmp_path, "echo starting\nsleep 60\necho never\n")  # a child holds the pipe open
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="took longer than 1 s"):
        envs._run_pip(hung, ["x"], "env", lambda _: None, timeout_s=1)
    assert time.monotonic() - start < 20


# -- real installs -------------------------------------------------------------------------------------------
def _absent(*dists: str) -> None:
    for dist in dists:
        with pytest.raises(md.PackageNotFoundError):
            md.version(dist)  # the test needs a package this environment lacks


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[tuple[float, str]]]:
    """One real environment, built once for the tests below: cowsay (no dependencies) and requests-file
    (which needs requests, which the worker already has)."""
    _absent("cowsay", "requests-file")
    cache = tmp_path_factory.mktemp("envs")
    reports: list[tuple[float, str]] = []
    site = envs.ensure_env(["cowsay==6.1", "requests-file==2.1.0"], cache, lambda s: reports.append((time.time(), s)))
    assert site is not None
    return cache, site, reports


def test_first_call_installs_and_reports_progress(built: tuple[Path, Path, list[tuple[float, str]]]) -> None:
    cache, site, reports = built
    digest = requirements_hash(["cowsay==6.1", "requests-file==2.1.0"])
    lines = [s for _, s in reports]
    assert lines[0] == f"environment {digest[:12]}: installing cowsay==6.1, requests-file==2.1.0"
    assert any("Successfully installed cowsay-6.1 requests-file-2.1.0" in s for s in lines)
    assert lines[-1].startswith(f"environment {digest[:12]} ready (built in ")
    pip_lines = reports[1:-2]  # throttled; the final pip line may come sooner
    assert all(b[0] - a[0] >= envs.REPORT_EVERY_S - 0.05 for a, b in zip(pip_lines, pip_lines[1:]))
    assert site.is_dir() and site.is_relative_to(cache / digest)
    assert (cache / digest / "ready").is_file()
    names = {p.name for p in site.iterdir()}
    assert {"cowsay", "requests_file.py", "cowsay-6.1.dist-info", "requests_file-2.1.0.dist-info"} <= names
    # requests is a dependency the worker already has: not installed again, and no helper .pth is left behind.
    assert not {n for n in names if n.lower().startswith(("requests-2", "requests/", "_aibro"))}
    assert "requests" not in names


def test_second_call_in_another_order_is_cached(built: tuple[Path, Path, list[tuple[float, str]]]) -> None:
    cache, site, _ = built
    got: list[str] = []
    again = envs.ensure_env(["Requests_File == 2.1.0", "COWSAY==6.1", "cowsay==6.1"], cache, got.append)
    digest = requirements_hash(["cowsay==6.1", "requests-file==2.1.0"])
    assert again == site and got == [f"environment {digest[:12]} ready (cached)"]
    assert envs.ensure_env([], cache, got.append) is None and len(got) == 1


class _Shelf:
    """envs.Shared as a dict (the agent's goes through the backend; tests/test_requirements_kernel.py runs that)."""

    def __init__(self) -> None:
        self.held: dict[str, bytes] = {}

    def fetch(self, key: str, dest: Path) -> bool:
        if key not in self.held:
            return False
        dest.write_bytes(self.held[key])
        return True

    def offer(self, key: str, source: Path) -> None:
        self.held[key] = source.read_bytes()


def test_a_built_environment_is_shared_and_the_next_machine_unpacks_it(tmp_path: Path) -> None:
    """Issue 26 item 6: the first cache builds and offers its site-packages; a second (another machine) takes
    that copy without running pip; a broken copy is built again, never half used."""
    _absent("cowsay")
    shelf, first, second, third = _Shelf(), tmp_path / "a", tmp_path / "b", tmp_path / "c"
    said: list[str] = []
    built_site = envs.ensure_env(["cowsay==6.1"], first, said.append, shared=shelf)
    assert built_site is not None and any("ready (built in" in s for s in said)
    (key,) = shelf.held
    digest = requirements_hash(["cowsay==6.1"])
    assert key == envs.env_key(digest) and key.startswith(digest[:32]) and "-py3" in key
    assert any("shared with your next machines" in s for s in said), said
    got: list[str] = []
    site = envs.ensure_env(["COWSAY==6.1"], second, got.append, shared=shelf)
    assert site is not None and any("ready (downloaded, built by another of your machines" in s for s in got), got
    assert not any("Successfully installed" in s or "built in" in s for s in got), "pip did not run"
    assert (site / "cowsay" / "__init__.py").read_bytes() == (built_site / "cowsay" / "__init__.py").read_bytes()
    assert envs.activate(site) == []
    try:
        import cowsay

        assert Path(cowsay.__file__).is_relative_to(site)
    finally:
        envs.deactivate()
    shelf.held[key] = b"not a zip"
    again: list[str] = []
    assert envs.ensure_env(["cowsay==6.1"], third, again.append, shared=shelf) is not None
    assert any("the shared copy could not be used" in s for s in again) and any("built in" in s for s in again)


def test_activate_then_deactivate(built: tuple[Path, Path, list[tuple[float, str]]]) -> None:
    _, site, _ = built
    path_before = list(sys.path)
    with pytest.raises(ImportError):
        import cowsay  # noqa: F401
    assert envs.activate(site) == []
    at = sys.path.index(str(site))
    worker_site = next(p for p in sys.path if p.endswith("site-packages") and p != str(site))
    assert at < sys.path.index(worker_site) and at > sys.path.index(os.path.dirname(os.__file__))
    import cowsay
    import requests_file

    assert Path(cowsay.__file__).is_relative_to(site) and md.version("cowsay") == "6.1"
    assert Path(requests_file.__file__).is_relative_to(site)
    assert not Path(sys.modules["requests"].__file__).is_relative_to(site)  # the worker's own copy
    envs.deactivate()
    assert sys.path == path_before
    assert not [m for m in sys.modules if m.split(".")[0] in ("cowsay", "requests_file")]
    with pytest.raises(ImportError):
        import cowsay  # noqa: F401, F811
    assert "requests" in sys.modules  # the worker's own modules stay
    envs.deactivate()  # idempotent
    assert envs.activate(None) == [] and sys.path == path_before


def test_concurrent_builders_on_one_host_build_once(tmp_path: Path) -> None:
    """Two worker processes ask for the same environment while a third party holds the build lock: both wait,
    one builds, the other finds it ready."""
    reqs = ["cowsay==6.1"]
    digest = requirements_hash(reqs)
    code = (
        "import json, sys; from pathlib import Path; from aibro_backend.worker import envs\n"
        "say = lambda s: print(json.dumps(s), flush=True)\n"
        f"say(str(envs.ensure_env({reqs!r}, Path(sys.argv[1]), say)))\n"
    )
    with open(tmp_path / f"{digest}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        procs = [
            subprocess.Popen([sys.executable, "-I", "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
            for _ in range(2)
        ]
        for proc in procs:
            assert proc.stdout is not None
            assert "waiting for another worker" in json.loads(proc.stdout.readline())
        fcntl.flock(lock, fcntl.LOCK_UN)
    outs = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        outs.append([json.loads(line) for line in out.splitlines()])
    builders = [o for o in outs if any(": installing cowsay==6.1" in s for s in o)]
    assert len(builders) == 1
    other = next(o for o in outs if o is not builders[0])
    assert other[-2] == f"environment {digest[:12]} ready (cached)"
    assert outs[0][-1] == outs[1][-1] and Path(outs[0][-1]).is_dir()


def test_a_bad_requirement_fails_helpfully_and_leaves_no_environment(tmp_path: Path) -> None:
    reqs = ["cowsay==6.1", "no-such-package-aibro-xyz==1.0"]
    for _ in range(2):  # a failure is not cached
        with pytest.raises(RuntimeError) as err:
            envs.ensure_env(reqs, tmp_path, lambda _: None)
        msg = str(err.value)
        assert "the requirement 'no-such-package-aibro-xyz==1.0' could not be installed" in msg
        assert "pip index versions NAME" in msg and "No matching distribution found" in msg
    digest = requirements_hash(reqs)
    assert not (tmp_path / digest).exists()
    assert [p.name for p in tmp_path.iterdir()] == [f"{digest}.lock"]


def test_a_pinned_version_beats_the_workers_copy_without_touching_it(tmp_path: Path) -> None:
    """The worker has pyjokes 0.8.2; the job pins 0.8.3. The environment gets 0.8.3, the job imports it, the
    worker's copy is neither uninstalled nor changed; once a module is imported the worker's copy stays and
    activate says so."""
    _absent("pyjokes")
    worker_site = tmp_path / "worker-site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--target", str(worker_site), "pyjokes==0.8.2"],
        check=True,
        capture_output=True,
    )
    code = textwrap.dedent(
        """\
        import importlib.metadata as md, json, sys
        from pathlib import Path
        import site as site_module
        site_module.addsitedir(sys.argv[2])  # the worker's own packages: a site directory after the stdlib
        from aibro_backend.worker import envs
        site = envs.ensure_env(["pyjokes==0.8.3"], Path(sys.argv[1]), lambda s: None)
        out = {"shadowed_fresh": envs.activate(site)}
        import pyjokes
        out["env_file"], out["env_version"] = pyjokes.__file__, md.version("pyjokes")
        envs.deactivate()
        import pyjokes
        out["worker_file"], out["worker_version"] = pyjokes.__file__, md.version("pyjokes")
        out["shadowed_warm"] = envs.activate(site)
        envs.deactivate()
        print(json.dumps(out))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code, str(tmp_path / "cache"), str(worker_site)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["shadowed_fresh"] == [] and out["env_version"] == "0.8.3"
    assert str(tmp_path / "cache") in out["env_file"]
    assert out["worker_file"].startswith(str(worker_site)) and out["worker_version"] == "0.8.2"
    assert out["shadowed_warm"] == ["pyjokes"]
    assert [p.name for p in worker_site.glob("pyjokes-*.dist-info")] == ["pyjokes-0.8.2.dist-info"]
