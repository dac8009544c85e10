"""Tokens of the calling user: mint (optionally expiring), list (ids and times, never a secret), revoke.

A user holds at most `Limits.max_tokens_per_user` live tokens: a script minting in a loop is stopped with the fix
(revoke some, or let them expire) instead of filling the table.
"""

from __future__ import annotations

import math

from aibro_core import models

from .base import ApiError, UserHandler

MAX_EXPIRES_IN_S = 10 * 365 * 86400.0


class TokensHandler(UserHandler):
    def get(self) -> None:
        current = self.backend.store.tokens.lookup(self.bearer())
        tokens = self.backend.store.tokens.list(self.uid)
        for t in tokens:
            t["current"] = bool(current and t["id"] == current["id"])
        self.send({"tokens": tokens})

    def post(self) -> None:
        body = self.body_model(models.TokenMint, "the token request")  # unknown fields are refused, like every body
        expires_in_s = check_expires_in(body.expires_in_s)
        store, cap = self.backend.store, self.backend.limits.max_tokens_per_user
        live = store.tokens.live(self.uid)
        if live >= cap:
            raise ApiError(
                429,
                f"you hold {live} live tokens, the limit is {cap}: revoke ones you no longer use "
                "(`aibro token list`, then `aibro token revoke ID`; DELETE /auth/tokens/ID), or mint expiring ones "
                "(expires_in_s) so they go by themselves",
            )
        self.send(store.tokens.mint(self.uid, expires_in_s), 201)


class TokenHandler(UserHandler):
    def delete(self, token_id: str) -> None:
        if not self.backend.store.tokens.revoke(self.uid, token_id):
            raise ApiError(404, f"you have no token '{token_id[:40]}' (GET /auth/tokens, `aibro token list`)")
        self.send({"revoked": token_id})


def check_expires_in(raw: object) -> float | None:
    """None, or a number of seconds in (0, ten years]: anything else is refused naming the field."""
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise ApiError(400, f"expires_in_s must be a number of seconds (got {raw!r:.40})")
    if not 0 < raw <= MAX_EXPIRES_IN_S:
        raise ApiError(400, f"expires_in_s must be more than 0 and at most {MAX_EXPIRES_IN_S:.0f} (ten years)")
    return float(raw)
