"""The ingest flow: landing folder → canonical Parquet dataset → a new DVC dataset version."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, task
from prefect.runtime import flow_run

from pipelines.params import Params, load_params


@task(name="ingest-logs")
def ingest_logs(params: Params, workspace: Path, run_id: str) -> dict:
    from pipelines.ingest import ingest_landing

    ingest = params.ingest
    report = ingest_landing(
        workspace / ingest.landing,
        workspace / ingest.dataset,
        workspace / ingest.quarantine,
        params.cell,
        ingest,
        run_id=run_id,
    )
    return report.as_dict()


@task(name="version-dataset")
def version_dataset(params: Params, workspace: Path) -> dict:
    """`dvc add` + `dvc push` the dataset folder; its DVC hash is the dataset version."""
    from pipelines import versioning

    versioning.ensure_workspace(workspace, params.ingest.remote)
    return versioning.version_dataset(workspace, workspace / params.ingest.dataset).as_dict()


@flow(name="ingest")
def ingest_flow(params_path: str = "params.yaml", workspace: str = ".") -> dict:
    """Ingest everything new in the landing folder and version the dataset."""
    params = load_params(params_path)
    root = Path(workspace).resolve()
    (root / params.ingest.dataset).mkdir(parents=True, exist_ok=True)
    report = ingest_logs(params, root, run_id=str(flow_run.get_id() or "local"))
    dataset = version_dataset(params, root)
    return {"ingest": report, "dataset": dataset, "dataset_version": dataset["version"]}
