"""A workspace moved or copied to another folder keeps working and never writes into the
folder it was made in: its DVC remote, MLflow store and landed files' names follow it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.ingest import open_source, versioning
from pipelines.ingest.sources import SeenFiles, SourceFile, workspace_uri
from pipelines.training import store_root, tracking
from tests.conftest import realloop


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (symlinks as their target) → its sha256."""
    files = {}
    for directory, _, names in os.walk(folder):
        for name in names:
            path = Path(directory) / name
            key = str(path.relative_to(folder))
            if path.is_symlink():
                files[key] = f"-> {os.readlink(path)}"
            else:
                files[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


@pytest.fixture
def no_user_git_config(monkeypatch, tmp_path):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@example.com")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@example.com")


@pytest.fixture
def local_store(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)


# --- DVC: the local remote is named relative to .dvc/ ------------------------------------


def remote_url(workspace: Path) -> str:
    from dvc.repo import Repo

    with Repo(str(workspace)) as repo:
        return repo.config["remote"][versioning.DEFAULT_REMOTE_NAME]["url"]


def test_the_local_dvc_remote_is_relative_and_an_old_absolute_one_follows_a_copy(
    tmp_path, no_user_git_config
):
    made = tmp_path / "made"
    made.mkdir()
    versioning.ensure_workspace(made, ".realloop/dvc-remote")
    config = made / ".dvc" / "config.local"
    assert "url = ../.realloop/dvc-remote" in config.read_text()
    assert str(tmp_path) not in config.read_text()
    # A workspace made before remotes were relative names its remote absolutely.
    config.write_text(config.read_text().replace("../.realloop", f"{made}/.realloop"))
    before = snapshot(made)
    copy = tmp_path / "copy"
    shutil.copytree(made, copy, symlinks=True)
    versioning.ensure_workspace(copy, ".realloop/dvc-remote")
    assert remote_url(copy) == str(copy / ".realloop" / "dvc-remote")
    assert changed(before, snapshot(made)) == []
    assert "url = ../.realloop/dvc-remote" in (copy / ".dvc" / "config.local").read_text()


# --- MLflow: the store is re-rooted once, in the copy only -------------------------------


def make_store(workspace: Path) -> tuple[str, str]:
    """A store as realloop leaves it: an experiment in <workspace>/mlartifacts, a run with an
    artifact and a dataset input, a model version whose source is the run's artifact folder."""
    from mlflow.entities import DatasetInput

    client = tracking.mlflow_client(workspace)
    experiment = tracking.ensure_experiment(client, workspace, "move")
    run = client.create_run(experiment)
    (workspace / "w.txt").write_text("weights")
    client.log_artifact(run.info.run_id, str(workspace / "w.txt"), "policy")
    dataset = tracking._line_dataset(workspace, "abc.dir", "data/dataset", {"episodes": 1})
    client.log_inputs(run.info.run_id, datasets=[DatasetInput(dataset, [])])
    client.set_terminated(run.info.run_id)
    client.create_registered_model("m")
    source = f"{run.info.artifact_uri}/policy"
    version = client.create_model_version("m", source, run_id=run.info.run_id).version
    return run.info.run_id, version


def stored_text(db: Path) -> str:
    connection = sqlite3.connect(db)
    try:
        return "\n".join(connection.iterdump())
    finally:
        connection.close()


def test_a_copied_mlflow_store_names_the_copy_and_logs_there(tmp_path, local_store):
    made = tmp_path / "made"
    made.mkdir()
    run_id, version = make_store(made)
    assert f"{made}/mlartifacts" in stored_text(made / "mlflow.db")
    before = snapshot(made)
    copy = tmp_path / "copy"
    shutil.copytree(made, copy)

    client = tracking.mlflow_client(copy)  # opening the copy's store re-roots it
    text = stored_text(copy / "mlflow.db")
    assert f"{made}/" not in text and f"{copy}/mlartifacts" in text
    assert client.get_run(run_id).info.artifact_uri.startswith(f"{copy}/mlartifacts/")
    assert client.get_model_version("m", version).source.startswith(f"{copy}/mlartifacts/")
    [dataset] = client.get_run(run_id).inputs.dataset_inputs
    assert json.loads(dataset.dataset.source)["uri"] == f"{copy}/data/dataset"
    # what the copy logs lands in the copy, and the original is never opened
    new = client.create_run(tracking.ensure_experiment(client, copy, "move"))
    client.log_text(new.info.run_id, "x", "note.txt")
    assert (copy / "mlartifacts" / new.info.run_id / "artifacts" / "note.txt").is_file()
    assert client.download_artifacts(run_id, "policy/w.txt", str(tmp_path))
    assert changed(before, snapshot(made)) == []
    # once: a store that names its own folder is not written again
    store_root._checked.clear()
    mtime = (copy / "mlflow.db").stat().st_mtime_ns
    assert store_root.reroot_store(copy / "mlflow.db", copy / "mlartifacts") is None
    assert (copy / "mlflow.db").stat().st_mtime_ns == mtime


def test_an_experiment_pointed_at_a_shared_folder_is_left_alone(tmp_path, local_store):
    workspace = tmp_path / "ws"
    workspace.mkdir()
    client = tracking.mlflow_client(workspace)
    shared = tmp_path / "shared" / "mlartifacts"
    experiment = client.create_experiment("shared", artifact_location=str(shared))
    client.log_text(client.create_run(experiment).info.run_id, "x", "note.txt")
    store_root._checked.clear()
    db = workspace / "mlflow.db"
    assert store_root.reroot_store(db, workspace / "mlartifacts") is None
    assert client.get_experiment(experiment).artifact_location == str(shared)


# --- landed files are named as the workspace names them ----------------------------------


def test_landed_files_inside_the_workspace_are_named_relative_to_it(tmp_path):
    landing = tmp_path / "data" / "landing"
    landing.mkdir(parents=True)
    (landing / "a.mcap").write_bytes(b"a")
    assert workspace_uri(landing / "a.mcap", tmp_path) == "data/landing/a.mcap"
    assert workspace_uri(landing / "a.mcap", None) == str((landing / "a.mcap").resolve())
    [file] = open_source(None, landing, tmp_path).list()
    assert file.uri == "data/landing/a.mcap"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "b.mcap").write_bytes(b"b")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    [far] = open_source(str(outside), landing, workspace).list()
    assert far.uri == str((outside / "b.mcap").resolve())  # outside the workspace: absolute
    (workspace / "logs").symlink_to(outside)  # a mount inside the workspace names the mount
    assert open_source("logs", landing, workspace).uri == str(outside.resolve())


def test_a_file_remembered_under_its_old_absolute_name_is_not_hashed_again(tmp_path):
    landing = tmp_path / "data" / "landing"
    landing.mkdir(parents=True)
    (landing / "a.mcap").write_bytes(b"a")
    [file] = open_source(None, landing, tmp_path).list()
    old = SourceFile(file.name, str(landing.resolve() / "a.mcap"), file.size, file.fingerprint)
    SeenFiles(tmp_path / "landed.jsonl").add(old, "f" * 64, "ingested")
    seen = SeenFiles(tmp_path / "landed.jsonl")
    assert seen.get(file)["sha256"] == "f" * 64
    other = SourceFile("b.mcap", "data/landing/b.mcap", file.size, file.fingerprint)
    assert seen.get(other) is None  # another name: looked at again


# --- the whole loop, in a copy ---------------------------------------------------------


def cycle_workspace(workspace: Path) -> None:
    """A one-cell workspace with its first model deployed and a production shift landed;
    trials time out at once (no cell answers), so a cycle ingests, validates, fine-tunes,
    registers and requests trials, and ends 'trials incomplete'."""
    from tests.flows.test_loop import record_production_shift, small_params

    small_params(workspace)
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["fleet"]["cells"] = ["cell-07"]
    params["trials"].update(max_episodes=2, timeout_s=2, poll_s=1)
    params["train"].update(epochs=2)
    (workspace / "params.yaml").write_text(yaml.safe_dump(params))
    for args in (
        ("cell", "pretrain", "--json"),
        ("deploy", "--initial", "models/sim-policy", "--cell", "cell-07", "--json"),
    ):
        run = realloop(*args, cwd=workspace)
        assert run.returncode == 0, run.stderr
    record_production_shift(workspace, "cell-07", 0)


def run_cycle(workspace: Path) -> dict:
    run = realloop("loop", "--json", cwd=workspace)
    assert run.returncode == 0, run.stderr
    [cell] = json.loads(run.stdout)["cells"]
    assert cell["outcome"] == "trials incomplete", cell["reason"]
    return cell


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_copied_workspace_runs_a_cycle_and_writes_nothing_into_the_original(tmp_path):
    from tests.flows.test_loop import record_production_shift

    made = tmp_path / "made"
    made.mkdir()
    cycle_workspace(made)
    run_cycle(made)
    before = snapshot(made)
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(made), str(copy)], check=True)
    copied = snapshot(copy)
    record_production_shift(copy, "cell-07", 1)  # new data, so the copy versions and trains

    cell = run_cycle(copy)

    assert changed(before, snapshot(made)) == []
    after = snapshot(copy)
    new = [k for k in changed(copied, after) if k not in copied]
    run_id = cell["training"]["mlflow_run_id"]
    assert any(k.startswith(f"mlartifacts/{run_id}/") for k in new)
    assert any(k.startswith(".realloop/dvc-remote/files/") for k in new)
    assert any(k.startswith(".dvc/cache/files/") for k in new)
    # the copy's own records name the copy, never the original
    assert str(made) not in (copy / ".dvc" / "config.local").read_text()
    assert f"{made}/" not in stored_text(copy / "mlflow.db")
