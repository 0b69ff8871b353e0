"""`realloop deploy --initial`: a cell's first production model, recorded as an override in the
registry (tags, alias) and on the channel (the signed release's decision, history), signed with
the workspace's keys (made on first use), on a folder channel and on S3 (the suite's S3 server
on loopback, tests/conftest.py), against a real SQLite MLflow store."""

from __future__ import annotations

import dataclasses
import getpass
import json
import shutil
from pathlib import Path

import pytest
import torch
import typer
import yaml

from edge import agent
from edge.channels import open_channel
from edge.release import HISTORY_ACTION
from edge.trials import read_history
from edge.tuf_client import enroll
from edge.tuf_repo import named_release
from flows import deploy
from flows.console import CommandError
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy
from pipelines.training.registry import POLICY_SHA256_TAG, model_version_info, production_version
from tests.conftest import ROOT, realloop

CELL = "cell-11"


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    tracking.use_workspace(workspace)
    return workspace


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    net = PolicyNet(PolicyConfig(hidden=[8], version="sim-0", trained_on={"world": "sim"}))
    return save_policy(net, tmp_path_factory.mktemp("policies") / "sim-policy")


def with_channel(params, channel: str):
    return dataclasses.replace(params, promote=dataclasses.replace(params.promote, channel=channel))


def check_deployed(result: dict, params, channel_uri: str, policy: Path, reason: str) -> None:
    """The registry and the channel both say: this version runs on CELL, by override."""
    model = params.train.registered_model
    info = model_version_info(model, result["model_version"])
    assert info.tags["override"] == "true"
    assert info.tags["override_by"] == getpass.getuser()
    assert info.tags["override_reason"] == reason
    assert info.tags["override_at"] == result["override"]["at"]
    assert info.tags["override_cell"] == CELL
    assert info.tags[POLICY_SHA256_TAG] == result["policy_sha256"]
    alias = f"{CELL}{params.promote.alias_suffix}"
    assert production_version(model, alias).version == result["model_version"]
    channel = open_channel(channel_uri)
    release = named_release(channel, CELL)
    assert release["bundle_id"] == result["bundle_id"]
    assert release["model_name"] == model
    assert release["model_version"] == int(result["model_version"])
    assert release["mlflow_run_id"] == result["mlflow_run_id"] == info.run_id
    assert release["decision"] == result["override"]
    assert release["decision"]["kind"] == "override" and release["decision"]["initial_deploy"]
    assert release["files"]["model.safetensors"]["sha256"] == result["policy_sha256"]
    history = read_history(channel, CELL)
    assert {e["action"] for e in history} == {HISTORY_ACTION}
    # The newest event names this bundle (an attempt cut short in the same second published
    # the same bundle: same content, same id).
    event = [e for e in history if e["subject"] == result["bundle_id"]][-1]
    assert history[-1] == event
    assert event["decision"] == result["override"] and event["decision"]["reason"] == reason
    assert event["model_version"] == int(result["model_version"])


def pulled_by_a_box(workspace: Path, params, channel: str, box: Path) -> dict:
    """What the cell's edge box does: enrol with the workspace's root, pull, verify."""
    enroll(channel, CELL, box, workspace / params.promote.keys / "root.json")
    return agent.pull(box)


def test_first_deploy_on_a_folder_channel_is_an_override_everywhere(
    workspace, params, policy, tmp_path
):
    params = with_channel(params, "data/edge-channel")  # relative: inside the workspace
    result = deploy.deploy_initial(workspace, params, policy, CELL, "cell commissioning")
    channel = str(workspace / "data" / "edge-channel")
    assert result["channel"] == channel and not result["resumed"]
    assert result["override"]["by"] == getpass.getuser()
    check_deployed(result, params, channel, policy, "cell commissioning")
    # What the cell's edge box does with it: pull, verify the signed metadata and every file.
    pulled = pulled_by_a_box(workspace, params, channel, tmp_path / "box")
    assert pulled["bundle_id"] == result["bundle_id"] and pulled["signed"] is True
    assert (
        pulled["decision"]["kind"] == "override" and pulled["decision"]["by"] == getpass.getuser()
    )
    assert (workspace / params.promote.keys / "offline" / "root.key").is_file()
    box = tmp_path / "box" / "current" / "model.safetensors"
    assert box.read_bytes() == (policy / "model.safetensors").read_bytes()


def test_first_deploy_on_s3(workspace, params, policy, s3_bucket):
    channel = f"s3://{s3_bucket}/releases"
    params = with_channel(params, channel)
    result = deploy.deploy_initial(workspace, params, policy, CELL)
    assert result["channel"] == channel
    check_deployed(
        result,
        params,
        channel,
        policy,
        f"first deployment of {CELL}: no incumbent to trial against",
    )


def test_a_cell_with_a_production_model_is_refused_unless_forced(workspace, params, policy):
    params = with_channel(params, str(workspace / "channel"))
    first = deploy.deploy_initial(workspace, params, policy, CELL)
    with pytest.raises(CommandError) as refused:
        deploy.deploy_initial(workspace, params, policy, CELL)
    message = str(refused.value)
    assert f"cell {CELL} already has a production model" in message
    assert f"registry alias {CELL}-production -> " in message and "--force" in message
    forced = deploy.deploy_initial(workspace, params, policy, CELL, "re-commissioned", force=True)
    assert forced["model_version"] != first["model_version"]
    assert forced["override"]["forced"] is True
    assert forced["override"]["replaced"][0].startswith(f"registry alias {CELL}-production")
    alias = f"{CELL}{params.promote.alias_suffix}"
    model = params.train.registered_model
    assert production_version(model, alias).version == forced["model_version"]
    actions = [e["action"] for e in read_history(open_channel(params.promote.channel), CELL)]
    assert actions == [HISTORY_ACTION] * 2


def test_a_release_already_on_the_channel_is_refused(workspace, params, policy, tmp_path):
    from edge.release import publish_release
    from edge.rotation import init_keys

    channel = str(workspace / "channel")
    params = with_channel(params, channel)
    keys = workspace / params.promote.keys
    init_keys(keys, channel, 86400)
    files = {name: policy / name for name in ("model.safetensors", "config.json")}
    by_hand = {"kind": "override", "by": "someone", "at": "2026-01-01", "reason": "by hand"}
    meta = {"model_name": "by-hand", "model_version": 1}
    publish_release(channel, keys, CELL, files, meta, by_hand, None, 86400)
    with pytest.raises(CommandError, match=rf"channel {channel}/{CELL}/release.json -> release 1-"):
        deploy.deploy_initial(workspace, params, policy, CELL)
    model = params.train.registered_model
    assert production_version(model, f"{CELL}{params.promote.alias_suffix}") is None


def test_a_deploy_cut_short_is_completed_by_running_it_again(
    workspace, params, policy, monkeypatch
):
    params = with_channel(params, str(workspace / "channel"))

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # killed after the publish, before the alias

    with monkeypatch.context() as patch:
        patch.setattr("pipelines.training.set_production_alias", crash)
        with pytest.raises(KeyboardInterrupt):
            deploy.deploy_initial(workspace, params, policy, CELL)
    again = deploy.deploy_initial(workspace, params, policy, CELL)
    assert again["resumed"] and again["model_version"] == "1"
    # Each publish is in the history: the one cut short was published too.
    assert len(read_history(open_channel(params.promote.channel), CELL)) == 2
    check_deployed(again, params, params.promote.channel, policy, again["override"]["reason"])


def test_a_broken_policy_folder_is_refused_in_one_line_and_nothing_is_written(tmp_path, policy):
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    shutil.copy(ROOT / "params.yaml", workspace / "params.yaml")
    broken = tmp_path / "broken"
    shutil.copytree(policy, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    done = realloop("deploy", "--initial", str(broken), "--cell", CELL, "--json", cwd=workspace)
    assert done.returncode == 1 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"realloop: {broken}: not a policy that loads, refusing to deploy it")
    assert "unreadable or mismatched weights" in line
    assert not (workspace / "data").exists() and not (workspace / "mlflow.db").exists()


@pytest.mark.slow  # the command twice as a process (~16 s); the refusal is also tested in-process
def test_the_command_prints_json_and_refuses_a_second_initial(tmp_path, policy, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    workspace = tmp_path / "workspace"
    workspace.mkdir()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["promote"]["channel"] = "channel"
    (workspace / "params.yaml").write_text(yaml.safe_dump(params))
    args = ("deploy", "--initial", str(policy), "--cell", CELL, "--reason", "commissioning")
    done = realloop(*args, "--json", cwd=workspace)
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert payload["cell"] == CELL and payload["alias"] == f"{CELL}-production"
    assert payload["override"]["reason"] == "commissioning"
    assert payload["signed"] is True
    assert (
        named_release(open_channel(workspace / "channel"), CELL)["bundle_id"]
        == payload["bundle_id"]
    )
    again = realloop(*args, cwd=workspace)
    assert again.returncode == 1 and "Traceback" not in again.stderr
    (line,) = again.stderr.strip().splitlines()
    assert f"cell {CELL} already has a production model" in line and "--force" in line


@pytest.mark.slow  # four registrations and releases (about 15 s): make test-all
def test_rollback_and_override_are_named_decisions_the_box_accepts(
    workspace, params, policy, tmp_path, monkeypatch, capsys
):
    from pipelines.release import named_decision

    params = with_channel(params, "channel")
    first = deploy.deploy_initial(workspace, params, policy, CELL)
    second = deploy.deploy_initial(workspace, params, policy, CELL, "v2", force=True)
    channel = str(workspace / "channel")
    box = tmp_path / "box"
    assert pulled_by_a_box(workspace, params, channel, box)["model_version"] == 2

    monkeypatch.setenv("REALLOOP_USER", "ana")
    rollback = named_decision("rollback", "version 2 drops parts")
    rolled = deploy.decided_release(workspace, params, CELL, first["model_version"], rollback)
    assert (rolled["model_version"], rolled["replaced"]) == ("1", 2)
    info = model_version_info(params.train.registered_model, "1")
    assert (info.tags["rollback_by"], info.tags["rollback_cell"]) == ("ana", CELL)
    assert info.tags["rollback_reason"] == "version 2 drops parts"
    alias = f"{CELL}{params.promote.alias_suffix}"
    assert production_version(params.train.registered_model, alias).version == "1"
    status = agent.pull(box)  # a downgrade, accepted because the signed decision is a rollback
    assert status["model_version"] == 1 and status["decision"]["kind"] == "rollback"
    assert status["decision"]["by"] == "ana" and status["intact"] is True

    override = named_decision("override", "back to 2 after the fix", by="bo")
    deploy.decided_release(workspace, params, CELL, second["model_version"], override)
    assert agent.pull(box)["decision"] == override
    events = [e["decision"]["kind"] for e in read_history(open_channel(channel), CELL)]
    assert events == ["override", "override", "rollback", "override"]

    capsys.readouterr()
    monkeypatch.chdir(workspace)
    (workspace / "params.yaml").write_text(yaml.safe_dump({}))  # never read: refused first
    with pytest.raises(typer.Exit):
        deploy.promote_command(cell=CELL, version="2", reason="x", override=False)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("realloop: realloop promote publishes without the gate only")
