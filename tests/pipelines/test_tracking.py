"""MLflow tracking against a real SQLite store in a temporary workspace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from pipelines.contract.params import GateParams
from pipelines.release.gate import decide
from pipelines.training import tracking
from pipelines.training.policy import Policy, PolicyConfig, PolicyNet, load_policy, save_policy
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
    logged_training_batches,
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
FINETUNE_MODE_KEYS = ("mode", "anchor_weight", "distill_weight", "residual_hidden")  # train.mode


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
        env.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")  # samples in a short run
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
            run_name="finetune cell-07",
            cell_id="cell-07",
            description="Fine-tunes cell-07's policy sim-0.",
        ) as run:
            time.sleep(0.7)  # a few system-metric samples
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
    hyperparameters = ("seed", "epochs", "batch_size", "learning_rate", "val_fraction")
    as_logged = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(params.train).items()}
    assert run.data.params == {
        f"train.{key}": str(as_logged[key])  # a list as params.yaml writes it: [32]
        for key in (*hyperparameters, "intervention_weight", *FINETUNE_MODE_KEYS)
    }  # only what changes the model: no paths, no names
    tags = run.data.tags
    assert tags["dataset_version"] == DATASET_VERSION
    assert tags["dvc.dataset_hash"] == DATASET_VERSION
    assert (run.info.run_name, tags["cell_id"]) == ("finetune cell-07", "cell-07")
    assert tags["mlflow.note.content"] == "Fine-tunes cell-07's policy sim-0."
    assert tags["realloop.stage"] == "finetune" and tags["mlflow.user"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert tags["mlflow.source.git.commit"] == head.stdout.strip()
    assert tags["mlflow.source.git.dirty"] in ("true", "false")
    assert not tags["mlflow.source.name"].startswith("/")  # no path of this machine
    assert any(name.startswith("system/cpu_utilization") for name in run.data.metrics)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
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


def logged_model(trained):
    """The MLflow model the run logged: its one model output."""
    client = client_for(trained.workspace)
    (output,) = client.get_run(trained.run.run_id).outputs.model_outputs
    return client.get_logged_model(output.model_id)


def test_a_runs_training_batches_are_read_back_by_its_name_and_a_missing_run_is_none(
    trained, params
):
    experiment = params.train.experiment
    read = logged_training_batches(trained.workspace, experiment, "finetune cell-07")
    assert read == sorted(BATCHES)
    assert logged_training_batches(trained.workspace, experiment, "finetune cell-08") is None
    assert (
        logged_training_batches(trained.workspace, "no-such-experiment", "finetune cell-07") is None
    )


def test_run_artifacts_are_the_learning_curve_and_batches_and_the_policy_a_logged_model(trained):
    client = client_for(trained.workspace)
    top = {a.path: a for a in client.list_artifacts(trained.run.run_id)}
    assert set(top) == {"learning_curve.png", "training_batches.json"}
    assert top["learning_curve.png"].file_size > 1000
    model = logged_model(trained)
    assert (model.name, model.source_run_id, model.status) == (
        "policy",
        trained.run.run_id,
        "READY",
    )
    assert model.params == client.get_run(trained.run.run_id).data.params
    png = Path(client.download_artifacts(trained.run.run_id, "learning_curve.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_registered_version_is_the_run_policy_folder_and_registering_again_reuses_it(trained):
    info = model_version_info(trained.model, trained.version, workspace=trained.workspace)
    assert info.run_id == trained.run.run_id
    assert info.source == f"models:/{logged_model(trained).model_id}"
    assert info.tags["policy_version"] == "t"
    card = client_for(trained.workspace).get_model_version(trained.model, trained.version)
    assert f"dataset version `{DATASET_VERSION}`" in card.description
    assert "train.epochs = " in card.description and "Not judged yet" in card.description
    assert info.tags["dataset_version"] == DATASET_VERSION
    assert info.tags["cell_id"] == "cell-07"
    assert len(info.tags["policy.sha256"]) == 64
    again = register_policy(
        trained.run.run_id, trained.folder, trained.model, workspace=trained.workspace
    )
    assert again == trained.version


def _one_look_decision(candidate: tuple[str, int], incumbent: tuple[str, int], n: int):
    """The gate on n trial episodes per arm, judged in one look at n (policy, successes)."""
    from tests.pipelines.test_gate import arm

    one_look = GateParams(
        alpha=0.05, margin=0.02, looks=1, futility_power=0.05, cycle_time_budget_s=5.0
    )
    tables = [arm([True] * k + [False] * (n - k), policy) for policy, k in (candidate, incumbent)]
    return decide(*tables, one_look, max_episodes=n)


def test_gate_record_becomes_version_tags_and_a_run_artifact(trained):
    decision = _one_look_decision(("candidate", 85), ("incumbent", 50), 100)
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
    client = client_for(trained.workspace)
    gate_file = client.download_artifacts(trained.run.run_id, "gate.json")
    assert json.loads(Path(gate_file).read_text()) == json.loads(json.dumps(record))
    metrics = client.get_run(trained.run.run_id).data.metrics  # sortable, chartable
    low, _ = decision.candidate["interval"]
    assert metrics["trial/candidate_success"] == 0.85
    assert metrics["trial/incumbent_success"] == 0.5
    assert metrics["trial/candidate_episodes"] == decision.episodes_used
    assert metrics["trial/candidate_success_low"] == pytest.approx(low)
    assert metrics["gate/statistic"] == pytest.approx(decision.statistic)
    assert metrics["gate/bound"] == pytest.approx(decision.bound)
    assert metrics["gate/statistic"] >= metrics["gate/bound"]  # a pass: over its boundary
    assert metrics["gate/noninferiority_margin"] == decision.margin
    assert metrics["gate/episodes_used"] == decision.episodes_used
    assert metrics["gate/passed"] == 1.0
    card = client.get_model_version(trained.model, trained.version).description
    assert "### Hardware trials" in card and "85/100 successes" in card
    assert "The gate passed" in card and decision.reasons[0] in card


def test_gate_tags_of_a_failed_record():
    tags = gate_tags({"passed": False, "reasons": ["FAIL: 1 safety stops", "pass: x"]})
    assert tags == {"gate.passed": "false", "gate.reasons": "FAIL: 1 safety stops; pass: x"}


def logged_observations(params, count: int) -> np.ndarray:
    """What the reference cell shows a policy, step by step, as its logs record it."""
    from refcell.runner import run_episodes
    from refcell.world import load_world

    seen: list[np.ndarray] = []
    untrained = Policy(PolicyNet(PolicyConfig(hidden=[8])))
    shift = run_episodes(
        load_world("line"),
        params.cell,
        untrained,
        40,
        3,
        None,
        (lambda _, r: seen.append(r.observation),),
    )
    for _ in shift:
        if len(seen) >= count:
            break
    return np.stack(seen[:count]).astype(np.float32)


def test_the_production_alias_loads_with_pyfunc_and_acts_as_the_policy_without_pickle(
    trained, params, monkeypatch
):
    """What an MLflow user does: load the cell's production model by its alias, predict."""
    import mlflow.pyfunc

    from pipelines.contract.schema import ACTION_FIELDS, OBS_FIELDS

    ws = trained.workspace
    set_production_alias(trained.model, "cell-07-production", trained.version, workspace=ws)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracking_uri(ws))
    model = mlflow.pyfunc.load_model(f"models:/{trained.model}@cell-07-production")
    observations = logged_observations(params, 1000)
    actions = model.predict(pd.DataFrame(observations, columns=list(OBS_FIELDS)))
    assert list(actions.columns) == list(ACTION_FIELDS) and len(actions) == 1000
    with torch.inference_mode():
        expected = load_policy(trained.folder).net(torch.from_numpy(observations)).numpy()
    assert np.abs(actions.to_numpy() - expected).max() <= 1e-6
    assert model.metadata.get_input_schema().input_names() == list(OBS_FIELDS)

    folder = Path(logged_model(trained).artifact_location)
    files = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert {"MLmodel", "input_example.json", "artifacts/model.safetensors"} <= files
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".cloudpickle"))]
    flavor = yaml.safe_load((folder / "MLmodel").read_text())["flavors"]["python_function"]
    assert flavor["loader_module"] == "mlflow.pyfunc.loaders.code_model"  # the model is code
    assert "python_model" not in flavor  # the key of a pickled PythonModel
    assert (folder / Path(flavor["model_code_path"]).name).is_file()


def test_a_cycle_is_a_parent_run_per_cell_with_a_child_run_per_stage(trained, params):
    from mlflow.entities import Metric

    from pipelines.training.cycle_runs import log_cycle_runs, start_cycle_run, trial_gate_metrics

    ws, experiment = trained.workspace, "cycles"  # the store made already, an experiment of its own
    parent = start_cycle_run(ws, experiment, 3, "cell-07", "v1")
    assert start_cycle_run(ws, experiment, 3, "cell-07", "v1") == parent  # a re-run finds it
    name = "finetune cell-07 cycle 3"
    with start_finetune_run(
        ws, experiment, params.train, "v1", "data/dataset", {}, name, parent_run_id=parent
    ) as run:
        pass
    decision = _one_look_decision(("c", 19), ("i", 10), 20).as_record()
    client = client_for(ws)
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(k, v, 0, 0) for k, v in trial_gate_metrics(decision).items()],
    )  # what record_gate logs when the gate judges
    promotion = {
        "promoted": True,
        "reasons": ["promoted: ..."],
        "alias": "cell-07-production",
        "bundle": {"bundle_id": "b1"},
    }
    cell = {
        "cell": "cell-07",
        "outcome": "promoted",
        "reason": "...",
        "dataset_version": "v1",
        "training": {"mlflow_run_id": run.info.run_id, "model_version": "4"},
        "trial_request": {"request_id": "r1", "created_at": "2026-12-03T08:00:00Z"},
        "attempt": {"attempt": "attempt-2"},
        "waited_s": 12.5,
        "trials": {a: decision[a] for a in ("candidate", "incumbent")},
        "gate": {"passed": True, "reasons": decision["reasons"]},
        "promotion": promotion,
    }
    skipped = {
        "cell": "cell-09",
        "outcome": "skipped",
        "reason": "no production model",
        "dataset_version": "v1",
    }
    for _ in range(2):  # ending a cycle twice makes no second set of runs
        runs = log_cycle_runs(ws, experiment, {"cycle": 3, "cells": [cell, skipped]})
    assert runs["cell-07"] == parent
    cycle_run = client.get_run(parent)
    assert (cycle_run.info.run_name, cycle_run.info.status) == ("cycle 3 cell-07", "FINISHED")
    assert cycle_run.data.tags["realloop.outcome"] == "promoted"
    assert cycle_run.data.metrics["trial/candidate_success"] == 0.95  # mirrored
    assert cycle_run.data.metrics["gate/promoted"] == 1.0
    children = {
        r.info.run_name: r
        for r in client.search_runs(
            [run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent}'"
        )
    }
    assert set(children) == {
        "finetune cell-07 cycle 3",
        "trials cell-07 cycle 3",
        "gate cell-07 cycle 3",
    }
    trials = children["trials cell-07 cycle 3"]
    assert trials.data.metrics["trial/waited_s"] == 12.5
    assert trials.info.start_time == 1796284800000  # when the request was made
    gate = children["gate cell-07 cycle 3"]
    assert gate.data.metrics["gate/statistic"] == cycle_run.data.metrics["gate/statistic"]
    assert gate.data.tags["promotion.bundle_id"] == "b1"
    other = client.get_run(runs["cell-09"])
    assert (other.info.run_name, other.data.tags["realloop.outcome"]) == (
        "cycle 3 cell-09",
        "skipped",
    )
    assert "no production model" in other.data.tags["mlflow.note.content"]


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

    (output,) = client_for(ws).get_run(run.info.run_id).outputs.model_outputs
    location = client_for(ws).get_logged_model(output.model_id).artifact_location
    stored = Path(location) / "artifacts" / "model.safetensors"
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
    assert {"train_loss", "val_loss", "epoch"} <= set(record["run"]["metrics"])
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


def test_every_name_the_runs_and_versions_carry_is_listed_in_docs_tracking(trained):
    """docs/tracking.md is the reference reviewers sort and chart by: nothing logged is
    missing from it (runs here: fine-tune, cycle, trials, gate; the versions' tags)."""
    doc = (ROOT / "docs" / "tracking.md").read_text()
    client = client_for(trained.workspace)
    experiments = [e.experiment_id for e in client.search_experiments()]
    names = set()
    for run in client.search_runs(experiments):
        names |= {*run.data.params, *run.data.metrics, *run.data.tags}
    for mv in client.search_model_versions(f"name = '{trained.model}'"):
        names |= set(mv.tags)
    stages = {r.data.tags.get("realloop.stage") for r in client.search_runs(experiments)}
    assert stages >= {"finetune", "cycle", "trials", "gate"}  # the cycle test's runs are here

    def listed(name: str) -> bool:
        general = name.replace("candidate_", "<arm>_").replace("incumbent_", "<arm>_")
        return f"`{name}`" in doc or f"`{general}`" in doc or name.startswith("gate.")

    assert sorted(n for n in names if not listed(n)) == []
