"""The line differs from sim along every failure class, systematically."""

import numpy as np
import pytest

from refcell.cell import Cell
from refcell.world import latency_sampler, load_world, randomized, shift_conditions


@pytest.fixture(scope="module")
def worlds():
    return load_world("sim"), load_world("line")


def test_line_differs_from_sim_in_each_failure_class(worlds):
    sim, line = worlds
    assert line.physics.friction < sim.physics.friction
    assert line.physics.part_mass_kg > sim.physics.part_mass_kg
    assert line.physics.joint_damping > sim.physics.joint_damping
    assert line.sensors.joint_position_noise_m > sim.sensors.joint_position_noise_m
    assert abs(line.perception.bias_x_m) > 0 and line.perception.confidence_drop > 0
    assert max(line.latency.steps) > max(sim.latency.steps) and line.latency.load_extra_steps > 0
    assert {p.name for p in line.parts} > {p.name for p in sim.parts}


def perceived_offsets(world, params, episode_index, shift=100, episodes=1):
    cell = Cell(world, params.cell)
    offsets, confidences = [], []
    for i in range(episodes):
        cell.reset(seed=3, episode_index=episode_index + i, shift_episodes=shift)
        offsets.append(cell.perceived.part_xy - cell.true_state().part)
        confidences.append(cell.perceived.confidence)
    return np.array(offsets), np.array(confidences)


def test_camera_bias_is_systematic_and_drifts_with_lighting(worlds, params):
    _, line = worlds
    early, conf_early = perceived_offsets(line, params, 0, episodes=5)
    midday, conf_mid = perceived_offsets(line, params, 50, episodes=5)
    # Consistent offset at shift start, larger at mid-shift when lighting drifted most.
    assert np.allclose(
        early.mean(0), [line.perception.bias_x_m, line.perception.bias_y_m], atol=0.004
    )
    assert np.linalg.norm(midday.mean(0)) > np.linalg.norm(early.mean(0)) + 0.01
    assert conf_mid.mean() < conf_early.mean() - 0.3


def test_sim_perception_is_unbiased(worlds, params):
    sim, _ = worlds
    offsets, _ = perceived_offsets(sim, params, 0, episodes=20)
    assert np.linalg.norm(offsets.mean(0)) < 0.002


def first_moving_step(world, params, episode_index):
    cell = Cell(world, params.cell)
    cell.reset(seed=1, episode_index=episode_index, shift_episodes=100)
    for step in range(10):
        cell.step(np.array([1.0, 0.0]))
        if abs(cell.data.ctrl[0]) > 0:
            return step
    return None


def test_commands_arrive_late_on_the_line_and_later_under_load(worlds, params):
    sim, line = worlds
    assert first_moving_step(sim, params, 0) == 0
    quiet = [first_moving_step(line, params, i) for i in range(0, 20)]
    loaded = [first_moving_step(line, params, i) for i in range(30, 50)]
    assert all(q is not None and 1 <= q <= 3 for q in quiet)
    assert shift_conditions(line, 30, 100).under_load
    assert np.mean(loaded) > np.mean(quiet) + 0.5


def test_the_delay_table_draws_what_generator_choice_drew(worlds):
    """The cell draws a delay every step from a table built once per episode; a stream must
    give the same delays it gave through `Generator.choice`, or recorded shifts would change."""
    _, line = worlds
    steps = list(line.latency.steps)
    probs = np.array([line.latency.steps[s] for s in steps], dtype=float)
    draw = latency_sampler(line.latency)
    for load in (False, True):
        conditions = shift_conditions(line, 30 if load else 0, 100)
        assert conditions.under_load is load
        ours, theirs = np.random.default_rng(5), np.random.default_rng(5)
        drawn = [draw(conditions, ours) for _ in range(2000)]
        extra = line.latency.load_extra_steps if load else 0
        expected = [
            int(steps[int(theirs.choice(len(steps), p=probs / probs.sum()))]) + extra
            for _ in range(2000)
        ]
        assert drawn == expected and len(set(drawn)) == len(steps)


def test_line_shows_part_variants_sim_never_shows(worlds, params):
    sim, line = worlds
    seen = {"sim": set(), "line": set()}
    for name, world in (("sim", sim), ("line", line)):
        cell = Cell(world, params.cell)
        for i in range(60):
            cell.reset(seed=2, episode_index=i, shift_episodes=60)
            seen[name].add(cell.part.name)
    assert seen["sim"] == {"standard"}
    assert {"large", "square"} <= seen["line"]


def test_a_sim_policy_records_the_footprints_of_its_sims_parts_and_the_camera_measures_them(
    worlds, params
):
    from refcell.pretrain import part_footprints

    sim, line = worlds
    assert part_footprints(sim) == [0.06]  # the standard 30 mm cylinder, across
    assert len(part_footprints(line)) == len({p.size_m for p in line.parts}) > 1
    cell = Cell(line, params.cell)
    for i in range(20):
        cell.reset(seed=3, episode_index=i, shift_episodes=20)
        # The box's part screen compares this measurement (2 mm noise per axis) to them.
        assert np.abs(cell.part_extent_m - 2 * cell.part.size_m).max() < 0.01


def test_domain_randomization_draws_within_params_ranges(worlds, params):
    sim, _ = worlds
    ranges = params.pretrain.randomization
    draws = [randomized(sim, ranges, np.random.default_rng(i)) for i in range(50)]
    frictions = [w.physics.friction for w in draws]
    assert ranges.friction[0] <= min(frictions) < max(frictions) <= ranges.friction[1]
    assert len({tuple(w.latency.steps) for w in draws}) == 2


def test_safety_stop_on_joint_limit(worlds, params):
    sim, _ = worlds
    cell = Cell(sim, params.cell)
    cell.reset(seed=0, episode_index=0, shift_episodes=1)
    for _ in range(params.cell.max_steps):
        result = cell.step(np.array([1.0, 1.0]))
        if result.done:
            break
    assert result.safety_stop == "joint_limit" and not result.success
