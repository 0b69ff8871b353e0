"""MuJoCo stays stable in every world, part variant and randomization extreme.

On a NaN, Inf or huge value MuJoCo resets the data and carries on, so an unstable episode
does not crash: it shows only in `data.warning` (and in a MUJOCO_LOG.TXT in the working
directory, which these tests do not read). The counters survive that reset; `Cell.reset`
clears them, so each episode is checked as it ends.
"""

import dataclasses
import itertools

import mujoco
import numpy as np
import pytest

from refcell.cell import Cell
from refcell.expert import Expert
from refcell.runner import run_episode
from refcell.world import World, load_world, randomized

LINE = load_world("line")
VARIANTS = [p.name for p in LINE.parts]
WARNINGS = {k: int(v) for k, v in mujoco.mjtWarning.__members__.items() if k != "mjNWARNING"}


def warnings_raised(cell: Cell) -> dict[str, int]:
    counts = {name: cell.data.warning[i].number for name, i in WARNINGS.items()}
    return {name: n for name, n in counts.items() if n}


def with_only(world: World, variant: str) -> World:
    part = next(p for p in LINE.parts if p.name == variant)
    return dataclasses.replace(world, parts=(dataclasses.replace(part, probability=1.0),))


def run_and_check(cell, controller, seed, episodes, worlds=None) -> list[bool]:
    """Run `episodes` (over a whole shift), asserting no episode raised a MuJoCo warning."""
    successes = []
    for index in range(episodes):
        world = worlds[index] if worlds else None
        result = run_episode(cell, controller, seed, index, episodes, world=world)
        raised = warnings_raised(cell)
        assert not raised, f"episode {index} ({result.part_variant}): {raised}"
        assert np.all(np.isfinite(cell.data.qpos)) and np.all(np.isfinite(cell.data.qvel))
        successes.append(result.success)
    return successes


class Wander:
    """Full-speed random drives held for a few steps: rams the part from every side."""

    name = "wander"

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.action = np.zeros(2)

    def act(self, _obs) -> np.ndarray:
        if self.rng.random() < 0.2:
            self.action = self.rng.choice([-1.0, 1.0], 2) * self.rng.uniform(0.5, 1.0, 2)
        return self.action


@pytest.mark.parametrize("variant", VARIANTS)
def test_expert_line_shift_is_stable_for_every_part_variant(variant, params):
    cell = Cell(with_only(LINE, variant), params.cell)
    successes = run_and_check(cell, Expert(), seed=11, episodes=100)
    assert np.mean(successes) >= 0.9  # the episodes did push the part, as on the line


@pytest.mark.parametrize("variant", VARIANTS)
def test_expert_is_stable_at_the_sim_randomization_extremes(variant, params):
    ranges = params.pretrain.randomization
    keys = ("friction", "part_mass_kg", "joint_damping", "latency_steps")
    corners = [  # every low/high combination, as degenerate (value, value) ranges
        dataclasses.replace(
            ranges,
            **{k: (getattr(ranges, k)[i],) * 2 for k, i in zip(keys, pick, strict=True)},
        )
        for pick in itertools.product((0, 1), repeat=len(keys))
    ]
    sim = with_only(load_world("sim"), variant)
    worlds = [randomized(sim, c, np.random.default_rng(0)) for c in corners for _ in range(5)]
    run_and_check(Cell(sim, params.cell), Expert(), seed=3, episodes=len(worlds), worlds=worlds)


@pytest.mark.parametrize("variant", VARIANTS)
def test_ramming_the_part_on_the_line_is_stable(variant, params):
    cell = Cell(with_only(LINE, variant), params.cell)
    run_and_check(cell, Wander(seed=VARIANTS.index(variant)), seed=5, episodes=60)
