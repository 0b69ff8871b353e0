"""Which policy a cycle starts from before anything was promoted."""

from __future__ import annotations

import pytest

from flows.cycle import current_policy
from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy
from tests.conftest import ROOT


@pytest.fixture
def workspace(tmp_path, monkeypatch, params):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    save_policy(
        PolicyNet(PolicyConfig(hidden=[8], version="sim-0")), tmp_path / params.pretrain.out
    )
    return tmp_path


def test_without_a_calibrated_policy_the_sim_policy_is_the_base(workspace, params):
    incumbent = current_policy(params, ROOT / "params.yaml", workspace)
    assert (incumbent["source"], incumbent["policy_version"]) == ("sim", "sim-0")


def test_the_policy_pretrained_in_the_calibrated_sim_is_preferred(workspace, params):
    calibrated = workspace / params.pretrain.calibrated_out
    save_policy(PolicyNet(PolicyConfig(hidden=[8], version="sim-cal-0")), calibrated)
    incumbent = current_policy(params, ROOT / "params.yaml", workspace)
    assert incumbent["source"] == "calibrated sim"
    assert incumbent["policy_version"] == "sim-cal-0"
    assert incumbent["folder"] == calibrated
