"""train.mode: full, anchored, residual (pipelines.training.finetune; figures: bench/efficacy)."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import yaml

from pipelines.contract.params import ParamsError, load_params
from pipelines.training.finetune import MODES, TrainingSet, finetune
from pipelines.training.onnx_export import save_policy_for_edge
from pipelines.training.policy import OBS_SIZE, PolicyConfig, PolicyNet, load_policy
from pipelines.training.train import fit


@pytest.fixture
def base() -> PolicyNet:
    torch.manual_seed(3)
    return PolicyNet(PolicyConfig(hidden=[16, 16], version="base-1"))


@pytest.fixture
def data() -> TrainingSet:
    """Labels far from anything the base does: any mode that may move will move."""
    rng = np.random.default_rng(0)
    n = 96
    correction = np.arange(n) % 3 == 0
    return TrainingSet(
        observations=rng.normal(0, 0.1, (n, OBS_SIZE)).astype(np.float32),
        actions=np.tile(np.float32([0.9, -0.9]), (n, 1)),
        weights=np.where(correction, 10.0, 1.0).astype(np.float32),
        episodes_used=8,
        success_steps=int((~correction).sum()),
        correction_steps=int(correction.sum()),
        is_correction=correction,
    )


def _train(params, **changes):
    return dataclasses.replace(
        params.train, **{"epochs": 4, "batch_size": 32, "threads": 1, **changes}
    )


def _weights(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def _actions(net: PolicyNet, data: TrainingSet) -> np.ndarray:
    with torch.no_grad():
        return net.eval()(torch.from_numpy(data.observations)).numpy()


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_trains_and_saves_a_policy_the_edge_export_and_load_policy_read(
    mode, base, data, params, tmp_path
):
    before = _weights(base)
    net, history = finetune(base, data, _train(params, mode=mode), version=f"ft-{mode}")
    assert len(history) == 4 and net.config.trained_on["finetune_mode"] == mode
    assert not np.allclose(_actions(net, data), _actions(base, data), atol=1e-3)  # it learned
    assert all(torch.equal(before[k], v) for k, v in base.state_dict().items())  # base as it was
    folder, export = save_policy_for_edge(net, tmp_path / mode, data.observations, 0.01)
    assert export["parity_passed"]  # policy.onnx computes what the torch network does
    loaded = load_policy(folder)
    np.testing.assert_array_equal(_actions(loaded.net, data), _actions(net, data))


def test_a_plain_policys_config_has_no_residual_key(base, tmp_path):
    from pipelines.training.policy import save_policy

    config = yaml.safe_load((save_policy(base, tmp_path / "p") / "config.json").read_text())
    assert "residual" not in config


def test_anchored_with_a_huge_anchor_stays_at_the_base(base, data, params):
    free, _ = finetune(
        base, data, _train(params, mode="anchored", anchor_weight=0.0, epochs=20), "free"
    )
    held, _ = finetune(
        base, data, _train(params, mode="anchored", anchor_weight=1e6, epochs=20), "held"
    )
    moved = {k: (free.state_dict()[k] - v).abs().max().item() for k, v in base.state_dict().items()}
    stayed = {
        k: (held.state_dict()[k] - v).abs().max().item() for k, v in base.state_dict().items()
    }
    # Adam's steps are about the learning rate whatever the gradient: the anchor holds each
    # weight within a few steps of the base while the free run drifts on.
    assert max(stayed.values()) < 0.05 * max(moved.values())
    np.testing.assert_allclose(_actions(held, data), _actions(base, data), atol=2e-3)


def test_residual_leaves_the_bases_weights_untouched_and_starts_as_the_base(base, data, params):
    net, _ = finetune(base, data, _train(params, mode="residual", residual_hidden=(8,)), "res")
    for key, value in base.state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key
    assert net.config.residual == [8]
    assert all(p.requires_grad for p in net.parameters())  # frozen only while training
    untrained, _ = finetune(base, data, _train(params, mode="residual", epochs=0), "zero")
    np.testing.assert_array_equal(_actions(untrained, data), _actions(base, data))
    # A second residual cycle trains the same head further; the base stays frozen still.
    again, _ = finetune(net, data, _train(params, mode="residual", residual_hidden=(4,)), "res2")
    assert again.config.residual == [8]
    assert torch.equal(again.mlp[0].weight, base.mlp[0].weight)


def test_full_is_the_original_recipe_byte_for_byte(base, data, params):
    train = _train(params, mode="full")
    net, _ = finetune(base, data, train, "full")
    again, _ = finetune(base, data, train, "full")
    original = copy.deepcopy(base)  # the recipe before modes: fit on a copy, nothing else
    fit(original, data.observations, data.actions, epochs=train.epochs,
        batch_size=train.batch_size, learning_rate=train.learning_rate, seed=train.seed,
        weights=data.weights, val_fraction=train.val_fraction, threads=1)  # fmt: skip
    for key, value in original.state_dict().items():
        assert torch.equal(net.state_dict()[key], value), key
        assert torch.equal(again.state_dict()[key], value), key


@pytest.mark.parametrize("mode", ["anchored", "residual"])
def test_every_mode_is_deterministic_for_a_seed(mode, base, data, params):
    first, _ = finetune(base, data, _train(params, mode=mode), "a")
    second, _ = finetune(base, data, _train(params, mode=mode), "b")
    for key, value in first.state_dict().items():
        assert torch.equal(second.state_dict()[key], value), key


def test_an_unknown_mode_is_one_line_naming_train_mode(params_path, tmp_path):
    raw = yaml.safe_load(params_path.read_text())
    raw["train"]["mode"] = "sideways"
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ParamsError) as error:
        load_params(path)
    message = str(error.value)
    assert "train.mode" in message and "full" in message and len(message.splitlines()) == 1
