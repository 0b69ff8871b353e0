"""The line's time: shifts of N episode slots on the cell clock.

Every episode, production or trial, takes the next slot of the current shift, and the line's
lighting and load follow the slot's place in the shift, as they follow the hour on a real
line. Trial episodes interleaved into a shift therefore meet the same conditions as the
production episodes around them, and episode ids (`<cell>-<shift_id>-<slot>`) stay unique and
keep the meaning docs/data-contract.md gives them. Episodes run paced to the cell clock.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from refcell.cell import Cell
from refcell.process.clock import NS, CellClock, save_high_water, stamp
from refcell.recorder import EPISODE_GAP_S, ShiftRecorder
from refcell.runner import Controller, EpisodeResult, Operator, Screen, StepRecord, run_episode
from refcell.timeline import (
    DAY_NS,
    Timeline,
    events_until,
    line_day,
    line_epoch_ns,
    world_on_day,
)

PRODUCTION, TRIAL = "production", "trial"

log = logging.getLogger("realloop.cell")


@dataclass
class Shift:
    shift_id: str
    start: datetime
    seed: int  # the shift's episode draws: differ per shift, reproducible from (seed, shift id)
    episodes: int
    file_indexes: Iterator[int] = field(default_factory=itertools.count)
    used: int = 0
    outcomes: dict[str, list[bool]] = field(default_factory=dict)  # kind → success per episode

    @property
    def full(self) -> bool:
        return self.used >= self.episodes


@dataclass(frozen=True)
class Slot:
    shift: Shift
    index: int
    start_ns: int


class Line:
    """Hands out slots and runs paced episodes in them; a shift ends (`on_shift_end`) right
    after the episode that used its last slot. The line's dated events (`timeline`) take
    effect at the first shift that starts on or after their day."""

    def __init__(
        self,
        cell: Cell,
        clock: CellClock,
        box: Path,
        episodes_per_shift: int,
        seed: int,
        on_shift_end: Callable[[Shift], None] = lambda shift: None,
        timeline: Timeline = (),
    ):
        if episodes_per_shift < 1:
            raise ValueError(f"--episodes-per-shift {episodes_per_shift}: must be at least 1")
        self.cell, self.clock, self.box = cell, clock, box
        self.episodes_per_shift, self.seed = episodes_per_shift, seed
        self.on_shift_end = on_shift_end
        self.cursor_ns = clock.now_ns()  # when the line is free for the next episode
        self.shift: Shift | None = None
        self.shifts_ended = 0
        self.first_day_world, self.timeline = cell.world, timeline
        self.epoch_ns = line_epoch_ns(box, self.cursor_ns)
        self.events_applied = 0

    def day(self, cell_ns: int) -> float:
        return line_day(self.epoch_ns, cell_ns)

    def take(self) -> Slot:
        start_ns = max(self.cursor_ns, self.clock.now_ns())
        if self.shift is None:
            self._apply_timeline(start_ns)
            shift_id = stamp(start_ns)
            self.shift = Shift(
                shift_id,
                datetime.fromtimestamp(start_ns // NS, tz=UTC),
                shift_seed(self.seed, shift_id),
                self.episodes_per_shift,
            )
        slot = Slot(self.shift, self.shift.used, start_ns)
        self.shift.used += 1
        return slot

    def run(
        self,
        slot: Slot,
        controller: Controller,
        recorder: ShiftRecorder,
        operator: Operator | None,
        kind: str,
        screen: Screen | None = None,
    ) -> EpisodeResult:
        """One episode in `slot`, recorded by `recorder`, each step paced to the cell clock;
        `screen`: the box's per-step OOD check (refcell.runner.run_episode)."""
        dt_ns = round(self.cell.params.dt * NS)
        recorder.begin_at(slot.start_ns)

        def pace(_cell: Cell, record: StepRecord) -> None:
            self.clock.advance_to(slot.start_ns + (record.index + 1) * dt_ns)

        shift = slot.shift
        result = run_episode(
            self.cell,
            controller,
            shift.seed,
            slot.index,
            shift.episodes,
            operator,
            observers=(recorder, pace),
            screen=screen,
        )
        self.cursor_ns = slot.start_ns + result.steps * dt_ns + round(EPISODE_GAP_S * NS)
        save_high_water(self.box, self.cursor_ns)
        shift.outcomes.setdefault(kind, []).append(result.success)
        self._end_shift_if_full()
        return result

    def _apply_timeline(self, start_ns: int) -> None:
        """The world of the day the shift starts on: every event up to then, in order."""
        due = events_until(self.timeline, self.day(start_ns))
        if len(due) == self.events_applied:
            return
        for event in due[self.events_applied :]:
            log.info("%s: line day %.1f: %s", stamp(start_ns), self.day(start_ns), event.name)
        self.cell.world = world_on_day(self.first_day_world, self.timeline, self.day(start_ns))
        self.events_applied = len(due)

    def _end_shift_if_full(self) -> None:
        if self.shift is not None and self.shift.full:
            self.end_shift()

    def end_shift(self) -> None:
        """End the open shift now, its slots left unused (a scheduled production start ends
        the shift trials opened before it: the day's production gets that day's line)."""
        ended, self.shift = self.shift, None
        self.shifts_ended += 1
        self.on_shift_end(ended)


def scheduled_start_ns(epoch_ns: int, shifts_per_day: int, now_ns: int) -> int:
    """The latest scheduled shift start at or before `now_ns`: shifts start at fixed times of
    the line's day (day 0 at `epoch_ns`), `shifts_per_day` of them, evenly spaced."""
    period = DAY_NS // shifts_per_day
    return epoch_ns + (now_ns - epoch_ns) // period * period


def shift_seed(seed: int, shift_id: str) -> int:
    digest = hashlib.sha256(f"{seed}:{shift_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big")
