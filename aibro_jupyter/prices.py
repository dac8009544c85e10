"""Prices as the user reads them everywhere in the kernel (the sidebar's labextension/src/format.ts and sidebar.ts
say the same)."""

from __future__ import annotations


def hourly(value: float | None) -> str:
    """ "$0.526" per hour, "$32.77", "<$0.001" under a tenth of a cent, and "free" for a machine that costs nothing
    (local, a Ray cluster of one's own, the user's own SSH hosts)."""
    if not value:
        return "free"
    return "<$0.001" if value < 0.001 else f"${value:.{3 if value < 10 else 2}f}"


def money(value: float) -> str:
    """Dollars spent, to the cent: "$0.31" (format.ts `money`)."""
    return f"${value:.2f}"


def job_cost(cost: float, price_per_hour: float | None) -> str:
    """What a job costs so far, as the sidebar's `jobCost` says it: "free" when nothing was billed and its machine
    has no price (local, Ray, SSH hosts; or a machine no longer offered), dollars otherwise ("$0.00" on a priced
    machine that has billed nothing yet)."""
    return money(cost) if cost or price_per_hour else "free"
