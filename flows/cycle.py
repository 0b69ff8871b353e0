"""What one loop cycle needs around its stages: which policy runs the line now, which
ingested batches came from which trial logs, and the cycle summary people and scripts read."""

from __future__ import annotations

from pathlib import Path

from pipelines.contract.params import Params


def production_alias(params: Params) -> str:
    return f"{params.cell.cell_id}{params.promote.alias_suffix}"


def current_policy(params: Params, params_path: Path, workspace: Path) -> dict:
    """The incumbent: the registry's `<cell>-production` version; before the first promotion,
    the policy pretrained in the calibrated sim (`cell pretrain --calibration`) if there is
    one, else the sim policy (pretrained here if it does not exist yet)."""
    from pipelines.training import download_policy, production_version

    production = production_version(params.train.registered_model, production_alias(params))
    if production is not None:
        folder = workspace / "models" / "production"
        download_policy(params.train.registered_model, production.version, folder)
        return {
            "folder": folder,
            "source": "registry",
            "model_version": production.version,
            "policy_version": _policy_version(folder),
        }
    calibrated = workspace / params.pretrain.calibrated_out
    if (calibrated / "config.json").is_file():  # pretrained in the sim calibrated to this line
        return {
            "folder": calibrated,
            "source": "calibrated sim",
            "model_version": None,
            "policy_version": _policy_version(calibrated),
        }
    folder = workspace / params.pretrain.out
    if not (folder / "config.json").is_file():
        _pretrain_sim_policy(params, folder)
    return {
        "folder": folder,
        "source": "sim",
        "model_version": None,
        "policy_version": _policy_version(folder),
    }


BASE_POLICY = Path("models/base")  # what the last fine-tune started from; a dvc.yaml dep


def pin_base_policy(folder: Path, workspace: Path) -> Path:
    """Copy the policy a fine-tune starts from to models/base, so `dvc repro finetune`
    reproduces the loop's fine-tuning from the same weights."""
    from pipelines.training import load_policy, save_policy

    return save_policy(load_policy(folder).net, workspace / BASE_POLICY)


def _policy_version(folder: Path) -> str:
    from pipelines.training import load_policy

    return load_policy(folder).name


def _pretrain_sim_policy(params: Params, folder: Path) -> None:
    from pipelines.training import save_policy
    from refcell.pretrain import pretrain
    from refcell.world import load_world

    save_policy(pretrain(load_world("sim"), params.cell, params.pretrain), folder)


def sources_of(ingest_summary: dict, logs: dict[str, list[str]]) -> dict[str, list[str]]:
    """Map each role's trial log paths to the sha256 of their ingested batches."""
    by_path = {
        str(Path(row["source"]).resolve()): row["sha256"]
        for row in ingest_summary["ingested"] + ingest_summary["skipped"]
    }
    missing = [p for paths in logs.values() for p in paths if str(Path(p).resolve()) not in by_path]
    if missing:
        raise ValueError(f"{missing[0]}: trial log was not ingested (see data/quarantine/)")
    return {role: [by_path[str(Path(p).resolve())] for p in paths] for role, paths in logs.items()}


def edge_channel_status(params: Params) -> dict | None:
    """What the channel tells the cell's edge box to run (None before any promotion)."""
    from edge.agent import fetch_bundle
    from edge.channels import open_channel
    from edge.errors import EdgeError

    try:
        bundle = fetch_bundle(open_channel(params.promote.channel), params.cell.cell_id)
    except EdgeError:
        return None
    manifest = bundle.manifest
    return {
        "bundle_id": bundle.bundle_id,
        "model_name": manifest.get("model_name"),
        "model_version": manifest.get("model_version"),
        "dataset_version": manifest.get("dataset_version"),
        "created_at": manifest.get("created_at"),
    }


def summarize_cycle(
    params: Params,
    cycle: int,
    incumbent: dict,
    shift: dict,
    ingested: dict,
    after_trials: dict,
    validation: dict,
    trained: dict,
    promotion: dict,
) -> dict:
    gate = trained["gate"]
    return {
        "cell": params.cell.cell_id,
        "cycle": cycle,
        "dataset_version": ingested["dataset_version"],
        "dataset_version_with_trials": after_trials["dataset_version"],
        "incumbent": {k: v for k, v in incumbent.items() if k != "folder"},
        "collected": {
            "episodes": shift["episodes"],
            "logs": len(shift["files"]),
            "captures": len(shift["captures"]),
            "success_rate": shift["success_rate"],
            "interventions": shift["interventions"],
        },
        "ingest": _ingest_counts(ingested["ingest"], after_trials["ingest"]),
        "validation": {k: v for k, v in validation.items() if k != "passed_batches"},
        "training": {k: v for k, v in trained.items() if k != "gate"},
        "trials": {"candidate": gate["candidate"], "incumbent": gate["incumbent"]},
        "gate": {"passed": gate["passed"], "reasons": gate["reasons"]},
        "promotion": promotion,
        "channel": params.promote.channel,
        "edge": edge_channel_status(params),
    }


def _ingest_counts(*reports: dict) -> dict:
    return {
        "episodes_ingested": sum(r["episodes_ingested"] for r in reports),
        "files_ingested": sum(r["files_ingested"] for r in reports),
        "files_skipped": reports[0]["files_skipped"],
        "files_quarantined": sum(r["files_quarantined"] for r in reports),
        "quarantined": [q for r in reports for q in r["quarantined"]],
    }


def print_cycle(summary: dict, print_line) -> None:
    """The human summary: one short block per stage."""
    from rich.table import Table

    ingest, validation, training = summary["ingest"], summary["validation"], summary["training"]
    print_line(f"[bold]cycle {summary['cycle']}[/] on {summary['cell']}")
    print_line(
        f"dataset {summary['dataset_version']}: {ingest['episodes_ingested']} episodes "
        f"ingested from {ingest['files_ingested']} logs, {ingest['files_quarantined']} "
        "quarantined"
    )
    for row in ingest["quarantined"]:
        print_line(f"  quarantined {row['source']}: {row['reason']}")
    print_line(
        f"validation: {validation['passed']} of {validation['batches']} batches passed; "
        f"excluded from training: {len(validation['excluded_from_training'])}"
    )
    if validation.get("data_docs"):
        print_line(f"  Data Docs: {validation['data_docs']}")
    print_line(
        f"fine-tune: MLflow run {training['mlflow_run_id']}, "
        f"{training['registered_model']} version {training['model_version']}"
    )
    table = Table(title="hardware trials on the line")
    for column in ("policy", "n", "success", "95% interval", "safety stops", "p95 cycle (s)"):
        table.add_column(column)
    for role, row in summary["trials"].items():
        low, high = row["interval"]
        table.add_row(
            f"{role} ({row['policy']})",
            str(row["n"]),
            f"{row['success_rate']:.1%}",
            f"{low:.1%}–{high:.1%}",
            str(row["safety_stops"]),
            "-" if row["p95_cycle_time_s"] is None else f"{row['p95_cycle_time_s']:.2f}",
        )
    print_line(table)
    verdict = "[green]PASSED[/]" if summary["gate"]["passed"] else "[red]FAILED[/]"
    print_line(f"gate {verdict}")
    for reason in summary["gate"]["reasons"]:
        print_line(f"  {reason}")
    edge = summary["edge"]
    runs = (
        f"{edge['model_name']} version {edge['model_version']} (bundle {edge['bundle_id']})"
        if edge
        else "nothing yet"
    )
    print_line(f"edge channel {summary['channel']}: cell {summary['cell']} runs {runs}")
