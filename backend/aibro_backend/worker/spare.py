"""`python -m aibro_backend.worker.spare`: a worker started before there is a job for it.

It imports TensorFlow and Keras (the seconds a first job would otherwise wait for), then blocks on stdin for the
one line the local provider sends when it hands this process an instance: a JSON object of the environment the
scheduler gave that instance (backend URL, worker token, instance id). From there it is an ordinary worker. A
closed stdin with nothing on it means the backend stopped or died first: the spare exits."""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.umask(0o077)  # before Keras makes its folders: private, however this was started
    import keras  # noqa: F401  the import a spare exists to have done already

    from . import agent, heap

    heap.settle()  # while nobody waits: the first job's collections then skip what the imports made

    line = sys.stdin.readline()
    if not line.strip():
        return
    env = json.loads(line)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(val, str) for k, val in env.items()):
        raise SystemExit("a spare worker expects one JSON object of strings on stdin")
    os.environ.update(env)
    agent.main()


if __name__ == "__main__":
    main()
