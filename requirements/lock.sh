#!/usr/bin/env bash
# Writes requirements/test-lock.txt: every package the README's test command installs (pyproject.toml with its
# test, aws and ray extras, and the build backend), pinned, for CPython 3.11 on x86-64 Linux.
#   bash requirements/lock.sh                           every pin moved to today's newest release
#   bash requirements/lock.sh --upgrade-package pytest  one pin moved, the rest kept (any uv pip compile option works)
# Run `python tests/try_newest.py` first: it shows what today's newest releases break, package by package.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- --upgrade
python3 -m pip install -q --root-user-action=ignore uv
python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' |
  python3 -m uv pip compile pyproject.toml - --extra test --extra aws --extra ray \
    --python-version 3.11 --python-platform x86_64-unknown-linux-gnu --no-header --quiet \
    -o requirements/test-lock.txt "$@"
{
  printf '# The test environment, pinned (issue 22). Written by `bash requirements/lock.sh`, never by hand; the README'"'"'s\n'
  printf '# test command installs with PIP_CONSTRAINT pointing here, build backend included.\n'
  cat requirements/test-lock.txt
} > requirements/test-lock.txt.new
mv requirements/test-lock.txt.new requirements/test-lock.txt
