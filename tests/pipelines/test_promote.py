"""Promotion: gate verdict → edge channel bundle + registry alias, against a real SQLite store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edge import agent
from edge.channels import generate_keypair, open_channel
from pipelines.release.gate import TrialStats, decide
from pipelines.release.promote import PromotionResult, promote
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, load_policy, save_policy
from pipelines.training.registry import production_version, register_policy
from pipelines.training.tracking import start_finetune_run, use_workspace

DATASET_VERSION = "5d41402abc4b2a76b9719d911017c592.dir"


@pytest.fixture(autouse=True)
def _workspace_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)


@pytest.fixture(scope="module")
def candidate(tmp_path_factory, params):
    """A registered candidate policy, as the fine-tune stage leaves it."""
    workspace = tmp_path_factory.mktemp("workspace")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.setattr(tracking, "_workspace_in_use", None)
        torch.manual_seed(0)
        net = PolicyNet(PolicyConfig(hidden=[8], version="t", trained_on={}))
        folder = save_policy(net, workspace / "models" / "candidate")
        with start_finetune_run(
            workspace, params.train.experiment, params.train, DATASET_VERSION, "data", {}
        ) as run:
            version = register_policy(run.info.run_id, folder, params.train.registered_model)
    return SimpleNamespace(
        workspace=workspace,
        net=net,
        folder=folder,
        run_id=run.info.run_id,
        model=params.train.registered_model,
        version=version,
    )


def trials(successes: int, stops: int = 0) -> TrialStats:
    return TrialStats("p", 100, successes, stops, 4.0)


def run_promote(candidate, params, decision, channel: Path, **kwargs) -> PromotionResult:
    kwargs.setdefault("workspace", candidate.workspace)
    return promote(
        decision,
        kwargs.pop("cell_id", params.cell.cell_id),
        dataclasses.replace(params.promote, channel=str(channel)),
        candidate.model,
        candidate.version,
        candidate.run_id,
        kwargs.pop("policy_folder", candidate.folder),
        DATASET_VERSION,
        **kwargs,
    )


def alias_version(candidate, params, cell_id: str = "cell-07") -> str | None:
    alias = f"{cell_id}{params.promote.alias_suffix}"
    info = production_version(candidate.model, alias, workspace=candidate.workspace)
    return None if info is None else info.version


def test_a_failed_gate_publishes_nothing_and_keeps_the_alias(candidate, params, tmp_path):
    before = alias_version(candidate, params)
    decision = decide(trials(60, stops=1), trials(80), cycle_time_budget_s=5.0)
    result = run_promote(candidate, params, decision, tmp_path / "channel")
    assert not result.promoted and (result.alias, result.channel, result.bundle) == (None,) * 3
    assert [r for r in result.reasons if r.startswith("FAIL")] == [
        r for r in decision.reasons if r.startswith("FAIL")
    ]
    assert "not promoted" in result.reasons[-1]
    assert not (tmp_path / "channel").exists()
    assert alias_version(candidate, params) == before


def test_a_plain_record_works_and_a_malformed_one_is_refused(candidate, params, tmp_path):
    record = {"passed": "true", "reasons": ["looks fine"]}  # not the boolean True: no promotion
    assert not run_promote(candidate, params, record, tmp_path / "channel").promoted
    with pytest.raises(TypeError, match="gate decision"):
        run_promote(candidate, params, {"reasons": []}, tmp_path / "channel")
    assert not (tmp_path / "channel").exists()


def test_a_passed_gate_publishes_a_bundle_the_edge_box_pulls(candidate, params, tmp_path):
    decision = decide(trials(90), trials(50), cycle_time_budget_s=5.0)
    channel = tmp_path / "channel"
    result = run_promote(candidate, params, decision, channel)

    assert result.promoted and result.alias == "cell-07-production"
    assert json.loads(json.dumps(result.as_dict()))["bundle"] == result.bundle
    assert alias_version(candidate, params) == candidate.version
    pointer = json.loads((channel / "cell-07" / "CURRENT.json").read_bytes())
    assert pointer["bundle_id"] == result.bundle["bundle_id"]
    manifest = json.loads(
        open_channel(channel).get_bytes(f"cell-07/bundles/{pointer['bundle_id']}/manifest.json")
    )
    assert manifest["model_name"] == candidate.model
    assert manifest["model_version"] == int(candidate.version)
    assert manifest["dataset_version"] == DATASET_VERSION
    assert manifest["mlflow_run_id"] == candidate.run_id
    assert manifest["gate"] == json.loads(json.dumps(decision.as_record()))
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}

    dest = tmp_path / "edge-box"
    pulled = agent.pull(str(channel), "cell-07", dest)
    assert pulled["action"] == "activated"
    assert (pulled["model_version"], pulled["mlflow_run_id"]) == (1, candidate.run_id)
    weights = load_policy(dest / "current").net.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in candidate.net.state_dict().items())

    again = run_promote(candidate, params, decision, channel)  # a re-run changes nothing
    assert again.bundle == result.bundle
    assert agent.pull(str(channel), "cell-07", dest)["action"] == "already_active"


def test_a_relative_channel_lives_in_the_workspace_in_use_and_signing_is_passed_on(
    candidate, params, tmp_path
):
    private, public = tmp_path / "signing.pem", tmp_path / "signing.pub.pem"
    generate_keypair(private, public)
    decision = decide(trials(90), trials(50), cycle_time_budget_s=5.0)
    use_workspace(candidate.workspace)  # as the CLI does; promote then needs no workspace
    result = run_promote(
        candidate, params, decision, Path("signed"), signing_key=private, workspace=None
    )
    assert result.channel == str(candidate.workspace / "signed")
    assert result.bundle["signature"]
    pulled = agent.pull(result.channel, "cell-07", tmp_path / "edge-box", public_key=public)
    assert pulled["signed"]


def test_weights_other_than_the_registered_version_are_not_published(candidate, params, tmp_path):
    other = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "other")
    decision = decide(trials(90), trials(50), cycle_time_budget_s=5.0)
    with pytest.raises(ValueError, match="refusing to publish"):
        run_promote(candidate, params, decision, tmp_path / "channel", policy_folder=other)
    assert not (tmp_path / "channel").exists()


def test_each_cell_has_its_own_channel_path_and_alias(candidate, params, tmp_path):
    decision = decide(trials(90), trials(50), cycle_time_budget_s=5.0)
    channel = tmp_path / "channel"
    before = alias_version(candidate, params)
    result = run_promote(candidate, params, decision, channel, cell_id="cell-08")
    assert result.promoted and result.alias == "cell-08-production"
    assert alias_version(candidate, params, "cell-08") == candidate.version
    assert alias_version(candidate, params) == before  # cell-07's alias is its own
    assert (channel / "cell-08" / "CURRENT.json").is_file()
    assert not (channel / "cell-07").exists()
