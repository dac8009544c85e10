"""Prices as the user reads them everywhere in the kernel (the sidebar's labextension/src/format.ts says the same)."""

from __future__ import annotations


def hourly(value: float | None) -> str:
    """ "$0.526" per hour, "$32.77", "<$0.001" under a tenth of a cent, and "free" for a machine that costs nothing
    (local, a Ray cluster of one's own, the user's own SSH hosts)."""
    if not value:
        return "free"
    return "<$0.001" if value < 0.001 else f"${value:.{3 if value < 10 else 2}f}"
