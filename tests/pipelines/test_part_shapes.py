"""Calibration tells a box from a cylinder of the same size by how its pushes turn it
(pipelines.calibrate.parts: shape votes), on episodes the reference cell records."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pipelines.calibrate import latency as latency_fit
from pipelines.calibrate import sensing
from pipelines.calibrate.logs import LoggedEpisode
from pipelines.calibrate.parts import fit_part_mix
from pipelines.contract.params import load_params
from refcell.cell import Cell
from refcell.expert import Expert
from refcell.replay import SimReplay
from refcell.runner import run_episode
from refcell.world import PartVariant, load_world
from tests.conftest import ROOT

EPISODES = 120
CYLINDER = PartVariant("standard", "cylinder", 0.030, 1.0, 0.6)
SQUARE = PartVariant("square", "box", 0.030, 1.0, 0.4)  # the same footprint as CYLINDER


def _recorded(parts: tuple[PartVariant, ...], seed: int):
    """The line's episodes as calibration reads them, and each episode's true part."""
    params = load_params(ROOT / "params.yaml")
    world = dataclasses.replace(load_world("line"), parts=parts)
    cell = Cell(world, params.cell)
    logs, truth = [], {}
    for index in range(EPISODES):
        steps: list = []
        result = run_episode(
            cell,
            Expert(),
            seed,
            index,
            EPISODES,
            observers=(lambda _, s, kept=steps: kept.append(s),),
        )
        obs = np.array([s.observation for s in steps], float)
        episode_id = f"cell-s1-{index:05d}"
        logs.append(
            LoggedEpisode(
                episode_id,
                "s1",
                index / EPISODES,
                np.array(cell.part_extent_m, float),
                obs[:, 0:2],
                obs[:, 2:4],
                obs[:, 4:6],
                np.unwrap(obs[:, 6]),
                obs[:, 7],
                np.array([s.commanded for s in steps], float),
            )
        )
        truth[episode_id] = result.part_variant
    return logs, truth, world, params.cell


@pytest.fixture(scope="module")
def boxes_among_cylinders():
    return _recorded((CYLINDER, SQUARE), seed=11)


class ReplayWithoutYaw(SimReplay):
    """A user's simulator that replays positions only (the protocol's yaw is optional)."""

    def replay(self, physics, batch):
        return [dataclasses.replace(r, part_yaw=None) for r in super().replay(physics, batch)]


def _part_mix(logs, world, cell, simulator_class=SimReplay):
    simulator = simulator_class(cell)
    radius = simulator.pusher_radius_m
    free = [sensing.clear_of_part(e, radius) for e in logs]
    latency = latency_fit.fit_latency(
        latency_fit.transitions(logs, cell.max_speed_mps, free), [e.episode_id for e in logs]
    )
    perception = {
        **sensing.perception_noise(logs, radius),
        **sensing.camera_bias(logs, radius),
    }
    physics = dataclasses.asdict(world.physics)
    noise = (world.sensors.joint_velocity_noise_mps, perception["pose_noise_m"].value)
    return fit_part_mix(
        simulator,
        logs,
        latency.ages_by_episode,
        perception,
        physics,
        noise,
        cell.max_speed_mps,
        yaw_noise=perception["yaw_noise_rad"].value,
    )


def test_a_box_among_cylinders_of_its_size_is_found_by_how_its_pushes_turn_it(
    boxes_among_cylinders,
):
    logs, truth, world, cell = boxes_among_cylinders
    parts = _part_mix(logs, world, cell)
    shapes = [p.shape for p in parts]
    assert shapes == ["cylinder", "box"]  # one footprint, two shapes
    cylinder, box = parts
    assert box.size.value == pytest.approx(cylinder.size.value)
    assert box.name.startswith("box-") and cylinder.name.startswith("part-")
    # Every episode voted box was one; the share is of the order of the truth's 0.4.
    assert {truth[e.episode_id] for e in box.episodes} == {"square"}
    assert 0.15 <= box.share.value <= 0.6
    assert box.share.value + cylinder.share.value == pytest.approx(1.0)


def test_cylinders_alone_stay_one_cylinder_variant():
    logs, _, world, cell = _recorded((dataclasses.replace(CYLINDER, probability=1.0),), seed=12)
    parts = _part_mix(logs, world, cell)
    assert [(p.shape, p.share.value) for p in parts] == [("cylinder", 1.0)]


def test_a_simulator_that_replays_no_yaw_leaves_every_part_a_cylinder(boxes_among_cylinders):
    logs, _, world, cell = boxes_among_cylinders
    parts = _part_mix(logs, world, cell, ReplayWithoutYaw)
    assert [p.shape for p in parts] == ["cylinder"]
