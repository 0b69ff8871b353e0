"""Lineage both ways on a real workspace: DVC versions, a SQLite MLflow store, registered
model versions with their training batches and gate records."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.ingest import versioning
from pipelines.release import lineage
from pipelines.training import registry, tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """The workspace's own SQLite store and no user git identity."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)
    empty = tmp_path / "empty-gitconfig"
    empty.write_text("")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(empty))


def add_source(dataset: Path, name: str, episodes: int, cell: str = "cell-07") -> str:
    """One source's episodes (the provenance columns) and steps, as ingest writes them."""
    sha = hashlib.sha256(name.encode()).hexdigest()
    for folder in ("episodes", "steps"):
        (dataset / folder).mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "episode_id": [f"{name}-{i}" for i in range(episodes)],
            "cell_id": [cell] * episodes,
            "policy_version": ["sim-3"] * episodes,
            "source_uri": [f"s3://fleet/{cell}/{name}"] * episodes,
            "source_sha256": [sha] * episodes,
        }
    )
    pq.write_table(table, dataset / "episodes" / f"{sha}.parquet")
    pq.write_table(
        pa.table({"step": list(range(3 * episodes))}), dataset / "steps" / f"{sha}.parquet"
    )
    return sha


def register(workspace: Path, params, version: str, batches: list[str], gate: dict | None, k: int):
    """A fine-tuning run recorded as the retrain stage records it; returns the model version."""
    torch.manual_seed(k)
    folder = save_policy(
        PolicyNet(PolicyConfig(hidden=[8], version=f"t-{k}", trained_on={})),
        workspace / "models" / f"candidate-{k}",
    )
    train = params.train
    with tracking.start_finetune_run(
        workspace, train.experiment, train, version, "data/dataset", {"episodes": 1}
    ) as run:
        if batches:
            tracking.log_training_batches(batches, "sim-policy")
        model_version = registry.register_policy(run.info.run_id, folder, train.registered_model)
    if gate is not None:
        registry.record_gate(train.registered_model, model_version, gate, run.info.run_id)
    return model_version


@pytest.fixture
def fleet(tmp_path, params):
    """Three dataset versions (a; a+b; a+b+c) and three model versions: v1 trained on the
    first dataset version and judged on trials from b and c, v2 on the second, v3 with no
    artifacts at all (a run that stopped before logging them)."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    versioning.ensure_workspace(workspace, ".realloop/dvc-remote")
    dataset = workspace / "data" / "dataset"
    shas, versions = {}, []
    for name, episodes in (("a.mcap", 2), ("b.mcap", 3), ("c.mcap", 1)):
        shas[name] = add_source(dataset, name, episodes)
        versions.append(versioning.version_dataset(workspace, dataset, push=False).version)
    tracking.use_workspace(workspace)
    gate = {
        "passed": True,
        "reasons": [],
        "candidate": {"success_rate": 0.9},
        "trial_sources": {"candidate": [shas["b.mcap"]], "incumbent": [shas["c.mcap"]]},
    }
    models = [
        register(workspace, params, versions[0], [shas["a.mcap"]], gate, 1),
        register(workspace, params, versions[1], [shas["a.mcap"], shas["b.mcap"]], None, 2),
        register(workspace, params, versions[2], [], None, 3),
    ]
    return workspace, dataset, params.train.registered_model, shas, versions, models


def test_from_a_model_version_its_sources_trials_and_gate(fleet):
    workspace, dataset, model, shas, versions, models = fleet
    result = lineage.model_lineage(workspace, dataset, model, models[0])
    assert result["dataset_version"] == versions[0]
    assert result["sources"] == [
        {
            "sha256": shas["a.mcap"],
            "uri": "s3://fleet/cell-07/a.mcap",
            "cell_id": "cell-07",
            "policy_version": "sim-3",
            "episodes": 2,
        }
    ]
    trials = {role: [s["uri"] for s in t["sources"]] for role, t in result["trials"].items()}
    assert trials == {
        "candidate": ["s3://fleet/cell-07/b.mcap"],
        "incumbent": ["s3://fleet/cell-07/c.mcap"],
    }
    assert result["trials"]["candidate"]["stats"] == {"success_rate": 0.9}
    assert result["gate"] == {"passed": True, "reasons": []}
    bare = lineage.model_lineage(workspace, dataset, model, models[2])
    assert bare["sources"] == [] and bare["trials"] == {} and bare["gate"]["passed"] is None


def test_from_a_file_its_dataset_versions_and_models(fleet, tmp_path):
    workspace, dataset, model, shas, versions, models = fleet
    a = lineage.file_lineage(workspace, dataset, model, shas["a.mcap"])
    assert a["dataset_versions"] == versions
    assert [(m["version"], m["trained_on_file"], m["trials"]) for m in a["models"]] == [
        (models[0], True, []),
        (models[1], True, []),
    ]
    assert a["models"][1]["dataset_version"] == versions[1]
    b = lineage.file_lineage(workspace, dataset, model, shas["b.mcap"])
    assert b["dataset_versions"] == versions[1:]  # not in the version made before it landed
    assert [(m["version"], m["trained_on_file"], m["trials"]) for m in b["models"]] == [
        (models[0], False, ["candidate"]),
        (models[1], True, []),
    ]
    c = lineage.file_lineage(workspace, dataset, model, shas["c.mcap"])
    assert c["dataset_versions"] == versions[2:] and c["source"]["episodes"] == 1
    assert [(m["version"], m["trials"]) for m in c["models"]] == [(models[0], ["incumbent"])]
    log = tmp_path / "c.mcap"
    log.write_bytes(b"not this one")  # by path: its sha256 names another, unknown file
    unknown = lineage.file_lineage(workspace, dataset, model, str(log))
    assert unknown["dataset_versions"] == [] and unknown["models"] == []
    assert unknown["source"] == {"sha256": unknown["sha256"], "uri": None, "episodes": 0}
    assert lineage.file_lineage(workspace, dataset, "no-such-model", shas["a.mcap"])["models"] == []


def test_sources_are_described_from_the_index_when_not_checked_out(fleet):
    workspace, dataset, model, shas, versions, models = fleet
    before = lineage.model_lineage(workspace, dataset, model, models[1])
    index = (workspace / lineage.SOURCE_INDEX).read_text().splitlines()
    trained_on = sorted([shas["a.mcap"], shas["b.mcap"]])  # v2: no gate, so no trial logs
    assert sorted(json.loads(line)["sha256"] for line in index) == trained_on

    versioning.checkout_version(workspace, versions[0])  # b and c leave the dataset folder
    assert not (dataset / "episodes" / f"{shas['b.mcap']}.parquet").exists()
    with (workspace / lineage.SOURCE_INDEX).open("a") as handle:
        handle.write('{"sha256": "cut by a cra')  # a line cut by a crash is skipped
    assert lineage.model_lineage(workspace, dataset, model, models[1]) == before

    (workspace / lineage.SOURCE_INDEX).unlink()  # without the index: what the folder holds
    again = lineage.model_lineage(workspace, dataset, model, models[1])
    assert [s["uri"] for s in again["sources"]] == ["s3://fleet/cell-07/a.mcap", None]


def test_an_unknown_version_is_one_line_saying_which_exist(fleet):
    workspace, dataset, model, _, _, models = fleet
    with pytest.raises(LookupError) as raised:
        lineage.model_lineage(workspace, dataset, model, "99")
    assert str(raised.value) == (
        f"{model} version 99: not in the registry, which has versions 1 to {len(models)}"
    )
