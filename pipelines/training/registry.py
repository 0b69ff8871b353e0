"""The MLflow model registry: policies as model versions, the production alias, the gate's
verdict, and the records lineage and drift read back from them.

A policy is logged as an MLflow model of its run (a LoggedModel, pyfunc flavour) from code,
not from a pickle: the model's code is `pipelines/training/mlflow_model.py` and its artifacts
are the policy's two files (safetensors weights, JSON config), with a signature (a column per
observation field in, a column per action field out) and an input example. The model version
is registered from that logged model (`models:/<model_id>`), so
`mlflow.pyfunc.load_model("models:/realloop-policy@cell-07-production")` gives a model that
acts as the policy does. Its description is the model card (`model_card`), rewritten with the
trials and the verdict when the gate has judged it. The store is the one
`pipelines.training.tracking` locates; mlflow and torch are imported on first use.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from edge.runtime import EXPORT_FILE, ONNX_FILE, OOD_FILE
from pipelines.training.mlflow_context import in_process_store
from pipelines.training.tracking import (
    BASE_POLICY_TAG,
    DATASET_VERSION_TAG,
    TRAINING_BATCHES_ARTIFACT,
    current_workspace,
    flatten,
    jsonable,
    mlflow_client,
    quiet_mlflow,
    run_json,
    tracking_uri,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

from pipelines.training.cycle_runs import trial_gate_metrics
from pipelines.training.model_card import model_card

POLICY_ARTIFACT_DIR = "policy"  # where versions registered before logged models keep them
LOGGED_MODEL_NAME = "policy"  # the logged model's name in its run
MODEL_ARTIFACTS_DIR = "artifacts"  # where an MLflow model keeps the files it was given
EDGE_FILES = (ONNX_FILE, OOD_FILE, EXPORT_FILE)  # what the box's runtime needs besides weights
GATE_ARTIFACT = "gate.json"
# The weights' sha256, kept on a model version so a version answers lineage questions alone.
POLICY_SHA256_TAG = "policy.sha256"
POLICY_VERSION_TAG = "policy_version"  # the policy's own name (its config.json `version`)


@dataclass(frozen=True)
class ModelVersionInfo:
    registered_model: str
    version: str
    run_id: str | None
    source: str
    tags: dict[str, str]
    aliases: list[str]


def register_policy(
    run_id: str,
    policy_folder: Path,
    registered_model: str,
    tags: Mapping[str, Any] | None = None,
    *,
    workspace: Path | None = None,
    input_example: Any = None,
) -> str:
    """Log the policy as an MLflow model of the run and register it as a new version of
    `registered_model`, described by its model card; return the version.

    `input_example`: a few observations, (n, 12) in OBS_FIELDS order (default: one of
    zeros). The version is tagged with the weights' sha256 and the run's dataset version.
    Registering the same weights from the same run again returns the existing version, so a
    re-run after a crash does not make duplicates; a run registers one policy, other weights
    from it are refused.
    """
    quiet_mlflow()
    from mlflow.exceptions import MlflowException

    # policy brings torch: imported here so that reading the registry never waits for it
    from pipelines.training.policy import WEIGHTS_FILE, load_policy

    policy_folder = Path(policy_folder)
    policy = load_policy(policy_folder)  # refuse anything that would not load on the cell
    weights_sha256 = _sha256(policy_folder / WEIGHTS_FILE)
    client = mlflow_client(workspace)
    run = client.get_run(run_id)
    existing = _registered_from_run(client, registered_model, run_id, weights_sha256)
    if existing is not None:
        return existing
    model_id = log_policy_model(run, policy_folder, input_example, workspace=workspace)
    version_tags = {
        **{key: str(value) for key, value in (tags or {}).items()},
        POLICY_SHA256_TAG: weights_sha256,
        POLICY_VERSION_TAG: policy.name,
        DATASET_VERSION_TAG: run.data.tags.get(DATASET_VERSION_TAG, ""),
    }
    batches = (run_json(client, run_id, TRAINING_BATCHES_ARTIFACT) or {}).get("batches")
    card = model_card(client.get_run(run_id), policy.name, batches)
    # Registering a logged model reads it back through MLflow's process-wide client.
    with in_process_store(tracking_uri(current_workspace(workspace))):
        try:
            client.create_registered_model(registered_model)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        version = client.create_model_version(
            registered_model,
            f"models:/{model_id}",
            run_id=run_id,
            tags=version_tags,
            description=card,
            model_id=model_id,
        )
    return str(version.version)


def log_policy_model(
    run: Any, policy_folder: Path, input_example: Any = None, *, workspace: Path | None = None
) -> str:
    """Log the policy in `policy_folder` as an MLflow model (pyfunc, from code) of `run`;
    return its model id. Its params are the run's hyperparameters."""
    import mlflow
    import numpy as np
    import pandas as pd
    from mlflow.models import Model

    from pipelines.contract.schema import OBS_FIELDS
    from pipelines.training import mlflow_model
    from pipelines.training.policy import CONFIG_FILE, WEIGHTS_FILE

    client = mlflow_client(workspace)
    example = np.zeros((1, len(OBS_FIELDS)), np.float32) if input_example is None else input_example
    example = pd.DataFrame(np.asarray(example, np.float32), columns=list(OBS_FIELDS))
    model = client.create_logged_model(
        run.info.experiment_id,
        name=LOGGED_MODEL_NAME,
        source_run_id=run.info.run_id,
        params=dict(run.data.params),
        model_type="policy",
    )
    with in_process_store(tracking_uri(current_workspace(workspace))):
        Model.log(
            artifact_path=None,
            name=LOGGED_MODEL_NAME,
            flavor=mlflow.pyfunc,
            run_id=run.info.run_id,
            model_id=model.model_id,
            python_model=mlflow_model.__file__,  # models from code: the file, never a pickle
            artifacts={
                mlflow_model.WEIGHTS_ARTIFACT: str(policy_folder / WEIGHTS_FILE),
                mlflow_model.CONFIG_ARTIFACT: str(policy_folder / CONFIG_FILE),
                # The edge files travel with the version: a release made from the registry
                # (rollback, override) must carry what the box's runtime needs.
                **{name: str(policy_folder / name) for name in _edge_files(policy_folder)},
            },
            signature=policy_signature(),
            input_example=example,
            # Named, not inferred: inferring loads the model in a subprocess, seconds per log.
            pip_requirements=_requirements(),
        )
    return model.model_id


def policy_signature() -> Any:
    """A float32 column per observation field in, a column per action field out."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    from pipelines.contract.schema import ACTION_FIELDS, OBS_FIELDS

    return ModelSignature(
        inputs=Schema([ColSpec("float", name) for name in OBS_FIELDS]),
        outputs=Schema([ColSpec("float", name) for name in ACTION_FIELDS]),
    )


def _requirements() -> list[str]:
    from importlib.metadata import version

    return [f"{name}=={version(name)}" for name in ("mlflow", "torch", "safetensors", "numpy")]


def record_gate(
    registered_model: str,
    version: str,
    gate_record: Mapping[str, Any],
    run_id: str,
    *,
    workspace: Path | None = None,
) -> None:
    """Keep the gate's verdict on the model version (tags: gate.passed, gate.reasons and the
    numbers behind them; the model card rewritten with the trials and the verdict), its
    figures as metrics of the run (`cycle_runs.trial_gate_metrics`: trial/candidate_success,
    gate/statistic, ...) and the whole record as `gate.json` on the run."""
    from mlflow.entities import Metric

    client = mlflow_client(workspace)
    for key, value in gate_tags(gate_record).items():
        client.set_model_version_tag(registered_model, str(version), key, value)
    now = int(time.time() * 1000)
    metrics = [Metric(k, v, now, 0) for k, v in trial_gate_metrics(gate_record).items()]
    client.log_batch(run_id, metrics=metrics)
    client.log_dict(run_id, jsonable(dict(gate_record)), GATE_ARTIFACT)
    run = client.get_run(run_id)
    batches = (run_json(client, run_id, TRAINING_BATCHES_ARTIFACT) or {}).get("batches")
    tags = client.get_model_version(registered_model, str(version)).tags
    policy = tags.get(POLICY_VERSION_TAG) or f"{registered_model} version {version}"
    card = model_card(run, policy, batches, gate_record)
    client.update_model_version(registered_model, str(version), description=card)


def gate_tags(gate_record: Mapping[str, Any]) -> dict[str, str]:
    """gate.passed ("true"/"false"), gate.reasons ("; "-joined) and every scalar in the
    record under its dotted path, e.g. gate.candidate.success_rate. Lists (trial source
    hashes, intervals) stay in gate.json."""
    tags = {
        "gate.passed": "true" if gate_record.get("passed") is True else "false",
        "gate.reasons": "; ".join(str(r) for r in gate_record.get("reasons", [])),
    }
    rest = {k: v for k, v in gate_record.items() if k not in ("passed", "reasons")}
    for key, value in flatten({"gate": rest}, keep_lists=False).items():
        tags[key] = str(value)
    return tags


def set_production_alias(
    registered_model: str, alias: str, version: str, *, workspace: Path | None = None
) -> None:
    mlflow_client(workspace).set_registered_model_alias(registered_model, alias, str(version))


def production_version(
    registered_model: str, alias: str, *, workspace: Path | None = None
) -> ModelVersionInfo | None:
    """The version `alias` names, or None when the model or the alias does not exist yet."""
    quiet_mlflow()
    from mlflow.exceptions import MlflowException

    client = mlflow_client(workspace)
    try:
        model = client.get_registered_model(registered_model)
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise
    # An unknown alias is INVALID_PARAMETER_VALUE in get_model_version_by_alias, the same code
    # as a malformed one, so look it up in the model's alias table instead.
    version = model.aliases.get(alias)
    if version is None:
        return None
    return model_version_info(registered_model, version, workspace=workspace)


def model_version_info(
    registered_model: str, version: str, *, workspace: Path | None = None
) -> ModelVersionInfo:
    """One version's run, source, tags and aliases; LookupError (one line, saying which versions
    exist) when the registry has no such version."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(workspace)
    try:
        mv = client.get_model_version(registered_model, str(version))
    except MlflowException as exc:
        if exc.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        raise LookupError(_no_such_version(client, registered_model, version)) from None
    return ModelVersionInfo(
        registered_model=registered_model,
        version=str(mv.version),  # an int from the SQL store, a str over REST
        run_id=mv.run_id or None,
        source=mv.source,
        tags=dict(mv.tags),
        aliases=list(mv.aliases),
    )


def _no_such_version(client: MlflowClient, registered_model: str, version: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        found = sorted(
            int(mv.version) for mv in client.search_model_versions(f"name = '{registered_model}'")
        )
    except MlflowException:
        found = []
    if not found:
        return (
            f"{registered_model} version {version}: no version of {registered_model} is "
            f"registered in this workspace yet; run `realloop loop` or `realloop train` first"
        )
    return (
        f"{registered_model} version {version}: not in the registry, which has versions "
        f"{found[0]} to {found[-1]}"
    )


def download_policy(
    registered_model: str, version: str, dest: Path, *, workspace: Path | None = None
) -> Path:
    """Fetch the version's weights and config, and its edge files (policy.onnx, ood.json,
    export.json) when it was registered with them, into the folder `dest` (replacing it),
    after checking the weights' sha256 against the registry and that the policy loads."""
    # policy brings torch: imported here so that reading the registry never waits for it
    from pipelines.training.policy import CONFIG_FILE, WEIGHTS_FILE, load_policy

    info = model_version_info(registered_model, version, workspace=workspace)  # quietly imports
    import mlflow.artifacts

    root = policy_files_uri(info.source, workspace=workspace)
    dest = Path(dest)
    staging = dest.with_name(dest.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    uri = tracking_uri(current_workspace(workspace))
    try:
        stored = {
            Path(f.path).name for f in mlflow.artifacts.list_artifacts(root, tracking_uri=uri)
        }
        edge = [name for name in EDGE_FILES if name in stored]  # older versions have none
        for name in (WEIGHTS_FILE, CONFIG_FILE, *edge):
            mlflow.artifacts.download_artifacts(
                artifact_uri=f"{root}/{name}", dst_path=str(staging), tracking_uri=uri
            )
        expected = info.tags.get(POLICY_SHA256_TAG)
        actual = _sha256(staging / WEIGHTS_FILE)
        if expected is not None and actual != expected:
            raise ValueError(
                f"{registered_model} version {info.version}: {WEIGHTS_FILE} sha256 {actual} "
                f"differs from the registered {expected}; refusing to use it"
            )
        load_policy(staging)
        _replace_folder(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _edge_files(policy_folder: Path) -> list[str]:
    return [name for name in EDGE_FILES if (Path(policy_folder) / name).is_file()]


def policy_files_uri(source: str, *, workspace: Path | None = None) -> str:
    """Where a version's weights and config lie: the `artifacts/` folder of the logged model a
    `models:/<model_id>` source names, or the run's `policy/` folder that versions registered
    before logged models name themselves."""
    if not source.startswith("models:/"):
        return source.rstrip("/")
    model_id = source.removeprefix("models:/").split("/")[0]
    location = mlflow_client(workspace).get_logged_model(model_id).artifact_location
    return f"{location.rstrip('/')}/{MODEL_ARTIFACTS_DIR}"


def model_version_record(
    registered_model: str, version: str, *, workspace: Path | None = None
) -> dict[str, Any]:
    """Everything lineage needs about one version, as plain JSON: the version (source, tags,
    aliases), its dataset version, run params, the batches it trained on and its base policy,
    its gate record, and the run (tags, final metrics, dataset inputs)."""
    info = model_version_info(registered_model, version, workspace=workspace)
    record: dict[str, Any] = {
        **dataclasses.asdict(info),
        "dataset_version": info.tags.get(DATASET_VERSION_TAG) or None,
        "params": {},
        "training_batches": [],
        "base_policy": None,
        "gate": None,
        "run": None,
        "datasets": [],
    }
    if info.run_id is None:
        return record
    client = mlflow_client(workspace)
    run = client.get_run(info.run_id)
    batches = run_json(client, info.run_id, TRAINING_BATCHES_ARTIFACT) or {}
    record.update(
        dataset_version=record["dataset_version"] or run.data.tags.get(DATASET_VERSION_TAG),
        params=dict(run.data.params),
        training_batches=batches.get("batches", []),
        base_policy=batches.get("base_policy") or run.data.tags.get(BASE_POLICY_TAG),
        gate=run_json(client, info.run_id, GATE_ARTIFACT),
    )
    record["run"] = {
        "run_id": run.info.run_id,
        "experiment_id": run.info.experiment_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "tags": dict(run.data.tags),
        "metrics": dict(run.data.metrics),
    }
    record["datasets"] = [
        {
            "name": item.dataset.name,
            "digest": item.dataset.digest,
            "source_type": item.dataset.source_type,
            "source": json.loads(item.dataset.source),
            "profile": json.loads(item.dataset.profile) if item.dataset.profile else None,
            "tags": {tag.key: tag.value for tag in item.tags},
        }
        for item in (run.inputs.dataset_inputs if run.inputs else [])
    ]
    return record


def model_version_records(
    registered_model: str, *, workspace: Path | None = None
) -> list[dict[str, Any]]:
    """model_version_record of every version of `registered_model`, oldest first; [] when the
    model was never registered."""
    client = mlflow_client(workspace)
    versions = sorted(
        int(mv.version) for mv in client.search_model_versions(f"name = '{registered_model}'")
    )
    return [model_version_record(registered_model, str(v), workspace=workspace) for v in versions]


def model_version_summaries(
    registered_model: str, *, workspace: Path | None = None
) -> list[dict[str, Any]]:
    """version, dataset_version, training_batches and gate of every version of the model,
    oldest first ([] when it was never registered).

    What `model_version_records` returns of each version, without the rest it also
    reads (run params, metrics, inputs, aliases): through the `runs:/` resolution that costs
    a dozen store queries per version, 65 ms each at 12 versions (measured). Here the
    versions and their tags come from one query, and the artifact roots of their runs from
    one more (`_artifact_roots`)."""
    from mlflow.exceptions import MlflowException

    client = mlflow_client(workspace)
    uri = tracking_uri(current_workspace(workspace))
    try:
        found = client.search_model_versions(f"name = '{registered_model}'")
    except MlflowException:
        return []
    records = []
    roots = _artifact_roots(client, found)
    for mv in sorted(found, key=lambda mv: int(mv.version)):
        root = roots.get(mv.run_id)
        batches = _artifact_json_at(root, TRAINING_BATCHES_ARTIFACT, uri) or {}
        dataset_version = mv.tags.get(DATASET_VERSION_TAG) or None
        if dataset_version is None and mv.run_id:
            run = client.get_run(mv.run_id)
            dataset_version = run.data.tags.get(DATASET_VERSION_TAG)
        records.append(
            {
                "version": str(mv.version),
                "dataset_version": dataset_version,
                "training_batches": batches.get("batches", []),
                "gate": _artifact_json_at(root, GATE_ARTIFACT, uri),
            }
        )
    return records


# --- internals ---------------------------------------------------------------------------


def _artifact_roots(client, versions) -> dict[str, str]:
    """run id → artifact root of the runs the versions were registered from: read off a
    version's source where it is the run's `policy/` folder (versions registered before
    logged models), else from one search over every experiment's runs."""
    roots, unknown = {}, set()
    suffix = f"/{POLICY_ARTIFACT_DIR}"
    for mv in versions:
        source = (mv.source or "").rstrip("/")
        if not mv.run_id:
            continue
        if source.endswith(suffix) and not source.startswith(("runs:", "models:")):
            roots[mv.run_id] = source.removesuffix(suffix)
        else:
            unknown.add(mv.run_id)
    if unknown:
        from mlflow.entities import ViewType

        every = ViewType.ALL  # a deleted run's files still say what its versions trained on
        experiments = [e.experiment_id for e in client.search_experiments(view_type=every)]
        ids = ", ".join(f"'{run_id}'" for run_id in sorted(unknown))
        where = f"attributes.run_id IN ({ids})"
        for run in client.search_runs(
            experiments, where, run_view_type=every, max_results=len(unknown)
        ):
            roots[run.info.run_id] = run.info.artifact_uri
    return roots


def _artifact_json_at(root: str | None, name: str, tracking_uri: str):
    """A small JSON artifact under a run's artifact root, or None when it has none."""
    from mlflow.artifacts import download_artifacts
    from mlflow.exceptions import MlflowException

    if root is None:
        return None
    local = _local_path(root)
    if local is not None:  # the default store: a folder in the workspace, read as it is
        try:
            return json.loads((local / name).read_text())
        except FileNotFoundError:
            return None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = download_artifacts(
                artifact_uri=f"{root.rstrip('/')}/{name}", dst_path=tmp, tracking_uri=tracking_uri
            )
        except (MlflowException, OSError):
            return None
        return json.loads(Path(local).read_text())


def _local_path(uri: str) -> Path | None:
    """The folder an artifact URI names when it is a local path or file:// URI, else None."""
    from urllib.parse import unquote

    parsed = urlparse(uri)
    if parsed.scheme == "file" and parsed.netloc in ("", "localhost"):
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and Path(uri).is_absolute():
        return Path(uri)
    return None


def _registered_from_run(
    client: MlflowClient, registered_model: str, run_id: str, weights_sha256: str
) -> str | None:
    """The version of `registered_model` that already holds these weights from this run.

    A run keeps one policy: its `policy/` folder is the source of every version registered
    from it, so uploading different weights there would change versions that already exist.
    """
    existing = client.search_model_versions(f"run_id = '{run_id}'")
    for mv in existing:
        if mv.tags.get(POLICY_SHA256_TAG) != weights_sha256:
            raise ValueError(
                f"run {run_id} already registered other weights as {mv.name} version "
                f"{mv.version}; a run registers one policy (start a new run for another)"
            )
    for mv in existing:
        if mv.name == registered_model:
            return str(mv.version)
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _replace_folder(new: Path, old: Path) -> None:
    """Swap `new` into place at `old`; `old` is never half-written."""
    if not old.exists():
        new.rename(old)
        return
    trash = old.with_name(old.name + ".old")
    shutil.rmtree(trash, ignore_errors=True)
    old.rename(trash)
    new.rename(old)
    shutil.rmtree(trash)
