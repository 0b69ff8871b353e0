"""A policy that sees its last frames (PolicyConfig.history) and can reach full speed
(output_gain): training data, the torch policy and the box build the same inputs."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from edge.runtime import (
    OOD,
    EpisodeInputs,
    Fallback,
    PolicySession,
    RuntimeLoadError,
    stacked_inputs,
)
from pipelines.contract.schema import STEPS_SCHEMA
from pipelines.training.finetune import training_examples
from pipelines.training.onnx_export import save_policy_for_edge
from pipelines.training.policy import Policy, PolicyConfig, PolicyNet, load_policy, save_policy
from tests.pipelines.test_finetune import _episodes, _step
from tests.pipelines.test_onnx_export import observations


def history_net(history: int = 3, gain: float = 1.0, seed: int = 0) -> PolicyNet:
    torch.manual_seed(seed)
    return PolicyNet(PolicyConfig(hidden=[16], history=history, output_gain=gain))


def test_inputs_stack_the_frames_before_each_step_and_never_cross_an_episode():
    frames = np.arange(5 * 12, dtype=np.float32).reshape(5, 12)  # row r holds 12r..12r+11
    first = np.array([0, 0, 0, 3, 3])  # two episodes: rows 0-2 and 3-4
    inputs = stacked_inputs(frames, 3, first)
    assert inputs.shape == (5, 36)
    rows_seen = inputs[:, ::12] / 12  # the first value of each stacked frame names its row
    np.testing.assert_array_equal(
        rows_seen, [[0, 0, 0], [1, 0, 0], [2, 1, 0], [3, 3, 3], [4, 3, 3]]
    )
    np.testing.assert_array_equal(stacked_inputs(frames, 3, first, rows=np.array([4])), inputs[4:])
    # Step by step, as the policy and the box build them, the same rows come out.
    episode = EpisodeInputs(3)
    for row in range(5):
        if row == 3:
            episode.begin()
        np.testing.assert_array_equal(episode.push(frames[row]), inputs[row])


def test_training_examples_give_each_label_the_frames_its_episode_showed_before_it():
    episodes = _episodes(
        [
            {"episode_id": "a", "target": [0.1, 0.2], "success": True},
            {"episode_id": "b", "target": [0.5, -0.5], "success": False},
        ]
    )
    rows = [_step("a", k, [0.5, 0.5]) for k in range(3)]
    rows += [_step("b", 0, [0.5, 0.0], base=10.0)]
    rows += [_step("b", 1, [0.0, -0.5], True, [0.0, -0.5], base=10.0)]
    data = training_examples(episodes, pa.Table.from_pylist(rows[::-1], schema=STEPS_SCHEMA), 1.0)
    assert len(data) == 4  # a's three steps, b's correction
    np.testing.assert_array_equal(data.inputs(PolicyConfig()), data.observations)
    inputs = data.inputs(PolicyConfig(history=2))
    assert inputs.shape == (4, 24)
    pusher_x = inputs[
        :, [0, 12]
    ]  # joint_x of the newest frame and the one before (base + step + 0.1)
    np.testing.assert_allclose(
        pusher_x, [[0.1, 0.1], [1.1, 0.1], [2.1, 1.1], [11.1, 10.1]], rtol=1e-6
    )
    bare = type(data)(data.observations, data.actions, data.weights, 2, 3, 1, data.is_correction)
    with pytest.raises(ValueError, match="without their episodes' frames"):
        bare.inputs(PolicyConfig(history=2))


def test_the_torch_policy_and_the_box_act_alike_on_an_episode_and_forget_it_after(tmp_path):
    net = history_net(history=3, gain=1.25)
    episode = observations(40, seed=4)
    folder, record = save_policy_for_edge(net, tmp_path / "p", stacked_inputs(episode, 3), 0.01)
    assert record["parity_passed"]
    config = json.loads((folder / "config.json").read_text())
    assert config["history"] == 3 and config["output_gain"] == 1.25
    torch_policy, box = load_policy(folder), PolicySession(folder, min_confidence=0.0)
    with torch.inference_mode():
        expected = net(torch.from_numpy(stacked_inputs(episode, 3))).numpy()
    for policy in (torch_policy, box):
        policy.begin_episode()
        acted = [
            policy.act(obs) if k != 5 else policy.observe(obs) for k, obs in enumerate(episode)
        ]
        acted = np.stack([a for k, a in enumerate(acted) if k != 5])
        # step 5 went to the fallback but was seen: every later action still matches
        np.testing.assert_allclose(acted, np.delete(expected, 5, axis=0), atol=1e-5)
        policy.begin_episode()  # a new episode remembers nothing of the last
        np.testing.assert_allclose(
            policy.act(episode[7]), expected_first(net, episode[7]), atol=1e-5
        )
    assert np.abs(expected).max() <= 1.0


def expected_first(net: PolicyNet, obs: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return net(torch.from_numpy(np.tile(obs, 3))).numpy()


def test_a_plain_policy_writes_its_config_as_before_and_the_box_refuses_a_bad_history(tmp_path):
    plain = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    assert "history" not in config and "output_gain" not in config
    assert load_policy(plain).episode.size == 12
    for bad in ({"history": 0}, {"history": 2.5}, {"output_gain": 0.5}, {"output_gain": None}):
        (plain / "config.json").write_text(json.dumps({**config, **bad}))
        with pytest.raises(ValueError, match=r"plain/config\.json: history .* output_gain"):
            load_policy(plain)
    folder, _ = save_policy_for_edge(
        history_net(2), tmp_path / "h2", np.tile(observations(500), (1, 2)), 0.01
    )
    for bad in (0, "4", True, 100):
        (folder / "config.json").write_text(json.dumps({**config, "history": bad}))
        with pytest.raises(RuntimeLoadError, match=r"config\.json: history .* not a number"):
            PolicySession(folder, 0.0)
    (folder / "config.json").write_text(json.dumps({**config, "history": 3}))
    with pytest.raises(
        RuntimeLoadError, match=r"policy\.onnx: expects 24 input values, its config\.json says 36"
    ):
        PolicySession(folder, 0.0)


def test_output_gain_reaches_full_speed_when_acting_and_keeps_its_gradient_in_training():
    net = history_net(history=1, gain=1.25)
    with torch.no_grad():
        net.mlp[-2].bias.fill_(3.0)  # tanh(3) = 0.995: a plain tanh would stop short of 1
    x = torch.from_numpy(observations(20, seed=2))
    acting = net.eval()(x)
    assert torch.all(acting == 1.0)
    training = net.train()(x)
    assert torch.all(training > 1.2)  # unclipped: the loss still pulls it back toward a label
    training.sum().backward()
    assert net.mlp[-2].bias.grad.abs().sum() > 0
    assert Policy(net).act(observations(1)[0]).max() == 1.0


def test_the_cell_starts_each_episode_afresh_and_shows_the_policy_every_frame():
    from pipelines.contract.params import load_params
    from refcell.cell import Cell
    from refcell.runner import run_episode
    from refcell.world import load_world

    class Counting:
        name = "counting"

        def __init__(self):
            self.begun, self.seen, self.acted = 0, 0, 0

        def begin_episode(self):
            self.begun += 1

        def observe(self, obs):
            self.seen += 1

        def act(self, obs):
            self.acted += 1
            return np.zeros(2)

    def every_third_step(obs, footprint):  # the box hands every third step to the operator
        every_third_step.calls += 1
        return Fallback(OOD, 9.0, 1.0, 0.9) if every_third_step.calls % 3 == 0 else None

    every_third_step.calls = 0
    params, policy = load_params("params.yaml"), Counting()
    cell = Cell(load_world("cell-07"), params.cell)
    results = [run_episode(cell, policy, 1, k, 10, screen=every_third_step) for k in range(2)]
    assert policy.begun == 2
    assert policy.seen + policy.acted == sum(r.steps for r in results)
    assert policy.seen == sum(r.steps for r in results) // 3 > 0
