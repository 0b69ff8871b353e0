"""The cell clock of `realloop cell run`: accelerated, paced, never ahead, never reused."""

from __future__ import annotations

import pytest

from refcell.process.clock import NS, CellClock, resumed_start_ns, save_high_water, stamp

START = 1_796_000_000 * NS


class FakeWall:
    """Monotonic wall seconds that pass only when the clock sleeps (or the test says so)."""

    def __init__(self):
        self.t = 100.0
        self.slept: list[float] = []
        self.stopped = False

    def monotonic(self) -> float:
        return self.t

    # the clock sleeps through its stop event: the fake one lets fake time pass instead
    def is_set(self) -> bool:
        return self.stopped

    def wait(self, seconds: float) -> bool:
        self.slept.append(seconds)
        self.t += seconds
        return self.stopped


def clock(speed: float = 60.0) -> tuple[CellClock, FakeWall]:
    wall = FakeWall()
    return CellClock(speed, START, stop=wall, monotonic=wall.monotonic), wall


def test_it_starts_at_the_given_wall_time_and_runs_speed_times_faster():
    cell, wall = clock(60.0)
    assert cell.now_ns() == START == cell.limit_ns()
    wall.t += 2.0
    assert cell.limit_ns() == START + 120 * NS
    assert cell.now_ns() == START  # cell time moves only when the cell works or idles


def test_work_waits_until_the_clock_allows_it_so_it_never_runs_ahead():
    cell, wall = clock(60.0)
    cell.advance_to(START + 30 * NS)
    assert wall.slept == [pytest.approx(0.5)]
    assert cell.now_ns() == START + 30 * NS <= cell.limit_ns()


def test_slow_work_makes_the_clock_slower_not_jumpy():
    cell, wall = clock(60.0)
    wall.t += 10.0  # simulation took 10 s of wall time for what is 3 s of cell time
    cell.advance_to(START + 3 * NS)
    assert wall.slept == [] and cell.now_ns() == START + 3 * NS  # no jump to the limit


def test_an_idle_cell_catches_up_with_the_wall():
    cell, wall = clock(60.0)
    wall.t += 1.0
    cell.catch_up()
    assert cell.now_ns() == START + 60 * NS


def test_a_stopping_cell_finishes_its_work_without_sleeping():
    cell, wall = clock(60.0)
    wall.stopped = True
    cell.advance_to(START + 600 * NS)
    assert wall.slept == [] and cell.now_ns() == START + 600 * NS


def test_speed_must_be_positive():
    with pytest.raises(ValueError, match="--speed 0"):
        CellClock(0)


def test_a_restart_begins_after_the_previous_runs_latest_cell_time(tmp_path):
    assert resumed_start_ns(tmp_path, now_ns=START) == START  # a fresh box: the wall time
    save_high_water(tmp_path, START + 3600 * NS)  # an earlier run at 60x got an hour ahead
    assert resumed_start_ns(tmp_path, now_ns=START) == START + 3601 * NS
    assert resumed_start_ns(tmp_path, now_ns=START + 7200 * NS) == START + 7200 * NS
    (tmp_path / "cell-clock.json").write_text("{torn")
    assert resumed_start_ns(tmp_path, now_ns=START) == START


def test_stamps_are_utc_seconds():
    assert stamp(START) == "20261130T005320Z"


def test_a_held_clock_idles_no_further_than_the_hold_but_work_is_never_held():
    hold = {"ns": START + 90 * NS}
    cell, wall = clock(60.0)
    cell.hold_ns = lambda: hold["ns"]
    wall.t += 10.0  # the wall allows 600 s of cell time; the hold allows 90
    cell.catch_up()
    assert cell.now_ns() == START + 90 * NS
    cell.advance_to(START + 300 * NS)  # a trial's episode past the hold runs, unpaced
    assert wall.slept == [] and cell.now_ns() == START + 300 * NS
    hold["ns"] = START + 10_000 * NS  # the harness moves the hold on: the wall limits again
    cell.catch_up()
    assert cell.now_ns() == START + 600 * NS
