"""MLflow tracking against a real SQLite store in a temporary workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pipelines.release.gate import TrialStats, decide
from pipelines.training import tracking
from pipelines.training.policy import PolicyConfig, PolicyNet, load_policy, save_policy
from pipelines.training.registry import (
    download_policy,
    gate_tags,
    model_version_info,
    model_version_record,
    model_version_records,
    production_version,
    record_gate,
    register_policy,
    set_production_alias,
)
from pipelines.training.tracking import (
    EpochLogger,
    log_learning_curve,
    log_training_batches,
    start_finetune_run,
    tracking_uri,
    use_workspace,
)
from pipelines.training.train import EpochMetrics

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 23  # flushed as 10 + 10 + 3
DATASET_VERSION = "0f3c9a5e1b7d2c4a8e6f0b1d3c5a7e9f.dir"
PROFILE = {"episodes": 300, "steps": 31_250, "intervention_steps": 4_100, "success_rate": 0.41}
BATCHES = ["b" * 64, "a" * 64]


@pytest.fixture(autouse=True)
def _workspace_store(monkeypatch):
    """The workspace's own SQLite store, and no workspace in use leaking between tests."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "_workspace_in_use", None)


def tiny_policy(folder: Path, seed: int = 0) -> PolicyNet:
    torch.manual_seed(seed)
    net = PolicyNet(PolicyConfig(hidden=[8], version="t", trained_on={}))
    save_policy(net, folder)
    return net


def client_for(workspace: Path):
    from mlflow import (
        MlflowClient,  # after pipelines.training.tracking has imported mlflow, quietly
    )

    return MlflowClient(tracking_uri(workspace))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, params):
    """One fine-tuning run, its epochs, learning curve and registered policy, recorded the way
    the retrain stage does it: the run's workspace and the run itself are implied."""
    workspace = tmp_path_factory.mktemp("workspace")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.setattr(tracking, "_workspace_in_use", None)
        folder = workspace / "models" / "candidate"
        net = tiny_policy(folder)
        history = [EpochMetrics(e, 1.0 / (e + 1), 1.5 / (e + 1)) for e in range(EPOCHS)]
        with start_finetune_run(
            workspace,
            params.train.experiment,
            params.train,
            DATASET_VERSION,
            "data/dataset",
            PROFILE,
        ) as run:
            log_training_batches(BATCHES, "sim-0")
            with EpochLogger(run.info.run_id, flush_every=10) as logger:
                for metrics in history:
                    logger(metrics)
            log_learning_curve(history)
            version = register_policy(
                run.info.run_id, folder, params.train.registered_model, {"cell_id": "cell-07"}
            )
    return SimpleNamespace(
        workspace=workspace,
        run=run.info,
        folder=folder,
        net=net,
        model=params.train.registered_model,
        version=version,
        logger=logger,
    )


def test_tracking_uri_is_the_workspace_sqlite_file_unless_the_env_names_one(tmp_path, monkeypatch):
    assert tracking_uri(tmp_path) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert use_workspace(tmp_path) == tracking_uri(tmp_path)
    assert tracking.current_workspace() == tmp_path.resolve()
    assert tracking.current_workspace(Path("elsewhere")) == Path("elsewhere")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert tracking_uri(tmp_path) == "http://mlflow.internal:5000"


def test_run_logs_train_params_tags_and_batched_epoch_metrics(trained, params):
    client = client_for(trained.workspace)
    run = client.get_run(trained.run.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith(str(trained.workspace.resolve() / "mlartifacts"))
    assert run.data.params == {
        f"train.{key}": str(value) for key, value in vars(params.train).items()
    }
    assert run.data.tags["dataset_version"] == DATASET_VERSION
    assert run.data.tags["dvc.dataset_hash"] == DATASET_VERSION
    for name in ("train_loss", "val_loss", "epoch"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == list(range(EPOCHS))
    assert trained.logger.flushes == 3  # one log_batch per 10 epochs and one for the rest
    assert run.data.metrics["val_loss"] == pytest.approx(1.5 / EPOCHS)


def test_dataset_version_is_a_training_input_of_the_run(trained):
    inputs = client_for(trained.workspace).get_run(trained.run.run_id).inputs.dataset_inputs
    assert len(inputs) == 1
    dataset, tags = inputs[0].dataset, {tag.key: tag.value for tag in inputs[0].tags}
    assert (dataset.name, dataset.digest) == ("line-dataset", DATASET_VERSION)
    assert tags == {"mlflow.data.context": "training", "dataset_version": DATASET_VERSION}
    assert json.loads(dataset.profile) == PROFILE
    assert json.loads(dataset.source) == {"uri": str(trained.workspace / "data" / "dataset")}


def test_run_artifacts_are_the_learning_curve_and_the_policy_files_only(trained):
    client = client_for(trained.workspace)
    top = {a.path: a for a in client.list_artifacts(trained.run.run_id)}
    assert set(top) == {"learning_curve.png", "policy", "training_batches.json"}
    assert top["learning_curve.png"].file_size > 1000
    policy = {a.path for a in client.list_artifacts(trained.run.run_id, "policy")}
    assert policy == {"policy/model.safetensors", "policy/config.json"}  # no MLmodel, no pickle
    png = Path(client.download_artifacts(trained.run.run_id, "learning_curve.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_registered_version_is_the_run_policy_folder_and_registering_again_reuses_it(trained):
    info = model_version_info(trained.model, trained.version, workspace=trained.workspace)
    assert info.run_id == trained.run.run_id
    assert info.source == f"{trained.run.artifact_uri}/policy"
    assert info.tags["dataset_version"] == DATASET_VERSION
    assert info.tags["cell_id"] == "cell-07"
    assert len(info.tags["policy.sha256"]) == 64
    again = register_policy(
        trained.run.run_id, trained.folder, trained.model, workspace=trained.workspace
    )
    assert again == trained.version


def test_gate_record_becomes_version_tags_and_a_run_artifact(trained):
    decision = decide(
        TrialStats("candidate", 100, 85, 0, 4.0), TrialStats("incumbent", 100, 50, 0, 4.2), 5.0
    )
    record = decision.as_record()
    record_gate(
        trained.model, trained.version, record, trained.run.run_id, workspace=trained.workspace
    )
    tags = model_version_info(trained.model, trained.version, workspace=trained.workspace).tags
    assert tags["gate.passed"] == "true"
    assert tags["gate.reasons"] == "; ".join(decision.reasons)
    assert float(tags["gate.candidate.success_rate"]) == 0.85
    assert float(tags["gate.incumbent.success_rate"]) == 0.5
    assert tags["gate.candidate.safety_stops"] == "0"
    assert float(tags["gate.cycle_time_budget_s"]) == 5.0
    gate_file = client_for(trained.workspace).download_artifacts(trained.run.run_id, "gate.json")
    assert json.loads(Path(gate_file).read_text()) == json.loads(json.dumps(record))


def test_gate_tags_of_a_failed_record():
    tags = gate_tags({"passed": False, "reasons": ["FAIL: 1 safety stops", "pass: x"]})
    assert tags == {"gate.passed": "false", "gate.reasons": "FAIL: 1 safety stops; pass: x"}


def test_production_alias_resolves_and_missing_ones_are_none(trained):
    alias = "cell-07-production"
    ws = trained.workspace
    assert production_version("no-such-model", alias, workspace=ws) is None
    assert production_version(trained.model, "cell-99-production", workspace=ws) is None
    set_production_alias(trained.model, alias, trained.version, workspace=ws)
    info = production_version(trained.model, alias, workspace=ws)
    assert (info.version, info.run_id) == (trained.version, trained.run.run_id)
    assert alias in info.aliases


def test_downloaded_policy_loads_with_the_original_weights(trained, tmp_path):
    dest = tmp_path / "production"
    for _ in range(2):  # the second download replaces the first
        folder = download_policy(trained.model, trained.version, dest, workspace=trained.workspace)
        assert folder == dest and sorted(p.name for p in dest.iterdir()) == [
            "config.json",
            "model.safetensors",
        ]
    loaded = load_policy(dest).net.state_dict()
    original = trained.net.state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[key], original[key]) for key in original)
    assert not (tmp_path / "production.partial").exists()


def test_a_run_registers_one_policy_and_tampered_weights_are_refused(trained, params, tmp_path):
    ws = trained.workspace
    with start_finetune_run(
        ws, params.train.experiment, params.train, "v2", "data/dataset", {}
    ) as run:
        pass
    folder = tmp_path / "policy-a"
    tiny_policy(folder, seed=1)
    version = register_policy(run.info.run_id, folder, trained.model, workspace=ws)
    tiny_policy(tmp_path / "policy-b", seed=2)
    with pytest.raises(ValueError, match="registers one policy"):
        register_policy(run.info.run_id, tmp_path / "policy-b", trained.model, workspace=ws)

    stored = Path(run.info.artifact_uri) / "policy" / "model.safetensors"
    stored.write_bytes((tmp_path / "policy-b" / "model.safetensors").read_bytes())
    dest = tmp_path / "dest"
    with pytest.raises(ValueError, match=r"sha256 .* differs from the registered"):
        download_policy(trained.model, version, dest, workspace=ws)
    assert not dest.exists() and not (tmp_path / "dest.partial").exists()


def test_model_version_record_holds_the_lineage(trained, params):
    record = model_version_record(trained.model, trained.version, workspace=trained.workspace)
    json.dumps(record)  # plain JSON, for the lineage stage
    assert (record["version"], record["run_id"]) == (trained.version, trained.run.run_id)
    assert record["dataset_version"] == DATASET_VERSION
    assert record["tags"]["dataset_version"] == DATASET_VERSION
    assert record["params"]["train.seed"] == str(params.train.seed)
    assert record["training_batches"] == sorted(BATCHES)
    assert record["base_policy"] == "sim-0"
    assert record["run"]["tags"]["dvc.dataset_hash"] == DATASET_VERSION
    assert set(record["run"]["metrics"]) == {"train_loss", "val_loss", "epoch"}
    (dataset,) = record["datasets"]
    assert dataset["digest"] == DATASET_VERSION and dataset["profile"] == PROFILE
    assert dataset["tags"]["mlflow.data.context"] == "training"

    every = model_version_records(trained.model, workspace=trained.workspace)
    assert [r["version"] for r in every] == sorted((r["version"] for r in every), key=int)
    assert every[0] == record
    assert model_version_records("no-such-model", workspace=trained.workspace) == []


def test_a_failing_run_is_marked_failed_and_bad_inputs_start_no_run(trained, params):
    ws, train = trained.workspace, params.train
    with (
        pytest.raises(RuntimeError, match="diverged"),
        start_finetune_run(ws, train.experiment, train, "v3", "data/dataset", {}) as run,
    ):
        raise RuntimeError("diverged")
    client = client_for(ws)
    assert client.get_run(run.info.run_id).info.status == "FAILED"

    runs_before = len(client.search_runs([run.info.experiment_id]))
    with (
        pytest.raises(ValueError, match="dataset source 'dvc://x'"),
        start_finetune_run(ws, train.experiment, train, "v4", "dvc://x", {}),
    ):
        pass
    with (
        pytest.raises(ValueError, match="dataset_version: empty"),
        start_finetune_run(ws, train.experiment, train, "", "data/dataset", {}),
    ):
        pass
    assert len(client.search_runs([run.info.experiment_id])) == runs_before
    with pytest.raises(RuntimeError, match="no MLflow run"):
        log_learning_curve([EpochMetrics(0, 1.0, 1.0)], workspace=ws)


def test_a_first_run_in_a_fresh_workspace_prints_nothing(tmp_path):
    """No migration logs, warnings, progress bars or telemetry on a normal (non-pytest) run."""
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from pipelines.training import registry, tracking
        from pipelines.contract.params import load_params
        from pipelines.training.policy import PolicyConfig, PolicyNet, save_policy
        from pipelines.training.train import EpochMetrics

        workspace, params = Path(sys.argv[1]), load_params(sys.argv[2]).train
        tracking.use_workspace(workspace)
        folder = save_policy(PolicyNet(PolicyConfig(hidden=[8])), workspace / "candidate")
        history = [EpochMetrics(e, 1.0, 1.0) for e in range(3)]
        with tracking.start_finetune_run(
            workspace, params.experiment, params, "abc", "data/dataset", {"episodes": 3}
        ) as run:
            with tracking.EpochLogger() as logger:
                for m in history:
                    logger(m)
            tracking.log_learning_curve(history)
        model = params.registered_model
        version = registry.register_policy(run.info.run_id, folder, model)
        registry.set_production_alias(model, "cell-07-production", version)
        registry.download_policy(model, version, workspace / "dl")
        registry.model_version_records(model)
        """
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MLFLOW_") and k != "PYTEST_CURRENT_TEST"
    }
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), str(ROOT / "params.yaml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "dl" / "model.safetensors").is_file()
