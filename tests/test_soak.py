"""The soak's short version (issue 39 item 2): two users train on one real backend for about three minutes while
every local fault of benchmarks/soak.py strikes once, on a fixed schedule (the oracle host's last, once a study
runs); then the same checks as the long run (every job ended with its epochs once and a readable reason, models
equal their last checkpoints, nothing left behind, the backend's memory and descriptors flat, its log quiet but for
what the faults explain)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import soak  # noqa: E402 - benchmarks/ is no package

# The fixed schedule: each fault once, spaced so that each finds a worker training (a fit's worker needs ~20 s
# to start here); the injector waits (bounded) for a training worker and for the next upload when there is none.
SCHEDULE = [(30.0, "kill_worker"), (60.0, "kill_client"), (80.0, "kill_backend"), (110.0, "stop_worker")]
SCHEDULE += [(140.0, "fill_disk"), (160.0, "kill_oracle")]  # a study runs by then (users start one now and then)

pytestmark = pytest.mark.backend_log(*soak.EXPECTED_LOG)


def test_a_short_soak_loses_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    cfg = soak.Config(users=2, minutes=3, seed=3, epochs=3, rows=2000, schedule=SCHEDULE, root=tmp_path / "soak")
    report = soak.Soak(cfg).run()
    print(report.text())
    assert not report.failures, report.text()


@pytest.mark.fast
def test_the_seed_is_the_schedule() -> None:
    """A run is reproduced by its seed: the same faults at the same times; another seed, another schedule."""
    one = soak.schedule(soak.Config(seed=5, minutes=30))
    assert one == soak.schedule(soak.Config(seed=5, minutes=30)) and one != soak.schedule(soak.Config(seed=6))
    assert all(kind in soak.KINDS for _, kind in one) and all(0 < t < 1800 for t, _ in one)
    assert [t for t, _ in one] == sorted(t for t, _ in one)
