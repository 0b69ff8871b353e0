"""`realloop loop | ingest | datasets | train | lineage`: the loop and its stages by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.console import CommandError, emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


def _workspace() -> Path:
    """The workspace is the folder realloop runs in: params paths are relative to it."""
    from flows.prefect_env import configure_prefect
    from pipelines.training import use_workspace

    workspace = Path.cwd()
    configure_prefect(workspace)
    use_workspace(workspace)
    return workspace


CellOpt = Annotated[
    str | None, typer.Option("--cell", help="one cell's cycle (default: every cell of fleet.cells)")
]


@fails_cleanly
def loop(
    cell: CellOpt = None,
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            help="where the cells upload: folder, file:// or s3://bucket/prefix "
            "(default: ingest.landing)",
        ),
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """One retraining cycle per cell: ingest what the cells uploaded, validate, fine-tune,
    request hardware trials and wait for them, gate, promote."""
    from flows.cycle import FAILED, fleet_cells, print_cycle
    from pipelines.contract.params import load_params

    workspace = _workspace()
    _check_ingest(workspace, params_path, source)
    params = load_params(params_path)
    cells = fleet_cells(params, cell)  # a bad cell id fails here, in one line
    from flows.loop import loop_flow
    from flows.loop_lock import cells_locked

    # Taken here, held by the flow (same thread): a loop already running for one of the
    # cells is refused in one line, before Prefect starts a run that would fail.
    with cells_locked(workspace, cells, None, params):
        summary = loop_flow(
            params_path=str(params_path),
            workspace=str(workspace),
            cell=cell,
            source=source,
            progress=not as_json,
        )
    emit(summary, as_json, lambda s: print_cycle(s, stdout.print))
    failed = [c for c in summary["cells"] if c["outcome"] == FAILED]
    if failed:
        raise CommandError(f"cell {failed[0]['cell']} failed: {failed[0]['reason']}")


@fails_cleanly
def ingest(
    source: Annotated[
        str | None,
        typer.Option(
            "--source",
            help="landing folder, file:// or s3://bucket/prefix URI (default: ingest.landing)",
        ),
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Ingest new logs from a source once, into a new DVC dataset version if any were added."""
    workspace = _workspace()
    _check_ingest(workspace, params_path, source)
    from flows.ingest import ingest_flow

    # A bar over the files on a terminal's stderr; none under --json, whose callers are
    # programs (stdout stays JSON either way; stderr keeps only a failure's one line).
    result = ingest_flow(
        params_path=str(params_path), workspace=str(workspace), source=source, progress=not as_json
    )
    emit(result, as_json, _print_ingest)


def _check_ingest(workspace: Path, params_path: Path, source: str | None) -> None:
    """What the flow would refuse, refused here in one line (a failed flow run logs a
    traceback)."""
    from pipelines.contract.params import load_params
    from pipelines.ingest import LandingFolder, check_can_version, open_source

    params = load_params(params_path)
    origin = open_source(source, workspace / params.ingest.landing, workspace)
    if isinstance(origin, LandingFolder):
        if not origin.root.is_dir():
            raise CommandError(f"{origin.root}: landing folder not found")
    else:
        origin.check()  # bucket, credentials, endpoint
    check_can_version(workspace, workspace / params.ingest.dataset)


def _print_ingest(result: dict) -> None:
    report, version = result["ingest"], result["dataset"]
    state = f"new version {version['tag']}" if version.get("new") else "unchanged"
    stdout.print(
        f"dataset {result['dataset_version']} ({state}): {report['files_landed']} files from "
        f"{result['source']}: {report['episodes_ingested']} episodes from "
        f"{report['files_ingested']} new logs, {report['files_skipped']} already ingested, "
        f"{report['files_quarantined']} quarantined",
        soft_wrap=True,
    )
    for row in report["quarantined"]:
        stdout.print(f"  quarantined {row['source']}: {row['reason']}", soft_wrap=True)
    for row in report.get("waiting", []):
        stdout.print(f"  waiting for {row['source']}: {row['reason']}", soft_wrap=True)


@fails_cleanly
def datasets(
    checkout: Annotated[
        str | None,
        typer.Option(
            "--checkout",
            help="bring the dataset folder back to a version: hash, prefix, tag or 'latest'",
        ),
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Dataset versions (hash, git tag and commit, episodes, sources), or check one out."""
    from pipelines.contract.params import load_params
    from pipelines.ingest import versioning

    workspace = Path.cwd()
    dataset = workspace / load_params(params_path).ingest.dataset
    if checkout is not None:
        version = versioning.checkout_version(workspace, checkout).as_dict()
        version.pop("new")
        emit(
            version,
            as_json,
            lambda v: stdout.print(
                f"{v['path']} checked out at {v['version']} ({v['tag']}, {v['files']} files)",
                soft_wrap=True,
            ),
        )
        return
    emit(versioning.describe_versions(workspace, dataset), as_json, _print_datasets)


def _print_datasets(listing: dict) -> None:
    versions = listing["versions"]
    if not versions:
        stdout.print(f"{listing['dataset']}: no versions yet; run `realloop ingest`")
        return
    stdout.print(f"{listing['dataset']}: {len(versions)} versions, oldest first")
    for v in versions:
        episodes = "?" if v["episodes"] is None else v["episodes"]
        sources = "?" if v["sources"] is None else len(v["sources"])
        marker, name = "*" if v["current"] else " ", v["tag"] or v["version"][:12]
        stdout.print(
            f"{marker} {name}  {v['created_at'][:19]}  {(v['commit'] or '-')[:10]}"
            f"  {sources} sources (+{v['sources_added']})"
            f"  {episodes} episodes  {v['files']} files",
            highlight=False,
            soft_wrap=True,
        )


@fails_cleanly
def train(
    cell: Annotated[
        str | None,
        typer.Option("--cell", help="train on this cell's batches only (default: all batches)"),
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    base: Annotated[
        Path | None,
        typer.Option(help="policy folder to fine-tune (default: the cell's production model)"),
    ] = None,
    training_set: Annotated[
        Path | None,
        typer.Option(
            "--training-set",
            help="the dataset version and batches a loop cycle pinned for --cell "
            "(what `dvc repro finetune@<cell>` runs); default: the current version, validated",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Fine-tune on the workspace's current dataset version, or on a cycle's pinned training
    set; with --cell, also write the cell's DVC metrics and learning curve (dvc.yaml)."""
    from pipelines.contract.params import load_params
    from pipelines.release.cycle_record import fine_tune_cell, read_training_set
    from pipelines.training import fine_tune_and_register

    workspace = _workspace()
    params = load_params(params_path)
    if training_set is not None:
        if cell is None:
            raise CommandError("--training-set is one cell's: pass --cell too")
        version, batches = read_training_set(training_set)
    else:
        version, batches = _validated_batches(params, workspace)
    folder = base or _production_policy(params, workspace, cell or params.cell.cell_id)
    if cell is None:
        result = fine_tune_and_register(params, workspace, folder, version, batches)
    else:
        result = fine_tune_cell(params, workspace, folder, version, batches, cell)
    emit(
        result,
        as_json,
        lambda r: stdout.print(
            f"fine-tuned on dataset {r['dataset_version']}: {r['registered_model']} version "
            f"{r['model_version']} (MLflow run {r['mlflow_run_id']})"
        ),
    )


def _validated_batches(params, workspace: Path) -> tuple[str, list[str]]:
    """The current dataset version and its batches that pass validation."""
    from pipelines.ingest import current_version
    from pipelines.quality import validate_dataset

    dataset = workspace / params.ingest.dataset
    version = current_version(workspace, dataset)
    captures = workspace / params.ingest.landing / "captures"
    report = validate_dataset(dataset, params.cell, params.validate, captures=captures)
    return version, report.passed_batches


def _production_policy(params, workspace: Path, cell_id: str) -> Path:
    """The cell's production model, fetched and checked against the registry."""
    from flows.cycle import base_folder, production_alias
    from pipelines.training import download_policy, production_version

    model = params.train.registered_model
    production = production_version(model, production_alias(params, cell_id))
    if production is None:
        raise CommandError(
            f"{cell_id}: no production model ({production_alias(params, cell_id)}); "
            "pass --base PATH or run realloop deploy --initial"
        )
    return download_policy(model, production.version, base_folder(workspace, cell_id))


@fails_cleanly
def lineage(
    target: Annotated[str, typer.Argument(help="a model version, a log file or its sha256")],
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Provenance both ways: a model's data, params and trials, or a file's datasets and models."""
    from pipelines.contract.params import load_params
    from pipelines.release import file_lineage, model_lineage

    workspace = _workspace()
    params = load_params(params_path)
    dataset, model = workspace / params.ingest.dataset, params.train.registered_model
    if target.isdigit():
        result = model_lineage(workspace, dataset, model, target)
    elif Path(target).exists() or len(target) == 64:
        result = file_lineage(workspace, dataset, model, target)
    else:
        raise CommandError(f"{target}: not a model version, a file, or a sha256")
    emit(result, as_json, _print_lineage)


def _print_lineage(result: dict) -> None:
    if "models" in result:
        stdout.print(f"{result['file']} (sha256 {result['sha256'][:12]}…)")
        stdout.print(f"  in dataset versions: {', '.join(result['dataset_versions']) or 'none'}")
        for m in result["models"]:
            use = "trained on it" if m["trained_on_file"] else f"trials: {', '.join(m['trials'])}"
            stdout.print(f"  {m['model']} version {m['version']} ({use})")
        return
    stdout.print(
        f"{result['model']} version {result['version']}: dataset {result['dataset_version']}, "
        f"MLflow run {result['mlflow_run_id']}, gate "
        f"{'passed' if result['gate']['passed'] else 'failed'}"
    )
    for source in result["sources"]:
        stdout.print(f"  trained on {source['uri']} (sha256 {source['sha256'][:12]}…)")
    for role, trial in result["trials"].items():
        for source in trial["sources"]:
            stdout.print(f"  {role} trials: {source['uri']}")
