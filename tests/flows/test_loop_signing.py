"""The loop's `gate` and `promote` tasks as the loop wires them (called directly, trials and
their records stubbed): the gate signs its verdict, promote publishes only what it signed."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from edge import agent
from edge.rotation import init_keys
from edge.tuf_client import enroll
from flows import loop
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy
from pipelines.training.registry import register_policy
from pipelines.training.tracking import start_finetune_run

pytestmark = pytest.mark.slow  # a registered candidate and an MLflow store (about 10 s)
CELL = "cell-07"


@pytest.fixture
def loop_env(tmp_path, params, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    workspace = tmp_path / "ws"
    tracking.use_workspace(workspace)
    torch.manual_seed(0)
    folder = save_policy(PolicyNet(PolicyConfig(hidden=[8])), workspace / "candidate")
    with start_finetune_run(
        workspace, params.train.experiment, params.train, "d1", "data", {}
    ) as run:
        version = register_policy(run.info.run_id, folder, params.train.registered_model)
    trained = {
        "model_version": version,
        "mlflow_run_id": run.info.run_id,
        "policy_folder": str(folder),
        "dataset_version": "d1",
    }
    params = dataclasses.replace(params, promote=dataclasses.replace(params.promote, channel="ch"))
    init_keys(workspace / params.promote.keys, None, 86400)
    monkeypatch.setattr(loop.trials, "close_trial_request", lambda *a, **k: None)
    monkeypatch.setattr(loop.artifacts, "gate_report", lambda *a, **k: None)
    return SimpleNamespace(workspace=workspace, params=params, trained=trained)


def judged(passed: bool):
    return lambda *a, **k: {
        "passed": passed,
        "reasons": ["pass: test" if passed else "FAIL: test"],
        "candidate": {"n": 10, "successes": 9, "success_rate": 0.9, "interval": [0.6, 0.98]},
        "incumbent": {"n": 10, "successes": 5, "success_rate": 0.5, "interval": [0.2, 0.8]},
        "trial_request_id": "req-1",
    }


@pytest.mark.parametrize("passed", [True, False])
def test_the_gate_signs_and_promote_publishes_only_a_signed_pass(loop_env, monkeypatch, passed):
    env = loop_env
    monkeypatch.setattr(loop.trials, "judge_attempt", judged(passed))
    attempt = SimpleNamespace(attempt="a1")
    record = loop.gate.fn(
        env.params, env.workspace, CELL, env.trained, {"request_id": "req-1"}, attempt
    )
    assert record["attestation"].startswith("{")  # the DSSE envelope, JSON

    result = loop.promote.fn(env.params, env.workspace, CELL, env.trained, record)
    assert result["promoted"] is passed
    if not passed:
        assert "verdict is 'fail'" in result["reasons"][0]
        assert not (env.workspace / "ch").exists()
        return
    box = tmp = env.workspace / "box"
    enroll(
        str(env.workspace / "ch"), CELL, tmp, env.workspace / env.params.promote.keys / "root.json"
    )
    pulled = agent.pull(box)
    assert pulled["decision"]["attestation"]["request_id"] == "req-1"
    assert pulled["decision"]["attestation"]["verdict"] == "pass"

    # A caller editing the record's verdict changes nothing: the envelope is what counts.
    forged = dict(record, passed=True, attestation=None)
    refused = loop.promote.fn(env.params, env.workspace, "cell-08", env.trained, forged)
    assert not refused["promoted"] and "no gate attestation" in refused["reasons"][0]
