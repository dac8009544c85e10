"""The machine picker: the marketplace as a table, an ordered choice, spot or on-demand, and a cool-down."""

from __future__ import annotations

import html
import threading
from typing import Any

import ipywidgets as w


class MachinePicker(w.VBox):
    """Pick an ordered fallback list of machines; Start sets `chosen` (machine ids, cool-down seconds)."""

    def __init__(self, offers: list[dict[str, Any]], cool_down_s: float = 0) -> None:
        self.offers = offers
        self.started = threading.Event()
        self.chosen: tuple[list[str], float] | None = None
        self.table = w.HTML(self._table_html())
        spot_ids = [o["machine_id"] for o in offers if not o["machine_id"].endswith(".od")]
        self.available = w.Select(options=spot_ids, rows=min(6, max(2, len(spot_ids))), description="machines")
        self.kind = w.ToggleButtons(options=["spot", "on-demand"], value="spot", description="pricing")
        self.add_button = w.Button(description="Add ↓", icon="plus")
        self.clear_button = w.Button(description="Clear")
        self.order = w.Select(options=[], rows=4, description="try in order")
        self.cool_down = w.BoundedIntText(value=int(cool_down_s), min=0, max=7 * 24 * 3600, description="cool-down s")
        self.start_button = w.Button(description="Start training", button_style="primary", icon="play")
        self.message = w.HTML()
        self.add_button.on_click(lambda _b: self.add(self.available.value, self.kind.value == "on-demand"))
        self.clear_button.on_click(lambda _b: setattr(self.order, "options", []))
        self.start_button.on_click(lambda _b: self.start())
        super().__init__(
            [
                self.table,
                w.HBox([self.available, w.VBox([self.kind, w.HBox([self.add_button, self.clear_button])])]),
                self.order,
                w.HBox([self.cool_down, self.start_button]),
                self.message,
            ]
        )

    def add(self, machine_id: str | None, on_demand: bool = False) -> None:
        if not machine_id:
            return
        known = {o["machine_id"] for o in self.offers}
        mid = f"{machine_id}.od" if on_demand and f"{machine_id}.od" in known else machine_id
        if mid not in self.order.options:
            self.order.options = [*self.order.options, mid]

    def start(self) -> None:
        machines = list(self.order.options) or ([self.available.value] if self.available.value else [])
        if not machines:
            self.message.value = "<span style='color:#c62828'>add at least one machine</span>"
            return
        self.chosen = (machines, float(self.cool_down.value))
        self.start_button.disabled = True
        self.message.value = f"starting on {html.escape(', '.join(machines))}…"
        self.started.set()

    def _table_html(self) -> str:
        head = (
            "<tr><th>machine</th><th>provider</th><th>GPU</th><th>vCPUs</th><th>GiB</th><th>$/h</th>"
            "<th>on-demand $/h</th><th>availability</th></tr>"
        )
        rows = []
        for o in self.offers:
            gpu = f"{o['gpu_count']}× {o['gpu_type']}" if o.get("gpu_count") else "—"
            rows.append(
                f"<tr><td><code>{html.escape(o['machine_id'])}</code></td><td>{html.escape(o['provider'])}</td>"
                f"<td>{html.escape(gpu)}</td><td>{o['vcpus']}</td><td>{o['memory_gib']}</td>"
                f"<td>{o['price_per_hour']:.3f}</td><td>{o['on_demand_price_per_hour']:.3f}</td>"
                f"<td>{html.escape(str(o['availability']))}</td></tr>"
            )
        return f"<table>{head}{''.join(rows)}</table>"
