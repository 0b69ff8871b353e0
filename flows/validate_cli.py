"""`realloop validate | admit`: the dataset's validation, and re-admitting an excluded batch.

Validation runs in the loop on every new batch; `realloop validate` runs it by hand (stored
results are reused, so only new batches start Great Expectations) and says where the Data
Docs are. A batch that failed a critical expectation stays out of training until
`realloop admit BATCH --reason ...` records who admitted it, when and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.console import CommandError, emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


@fails_cleanly
def validate_command(
    params_path: ParamsOpt = Path("params.yaml"), as_json: JsonOpt = False
) -> None:
    """Validate the dataset's batches (stored results reused); write results and Data Docs."""
    from pipelines.contract.params import load_params

    report = validate_workspace(Path.cwd(), load_params(params_path))
    emit(report.as_dict(), as_json, _print_validation)


def validate_workspace(workspace: Path, params):
    """The workspace dataset's ValidationReport: every batch, stored results reused."""
    from pipelines.ingest import CAPTURES_DIR
    from pipelines.quality import validate_dataset

    dataset = workspace / params.ingest.dataset
    if not (dataset / "episodes").is_dir():
        raise CommandError(f"{dataset}: no dataset yet; run `realloop ingest` first")
    return validate_dataset(
        dataset,
        params.cell,
        params.validate,
        captures=workspace / params.ingest.landing / CAPTURES_DIR,
    )


def _print_validation(summary: dict) -> None:
    stdout.print(
        f"dataset {summary['dataset_version']}: {summary['batches']} batches, "
        f"{summary['passed']} passed every critical expectation, "
        f"{len(summary['excluded_from_training'])} excluded from training, "
        f"{len(summary['admitted'])} re-admitted ({summary['validated']} validated now, "
        f"{summary['cached']} stored results reused)",
        soft_wrap=True,
        highlight=False,
    )
    excluded = set(summary["excluded_from_training"])
    for row in summary["failed"]:
        state = "excluded" if row["batch"] in excluded else "admitted"
        more = f" (+{len(row['failures']) - 1} more)" if len(row["failures"]) > 1 else ""
        stdout.print(
            f"  {state} {row['batch'][:12]}: {row['failures'][0]}{more}",
            soft_wrap=True,
            highlight=False,
        )
    for row in summary["warnings"]:
        more = f" (+{len(row['warnings']) - 1} more)" if len(row["warnings"]) > 1 else ""
        stdout.print(
            f"  warning {row['batch'][:12]}: {row['warnings'][0]}{more}",
            soft_wrap=True,
            highlight=False,
        )
    stdout.print(f"data docs: {summary['data_docs']}", soft_wrap=True, highlight=False)


@fails_cleanly
def admit_command(
    batch: Annotated[str, typer.Argument(help="the batch: its source sha256 or a unique prefix")],
    reason: Annotated[
        str, typer.Option("--reason", help="why it may be trained on despite its failures")
    ],
    by: Annotated[
        str | None, typer.Option("--by", help="who admits it (default: the login name)")
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Re-admit a batch that failed a critical expectation into training; recorded."""
    from pipelines.contract.params import load_params
    from pipelines.quality import admit_batch

    params = load_params(params_path)
    dataset = Path.cwd() / params.ingest.dataset
    record = admit_batch(dataset, params.cell, params.validate, batch, reason, by)
    emit(record, as_json, _print_admission)


def _print_admission(record: dict) -> None:
    stdout.print(
        f"batch {record['batch'][:12]} admitted by {record['by']} at {record['at']}: "
        f"{record['reason']}\n  over {len(record['failures'])} critical failures; "
        f"recorded in {record['admissions']}. Training uses it from the next validation "
        "(the loop, `realloop train` or `realloop validate`).",
        soft_wrap=True,
        highlight=False,
    )
