"""Tokens (issue 10 item 6): list (ids and times, never a secret), revoke, optional expiry, a cap of live tokens per
user, the `aibro token` and `aibro backend add-user --expires-in / revoke-tokens` commands, and databases made
before tokens had ids."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from backend_proc import OwnBackend, own_backend

from aibro_backend.storage.store import Store
from aibro_backend.storage.tokens import hash_token
from aibro_core.errors import ApiError, AuthError
from aibro_jupyter.client import BackendClient

from helpers import aibro_cli

pytestmark = pytest.mark.fast

CAP = 6


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnBackend]:
    with own_backend(tmp_path_factory.mktemp("tokens") / "home", AIBRO_MAX_TOKENS_PER_USER=str(CAP)) as b:
        yield b


def _add_user(b: OwnBackend, name: str, *extra: str) -> tuple[int, str, str | None]:
    res = aibro_cli(b.home, "backend", "add-user", name, *extra, timeout=60, AIBRO_MAX_TOKENS_PER_USER=str(CAP))
    found = re.search(r"--token=(\S+)", res.stdout)
    return res.returncode, res.stdout + res.stderr, found.group(1) if found else None


def _user(b: OwnBackend, name: str) -> BackendClient:
    code, out, token = _add_user(b, name)
    assert code == 0 and token, out
    return b.client(token)


def test_list_shows_ids_and_times_never_a_secret(backend: OwnBackend) -> None:
    alice = _user(backend, "alice")
    made = alice.mint_token()
    assert set(made.model_fields_set) == {"id", "token", "created", "expires"} and made.expires is None
    assert made.id.startswith("tok_") and made.token.startswith("aibro_u_")
    resp = requests.get(f"{backend.url}/api/v1/auth/tokens", headers={"Authorization": f"Bearer {alice.t.token}"})
    assert resp.status_code == 200
    tokens = resp.json()["tokens"]
    assert [t["id"] for t in tokens][-1] == made.id
    assert all(set(t) == {"id", "created", "expires", "last_used", "current"} for t in tokens), tokens
    assert [t["current"] for t in tokens].count(True) == 1 and tokens[0]["current"] and tokens[0]["last_used"]
    for secret in (alice.t.token, made.token, hash_token(alice.t.token), hash_token(made.token)):
        assert secret not in resp.text


def test_a_revoked_token_stops_working_and_only_its_owner_can_revoke_it(backend: OwnBackend) -> None:
    bob, carol = _user(backend, "bob"), _user(backend, "carol")
    spare = bob.mint_token()
    spare_client = backend.client(spare.token)
    assert spare_client.health().user == "bob"
    with pytest.raises(ApiError, match="no token") as e:
        carol.revoke_token(spare.id)  # not carol's
    assert e.value.status == 404
    assert spare_client.health().user == "bob"
    assert bob.revoke_token(spare.id).revoked == spare.id
    with pytest.raises(AuthError, match="not valid"):
        spare_client.health()
    assert spare.id not in [t.id for t in bob.tokens()]
    with pytest.raises(ApiError) as e:
        bob.revoke_token(spare.id)
    assert e.value.status == 404
    # revoking the token in use works too: the next call is refused
    assert bob.revoke_token(next(t.id for t in bob.tokens() if t.current))
    with pytest.raises(AuthError):
        bob.health()


def test_tokens_expire(backend: OwnBackend) -> None:
    dave = _user(backend, "dave")
    short = dave.mint_token(expires_in_s=1.5)
    assert short.expires == pytest.approx(short.created + 1.5)
    short_client = backend.client(short.token)
    assert short_client.health().user == "dave"
    time.sleep(2.0)
    with pytest.raises(AuthError, match=rf"the token {short.id} expired at .*aibro login"):
        short_client.health()
    assert short.id not in [t.id for t in dave.tokens()]
    for bad in (0, -5, "60", True, 1e12, None):
        if bad is None:
            continue
        with pytest.raises(ApiError, match="expires_in_s") as e:
            dave.t.json("POST", "/auth/tokens", json={"expires_in_s": bad})
        assert e.value.status == 400, bad
    resp = requests.post(
        f"{backend.url}/api/v1/auth/tokens",
        data='{"expires_in_s": NaN}',
        headers={"Authorization": f"Bearer {dave.t.token}"},
        timeout=10,
    )
    assert resp.status_code == 400


def test_live_tokens_are_capped_per_user(backend: OwnBackend) -> None:
    erin = _user(backend, "erin")
    made = [erin.mint_token() for _ in range(CAP - 1)]
    with pytest.raises(ApiError, match=rf"you hold {CAP} live tokens, the limit is {CAP}: .*aibro token revoke") as e:
        erin.mint_token()
    assert e.value.status == 429
    code, out, _ = _add_user(backend, "erin")  # the admin's mint is capped too, naming the admin's fix
    assert code == 2 and "aibro backend revoke-tokens erin" in out, out
    erin.revoke_token(made[0].id)
    assert erin.mint_token(expires_in_s=60).expires
    # expired tokens do not count against the cap
    erin.revoke_token(made[1].id)
    erin.mint_token(expires_in_s=0.5)
    time.sleep(1.0)
    erin.mint_token()


def test_the_cli_lists_mints_and_revokes(backend: OwnBackend, tmp_path: Path) -> None:
    code, out, token = _add_user(backend, "frank", "--expires-in", "3600")
    assert code == 0 and token and "(expires " in out, out
    env = {"AIBRO_BACKEND_URL": backend.url, "AIBRO_TOKEN": token}
    listed = aibro_cli(tmp_path, "token", "list", **env)
    assert listed.returncode == 0 and "(this one)" in listed.stdout and token not in listed.stdout, listed.stdout
    new = aibro_cli(tmp_path, "token", "new", "--expires-in", "600", **env)
    assert new.returncode == 0, new.stderr
    tid, secret = re.search(r"(tok_\w+) \(expires [^)]+\): (aibro_u_\S+)", new.stdout).groups()
    assert backend.client(secret).health().user == "frank"
    revoked = aibro_cli(tmp_path, "token", "revoke", tid, **env)
    assert revoked.returncode == 0 and f"revoked {tid}" in revoked.stdout
    assert tid not in aibro_cli(tmp_path, "token", "list", **env).stdout
    missing = aibro_cli(tmp_path, "token", "revoke", **env)
    assert missing.returncode == 2 and "aibro token list" in missing.stderr
    gone = aibro_cli(tmp_path, "token", "revoke", "tok_000000000000", **env)
    assert gone.returncode == 2 and "no token" in gone.stderr

    # the admin revokes every token of a user
    res = aibro_cli(backend.home, "backend", "revoke-tokens", "frank", timeout=60)
    assert res.returncode == 0 and "revoked" in res.stdout, res.stderr
    with pytest.raises(AuthError):
        backend.client(token).health()


def test_a_database_from_before_token_ids_gets_them(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    con = sqlite3.connect(db)
    con.executescript(
        "CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, created REAL NOT NULL);"
        "CREATE TABLE tokens (hash TEXT PRIMARY KEY, user_id INTEGER NOT NULL, created REAL NOT NULL);"
        "INSERT INTO users VALUES (1, 'old', 0);"
        f"INSERT INTO tokens VALUES ('{hash_token('aibro_u_oldtoken')}', 1, 0);"
    )
    con.commit()
    con.close()
    store = Store(db)
    try:
        assert store.tokens.user_for("aibro_u_oldtoken") == {"id": 1, "name": "old"}
        (listed,) = store.tokens.list(1)
        assert listed["id"].startswith("tok_") and listed["expires"] is None
        assert store.tokens.revoke(1, listed["id"]) and store.tokens.user_for("aibro_u_oldtoken") is None
    finally:
        store.close()
