import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
from pipelines.training.finetune import finetune, training_examples
from pipelines.training.policy import OBS_SIZE, Policy, PolicyConfig, PolicyNet


def _episodes(rows: list[dict]) -> pa.Table:
    """An episodes table in the contract's schema; only id, target and success matter here."""
    filler = {
        "cell_id": "cell-07",
        "robot_serial": "GX",
        "policy_version": "sim-0",
        "sensor_calibration_id": "cam",
        "software_version": "1",
        "source_uri": "file.mcap",
        "source_sha256": "0" * 64,
        "source_chunk": None,
        "ingest_run_id": "run",
        "ingested_at": 0,
        "realloop_version": "0",
        "start_time": 0,
        "part_extent_m": None,
        "failure_cause": None,
        "safety_stops": 0,
        "safety_stop_kind": None,
        "interventions": 0,
        "steps": 0,
        "cycle_time_s": 0.0,
        "edge_case": False,
        "edge_case_reasons": None,
        "attachments": None,
    }
    return pa.Table.from_pylist([{**filler, **row} for row in rows], schema=EPISODES_SCHEMA)


def _step(episode_id, step, action, intervention=False, corrected=None, base=0.0) -> dict:
    """A step row whose sensor values encode (episode base, step) so they can be traced."""
    v = base + step
    return {
        "episode_id": episode_id,
        "step": step,
        "time_s": step / 20,
        "joint_position": [v + 0.1, v + 0.2],
        "joint_velocity": [v + 0.3, v + 0.4],
        "part_pose": [v + 0.5, v + 0.6, v + 0.7],
        "part_confidence": 0.75,
        "action": action,
        "intervention": intervention,
        "corrected_action": corrected,
    }


@pytest.fixture
def tables() -> tuple[pa.Table, pa.Table]:
    """Episode a succeeds with one operator takeover; episode b fails with one."""
    episodes = _episodes(
        [
            {"episode_id": "b", "target": [0.5, -0.5], "success": False},
            {"episode_id": "a", "target": [0.1, 0.2], "success": True},
        ]
    )
    rows = [
        _step("a", 0, [0.5, 0.5]),
        _step("a", 1, [-0.25, 0.75], True, [-0.25, 0.75]),
        _step("a", 2, [1.0, 0.0]),
        _step("b", 0, [0.5, 0.0], base=10.0),
        _step("b", 1, [0.0, -0.5], True, [0.0, -0.5], base=10.0),
        _step("b", 2, [0.25, 0.25], base=10.0),
    ]
    order = [4, 2, 0, 5, 1, 3]  # as ingest might deliver them: not sorted
    return episodes, pa.Table.from_pylist([rows[i] for i in order], schema=STEPS_SCHEMA)


def test_observations_are_rebuilt_in_obs_fields_order(tables):
    episodes, steps = tables
    all_kept = episodes.set_column(
        episodes.schema.get_field_index("success"), "success", pa.array([True, True])
    )
    data = training_examples(all_kept, steps, intervention_weight=1.0)
    assert data.observations.dtype == np.float32 and data.observations.shape == (6, 12)
    # Sorted by episode, then step; step 0 has no previous action.
    a0, a1, b0 = data.observations[0], data.observations[1], data.observations[3]
    np.testing.assert_allclose(
        a0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.1, 0.2, 0.0, 0.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        a1, [1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 0.75, 0.1, 0.2, 0.5, 0.5], rtol=1e-6
    )
    # The previous action is never carried across episodes.
    np.testing.assert_allclose(b0[8:], [0.5, -0.5, 0.0, 0.0])
    np.testing.assert_allclose(b0[:2], [10.1, 10.2], rtol=1e-6)
    # After a takeover the previous action is what was commanded: the operator's.
    np.testing.assert_allclose(data.observations[2][10:], [-0.25, 0.75])


def test_labels_are_successes_plus_corrections_never_failed_episodes_own_actions(tables):
    episodes, steps = tables
    data = training_examples(episodes, steps, intervention_weight=4.0)
    # a: all three steps (step 1 labelled by its correction); b: only its correction.
    assert len(data) == 4
    assert (data.success_steps, data.correction_steps, data.episodes_used) == (2, 2, 2)
    np.testing.assert_allclose(
        data.actions, [[0.5, 0.5], [-0.25, 0.75], [1.0, 0.0], [0.0, -0.5]], rtol=1e-6
    )
    np.testing.assert_allclose(data.weights, [1.0, 4.0, 1.0, 4.0])
    assert data.weights.dtype == np.float32 and data.actions.dtype == np.float32
    # b's correction sits at b's step 1, after b's own step 0.
    np.testing.assert_allclose(data.observations[3][:2], [11.1, 11.2], rtol=1e-6)


def test_a_novel_part_episodes_examples_weigh_more_and_the_rest_do_not_move(tables):
    episodes, steps = tables
    novel = {"b"}  # data selection found another part in b (triage.novel_part_weight)
    data = training_examples(episodes, steps, 4.0, novel_episodes=novel, novel_weight=3.0)
    np.testing.assert_allclose(data.weights, [1.0, 4.0, 1.0, 12.0])
    same = training_examples(episodes, steps, 4.0, novel_episodes={"elsewhere"}, novel_weight=3.0)
    np.testing.assert_allclose(same.weights, [1.0, 4.0, 1.0, 4.0])


def test_corrected_action_not_commanded_action_is_the_label():
    """Were they ever to differ, the operator's corrected action is what the policy learns."""
    episodes = _episodes([{"episode_id": "a", "target": [0.0, 0.0], "success": False}])
    steps = pa.Table.from_pylist(
        [_step("a", 0, [0.0, 0.0], True, [0.5, -0.5])], schema=STEPS_SCHEMA
    )
    data = training_examples(episodes, steps, intervention_weight=2.0)
    np.testing.assert_allclose(data.actions, [[0.5, -0.5]])
    assert data.episodes_used == 1 and data.success_steps == 0


def test_steps_of_an_unknown_episode_are_an_error(tables):
    episodes, steps = tables
    with pytest.raises(ValueError, match="missing from the episodes table"):
        training_examples(episodes.slice(0, 1), steps, intervention_weight=1.0)


def test_rebuilt_observations_equal_what_the_cell_showed_the_policy(params):
    """The real-cell round trip: log what run_episode records, rebuild, compare bit for bit."""
    from refcell.runner import Operator, run_episodes
    from refcell.world import load_world

    torch.manual_seed(0)
    untrained = Policy(PolicyNet(PolicyConfig(hidden=[16])))  # wrong often: many takeovers
    seen, rows, episode_rows = [], [], []

    def log(_cell, record) -> None:
        episode_id = f"e{len(episode_rows)}"
        seen.append(record.observation)
        o, corrected = record.observation, record.corrected
        rows.append(
            {
                "episode_id": episode_id,
                "step": record.index,
                "time_s": record.time_s,
                "joint_position": o[0:2].tolist(),
                "joint_velocity": o[2:4].tolist(),
                "part_pose": o[4:7].tolist(),
                "part_confidence": float(o[7]),
                "action": np.asarray(record.commanded, np.float32).tolist(),
                "intervention": record.intervention,
                "corrected_action": None if corrected is None else corrected.tolist(),
            }
        )
        if record.result.done:
            episode_rows.append({"episode_id": episode_id, "target": o[8:10].tolist()})

    operator = Operator(params.record.operator)
    for _ in run_episodes(load_world("line"), params.cell, untrained, 2, 3, operator, (log,)):
        pass
    episodes = _episodes([{**row, "success": True} for row in episode_rows])
    steps = pa.Table.from_pylist(rows, schema=STEPS_SCHEMA)
    no_takeovers = steps.set_column(
        steps.schema.get_field_index("intervention"),
        "intervention",
        pa.array([False] * len(rows)),
    )
    data = training_examples(episodes, no_takeovers, intervention_weight=1.0)
    np.testing.assert_array_equal(data.observations, np.stack(seen))
    assert any(row["intervention"] for row in rows)


def test_finetune_is_deterministic_and_leaves_the_base_alone(tables, params):
    episodes, steps = tables
    data = training_examples(episodes, steps, intervention_weight=3.0)
    torch.manual_seed(0)
    base = PolicyNet(PolicyConfig(hidden=[16, 16], version="sim-0", trained_on={"world": "sim"}))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    train = dataclasses.replace(params.train, epochs=3, batch_size=2, val_fraction=0.25)

    first, history = finetune(base, data, train, "line-1")
    second, _ = finetune(base, data, train, "line-1")

    assert len(history) == 3
    for key, value in base.state_dict().items():
        assert torch.equal(value, before[key]), f"base changed: {key}"
        assert torch.equal(first.state_dict()[key], second.state_dict()[key])
    assert any(not torch.equal(first.state_dict()[k], before[k]) for k in before)
    assert first.config.version == "line-1" and base.config.version == "sim-0"
    assert first.config.trained_on["base_version"] == "sim-0"
    assert first.config.trained_on["correction_steps"] == 2
    assert base.config.trained_on == {"world": "sim"}


def test_finetune_refuses_an_empty_training_set(tables, params):
    episodes, steps = tables
    data = training_examples(episodes, steps.slice(0, 0), intervention_weight=3.0)
    assert len(data) == 0
    with pytest.raises(ValueError, match="no training examples"):
        finetune(PolicyNet(PolicyConfig(hidden=[4])), data, params.train, "line-1")


def test_the_thread_count_changes_no_weight_and_the_callers_setting_comes_back():
    from pipelines.training.train import fit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, OBS_SIZE)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(600, 2)).astype(np.float32)
    seen, weights = [], []
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for threads in (None, 1):  # torch's default (the caller's 2), then train.threads: 1
            torch.manual_seed(0)
            net = PolicyNet(PolicyConfig())
            fit(net, x, y, epochs=2, batch_size=64, learning_rate=1e-3, seed=3, threads=threads,
                on_epoch=lambda _: seen.append(torch.get_num_threads()))  # fmt: skip
            weights.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
            assert torch.get_num_threads() == 2  # the caller's setting is back
    finally:
        torch.set_num_threads(before)
    assert seen == [2, 2, 1, 1]
    assert torch.equal(weights[0], weights[1])


def test_a_cosine_schedule_brings_the_weights_to_rest_and_constant_changes_nothing():
    """Annealed, the last epoch barely moves the weights (the rate is near zero there); held,
    it moves them as much as ever. "constant" is the old fit, to the byte."""
    from pipelines.training.train import fit

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, OBS_SIZE)).astype(np.float32)
    y = rng.uniform(-1, 1, size=(600, 2)).astype(np.float32)

    def weights(net):
        return torch.cat([p.detach().flatten() for p in net.parameters()]).clone()

    def last_epoch_move(schedule):
        torch.manual_seed(0)
        net = PolicyNet(PolicyConfig())
        seen = []
        fit(
            net,
            x,
            y,
            epochs=6,
            batch_size=64,
            learning_rate=1e-3,
            seed=3,
            learning_rate_schedule=schedule,
            on_epoch=lambda _: seen.append(weights(net)),
        )
        first, last = seen[1] - seen[0], seen[-1] - seen[-2]
        return float(last.norm() / first.norm()), seen[-1]

    held, held_weights = last_epoch_move("constant")
    annealed, _ = last_epoch_move("cosine")
    assert annealed < 0.1 < held
    torch.manual_seed(0)
    default = PolicyNet(PolicyConfig())
    fit(default, x, y, epochs=6, batch_size=64, learning_rate=1e-3, seed=3)
    assert torch.equal(weights(default), held_weights)


def test_each_used_episodes_measured_footprint_is_kept_for_the_edge_part_screen(tables):
    episodes, steps = tables
    extents = pa.array([[0.07, 0.074], None], episodes.schema.field("part_extent_m").type)
    measured = episodes.set_column(
        episodes.schema.get_field_index("part_extent_m"), "part_extent_m", extents
    )
    data = training_examples(measured, steps, intervention_weight=1.0)
    # Sorted by episode id: a (no footprint logged), then b.
    np.testing.assert_allclose(data.part_footprints_m, [np.nan, 0.072])
