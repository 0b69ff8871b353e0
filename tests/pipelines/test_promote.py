"""Promotion: a signed gate attestation → signed release on the edge channel + registry alias,
against a real SQLite store; promote believes the attestation, never a caller's verdict."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from edge import agent
from edge.keys import generate_key
from edge.rotation import init_keys
from edge.tuf_client import enroll
from pipelines.release.promote import PromotionResult, attest_gate, named_decision, promote
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
    keys = workspace / params.promote.keys
    init_keys(keys, None, params.promote.timestamp_expiry_s)
    return SimpleNamespace(
        workspace=workspace,
        keys=keys,
        net=net,
        folder=folder,
        run_id=run.info.run_id,
        model=params.train.registered_model,
        version=version,
    )


def gate_record(passed: bool = True) -> dict:
    """A gate record as the gate stage leaves it (its fields are the gate's business)."""
    verdict = "pass: 0 safety stops" if passed else "FAIL: 1 safety stops (0 allowed)"
    return {
        "passed": passed,
        "reasons": [verdict],
        "candidate": {"success_rate": 0.9 if passed else 0.6, "interval": [0.82, 0.95]},
        "incumbent": {"success_rate": 0.5},
        "trial_request_id": "cell-07-trial-1",
        "trial_attempt": "a1",
    }


def attested(candidate, passed: bool = True, folder: Path | None = None) -> bytes:
    return attest_gate(gate_record(passed), folder or candidate.folder, candidate.keys)


def run_promote(candidate, params, attestation, channel: Path, **kwargs) -> PromotionResult:
    kwargs.setdefault("workspace", candidate.workspace)
    return promote(
        attestation,
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


def box_for(candidate, channel: Path, box: Path, cell: str = "cell-07") -> Path:
    enroll(str(channel), cell, box, candidate.keys / "root.json")
    return box


def test_a_failed_gate_publishes_nothing_and_keeps_the_alias(candidate, params, tmp_path):
    before = alias_version(candidate, params)
    result = run_promote(candidate, params, attested(candidate, passed=False), tmp_path / "channel")
    assert not result.promoted and (result.alias, result.channel, result.bundle) == (None,) * 3
    assert "verdict is 'fail'" in result.reasons[0] and "unchanged" in result.reasons[0]
    assert not (tmp_path / "channel").exists()
    assert alias_version(candidate, params) == before


@pytest.mark.parametrize(
    "claim, why",
    [
        (None, "no gate attestation"),
        (json.dumps({"passed": True, "reasons": ["trust me"]}).encode(), "not a DSSE envelope"),
    ],
)
def test_an_asserted_verdict_is_not_an_attestation(candidate, params, tmp_path, claim, why):
    before = alias_version(candidate, params)
    result = run_promote(candidate, params, claim, tmp_path / "channel")
    assert not result.promoted and why in result.reasons[0]
    assert not (tmp_path / "channel").exists()
    assert alias_version(candidate, params) == before


def test_an_attestation_for_other_bytes_or_by_another_key_is_refused(candidate, params, tmp_path):
    other = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "other")
    result = run_promote(candidate, params, attested(candidate, folder=other), tmp_path / "c")
    assert not result.promoted and "other bytes" in result.reasons[0]
    forger = tmp_path / "forger"
    generate_key(forger, "gate")
    forged = attest_gate(gate_record(), candidate.folder, forger)
    result = run_promote(candidate, params, forged, tmp_path / "c")
    assert not result.promoted and "not signed by a gate key" in result.reasons[0]
    assert not (tmp_path / "c").exists()


def test_a_passed_gate_publishes_a_signed_release_the_edge_box_pulls(candidate, params, tmp_path):
    channel = tmp_path / "channel"
    result = run_promote(candidate, params, attested(candidate), channel)

    assert result.promoted and result.alias == "cell-07-production"
    assert json.loads(json.dumps(result.as_dict()))["bundle"] == result.bundle
    assert alias_version(candidate, params) == candidate.version
    release = result.bundle
    assert release["model_name"] == candidate.model
    assert release["model_version"] == int(candidate.version)
    assert release["dataset_version"] == DATASET_VERSION
    assert release["mlflow_run_id"] == candidate.run_id
    assert release["decision"] == {"kind": "gate"} and release["attestation"] == "attestation.json"
    assert set(release["files"]) == {"model.safetensors", "config.json"}

    box = box_for(candidate, channel, tmp_path / "edge-box")
    pulled = agent.pull(box)
    assert pulled["action"] == "activated" and pulled["signed"] is True
    assert (pulled["model_version"], pulled["mlflow_run_id"]) == (1, candidate.run_id)
    assert pulled["decision"]["attestation"]["request_id"] == "cell-07-trial-1"
    weights = load_policy(box / "current").net.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in candidate.net.state_dict().items())

    again = run_promote(candidate, params, attested(candidate), channel)  # a re-run
    assert again.bundle["bundle_id"] == result.bundle["bundle_id"]
    assert agent.pull(box)["action"] == "already_active"


def test_a_relative_channel_lives_in_the_workspace_in_use(candidate, params, tmp_path):
    use_workspace(candidate.workspace)  # as the CLI does; promote then needs no workspace
    result = run_promote(candidate, params, attested(candidate), Path("signed"), workspace=None)
    assert result.channel == str(candidate.workspace / "signed")
    assert agent.pull(box_for(candidate, Path(result.channel), tmp_path / "box"))["signed"]


def test_weights_other_than_the_registered_version_are_not_published(candidate, params, tmp_path):
    other = save_policy(PolicyNet(PolicyConfig(hidden=[8])), tmp_path / "other")
    with pytest.raises(ValueError, match="refusing to publish"):
        run_promote(
            candidate,
            params,
            attested(candidate, folder=other),
            tmp_path / "channel",
            policy_folder=other,
        )
    assert not (tmp_path / "channel").exists()


def test_each_cell_has_its_own_channel_path_and_alias(candidate, params, tmp_path):
    channel = tmp_path / "channel"
    before = alias_version(candidate, params)
    result = run_promote(candidate, params, attested(candidate), channel, cell_id="cell-08")
    assert result.promoted and result.alias == "cell-08-production"
    assert alias_version(candidate, params, "cell-08") == candidate.version
    assert alias_version(candidate, params) == before  # cell-07's alias is its own
    assert (channel / "cell-08" / "bundles").is_dir() and not (channel / "cell-07").exists()


def test_an_override_is_named_in_the_registry_and_the_signed_release(
    candidate, params, tmp_path, monkeypatch
):
    from pipelines.training.registry import model_version_info

    monkeypatch.setenv("REALLOOP_USER", "ana")
    decision = named_decision("override", "line stopped; the gate's cell is down")
    result = run_promote(
        candidate, params, None, tmp_path / "channel", cell_id="cell-09", decision=decision
    )
    assert result.promoted and result.bundle["decision"] == decision and decision["by"] == "ana"
    tags = model_version_info(
        candidate.model, candidate.version, workspace=candidate.workspace
    ).tags
    assert (tags["override"], tags["override_by"], tags["override_cell"]) == (
        "true",
        "ana",
        "cell-09",
    )
    assert tags["override_reason"] == "line stopped; the gate's cell is down"
    status = agent.pull(box_for(candidate, tmp_path / "channel", tmp_path / "box", "cell-09"))
    assert status["decision"]["kind"] == "override" and status["decision"]["by"] == "ana"


def test_the_edge_files_of_a_policy_folder_are_signed_and_shipped(candidate, params, tmp_path):
    import shutil

    folder = tmp_path / "with-edge-files"
    shutil.copytree(candidate.folder, folder)
    (folder / "policy.onnx").write_bytes(b"onnx bytes")
    (folder / "ood.json").write_text('{"threshold": 3.0}')
    result = run_promote(
        candidate, params, attested(candidate), tmp_path / "c", policy_folder=folder
    )
    assert set(result.bundle["files"]) == {
        "model.safetensors",
        "config.json",
        "policy.onnx",
        "ood.json",
    }
    box = agent.pull(box_for(candidate, tmp_path / "c", tmp_path / "box"))
    assert (Path(box["path"]) / "policy.onnx").read_bytes() == b"onnx bytes"
