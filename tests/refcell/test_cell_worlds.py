"""The three cells' own lines (refcell/worlds/cell-0N.yaml): each differs from sim and from
the others systematically, and each is solvable (the expert succeeds on nearly every part)."""

from __future__ import annotations

import itertools

import pytest

from refcell.expert import Expert
from refcell.runner import run_episodes, summarize
from refcell.world import WORLD_NAMES, load_world

CELLS = ("cell-07", "cell-08", "cell-09")


def signature(world) -> dict:
    p = world.perception
    return {
        "camera_offset": (p.bias_x_m, p.bias_y_m),
        "friction": world.physics.friction,
        "latency": tuple(sorted(world.latency.steps.items())),
        "parts": tuple(sorted((v.name, v.probability) for v in world.parts)),
    }


def test_the_cells_worlds_are_shipped_by_name():
    assert set(CELLS) | {"sim", "line"} <= set(WORLD_NAMES)


@pytest.mark.parametrize("name", CELLS)
def test_each_line_differs_from_sim_in_every_class(name):
    sim, line = signature(load_world("sim")), signature(load_world(name))
    for key in sim:
        assert line[key] != sim[key], key
    assert min(dict(line["latency"])) > 0  # every command arrives late, every episode


def test_the_lines_differ_from_each_other_in_every_class():
    for a, b in itertools.combinations([signature(load_world(n)) for n in CELLS], 2):
        for key in a:
            assert a[key] != b[key], key


@pytest.mark.parametrize("name", CELLS)
def test_the_expert_solves_each_line(params, name):
    results = list(run_episodes(load_world(name), params.cell, Expert(), 40, seed=11))
    assert summarize(results)["success_rate"] >= 0.9
