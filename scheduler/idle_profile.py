"""The full cost table, measured in the engine's idle gaps while it serves on a provisional one.

A first start on a machine has no cached table, and measuring one takes tens of seconds on a
CPU. The engine starts instead on a provisional table from a short probe (`profile.probe`) and
measures the full one here, one forward at a time, only while no request waits or runs and
only after the engine has been idle for `quiet_seconds` (a conversation's next turn usually
comes sooner). A request that arrives waits at most for the one forward in progress; the
scratch requests' KV slots go back to the pool before the engine's next step. When the last
forward is timed, the table is cached and takes over (`on_ready`).

Nothing here changes a request's output: the table only prices verification lengths, and
every length is lossless.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dspark_serve.scheduler.policy import CostTable
from dspark_serve.scheduler.profile import TableMeasurement, save_measured

log = logging.getLogger(__name__)

# Idle time before the measurement's next forward: a client's next request (a streamed reply
# read, the next turn) usually lands within it, and then finds the engine free.
QUIET_SECONDS = 0.5


class IdleProfile:
    """`measurement` advanced in idle gaps (`wait`, `advance`), cached at `path` and handed to
    `on_ready(table, raw)` when done."""

    def __init__(
        self,
        measurement: TableMeasurement,
        path: Path | None,
        on_ready: Callable[[CostTable, dict[str, Any]], None],
        quiet_seconds: float = QUIET_SECONDS,
    ) -> None:
        if not quiet_seconds >= 0:
            raise ValueError(f"quiet_seconds must be >= 0, got {quiet_seconds!r}")
        self.measurement = measurement
        self.path = path
        self.on_ready = on_ready
        self.quiet_seconds = quiet_seconds
        self.started = self.busy_at = time.monotonic()

    @property
    def progress(self) -> float:
        """The fraction of the table's forwards timed so far."""
        m = self.measurement
        return m.timed / m.forwards if m.forwards else 1.0

    def wait(self) -> float:
        """Seconds until the next forward may run (the engine quiet since its last step)."""
        return max(0.0, self.quiet_seconds - (time.monotonic() - self.busy_at))

    def pause(self) -> None:
        """The engine steps next: the scratch requests give their KV slots back."""
        self.measurement.release()
        self.busy_at = time.monotonic()

    def advance(self) -> bool:
        """Time one forward; on the last one, cache the table and hand it over. True when done."""
        m = self.measurement
        m.advance()
        if not m.done:
            return False
        raw = m.result()
        raw["seconds"] = m.seconds
        save_measured(self.path, raw)
        log.info(
            "cost table measured in the engine's idle gaps (%.1fs of forwards, %.0fs after start)",
            m.seconds,
            time.monotonic() - self.started,
        )
        self.on_ready(CostTable.from_dict(raw), raw)
        return True
