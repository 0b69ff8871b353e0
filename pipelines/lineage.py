"""Provenance in both directions.

- model → data: a registered model version names its dataset version (MLflow tag), the batches
  it trained on (run artifact), its params and its gate record with the trial logs;
  each batch is one source log file, whose URI and sha256 the episodes table carries.
- file → models: a log file's sha256 is the name of its batch; every dataset version whose DVC
  listing holds that batch contains the file, and every model version trained on one of those
  versions, or judged on trials from it, descends from it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq

from pipelines import tracking, versioning
from pipelines.ingest import sha256_file

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def model_lineage(workspace: Path, dataset: Path, registered_model: str, version: str) -> dict:
    record = tracking.model_version_record(registered_model, version)
    gate = record.get("gate") or {}
    trial_sources = gate.get("trial_sources", {})
    return {
        "model": registered_model,
        "version": str(version),
        "mlflow_run_id": record["run_id"],
        "dataset_version": record["dataset_version"],
        "sources": [_source(dataset, sha) for sha in record["training_batches"]],
        "params": record["params"],
        "trials": {
            role: {
                "stats": gate.get(role),
                "sources": [_source(dataset, sha) for sha in shas],
            }
            for role, shas in trial_sources.items()
        },
        "gate": {"passed": gate.get("passed"), "reasons": gate.get("reasons", [])},
    }


def file_lineage(workspace: Path, dataset: Path, registered_model: str, target: str) -> dict:
    """Every dataset version and model version that holds `target` (a path or a sha256)."""
    sha = _sha_of(target)
    versions = [
        v.version
        for v in versioning.list_versions(workspace)
        if sha in versioning.version_sources(workspace, v.version)
    ]
    models = []
    for record in tracking.model_version_records(registered_model):
        gate = record.get("gate") or {}
        trial_roles = [r for r, shas in gate.get("trial_sources", {}).items() if sha in shas]
        if sha in record["training_batches"] or trial_roles:
            models.append(
                {
                    "model": registered_model,
                    "version": record["version"],
                    "dataset_version": record["dataset_version"],
                    "trained_on_file": sha in record["training_batches"],
                    "trials": trial_roles,
                }
            )
    return {
        "file": target,
        "sha256": sha,
        "source": _source(dataset, sha),
        "dataset_versions": versions,
        "models": models,
    }


def _sha_of(target: str) -> str:
    path = Path(target)
    if path.is_file():
        return sha256_file(path)
    if SHA256.match(target):
        return target
    raise ValueError(f"{target}: neither a file nor a sha256; pass a log file or its sha256")


def _source(dataset: Path, sha: str) -> dict:
    """Where a batch came from, read from its episodes (the provenance columns)."""
    episodes = dataset / "episodes" / f"{sha}.parquet"
    if not episodes.is_file():
        return {"sha256": sha, "uri": None, "episodes": 0}
    table = pq.read_table(episodes, columns=["source_uri", "cell_id", "policy_version"])
    first = table.slice(0, 1).to_pylist()[0] if table.num_rows else {}
    return {
        "sha256": sha,
        "uri": first.get("source_uri"),
        "cell_id": first.get("cell_id"),
        "policy_version": first.get("policy_version"),
        "episodes": table.num_rows,
    }
