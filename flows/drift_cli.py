"""`realloop drift`: has the line drifted from the production model's training data?"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from flows.console import emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


@fails_cleanly
def drift_command(params_path: ParamsOpt = Path("params.yaml"), as_json: JsonOpt = False) -> None:
    """Drift of the data since the production model's training data, per feature, and whether
    to retrain (`trigger`). Exits 0 whether or not it triggers; plots under drift.out."""
    from pipelines.contract.params import load_params
    from pipelines.quality import drift_report

    workspace = Path.cwd()
    params = load_params(params_path)
    report = drift_report(workspace, params, production_record(params, workspace))
    report["event"] = _emit_detected(report) if report["trigger"] else None
    emit(report, as_json, _print_drift)


def _emit_detected(report: dict) -> str | None:
    """realloop.drift.detected for the retrain-loop deployment's trigger; the event's name
    when a server took it (none without PREFECT_API_URL: nothing would act on it)."""
    from flows import events

    payload = {
        key: report[key] for key in ("cell", "reasons", "drifted_features", "new_edge_cases")
    } | {"dataset_version": report["current"]["dataset_version"]}
    resource = f"realloop.cell.{report['cell']}"
    return events.DRIFT_DETECTED if events.emit(events.DRIFT_DETECTED, resource, payload) else None


def production_record(params, workspace: Path, cell_id: str | None = None) -> dict | None:
    """The registry record of `<cell_id><promote.alias_suffix>`'s model version (default:
    cell.cell_id), or None before any promotion. Without a tracking server or a workspace
    store there is none, and no empty mlflow.db is made just to find that out."""
    from pipelines.training import DB_FILE, model_version_record, production_version

    if not os.environ.get("MLFLOW_TRACKING_URI") and not (workspace / DB_FILE).is_file():
        return None
    from flows.cycle import production_alias

    model = params.train.registered_model
    alias = production_alias(params, cell_id)
    production = production_version(model, alias, workspace=workspace)
    if production is None:
        return None
    return model_version_record(model, production.version, workspace=workspace)


def _print_drift(report: dict) -> None:
    from rich.table import Table

    from pipelines.quality import describe_measures

    base, cur = report["baseline"], report["current"]
    origin = (
        f"production model version {base['model_version']}"
        if base["source"] == "production"
        else "the first dataset version (no production model yet)"
    )
    stdout.print(
        f"baseline: {origin}, {base['batches']} batches, {base['episodes']} episodes; "
        f"current: dataset {cur['dataset_version']}, {cur['batches']} new batches, "
        f"{cur['episodes']} episodes",
        soft_wrap=True,
        highlight=False,
    )
    table = Table(title="drift per feature")
    for column in ("feature", "n before", "n after", "measures", "drifted"):
        table.add_column(column)
    for name, row in report["features"].items():
        verdict = ("[red]yes[/]" if row["drifted"] else "no") if row["assessed"] else "not judged"
        table.add_row(
            name,
            str(row["n_baseline"]),
            str(row["n_current"]),
            describe_measures(row["measures"]),
            verdict,
        )
    stdout.print(table)
    stdout.print(f"new edge-case episodes: {report['new_edge_cases']}", highlight=False)
    verdict = "[bold red]RETRAIN[/]" if report["trigger"] else "[green]no retraining needed[/]"
    stdout.print(f"trigger: {verdict}")
    for reason in report["reasons"]:
        stdout.print(f"  {reason}", soft_wrap=True, highlight=False)
    if report.get("event"):
        stdout.print(f"event: {report['event']} sent to {os.environ.get('PREFECT_API_URL')}")
    if report["plots"]:
        stdout.print(f"plots: {Path(report['plots'][0]).parent}/", soft_wrap=True)
