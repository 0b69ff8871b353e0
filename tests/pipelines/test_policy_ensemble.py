"""A policy of several students trained side by side, acting on their mean action
(PolicyConfig.ensemble): one module, one file, one ONNX graph."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from edge.runtime import PolicySession, stacked_inputs
from pipelines.contract.params import load_params
from pipelines.training.finetune import MODES, TrainingSet, finetune
from pipelines.training.onnx_export import save_policy_for_edge
from pipelines.training.policy import PolicyConfig, PolicyNet, load_policy, save_policy
from pipelines.training.train import fit
from tests.pipelines.test_onnx_export import observations


def ensemble_net(members: int = 3, seed: int = 0, **config) -> PolicyNet:
    torch.manual_seed(seed)
    return PolicyNet(PolicyConfig(hidden=[16, 16], ensemble=members, **config))


def labels(obs: np.ndarray) -> np.ndarray:
    """A smooth target the members can all learn: toward the part, as the expert goes."""
    return np.tanh(10.0 * (obs[:, 4:6] - obs[:, 0:2])).astype(np.float32)


def test_the_policy_acts_on_the_mean_of_members_that_start_apart():
    net = ensemble_net(members=3, output_gain=1.25).eval()
    x = torch.from_numpy(observations(50, seed=1))
    members = net.member_actions(x)
    assert members.shape == (3, 50, 2)
    assert (members[0] - members[1]).abs().max() > 1e-3  # each from its own draw
    torch.testing.assert_close(net(x), members.mean(dim=0).clamp(-1.0, 1.0))
    one = net(x[7])  # a single observation, as the cell's controller asks
    torch.testing.assert_close(one, net(x)[7])


def test_training_fits_every_member_on_its_own_and_their_mean_errs_least():
    obs = observations(3000, seed=3)
    net = ensemble_net(members=3)
    history = fit(net, obs, labels(obs), epochs=30, batch_size=128, learning_rate=3e-3, seed=5)
    assert history[-1].train_loss < history[0].train_loss / 3
    test = observations(1000, seed=9)
    target = torch.from_numpy(labels(test))
    with torch.no_grad():
        member_errors = ((net.member_actions(torch.from_numpy(test)) - target) ** 2).mean((1, 2))
        mean_error = float(((net.eval()(torch.from_numpy(test)) - target) ** 2).mean())
    assert member_errors.max() < 0.05  # every member learned, not only their sum
    assert mean_error <= float(member_errors.mean())  # averaging cannot err more (convexity)


def test_an_ensemble_round_trips_through_its_files_and_the_box_acts_as_torch_does(tmp_path):
    net = ensemble_net(members=4, history=2, output_gain=1.25)
    inputs = stacked_inputs(observations(600, seed=2), 2)
    folder, record = save_policy_for_edge(net, tmp_path / "ens", inputs, 0.01)
    assert record["parity_passed"] and record["parity_observations"] == 600
    assert json.loads((folder / "config.json").read_text())["ensemble"] == 4
    loaded = load_policy(folder).net
    with torch.inference_mode():
        expected = net.eval()(torch.from_numpy(inputs)).numpy()
        np.testing.assert_array_equal(loaded(torch.from_numpy(inputs)).numpy(), expected)
    box = PolicySession(folder, min_confidence=0.0)
    np.testing.assert_allclose(box.act_batch(inputs), expected, atol=1e-5)


def test_a_plain_policy_has_no_ensemble_key_and_a_bad_member_count_is_refused(tmp_path):
    plain = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    assert "ensemble" not in config
    for bad in (0, 9, 2.0, "3", None):
        (plain / "config.json").write_text(json.dumps({**config, "ensemble": bad}))
        with pytest.raises(ValueError, match=r"plain/config\.json: .* ensemble .* members"):
            load_policy(plain)
    # weights of one network under a config that says three members: refused, not half-loaded
    (plain / "config.json").write_text(json.dumps({**config, "ensemble": 3}))
    with pytest.raises(ValueError, match=r"model\.safetensors: unreadable or mismatched"):
        load_policy(plain)


@pytest.mark.parametrize("mode", MODES)
def test_fine_tuning_an_ensemble_moves_it_and_leaves_the_base_as_it_was(mode):
    base = ensemble_net(members=3)
    before = copy.deepcopy(base.state_dict())
    obs = observations(96, seed=6)
    correction = np.arange(len(obs)) % 3 == 0
    data = TrainingSet(
        observations=obs,
        actions=np.tile(np.float32([0.9, -0.9]), (len(obs), 1)),  # far from what the base does
        weights=np.where(correction, 10.0, 1.0).astype(np.float32),
        episodes_used=8,
        success_steps=int((~correction).sum()),
        correction_steps=int(correction.sum()),
        is_correction=correction,
    )
    recipe = dataclasses.replace(
        load_params("params.yaml").train, mode=mode, epochs=4, batch_size=32, threads=1
    )
    tuned, _ = finetune(base, data, recipe, "line-1")
    assert tuned.config.ensemble == 3
    x = torch.from_numpy(obs)
    with torch.no_grad():
        assert (tuned.eval()(x) - base.eval()(x)).abs().max() > 1e-3
    for key, value in base.state_dict().items():
        assert torch.equal(value, before[key]), key
