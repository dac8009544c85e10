"""The AWS marketplace: EC2 GPU types from a small vendored catalog (aws_catalog.csv), priced per region.

The catalog holds list on-demand prices (its header says from where and as of when). Spot prices move every few
minutes, so they are never vendored: `fetch_spot_prices` reads them from `describe_spot_price_history` and
`offers` marks any spot price it had to estimate instead. Machine ids follow the seed's naming: `g4dn.xlarge` is
the spot machine, `g4dn.xlarge.od` its on-demand twin.
"""

from __future__ import annotations

import csv
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from aibro_core.models import Machine

CATALOG = Path(__file__).with_name("aws_catalog.csv")
OD_SUFFIX = ".od"
# Without a live spot price, a spot machine is shown at this fraction of its on-demand price and marked as an
# estimate (`price_source: "estimate"`). GPU spot prices usually sit 50-70% below on-demand; 0.4 is a middle guess.
SPOT_ESTIMATE_FRACTION = 0.4
# How many instances of one machine the scheduler may run at once when the config does not say (account quotas,
# not the catalog, are the real limit; the provider reports InstanceLimitExceeded as a capacity error).
DEFAULT_CAPACITY = 8
# describe_spot_price_history's product names for Linux: "Linux/UNIX" in VPC-only accounts (all accounts made
# since 2013); "(Amazon VPC)" in older ones and in moto.
LINUX_PRODUCTS = ("Linux/UNIX", "Linux/UNIX (Amazon VPC)")


@dataclass(frozen=True)
class CatalogRow:
    instance_type: str
    gpu_name: str
    gpu_count: int
    vcpus: int
    memory_gib: float
    on_demand_price_per_hour: float
    region: str


def _rows(lines: Iterable[str]) -> list[CatalogRow]:
    reader = csv.DictReader(line for line in lines if line.strip() and not line.lstrip().startswith("#"))
    rows = []
    for n, rec in enumerate(reader, start=2):
        try:
            rows.append(
                CatalogRow(
                    instance_type=rec["instance_type"].strip(),
                    gpu_name=rec["gpu_name"].strip(),
                    gpu_count=int(rec["gpu_count"]),
                    vcpus=int(rec["vcpus"]),
                    memory_gib=float(rec["memory_gib"]),
                    on_demand_price_per_hour=float(rec["on_demand_price_per_hour"]),
                    region=rec["region"].strip(),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"aws catalog data row {n - 1} is malformed ({exc}): {rec}") from None
    return rows


@lru_cache(maxsize=4)
def load_catalog(path: Path = CATALOG) -> tuple[CatalogRow, ...]:
    """Every row of the catalog file (comment lines skipped); read once per path."""
    with open(path, encoding="utf-8", newline="") as f:
        return tuple(_rows(f))


def regions(path: Path = CATALOG) -> list[str]:
    """The regions the catalog prices, in file order."""
    return list(dict.fromkeys(r.region for r in load_catalog(path)))


def instance_types(region: str, path: Path = CATALOG) -> list[str]:
    """The instance types the catalog offers in `region` (empty for a region it does not price)."""
    return [r.instance_type for r in load_catalog(path) if r.region == region]


def row(region: str, instance_type: str, path: Path = CATALOG) -> CatalogRow | None:
    return next((r for r in load_catalog(path) if r.region == region and r.instance_type == instance_type), None)


def parse_machine_id(machine_id: str) -> tuple[str, bool]:
    """`g4dn.xlarge` -> ("g4dn.xlarge", spot=True); `g4dn.xlarge.od` -> ("g4dn.xlarge", spot=False)."""
    if machine_id.endswith(OD_SUFFIX):
        return machine_id[: -len(OD_SUFFIX)], False
    return machine_id, True


def offers(
    region: str,
    spot_prices: Mapping[str, float] | None = None,
    *,
    capacity: int = DEFAULT_CAPACITY,
    provider: str = "aws",
    path: Path = CATALOG,
) -> list[Machine]:
    """Two offers per catalog type in `region`: the spot machine (`X`) and its on-demand twin (`X.od`).

    Machines as LocalProvider.offers() makes them, plus `region` and `price_source`: "live" (a spot price read from
    EC2), "estimate" (no live price: SPOT_ESTIMATE_FRACTION of on-demand) or "list" (the catalog's on-demand list
    price). A region the catalog does not price gives no offers.
    """
    spot_prices = spot_prices or {}
    out: list[Machine] = []
    for r in load_catalog(path):
        if r.region != region:
            continue
        base: dict[str, Any] = {
            "provider": provider,
            "gpu_type": r.gpu_name,
            "gpu_count": r.gpu_count,
            "vcpus": r.vcpus,
            "memory_gib": r.memory_gib,
            "on_demand_price_per_hour": r.on_demand_price_per_hour,
            "capacity": capacity,
            "availability": "available",
            "region": region,
        }
        live = spot_prices.get(r.instance_type)
        if live is not None and live > 0:
            spot_price, source = float(live), "live"
        else:
            spot_price, source = round(r.on_demand_price_per_hour * SPOT_ESTIMATE_FRACTION, 4), "estimate"
        out.append(
            Machine(**base, machine_id=r.instance_type, price_per_hour=spot_price, spot=True, price_source=source)
        )
        out.append(
            Machine(
                **base,
                machine_id=r.instance_type + OD_SUFFIX,
                price_per_hour=r.on_demand_price_per_hour,
                spot=False,
                price_source="list",
            )
        )
    return out


def latest_spot_prices(history: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """From describe_spot_price_history records: per instance type, the lowest of each zone's latest price.

    The latest record of a zone is what a launch there pays now; the lowest zone is what a launch in the best
    zone pays (the provider asks only for its subnet's zone when it knows it, so there is then only one).
    """
    latest: dict[tuple[str, str], tuple[dt.datetime, float]] = {}
    for rec in history:
        if rec.get("ProductDescription") not in LINUX_PRODUCTS:
            continue
        try:
            key = (str(rec["InstanceType"]), str(rec.get("AvailabilityZone", "")))
            when, price = rec["Timestamp"], float(rec["SpotPrice"])
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(when, str):
            when = dt.datetime.fromisoformat(when.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.timezone.utc)
        if key not in latest or when > latest[key][0]:
            latest[key] = (when, price)
    prices: dict[str, float] = {}
    for (itype, _zone), (_when, price) in latest.items():
        prices[itype] = min(price, prices.get(itype, price))
    return prices


def fetch_spot_prices(ec2: Any, types: Iterable[str], availability_zone: str | None = None) -> dict[str, float]:
    """Live spot prices for `types` (Linux/UNIX) from an EC2 client: blocking, so call it off the IOLoop.

    StartTime=now makes EC2 return, per zone, the price in effect now rather than a week of history.
    """
    kwargs: dict[str, Any] = {
        "InstanceTypes": list(types),
        "ProductDescriptions": list(LINUX_PRODUCTS),
        "StartTime": dt.datetime.now(dt.timezone.utc),
    }
    if availability_zone:
        kwargs["AvailabilityZone"] = availability_zone
    records: list[dict[str, Any]] = []
    for page in ec2.get_paginator("describe_spot_price_history").paginate(**kwargs):
        records.extend(page.get("SpotPriceHistory", []))
    return latest_spot_prices(records)
