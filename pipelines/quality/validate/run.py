"""The validate stage: Great Expectations suites over each ingested batch, results people read.

A batch is what ingest made of one source log file: `<dataset>/episodes/<sha256>.parquet` and
`<dataset>/steps/<sha256>.parquet`, plus the edge-case captures of its episodes. Three suites
check it (pipelines/quality/expectations/: episodes, steps, captures); each expectation is critical
or warning. A batch failing a critical one is excluded from training, never deleted, until
someone re-admits it (`admit_batch`, `realloop admit`); warnings are reported only.

How it runs, and why:
- The Arrow schema is compared with the contract in plain pyarrow (types and nullability are
  Arrow concepts that a pandas frame no longer has).
- GX's per-expectation cost is Python bookkeeping (several ms each) and its per-row work is
  slow on millions of rows, so GX never walks the steps table. Its per-step quantities (time
  and index advance within an episode, sampling jitter, correction vs intervention) are
  derived vectorized with pyarrow/numpy, and GX checks the steps table's extremes: per column
  its min, its max and a null if it has any, which pass exactly when every step does (see
  pipelines/quality/expectations/steps.py). Episodes (one row each) and captures are checked by GX
  row by row, with per-episode aggregates of the steps joined on.
- GX only decides pass or fail (BOOLEAN_ONLY: its counting doubles its cost). For a failed
  expectation realloop counts the offending rows exactly, per vector axis, names the first
  one, and fills the counts into GX's results for the Data Docs.
- GX takes seconds to import and start, so it is imported lazily, once per process, in a
  background thread while the first batch is read; limits from params.yaml are suite
  parameters ($PARAMETER).

What is kept, next to the dataset (`<dataset>/../validation/`):

    batches/<sha256>/<suites>/result.json     one batch's verdict under one suite version
    batches/<sha256>/<suites>/gx.json         GX's validation results (the Data Docs' source)
    batches/<sha256>/<suites>/<suite>.html    GX's Data Docs page per suite
    suites/<suites>/realloop-<suite>.html     GX's page of each suite
    <dataset_version>/report.json             every batch of that version, admissions applied
    <dataset_version>/index.html              Data Docs index of the version: a GX Data Docs
                                              site (validations/, expectations/, static/)
    admissions.jsonl                          append-only: who re-admitted which batch, why

`<suites>` is a fingerprint of the suites' code, the contract and the limits. A batch's files
never change (they are named by the source's sha256), so a result stored under the current
fingerprint is reused and GX is not started for it again; changing a suite or a limit
re-validates every batch once.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.contract.params import CellParams, ValidateParams
from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA, TRIAL_COLUMNS
from pipelines.ingest import current_version
from pipelines.quality.expectations.common import CRITICAL, WARNING
from pipelines.quality.validate.admissions import read_admissions
from pipelines.quality.validate.data_docs import (
    render_pages,
    render_suite_pages,
    run_identity,
    write_version,
)
from pipelines.quality.validate.frames import FrameRows, captures_frame, episodes_frame
from pipelines.quality.validate.gx_runtime import GX_LOCK, runtime, warm_up_in_background
from pipelines.quality.validate.result_lines import fill_counts, result_lines
from pipelines.quality.validate.results import BatchResult, ValidationReport
from pipelines.quality.validate.step_arrays import StepArrays
from pipelines.quality.validate.stored import (
    SUITES,
    load_result,
    store_result,
    suite_fingerprint,
    suite_name,
    suite_pages_folder,
    suite_parameters,
    validation_root,
    write_atomically,
)

TABLES = {"episodes": EPISODES_SCHEMA, "steps": STEPS_SCHEMA}
# GX decides pass or fail; realloop counts the offending rows of a failed expectation (GX
# sees only the extremes of the steps, and its BASIC results cost twice the time).
RESULT_FORMAT = "BOOLEAN_ONLY"
UNVERSIONED = "unversioned"


# --- entry points ----------------------------------------------------------------------------


def validate_batch(
    episodes: pa.Table,
    steps: pa.Table,
    batch: str,
    cell: CellParams,
    params: ValidateParams,
    captures: Path | None = None,
    attachments: Path | None = None,
) -> BatchResult:
    """Run the schema check and the GX suites over one batch; report what broke.

    `captures` is the folder of capture sidecars (`<landing>/captures`), `attachments` the
    dataset's attachment store; without them the checks that need them are not made."""
    return _check_batch(episodes, steps, batch, cell, params, captures, attachments)[0]


def validate_dataset(
    dataset: Path,
    cell: CellParams,
    params: ValidateParams,
    batches: list[str] | None = None,
    *,
    dataset_version: str | None = None,
    captures: Path | None = None,
) -> ValidationReport:
    """Validate the named batches, one result each, reusing stored results; write the
    version's report and Data Docs.

    By default every batch whose `episodes/<sha256>.parquet` exists: ingest writes that file
    last, so a steps file without it is an ingest still running (or to be completed by a
    re-run), not a batch. A named batch with either file missing fails (and is not stored).
    `dataset_version` defaults to the one `<dataset>.dvc` records; `captures` is the folder
    of capture sidecars (`<landing>/captures`).
    """
    dataset = Path(dataset)
    if batches is None:
        batches = sorted(p.stem for p in (dataset / "episodes").glob("*.parquet"))
    root = validation_root(dataset)
    version = dataset_version or current_dataset_version(dataset)
    fingerprint = suite_fingerprint(cell, params)
    admissions = read_admissions(dataset)
    stored = {batch: load_result(dataset, batch, fingerprint) for batch in batches}
    if any(result is None for result in stored.values()):
        warm_up_in_background()
    results = []
    for batch in batches:
        result = stored[batch]
        if result is None:
            run = run_identity(version, batch)
            result = _validate_stored_batch(
                dataset, batch, cell, params, captures, fingerprint, run
            )
        if not result.passed and batch in admissions:
            result = replace(result, admitted=admissions[batch])
        results.append(result)
    _store_suite_pages(dataset, fingerprint)
    report = ValidationReport(results, version)
    return write_version(dataset, root / version, report, fingerprint)


def current_dataset_version(dataset: Path) -> str:
    """The version `<dataset>.dvc` records, or "unversioned" before the first `dvc add`."""
    dataset = Path(dataset).resolve()
    try:
        return current_version(dataset.parent, dataset)
    except (ValueError, OSError, KeyError, TypeError, IndexError):
        return UNVERSIONED


# --- one stored batch -----------------------------------------------------------------------


def _validate_stored_batch(
    dataset: Path,
    batch: str,
    cell: CellParams,
    params: ValidateParams,
    captures: Path | None,
    fingerprint: str,
    run: dict[str, str],
) -> BatchResult:
    tables: dict[str, pa.Table] = {}
    unreadable: list[str] = []
    for name, contract in TABLES.items():
        path = dataset / name / f"{batch}.parquet"
        try:
            tables[name] = _read_table(path, contract)
        except FileNotFoundError:
            unreadable.append(f"{name}: {path} is missing")
        except (OSError, pa.ArrowException) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
            if "Expected all lists to be of size" in reason:
                reason += (
                    "; pyarrow cannot read back null fixed-size lists (apache/arrow#35692): "
                    "store nullable vectors as list<float32>"
                )
            unreadable.append(f"{name}: {path} is not readable Parquet ({reason})")
    if unreadable:  # not stored: the files may yet be completed by ingest
        return BatchResult(batch, False, unreadable, 0)
    result, gx_results = _check_batch(
        tables["episodes"],
        tables["steps"],
        batch,
        cell,
        params,
        captures,
        dataset / "attachments",
    )
    for table, outcome in gx_results.items():
        meta = outcome.setdefault("meta", {})
        meta["run_id"] = run  # GX's pages name the run (else "__none__")
        # and its data asset, read from batch_spec, where GX's dataframe assets leave it out
        meta.setdefault("batch_spec", {})["data_asset_name"] = table
    result = replace(result, details=result.details | {"gx_run": run})
    return store_result(dataset, result, fingerprint, gx_results, render_pages(gx_results))


def _store_suite_pages(dataset: Path, fingerprint: str) -> None:
    """GX's page of each suite, once per suite fingerprint (GX starts here only if no batch
    was validated since the pages went missing)."""
    folder = suite_pages_folder(dataset, fingerprint)
    if all((folder / f"{suite_name(t)}.html").is_file() for t in SUITES):
        return
    with GX_LOCK:
        pages = render_suite_pages(runtime().suites)
    folder.mkdir(parents=True, exist_ok=True)
    for table, page in pages.items():
        write_atomically(folder / f"{suite_name(table)}.html", page)


def _read_table(path: Path, contract: pa.Schema) -> pa.Table:
    """Read a Parquet file, restoring vectors that were stored as variable-size lists.

    pyarrow fails to read null fixed-size lists (nullable vectors such as corrected_action)
    from Parquet (apache/arrow#35692), so ingest stores nullable vectors as list<float32>
    (`pipelines.ingest.store.storage_schema`). The cast restores the contract's type and raises on
    a row of the wrong length, in which case the column is left for the schema check to report.
    Nothing else is cast: a drifted type must reach the schema check as it is.
    """
    table = pq.read_table(path)
    for i, field_ in enumerate(table.schema):
        want = contract.field(field_.name).type if field_.name in contract.names else None
        if not (
            want is not None
            and pa.types.is_fixed_size_list(want)
            and pa.types.is_list(field_.type)
            and field_.type.value_type.equals(want.value_type)
        ):
            continue
        try:
            column = table.column(i).cast(want)
        except pa.ArrowInvalid:
            continue  # a row of the wrong length: left as it is for the schema check
        table = table.set_column(i, field_.with_type(want), column)
    return _with_trial_columns(table, contract)


def _with_trial_columns(table: pa.Table, contract: pa.Schema) -> pa.Table:
    """A batch written before the trial columns joined the contract lacks them: they are
    null there (no trial then), not missing, so they are added as nulls."""
    for name in TRIAL_COLUMNS:
        if name in contract.names and name not in table.schema.names:
            table = table.append_column(contract.field(name), pa.nulls(table.num_rows, pa.string()))
    return table


# --- one batch -------------------------------------------------------------------------------


def _check_batch(
    episodes: pa.Table,
    steps: pa.Table,
    batch: str,
    cell: CellParams,
    params: ValidateParams,
    captures: Path | None,
    attachments: Path | None,
) -> tuple[BatchResult, dict]:
    """The batch's result, and GX's validation results (JSON) with realloop's counts."""
    failures: list[str] = []
    unusable: set[str] = set()  # "<table>.<column>": missing, or not of the contract's type
    present: dict[str, set[str]] = {}
    for name, table in (("episodes", episodes), ("steps", steps)):
        table_failures, mistyped = _schema_failures(name, table, TABLES[name])
        failures += table_failures
        missing = [f.name for f in TABLES[name] if f.name not in table.schema.names]
        if missing:
            failures.append(f"{name}: columns missing: {', '.join(missing)}")
        unusable |= mistyped | {f"{name}.{c}" for c in missing}
        present[name] = {f.name for f in TABLES[name]} - {
            c.split(".", 1)[1] for c in unusable if c.startswith(f"{name}.")
        }

    episode_ids = episodes.column("episode_id") if "episode_id" in present["episodes"] else None
    step_rows = StepArrays.build(steps, present["steps"], episode_ids, cell.dt)
    rows = {
        "episodes": FrameRows(episodes_frame(episodes, present["episodes"], step_rows, cell.dt)),
        "steps": step_rows,
        "captures": FrameRows(captures_frame(episodes, present["episodes"], captures, attachments)),
    }
    frames = {table: found.frame() for table, found in rows.items()}
    parameters = suite_parameters(cell, params) | {"batch": [batch]}
    outcomes = _run_suites(frames, parameters)
    gx_results = {table: outcome.to_json_dict() for table, outcome in outcomes.items()}
    for table, found in rows.items():
        fill_counts(gx_results[table], found)
    lines = result_lines(gx_results, rows, unusable, parameters)
    failures += lines[CRITICAL]
    evaluated = len(TABLES) + sum(len(r["results"]) for r in gx_results.values())
    details = {
        "source_uri": _first(episodes, "source_uri", present["episodes"]),
        "episodes": episodes.num_rows,
        "steps": steps.num_rows,
        "captures": rows["captures"].rows,
    }
    result = BatchResult(
        batch, not failures, sorted(failures), evaluated, lines[WARNING], details=details
    )
    return result, gx_results


def _first(table: pa.Table, column: str, present: set[str]) -> str | None:
    if column not in present or table.num_rows == 0:
        return None
    return table.column(column)[0].as_py()


def _schema_failures(name: str, table: pa.Table, contract: pa.Schema) -> tuple[list[str], set]:
    """Types, nullability, extra columns and order, column by column, so that the message says
    which column differs and how. Missing columns are reported apart."""
    failures, mistyped = [], set()
    for field_ in contract:
        if field_.name not in table.schema.names:
            continue
        column, actual = f"{name}.{field_.name}", table.schema.field(field_.name)
        if not actual.type.equals(field_.type):
            failures.append(f"{column}: type {actual.type}, contract says {field_.type}")
            mistyped.add(column)
        elif actual.nullable != field_.nullable:
            declared = "nullable" if actual.nullable else "required"
            expected = "nullable" if field_.nullable else "required"
            failures.append(f"{column}: declared {declared}, contract says {expected}")
    extra = [n for n in table.schema.names if n not in contract.names]
    if extra:
        failures.append(f"{name}: columns not in the contract: {', '.join(extra)}")
    elif table.schema.names != contract.names and set(table.schema.names) == set(contract.names):
        failures.append(f"{name}: columns out of the contract's order")
    return failures, mistyped


# --- GX --------------------------------------------------------------------------------------


def _run_suites(frames: dict[str, pd.DataFrame], parameters: dict) -> dict:
    """GX's validation result of each suite over its frame."""
    outcomes = {}
    with GX_LOCK:
        gx = runtime()
        for table in SUITES:
            batch = gx.batch_definitions[table].get_batch(
                batch_parameters={"dataframe": frames[table]}
            )
            # batch.validate keeps no result store (a ValidationDefinition run would grow one).
            outcomes[table] = batch.validate(
                gx.suites[table],
                result_format=RESULT_FORMAT,
                expectation_parameters=parameters,
            )
    return outcomes


def warm_up() -> None:
    """Build the GX context and suites now, and run them once on an empty batch (GX's first
    validation in a process imports more of it), e.g. before timing anything."""
    global _WARM
    with GX_LOCK:  # re-entrant: the dry run below takes it again
        runtime()
        if not _WARM:
            # Only what suite_parameters and the step arrays read; the limits do not matter.
            cell = SimpleNamespace(dt=0.05, safety=SimpleNamespace(joint_limit_m=0.3))
            limits = dict.fromkeys(ValidateParams.__dataclass_fields__, 1)
            empty = EPISODES_SCHEMA.empty_table(), STEPS_SCHEMA.empty_table()
            _check_batch(*empty, "0" * 64, cell, SimpleNamespace(**limits), None, None)
            _WARM = True


_WARM = False  # warm_up's dry run is done
