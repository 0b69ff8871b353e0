"""A line that changes: dated events in a cell's line file, applied by the reference cell."""

from __future__ import annotations

import pytest

from refcell.cell import Cell
from refcell.process.clock import NS, CellClock
from refcell.process.line import Line
from refcell.timeline import DAY_NS, load_timeline, parse_timeline, world_on_day
from refcell.world import load_world

T0 = 1_800_000_000 * NS


def test_events_apply_in_day_order_and_only_once_their_day_has_come():
    world, timeline = load_world("cell-07"), load_timeline("cell-07")
    assert world_on_day(world, timeline, 2.9) == world
    knocked = world_on_day(world, timeline, 3.0)
    assert knocked.perception.bias_x_m == pytest.approx(world.perception.bias_x_m + 0.015)
    late = world_on_day(world, timeline, 14)
    parts = {part.name: part.probability for part in late.parts}
    assert parts["wide-box"] == pytest.approx(0.2)
    assert sum(parts.values()) == pytest.approx(1.0)  # the others shrank to make room
    assert min(late.latency.steps) == min(world.latency.steps) + 1  # the worn drive
    assert late.lighting.amplitude == 1.3


def test_every_reference_cell_changes_but_the_sim_and_shared_line_do_not():
    for cell in ("cell-07", "cell-08", "cell-09"):
        assert len(load_timeline(cell)) >= 4
    assert load_timeline("sim") == () and load_timeline("line") == ()


def test_a_bad_event_is_one_line_naming_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"^cell-x\.yaml: timeline: ") as caught:
        parse_timeline([{"day": -1, "name": "oops"}], "cell-x.yaml")
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match=r"no world key perception\.nothing"):
        world_on_day(
            load_world("cell-07"),
            parse_timeline([{"day": 0, "name": "x", "add": {"perception.nothing": 1}}], "f"),
            1,
        )


def test_the_line_applies_events_at_a_shift_start_and_keeps_day_zero_across_restarts(
    tmp_path, params
):
    world, timeline = load_world("cell-07"), load_timeline("cell-07")

    def line_at(start_ns: int) -> Line:
        cell = Cell(world, params.cell)
        return Line(cell, CellClock(1.0, start_ns), tmp_path, 10, seed=1, timeline=timeline)

    first = line_at(T0)
    first.take()
    assert first.cell.world == world  # day 0

    restarted = line_at(T0 + 4 * DAY_NS)  # the box remembers day 0
    assert restarted.day(restarted.cursor_ns) == pytest.approx(4.0)
    restarted.take()
    assert restarted.cell.world.perception.bias_x_m == pytest.approx(
        world.perception.bias_x_m + 0.015
    )
    assert {p.name for p in restarted.cell.world.parts} == {"standard", "large"}  # not day 5 yet
