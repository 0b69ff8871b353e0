"""params `simulator.counterfactual`: would a standard part have made it?

Triage (pipelines.quality.triage.counterfactual) hands over a failed episode's start as its
logs show it; this replays it in the sim a calibration describes, with the part the cell was
built for (the sim's), under fresh draws of the calibrated noise, and returns the share that
succeeds. The logs show the part where the camera saw it: the calibration's camera bias, at
the light the episode's camera confidence shows, is taken off to place it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import mujoco
import numpy as np

from pipelines.contract.params import CellParams
from pipelines.quality.triage.counterfactual import LoggedStart
from refcell.cell import Cell, camera_bias
from refcell.world import Perception, ShiftConditions, calibrated_world, load_world


def standard_part_success(
    policy: Path,
    calibration: Path,
    cell: CellParams,
    starts: Sequence[LoggedStart],
    draws: int,
    seed: int,
) -> list[float]:
    """For each start, the share of `draws` episodes `policy` places from it with the
    standard part in the calibrated sim (pipelines.quality.triage.StandardPartReplay)."""
    from pipelines.training import load_policy
    from refcell.runner import run_episode

    line, _ = calibrated_world(calibration)
    standard = dataclasses.replace(line, parts=load_world("sim").parts)
    replaying = StartedCell(standard, cell)
    controller = load_policy(policy)
    shares = []
    for k, start in enumerate(starts):
        replaying.start = start
        wins = [
            run_episode(replaying, controller, seed, k * draws + draw, draws).success
            for draw in range(draws)
        ]
        shares.append(float(np.mean(wins)))
    return shares


def lighting_from_confidence(perception: Perception, amplitude: float, confidence: float) -> float:
    """The light an episode's mean camera confidence shows (the camera is surer in good
    light: confidence = base - drop x lighting, refcell.cell), within the line's range."""
    if perception.confidence_drop <= 0:  # confidence says nothing of the light: its middle
        return 0.5 * amplitude
    light = (perception.confidence_base - confidence) / perception.confidence_drop
    return float(np.clip(light, 0.0, amplitude))


class StartedCell(Cell):
    """The cell with each episode started where `start` says, in the light its confidence
    shows; load (an extra step of latency) comes with the line's share of the shift, drawn
    like the rest of the noise."""

    start: LoggedStart

    def reset(self, seed, episode_index, shift_episodes, world=None):
        super().reset(seed, episode_index, shift_episodes, world=world)
        world = self.episode_world
        lighting = lighting_from_confidence(
            world.perception, world.lighting.amplitude, self.start.confidence
        )
        under_load = bool(self.rng["latency"].random() < world.latency.load_fraction)
        self.conditions = ShiftConditions(lighting=lighting, under_load=under_load)
        part = np.asarray(self.start.part) - camera_bias(world.perception, lighting)
        self.target = np.asarray(self.start.target, dtype=float)
        self.data.qpos[0:2] = self.start.pusher
        self.data.qpos[2:5] = [*part, self.start.part_yaw]
        mujoco.mj_forward(self.model, self.data)
        self.perceived = self._perceive()
        return self.observation()
