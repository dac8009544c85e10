"""`aibro`: jobs, machines, login and the backend itself, from a terminal."""

from __future__ import annotations

import argparse
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from aibro_core import vocabulary as v
from aibro_core.files import write_private
from aibro_core.serveflags import add_serve_flags, given_only_for_serve, serve_argv

from . import config
from .client import BackendClient
from .errors import AibroError


def _client() -> BackendClient:
    from .training import connect

    return connect()


def cmd_backend(args: argparse.Namespace) -> int:
    if args.name and args.action not in ("add-user", "revoke-tokens", "aws-policy"):
        raise AibroError(
            f"`aibro backend {args.action}` takes no name (only add-user, revoke-tokens and aws-policy FILE do): "
            f"drop {args.name!r}"
        )
    if given_only_for_serve(args) and args.action != "serve":
        raise AibroError(f"{', '.join(given_only_for_serve(args))} go with `aibro backend serve`")
    if args.action == "aws-policy":
        if not args.name:
            raise AibroError("aws-policy needs the AWS config file: aibro backend aws-policy FILE")
        _exec_backend("aibro_backend.providers.aws_config", "policy", args.name)
    if args.action == "serve":
        _exec_backend("aibro_backend", "--home", str(config.home()), *serve_argv(args))
    if args.action == "start":
        t = config.resolve()
        print(f"aibro backend running at {t.url}")
        return 0
    if args.action in ("add-user", "revoke-tokens"):
        if not args.name:
            raise AibroError(f"{args.action} needs a name: aibro backend {args.action} NAME")
        cmd = [
            sys.executable,
            "-m",
            "aibro_backend.server.accounts",
            args.action,
            args.name,
            "--home",
            str(config.home()),
        ]
        if args.expires_in is not None:
            if args.action != "add-user":
                raise AibroError("--expires-in goes with add-user (the new token's lifetime)")
            cmd += ["--expires-in", str(args.expires_in)]
        return subprocess.run(cmd).returncode
    if args.action == "stop":
        print("stopped" if config.stop_embedded() else "no embedded backend was running")
        return 0
    target = config.configured_target() or config.embedded_target()
    if target is None:
        print("no backend running (the first client starts the embedded one; or `aibro backend start`)")
        return 3
    info = BackendClient(target.url, target.token, ca_bundle=target.ca_bundle).health()
    kind = "embedded" if target.embedded else "configured"
    print(f"{kind} backend at {target.url}: ok, user {info.user}, version {info.version}")
    print(f"sandbox: {info.sandbox}" + (f" ({info.sandbox_warning})" if info.sandbox_warning else ""))
    if info.job_memory:  # an older backend does not say
        print(f"memory per job: {info.job_memory.summary}")
    if target.embedded:
        print(backend_process_status(config.home()))
    return 0


def backend_process_status(home: Path) -> str:
    """The embedded backend's process on this host: pid, home, log, and its workers with their memory."""
    pid = int((config._read_json(home / "backend.json") or {}).get("pid") or 0)
    lines = [f"pid {pid}, home {home}, log {home / 'backend.log'}"]
    workers = worker_processes(pid)
    lines.append(f"workers: {len(workers)}" + ("" if workers else " (none running)"))
    lines += [f"  pid {w:<8} {rss / 2**20:8.0f} MiB  {what}" for w, rss, what in workers]
    return "\n".join(lines)


def worker_processes(root: int) -> list[tuple[int, int, str]]:
    """(pid, resident bytes, what) of the worker agents below process `root` on this host (sandboxed ones too)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    below, todo = set(), [root]
    while todo:
        parent = todo.pop()
        for child in [p for p, pp in parents.items() if pp == parent and p not in below]:
            below.add(child)
            todo.append(child)
    out = []
    for pid in sorted(below):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            rss = next(int(line.split()[1]) * 1024 for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        if "aibro_backend.worker" in cmd and "bwrap" not in cmd.split(" ", 1)[0]:
            out.append((pid, rss, "spare worker" if "worker.spare" in cmd else "worker"))
    return out


def cmd_jobs(args: argparse.Namespace) -> int:
    from .timeline_table import JOBS_HEAD, job_row

    jobs = _client().jobs()
    if args.json:
        print(json.dumps([j.model_dump(mode="json") for j in jobs], indent=2))  # as the backend sent them
        return 0
    print(JOBS_HEAD)
    for j in jobs:
        print(job_row(j))
    return 0


def cmd_machines(args: argparse.Namespace) -> int:
    from .training import format_machines

    print(format_machines(_client().machines()))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = _client().cancel(args.job_id)
    print(f"{job.job_id}: cancel requested ({job.status} · {job.substatus})")
    return 0


def cmd_instances(args: argparse.Namespace) -> int:
    client = _client()
    if args.terminate:
        client.terminate(args.terminate)
    print(f"{'instance':<18} {'machine':<12} {'status':<10} {'substatus':<12} note")
    for i in client.instances():
        note = f"cooling {i.cooling_left_s:.0f}s more" if i.status == v.COOLING else ""
        print(f"{i.id:<18} {i.machine_id:<12} {i.status:<10} {i.substatus or '-':<12} {note}".rstrip())
    spare = client.health().spare
    if spare:
        print(f"{'(spare)':<18} {spare:<12} {'READY':<10} {'-':<12} a spare worker: takes your next {spare} job")
    return 0


def cmd_fit(args: argparse.Namespace) -> int:
    """Train a saved .keras model on .npy arrays, no notebook needed; follows the job unless --detach."""
    import numpy as np

    from .errors import ValidationError
    from .fitrequest import FitRequest
    from .progress import TextProgress
    from .training import Training

    def load(path: str | None) -> np.ndarray | None:
        if path is None:
            return None
        try:
            return np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValidationError(f"{path}: not a readable .npy array ({exc}); save arrays with numpy.save") from None

    if not args.model.endswith(".keras"):
        raise ValidationError(f"{args.model}: give a Keras v3 model file (model.save('model.keras'))")
    from .quiet import import_tensorflow_quietly, unbuilt_optimizer_ok

    import_tensorflow_quietly()
    import keras

    try:
        with unbuilt_optimizer_ok():
            model = keras.models.load_model(args.model, safe_mode=not args.unsafe)
    except (OSError, ValueError) as exc:
        raise ValidationError(f"{args.model}: cannot load it as a Keras model ({exc})") from None
    val = (load(args.val_x), load(args.val_y)) if args.val_x else None
    trainer = Training()
    request = FitRequest(
        model,
        load(args.x),
        load(args.y),
        machine_ids=args.machine,
        batch_size=args.batch_size,
        epochs=args.epochs,
        validation_data=val,
        description=args.description,
        cool_down_period_s=args.cool_down,
        safe_mode=not args.unsafe,
        argnames={
            "machine_ids": "--machine",
            "cool_down_period_s": "--cool-down",
            "description": "--description",
            "train_X": "--x",
            "train_Y": "--y",
        },
    )
    job = trainer.submit(request)
    print(f"{job.job_id} started on {', '.join(job.machines)}", flush=True)
    if args.detach:
        return 0
    view = trainer.watch(job.job_id, [TextProgress()])
    return 0 if view.status == v.COMPLETED else 1


def cmd_login(args: argparse.Namespace) -> int:
    """The token comes from a prompt or stdin (`--token-stdin`), so it stays out of `ps` and shell history;
    `--token=TOKEN` still works where that is acceptable."""
    token = args.token
    if token is None:
        if args.token_stdin or not sys.stdin.isatty():
            token = sys.stdin.readline().strip()
        else:
            token = getpass.getpass(f"token for {args.url}: ").strip()
    if not token:
        raise AibroError("no token given: pipe it in with --token-stdin, type it at the prompt, or pass --token=TOKEN")
    ca_bundle = os.path.abspath(args.ca_bundle) if args.ca_bundle else None
    BackendClient(args.url, token, ca_bundle=ca_bundle).health()
    saved = {"url": args.url, "token": token, **({"ca_bundle": ca_bundle} if ca_bundle else {})}
    write_private(config.login_file(), saved)
    print(f"logged in to {args.url}; saved in {config.login_file()} (mode 0600)")
    return 0


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"


def cmd_token(args: argparse.Namespace) -> int:
    """Your tokens on the backend you use: list them (ids and times, never secrets), mint one, revoke one."""
    client = _client()
    if args.action == "list":
        if args.id:
            raise AibroError(f"`aibro token list` takes no id: drop {args.id!r}")
        print(f"{'id':<18} {'created':<17} {'expires':<17} {'last used':<17}")
        for t in client.tokens():
            times = " ".join(f"{_when(ts):<17}" for ts in (t.created, t.expires, t.last_used))
            print(f"{t.id:<18} {times}{'  (this one)' if t.current else ''}")
        return 0
    if args.action == "revoke":
        if not args.id:
            raise AibroError("revoke needs a token id: `aibro token list` shows them (tok_...)")
        client.revoke_token(args.id)
        print(f"revoked {args.id}")
        return 0
    if args.id:
        raise AibroError(f"`aibro token new` takes no id: drop {args.id!r}")
    made = client.mint_token(args.expires_in)
    until = f" (expires {_when(made.expires)})" if made.expires else ""
    print(f"{made.id}{until}: {made.token}")
    print("shown once (the backend keeps only its hash); use it with: aibro login URL --token-stdin")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    _exec_backend("aibro_backend.worker")
    return 0


def _exec_backend(module: str, *argv: str) -> None:
    """Become a backend-side program: the notebook package never imports the backend (imports run one way)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aibro", description="Train Keras models on remote machines.")
    sub = p.add_subparsers(dest="cmd", required=True)
    be = sub.add_parser("backend", help="start, stop or inspect the backend")
    be.add_argument("action", choices=["start", "status", "stop", "serve", "add-user", "revoke-tokens", "aws-policy"])
    be.add_argument("name", nargs="?", help="the user, for add-user and revoke-tokens; the AWS config for aws-policy")
    add_serve_flags(be, help_prefix="serve: ")
    be.add_argument("--expires-in", type=float, default=None, metavar="S", help="add-user: the token expires in S s")
    be.set_defaults(fn=cmd_backend)
    tk = sub.add_parser("token", help="list, mint or revoke your tokens")
    tk.add_argument("action", choices=["list", "new", "revoke"])
    tk.add_argument("id", nargs="?", help="the token to revoke (tok_..., from `aibro token list`)")
    tk.add_argument("--expires-in", type=float, default=None, metavar="S", help="new: the token expires in S s")
    tk.set_defaults(fn=cmd_token)
    j = sub.add_parser("jobs", help="list your jobs")
    j.add_argument("--json", action="store_true")
    j.set_defaults(fn=cmd_jobs)
    sub.add_parser("machines", help="list the machines you can train on").set_defaults(fn=cmd_machines)
    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job_id")
    c.set_defaults(fn=cmd_cancel)
    i = sub.add_parser("instances", help="list your instances")
    i.add_argument("--terminate", metavar="INSTANCE", help="terminate a cooling or stopped instance now")
    i.set_defaults(fn=cmd_instances)
    f = sub.add_parser("fit", help="train a saved .keras model on .npy arrays")
    f.add_argument("model", help="a .keras file saved with model.save (compiled)")
    f.add_argument("--x", required=True, help="training inputs, .npy")
    f.add_argument("--y", default=None, help="training targets, .npy")
    f.add_argument("--val-x", default=None, help="validation inputs, .npy")
    f.add_argument("--val-y", default=None, help="validation targets, .npy")
    f.add_argument("--epochs", type=int, default=1)
    f.add_argument("--batch-size", type=int, default=None)
    f.add_argument("--machine", "-m", default=None, help="ordered machine list, e.g. local-cpu")
    f.add_argument("--cool-down", type=float, default=0, help="seconds to keep the machine warm afterwards")
    f.add_argument("--description", "-d", default="")
    f.add_argument("--unsafe", action="store_true", help="load with safe_mode=False (Lambda layers)")
    f.add_argument("--detach", action="store_true", help="print the job id and return at once")
    f.set_defaults(fn=cmd_fit)
    lg = sub.add_parser("login", help="use a shared or cloud backend")
    lg.add_argument("url")
    how = lg.add_mutually_exclusive_group()
    how.add_argument("--token", default=None, help="the token (prefer --token-stdin: argv shows in ps and history)")
    how.add_argument("--token-stdin", action="store_true", help="read the token from standard input")
    lg.add_argument("--ca-bundle", default=None, metavar="FILE", help="the CA (PEM) that verifies an HTTPS backend")
    lg.set_defaults(fn=cmd_login)
    sub.add_parser("worker", help="run the worker agent (started by providers)").set_defaults(fn=cmd_worker)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.fn(args) or 0)
    except AibroError as exc:
        print(f"aibro: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
