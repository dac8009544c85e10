"""The machine picker: the marketplace as a sortable table, one row per machine with its spot and on-demand prices
side by side; a row's buttons add that machine to the ordered list the job tries, then a cool-down and Start.
After Start the picker folds into one line, so the panel that follows sits right under the cell."""

from __future__ import annotations

import html
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ipywidgets as w

from aibro_core.models import Machine, Prediction

from ..predictions import shown
from ..prices import hourly
from .style import STYLE, text_class

HINT = (
    "Add machines in the order to try them, then press Start training (or pass --machine, or `%cloud_machines --use`)."
)
AVAILABILITY_RANK = {"available": 3, "high": 3, "medium": 2, "low": 1, "busy": 1, "unreachable": 0}


@dataclass
class Row:
    """One machine of the marketplace: its spot and on-demand variants (machine id and $/h), either may be absent."""

    machine: str
    provider: str
    gpu_count: int
    gpu_type: str | None
    vcpus: int
    memory_gib: float
    availability: str
    spot: tuple[str, float] | None = None
    on_demand: tuple[str, float] | None = None
    prediction: Prediction | None = None  # the fit's, on the spot variant where there is one (issue 38)

    @property
    def free(self) -> bool:
        """A machine that costs nothing (local, Ray, SSH): free whichever way it is bought."""
        return any(variant is not None and variant[1] == 0 for variant in (self.spot, self.on_demand))

    def cost(self, variant: tuple[str, float] | None) -> float | None:
        return 0.0 if self.free else (variant[1] if variant else None)


# A price column (or a predicted time or cost) sorts the machines that have one; the others stay at the end.
PRICED: dict[str, Callable[[Row], float | None]] = {
    "spot": lambda r: r.cost(r.spot),
    "on-demand": lambda r: r.cost(r.on_demand),
    "time": lambda r: r.prediction.seconds if r.prediction else None,
    "cost": lambda r: r.prediction.cost if r.prediction else None,
}
SORTS: dict[str, Callable[[Row], Any]] = {
    "spot": PRICED["spot"],
    "on-demand": PRICED["on-demand"],
    "GPU": lambda r: (r.gpu_count, r.gpu_type or ""),
    "vCPU": lambda r: r.vcpus,
    "memory": lambda r: r.memory_gib,
    "availability": lambda r: AVAILABILITY_RANK.get(r.availability, 0),
    "time": PRICED["time"],
    "cost": PRICED["cost"],
}
COLUMNS = ["machine", "provider", "GPU", "vCPU", "memory", "spot $/h", "on-demand $/h", "availability", "add to list"]
PREDICTED = ["time", "cost"]  # with a fit's predictions: after the prices
SORTABLE = {
    "time": "time",
    "cost": "cost",
    "GPU": "GPU",
    "vCPU": "vCPU",
    "memory": "memory",
    "spot $/h": "spot",
    "on-demand $/h": "on-demand",
    "availability": "availability",
}


def _compact() -> w.Layout:
    return w.Layout(width="auto", padding="0 6px", margin="0 2px")


def marketplace_rows(offers: list[Machine]) -> list[Row]:
    """Offers grouped by machine: `g4dn.xlarge` (spot) and `g4dn.xlarge.od` (on-demand) make one row. An offer whose
    provider does not say whether it is spot is spot when an `.od` variant of it is on offer too."""
    ids = {o.machine_id for o in offers}
    rows: dict[str, Row] = {}
    for o in offers:
        mid = o.machine_id
        base = mid[: -len(".od")] if mid.endswith(".od") else mid
        spot = o.spot if "spot" in o.model_fields_set else not mid.endswith(".od") and f"{mid}.od" in ids
        row = rows.setdefault(base, Row(base, o.provider, o.gpu_count, o.gpu_type, o.vcpus, o.memory_gib, ""))
        if spot:
            row.spot = (mid, o.price_per_hour)
        else:
            row.on_demand = (mid, o.price_per_hour)  # what this offer costs (Ray's and local: nothing)
        if AVAILABILITY_RANK.get(o.availability, 0) >= AVAILABILITY_RANK.get(row.availability, -1):
            row.availability = o.availability
    return list(rows.values())


class MachinePicker(w.VBox):
    """Pick an ordered fallback list of machines; Start sets `chosen` (machine ids, cool-down seconds)."""

    def __init__(
        self, offers: list[Machine], cool_down_s: float = 0, predictions: list[Prediction] | None = None
    ) -> None:
        """`predictions` (Training.predictions of the fit): a predicted time and cost column, each cell's tooltip
        saying where its number came from."""
        self.offers = offers
        self.rows = marketplace_rows(offers)
        self.columns = COLUMNS if predictions is None else [*COLUMNS[:7], *PREDICTED, *COLUMNS[7:]]
        by_id = {p.machine_id: p for p in predictions or []}
        for row in self.rows:
            variants = [variant[0] for variant in (row.spot, row.on_demand) if variant]
            row.prediction = next((by_id[m] for m in variants if m in by_id), None)
        self.sort_key, self.descending = "spot", False
        self.started = threading.Event()
        self.chosen: tuple[list[str], float] | None = None
        self.hint = w.HTML(f"{STYLE}<div class='aibro-nb-hint'>{html.escape(HINT)}</div>")
        self.grid = w.GridBox(
            layout=w.Layout(
                grid_template_columns=f"repeat({len(self.columns)}, max-content)",
                width="max-content",
                max_width="100%",
                overflow="auto",  # a narrow notebook scrolls the table rather than cutting it off
            )
        )
        self.grid.add_class("aibro-nb-grid")
        self.order = w.Select(options=[], rows=4, description="try in order", layout=w.Layout(width="420px"))
        self.order.style.description_width = "90px"
        self.remove_button = w.Button(description="Remove", icon="minus")
        self.clear_button = w.Button(description="Clear")
        self.cool_down = w.BoundedIntText(value=int(cool_down_s), min=0, max=7 * 24 * 3600, description="cool-down s")
        self.start_button = w.Button(description="Start training", button_style="primary", icon="play")
        self.message = w.HTML()
        self.remove_button.on_click(lambda _b: self._remove())
        self.clear_button.on_click(lambda _b: setattr(self.order, "options", []))
        self.start_button.on_click(lambda _b: self.start())
        self.sort_buttons: dict[str, w.Button] = {}
        self.add_buttons: dict[str, w.Button] = {}
        self._render_grid()
        variants = [variant[0] for r in self.rows for variant in (r.spot, r.on_demand) if variant]
        if len(variants) == 1:  # one machine on offer: it is the choice unless the user clears it
            self.order.options = variants
        super().__init__(
            [
                self.hint,
                self.grid,
                w.HBox([self.order, w.VBox([self.remove_button, self.clear_button])]),
                w.HBox([self.cool_down, self.start_button]),
                self.message,
            ]
        )
        self.add_class("aibro-nb-picker")

    @property
    def visible_rows(self) -> list[str]:
        """The machines in the order the table shows them."""
        return [r.machine for r in self._sorted()]

    def sort_by(self, key: str) -> None:
        """Sort the table by spot or on-demand price, GPU, vCPU, memory, availability, or the fit's predicted time or
        cost; the same key again reverses it."""
        if key not in SORTS:
            raise ValueError(f"sort by one of {', '.join(SORTS)}, not {key!r}")
        self.descending = (
            not self.descending if key == self.sort_key else key in ("GPU", "vCPU", "memory", "availability")
        )
        self.sort_key = key
        self._render_grid()

    def add(self, machine_id: str | None, on_demand: bool = False) -> None:
        """Add a machine (its on-demand variant when asked and offered) to the end of the ordered list."""
        if not machine_id:
            return
        known = {o.machine_id for o in self.offers}
        mid = f"{machine_id}.od" if on_demand and f"{machine_id}.od" in known else machine_id
        if mid not in known:
            self.message.value = f"<span class='{text_class('error')}'>no machine {html.escape(mid)} on offer</span>"
            return
        if mid not in self.order.options:
            self.order.options = [*self.order.options, mid]
        self.message.value = ""

    def _remove(self) -> None:
        if self.order.value:
            self.order.options = [m for m in self.order.options if m != self.order.value]

    def start(self) -> None:
        machines = list(self.order.options)
        if not machines:
            self.message.value = f"<span class='{text_class('error')}'>add at least one machine</span>"
            return
        self.chosen = (machines, float(self.cool_down.value))
        self.start_button.disabled = True
        summary = f"training on {', '.join(machines)} (tried in this order) · cool-down {int(self.cool_down.value)} s"
        self.message.value = html.escape(summary)
        self.children = (w.HTML(f"{STYLE}<div class='aibro-nb-summary'>{html.escape(summary)}</div>"),)
        self.started.set()

    def _sorted(self) -> list[Row]:
        if self.sort_key not in PRICED:
            return sorted(self.rows, key=SORTS[self.sort_key], reverse=self.descending)
        price = PRICED[self.sort_key]
        priced = sorted((r for r in self.rows if price(r) is not None), key=price, reverse=self.descending)
        return priced + sorted((r for r in self.rows if price(r) is None), key=lambda r: r.machine)

    def _render_grid(self) -> None:
        cells: list[w.Widget] = []
        for col in self.columns:
            key = SORTABLE.get(col)
            if key:
                arrow = (" ▼" if self.descending else " ▲") if key == self.sort_key else ""
                b = self.sort_buttons.get(key) or w.Button(tooltip=f"sort by {key}", layout=_compact())
                b.description = f"{col}{arrow}"
                if key not in self.sort_buttons:
                    b.on_click(lambda _b, k=key: self.sort_by(k))
                    self.sort_buttons[key] = b
                cell: w.Widget = w.Box([b])
            else:
                cell = w.HTML(f"<b>{html.escape(col)}</b>")
            cell.add_class("aibro-nb-cell")
            cell.add_class("aibro-nb-head")
            cells.append(cell)
        for r in self._sorted():
            gpu = f"{r.gpu_count}× {r.gpu_type}" if r.gpu_count else "—"
            texts = [
                f"<code>{html.escape(r.machine)}</code>",
                html.escape(r.provider),
                html.escape(gpu),
                str(r.vcpus),
                f"{r.memory_gib:g} GiB",
                *(hourly(r.cost(variant)) if r.cost(variant) is not None else "—" for variant in (r.spot, r.on_demand)),
                *self._predicted(r),
                html.escape(r.availability),
            ]
            for t in texts:
                c = w.HTML(t)
                c.add_class("aibro-nb-cell")
                cells.append(c)
            buttons = []
            for variant, label in ((r.spot, "spot"), (r.on_demand, "on-demand")):
                if variant:
                    buttons.append(self._add_button(variant[0], "+ add" if r.free else f"+ {label}"))
            box = w.HBox(buttons)
            box.add_class("aibro-nb-cell")
            cells.append(box)
        self.grid.children = cells

    def _predicted(self, r: Row) -> list[str]:
        """The row's predicted time and cost cells, each with where the number came from as its tooltip."""
        if self.columns is COLUMNS:
            return []
        time_, cost, source = shown(r.prediction)
        return [f"<span title='{html.escape(source, quote=True)}'>{html.escape(t)}</span>" for t in (time_, cost)]

    def _add_button(self, machine_id: str, label: str) -> w.Button:
        b = self.add_buttons.get(machine_id)
        if b is None:
            b = w.Button(description=label, tooltip=f"add {machine_id} to the list", layout=_compact())
            b.on_click(lambda _b: self._append(machine_id))
            self.add_buttons[machine_id] = b
        return b

    def _append(self, machine_id: str) -> None:
        if machine_id not in self.order.options:
            self.order.options = [*self.order.options, machine_id]
        self.message.value = ""
