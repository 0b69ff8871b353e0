"""The standard-part replay triage asks for (params `simulator.counterfactual`): an episode
started where its logs say, with the part the cell was built for, in the calibrated sim."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from pipelines.quality.triage import LoggedStart
from pipelines.training import PolicyConfig, PolicyNet, save_policy
from refcell.cell import camera_bias
from refcell.counterfactual import StartedCell, lighting_from_confidence, standard_part_success
from refcell.world import calibrated_world, load_world


@pytest.fixture
def calibration(tmp_path):
    path = tmp_path / "sim-calibration.yaml"
    camera = {"bias_x_m": -0.01, "bias_y_m": 0.012, "bias_drift_y_m": 0.008}
    camera |= {"confidence_base": 0.93, "confidence_drop": 0.45}  # it sees the light
    line = {"perception": camera, "lighting": {"amplitude": 1.0}}
    path.write_text(yaml.safe_dump({"world": line}))
    return path


def _start(part=(0.02, -0.03), target=(0.12, 0.05), confidence=0.7) -> LoggedStart:
    return LoggedStart("e-1", (-0.15, 0.1), part, 0.3, target, confidence)


def test_the_light_is_read_from_the_cameras_confidence():
    perception = load_world("line").perception
    base, drop = perception.confidence_base, perception.confidence_drop
    assert lighting_from_confidence(perception, 1.0, base - 0.4 * drop) == pytest.approx(0.4)
    assert lighting_from_confidence(perception, 1.0, base + 0.05) == 0.0  # brighter than best
    assert lighting_from_confidence(perception, 0.6, 0.0) == 0.6  # no darker than the line


def test_an_episode_starts_where_its_logs_say(params, calibration):
    world, _ = calibrated_world(calibration)
    cell = StartedCell(world, params.cell)
    cell.start = start = _start()
    cell.reset(3, 0, 8)
    light = lighting_from_confidence(world.perception, world.lighting.amplitude, 0.7)
    assert cell.conditions.lighting == pytest.approx(light) and light > 0
    state = cell.true_state()
    assert state.pusher == pytest.approx(start.pusher)
    # the camera saw the part through its offset: the true part is where it saw it, less that
    expected = np.asarray(start.part) - camera_bias(world.perception, light)
    assert state.part == pytest.approx(expected)
    assert state.target == pytest.approx(start.target)


def test_standard_part_success_is_a_share_per_start(params, calibration, tmp_path):
    policy = save_policy(PolicyNet(PolicyConfig()), tmp_path / "policy")
    world, _ = calibrated_world(calibration)
    on_target = np.asarray(_start().target) + camera_bias(world.perception, 0.0)
    starts = [_start(), _start(part=tuple(on_target), confidence=1.0)]
    shares = standard_part_success(policy, calibration, params.cell, starts, 4, 7)
    assert len(shares) == 2 and all(share in (0.0, 0.25, 0.5, 0.75, 1.0) for share in shares)
    assert shares[1] == 1.0, "a part the camera saw on its target is placed at once"
    assert standard_part_success(policy, calibration, params.cell, starts, 4, 7) == shares
