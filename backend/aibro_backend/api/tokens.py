"""Tokens of the calling user: mint, list, revoke."""

from __future__ import annotations

from .base import UserHandler


class TokensHandler(UserHandler):
    def post(self) -> None:
        self.send({"token": self.backend.store.new_token(self.uid)}, 201)
