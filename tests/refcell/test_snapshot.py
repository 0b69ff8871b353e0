"""A capture's snapshot shows the cell as it was: triage reads the true part back from it."""

import numpy as np

from pipelines.quality.triage.snapshots import read_snapshot
from refcell.cell import Cell
from refcell.runner import run_episode
from refcell.snapshot import caption, snapshot_png
from refcell.world import load_world


def _snapshots(params, world: str, episodes: int, every: int = 15):
    """(snapshot PNG, the cell's true state) at every `every`-th step of some episodes."""
    cell, taken = Cell(load_world(world), params.cell), []

    def take(cell, record):
        if record.index % every == 0:
            text = caption("near_failure", "2026-12-01T06:00:00+00:00", record, "a test")
            taken.append((snapshot_png(cell, record, text), cell.true_state()))

    from refcell.expert import Expert

    for index in range(episodes):
        run_episode(cell, Expert(), 3, index, episodes, observers=(take,))
    return taken


def test_triage_reads_the_true_part_back_from_the_snapshot(params):
    half_width = params.triage.snapshot_half_width_m
    read = [(read_snapshot(png, half_width), state) for png, state in _snapshots(params, "line", 6)]
    measured = [(part, state) for part, state in read if part is not None]
    assert len(measured) >= 0.8 * len(read) > 0
    pixel_m = 2 * half_width / 240  # the table is about 240 px across
    for part, state in measured:
        assert np.hypot(part.x_m - state.part[0], part.y_m - state.part[1]) < 1.5 * pixel_m
        assert abs(part.radius_m - state.part_size_m) < 1.5 * pixel_m


def test_snapshots_in_a_row_do_not_carry_over(params):
    """Each snapshot is the cell at its own step (the drawing is reused between snapshots)."""
    (first, _), (second, _) = _snapshots(params, "line", 1, every=40)[:2]
    again = _snapshots(params, "line", 1, every=40)
    assert first != second
    assert again[0][0] == first and again[1][0] == second
