"""Day pacing of `realloop cell run --shifts-per-day K`: production shifts start at fixed
times of the line's day, the clock idles between them, a late start is taken late (once)."""

from __future__ import annotations

from types import SimpleNamespace

from refcell.process.cell_process import CellProcess
from refcell.process.clock import NS, CellClock
from refcell.process.line import scheduled_start_ns
from refcell.timeline import DAY_NS
from tests.refcell.test_process_clock import START, FakeWall

EPISODES = 3


def test_shifts_start_at_fixed_times_of_the_line_day():
    half = DAY_NS // 2
    assert scheduled_start_ns(START, 2, START) == START
    assert scheduled_start_ns(START, 2, START + half - 1) == START
    assert scheduled_start_ns(START, 2, START + half) == START + half
    assert scheduled_start_ns(START, 1, START + 5 * DAY_NS + 7 * NS) == START + 5 * DAY_NS


class Paced(SimpleNamespace):
    """The parts of a CellProcess that pacing reads and writes; its methods are the real ones."""

    _production_due = CellProcess._production_due
    _end_scheduled_shift = CellProcess._end_scheduled_shift


def paced(shifts_per_day: int | None = 1, speed: float = 86_400.0):
    wall = FakeWall()  # speed 86,400: one line day per wall second
    closed: list[int] = []
    process = Paced(
        config=SimpleNamespace(shifts_per_day=shifts_per_day, episodes_per_shift=EPISODES),
        clock=CellClock(speed, START, stop=wall, monotonic=wall.monotonic),
        line=SimpleNamespace(epoch_ns=START, shift=None),
        production=SimpleNamespace(close=lambda: closed.append(1)),
        _scheduled_ns=None,
        _owed=0,
    )
    return process, wall, closed


def record_shift(process) -> int:
    """Production episodes recorded while it is due (at most a few shifts' worth)."""
    done = 0
    while done < 10 * EPISODES and process._production_due():
        process._end_scheduled_shift()
        done += 1
    return done


def test_a_day_records_one_shift_then_the_cell_idles_until_the_next_day():
    process, wall, _ = paced()
    assert record_shift(process) == EPISODES  # day 0's shift, at once
    wall.t += 0.5  # half a line day later: nothing is due
    assert record_shift(process) == 0
    wall.t += 0.6  # day 1 has begun
    assert record_shift(process) == EPISODES


def test_starts_missed_while_busy_are_taken_once_not_replayed():
    process, wall, _ = paced(shifts_per_day=2)
    assert record_shift(process) == EPISODES
    wall.t += 3.2  # trials kept the cell busy through six scheduled starts
    assert record_shift(process) == EPISODES
    wall.t += 0.2  # day 3.4: the start taken late was day 3.0's, the next is day 3.5
    assert record_shift(process) == 0
    wall.t += 0.2
    assert record_shift(process) == EPISODES


def test_a_shift_trials_left_open_is_closed_when_production_owes_nothing():
    process, _, closed = paced()
    record_shift(process)
    process.line.shift = SimpleNamespace(shift_id="trial-opened")  # trials took its last slot
    process._owed = 1
    process._end_scheduled_shift()
    assert closed == [1]  # the day's production log is uploaded the day it ran


def test_a_scheduled_start_ends_the_shift_trials_opened_before_it():
    process, wall, _ = paced()
    ended: list[str] = []
    process.line.end_shift = lambda: ended.append(process.line.shift.shift_id)
    record_shift(process)
    process.line.shift = SimpleNamespace(shift_id="trials-of-day-0")  # still open at midnight
    wall.t += 1.0
    assert process._production_due()  # day 1's start: production gets a shift of its own
    assert ended == ["trials-of-day-0"]


def test_without_a_schedule_production_runs_back_to_back():
    process, _, closed = paced(shifts_per_day=None)
    assert record_shift(process) == 10 * EPISODES and closed == []


def test_a_held_line_records_the_next_days_shift_only_once_the_hold_moves_on(tmp_path):
    from flows.campaign_days import HOLD_FILE, hold_line
    from refcell.timeline import held_until_ns

    process, wall, _ = paced()
    hold_file = tmp_path / HOLD_FILE
    clock = process.clock
    clock.hold_ns = lambda: held_until_ns(hold_file, START, clock.now_ns())
    assert record_shift(process) == EPISODES  # no hold written yet: day 0's shift, then wait
    wall.t += 3.0  # three line days of wall time pass while the campaign works on day 0
    assert record_shift(process) == 0 and clock.now_ns() == START
    hold_line(tmp_path, 0)  # the campaign's hold: noon of day 0
    assert record_shift(process) == 0 and clock.now_ns() == START + DAY_NS // 2
    hold_line(tmp_path, 1)  # day 0 done: day 1's shift records at once, and only it
    assert record_shift(process) == EPISODES
    assert clock.now_ns() == START + DAY_NS + DAY_NS // 2
    assert record_shift(process) == 0
