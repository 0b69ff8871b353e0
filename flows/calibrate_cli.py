"""`realloop calibrate`: estimate the line's parameters from its logs, for the sim."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from flows.console import emit, fails_cleanly, progress_bar, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


@fails_cleanly
def calibrate_command(
    out: Annotated[Path | None, typer.Option(help="overrides calibrate.out")] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Fit latency, sensor and perception noise, camera bias and physics to the validated
    line logs of the current dataset version (replaying them in the sim); write
    sim-calibration.yaml and plots, and record an MLflow run."""
    from pipelines.contract.params import load_params

    params = load_params(params_path)
    with progress_bar(not as_json) as update:
        payload = run_calibration(Path.cwd(), params, out, update)
    emit(payload, as_json, _print_calibration)


def run_calibration(workspace: Path, params, out: Path | None = None, progress=None) -> dict:
    from flows.plugins import load_simulator
    from pipelines.calibrate import (
        calibrate,
        plot_profiles,
        plot_replay,
        replay_comparison,
        write_calibration,
    )
    from pipelines.ingest import read_dataset
    from pipelines.training import log_calibration_run

    # params.yaml `simulator:` names it (refcell's by default): flows never import a simulator.
    # Loaded first, so that a wrong import path fails before validation runs.
    simulator, sim_world = load_simulator(params)
    dataset = workspace / params.ingest.dataset
    version, batches = _validated_batches(workspace, params)
    try:
        calibration, fits = calibrate(
            *read_dataset(dataset, sources=batches),
            simulator,
            sim_world,
            params.cell,
            params.calibrate,
            progress=progress,
        )
    except ValueError as exc:  # what the data cannot support: name the dataset it came from
        raise ValueError(f"{dataset} (version {version[:12]}): {exc}") from None
    plots = workspace / params.calibrate.plots / version
    comparison = replay_comparison(
        simulator,
        fits["logs"],
        fits["latency"],
        fits["perception"],
        sim_world,
        calibration,
        params.cell.max_speed_mps,
    )
    artifacts = [
        plot_replay(comparison, plots / "replay.png", params.cell.dt),
        plot_profiles(calibration.fit["profiles"], plots / "profiles.png"),
    ]
    report = {**calibration.as_dict(), "replay_rms": comparison["rms"]}
    full = plots / "calibration.json"
    full.write_text(json.dumps(report, indent=2, default=str))
    provenance = {
        "dataset_version": version,
        "batches": len(batches),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    yaml_path = write_calibration(
        calibration, workspace / (out or params.calibrate.out), provenance
    )
    run_id = log_calibration_run(
        workspace,
        params.calibrate.experiment,
        calibration.as_dict(),
        dataset_version=version,
        dataset_source=str(dataset),
        dataset_profile=calibration.fit | {"profiles": None},
        artifacts=[yaml_path, full, *artifacts],
    )
    return {
        **report,
        "dataset_version": version,
        "calibration_file": str(yaml_path),
        "plots": [str(p) for p in artifacts],
        "mlflow_run_id": run_id,
    }


def _validated_batches(workspace: Path, params) -> tuple[str, list[str]]:
    """The current dataset version and its batches that pass validation (or were admitted)."""
    from flows.validate_cli import validate_workspace

    report = validate_workspace(workspace, params)
    if not report.passed_batches:
        dataset = workspace / params.ingest.dataset
        raise ValueError(f"{dataset}: no batch passes validation; see `realloop validate`")
    return report.dataset_version, report.passed_batches


def _print_calibration(p: dict) -> None:
    from rich.table import Table

    table = Table(title=f"The line, estimated from dataset {p['dataset_version'][:12]}")
    for column in ("parameter", "estimate", "std. error"):
        table.add_column(column)
    for section in ("physics", "sensors", "perception"):
        for key, value in p["world"][section].items():
            std = p["uncertainty"][section].get(key)
            shown = "not identified" if std is None else f"{std:.3g}"
            table.add_row(f"{section}.{key}", f"{value:.4g}", shown)
    latency = p["world"]["latency"]
    table.add_row("latency.steps", str(latency["steps"]), "")
    table.add_row(
        "latency under load",
        f"+{latency['load_extra_steps']} steps, {latency['load_fraction']:.0%}",
        "",
    )
    for part in p["world"].get("parts", []):
        std = p["uncertainty"]["parts"][part["name"]]
        shown = lambda x: "not identified" if x is None else f"{x:.3g}"  # noqa: E731
        table.add_row(
            f"parts.{part['name']}.probability",
            f"{part['probability']:.3g}",
            shown(std["probability"]),
        )
        table.add_row(
            f"parts.{part['name']}.mass_scale",
            f"{part['mass_scale']:.3g}",
            shown(std["mass_scale"]),
        )
    stdout.print(table)
    force = p["derived"]["sliding_friction_force_n"]
    stdout.print(
        f"friction and part mass act only through the sliding force "
        f"{force['value']:.3f} ± {force['std']:.3f} N (see {p['plots'][1]})"
    )
    stdout.print(
        f"wrote {p['calibration_file']}; plots {p['plots'][0]}; MLflow run {p['mlflow_run_id']}"
    )
