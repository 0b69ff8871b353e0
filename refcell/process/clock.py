"""The cell's accelerated clock: a shift takes minutes of wall time, not hours.

Cell time starts at the wall time of the process start and runs at most `speed` times faster:
work stamped with a cell time waits until `start + speed * elapsed` has reached it, so the
clock never runs ahead of that (slow simulation only makes it slower). A box keeps the latest
cell time it used, and a restarted cell starts after it, so names built from cell times (shift
ids, log files) never repeat although the clock runs ahead of the wall.

A harness that simulates many days (`realloop campaign`) can also hold the line: idle time
then stops at the cell time the harness allows, so the line never runs ahead of the work that
watches it, however slow the machine (`hold_ns`; the cell's work itself is never held, so a
trial requested at the hold still runs).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

NS = 1_000_000_000
HIGH_WATER_FILE = "cell-clock.json"


class CellClock:
    """Cell time: `now_ns()` moves only forward, through `advance_to` (the cell's work) and
    `catch_up` (time passing while the cell idles), and never beyond `limit_ns()`, the wall
    time since the start times `speed`. `advance_to` sleeps until that limit allows the step,
    so slow simulation makes the cell clock slower, never faster or jumpy.

    Sleeps end early once `stop` is set, so a stopping cell finishes its episode at full speed.
    `hold_ns`, when given, answers the latest cell time idling may reach (None: no hold).
    """

    def __init__(
        self,
        speed: float,
        start_ns: int | None = None,
        stop: threading.Event | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        hold_ns: Callable[[], int | None] = lambda: None,
    ):
        if speed <= 0:
            raise ValueError(f"--speed {speed}: the clock's speed must be positive")
        self.speed = speed
        self.start_ns = time.time_ns() if start_ns is None else start_ns
        self.stop = stop or threading.Event()
        self._monotonic = monotonic
        self._started = monotonic()
        self._now_ns = self.start_ns
        self.hold_ns = hold_ns

    def limit_ns(self) -> int:
        return self.start_ns + int((self._monotonic() - self._started) * self.speed * NS)

    def now_ns(self) -> int:
        return self._now_ns

    def now(self) -> datetime:
        return datetime.fromtimestamp(self._now_ns / NS, tz=UTC)

    def advance_to(self, cell_ns: int) -> None:
        """Move the clock to `cell_ns`, first sleeping until the limit has reached it."""
        delay = (cell_ns - self.limit_ns()) / NS / self.speed
        if delay > 0 and not self.stop.is_set():
            self.stop.wait(delay)
        self._now_ns = max(self._now_ns, cell_ns)

    def catch_up(self) -> None:
        """An idle cell's clock runs at full speed: move it to the limit, or to the hold."""
        limit, hold = self.limit_ns(), self.hold_ns()
        self._now_ns = max(self._now_ns, limit if hold is None else min(limit, hold))


def resumed_start_ns(box: Path, now_ns: int | None = None) -> int:
    """Wall time now, or just after the box's high-water mark if a previous run got further
    (an accelerated clock runs ahead of the wall; a restart must not reuse its names)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    try:
        high_water = int(json.loads((box / HIGH_WATER_FILE).read_text())["cell_time_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        return now_ns
    return max(now_ns, high_water + NS)


def save_high_water(box: Path, cell_ns: int) -> None:
    """Record the latest cell time in use (atomically: a kill mid-write keeps the old mark)."""
    path = box / HIGH_WATER_FILE
    temp = path.with_name(f".{path.name}.partial")
    temp.write_text(json.dumps({"cell_time_ns": cell_ns}) + "\n")
    temp.replace(path)


def stamp(cell_ns: int) -> str:
    """Shift ids and attempt ids: UTC seconds, `%Y%m%dT%H%M%SZ` (docs/data-contract.md)."""
    return datetime.fromtimestamp(cell_ns / NS, tz=UTC).strftime("%Y%m%dT%H%M%SZ")
