"""The validate stage: a Great Expectations suite over each ingested batch.

A batch is what ingest made of one source log file: `<dataset>/episodes/<sha256>.parquet` and
`<dataset>/steps/<sha256>.parquet`. A batch that breaks an expectation is reported, never raised:
callers exclude the failed batches from training.

How it runs, and why:
- The Arrow schema is compared with the contract in plain pyarrow (types and nullability are
  Arrow concepts that a pandas frame no longer has).
- Everything else is a GX 1.x expectation over a pandas frame. Vector columns are flattened into
  scalar columns (`joint_position` -> `joint_position_x`, `joint_position_y`) and the per-episode
  quantities (time and step advance, rows per episode) are derived vectorized before GX sees the
  frame, so GX only checks columns and nothing loops over rows in Python.
- GX takes seconds to import and start, so it is imported lazily and its context and suites are
  built once per process. Limits that come from params.yaml are suite parameters ($PARAMETER),
  filled in at each run, so one suite serves every cell.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.params import CellParams, ValidateParams
from pipelines.schema import EPISODES_SCHEMA, STEPS_SCHEMA

# Names of the components of each vector column, used for the flattened scalar columns.
VECTOR_AXES = {
    "target": ("x", "y"),
    "part_extent_m": ("x", "y"),
    "joint_position": ("x", "y"),
    "joint_velocity": ("x", "y"),
    "part_pose": ("x", "y", "yaw"),
    "action": ("x", "y"),
    "corrected_action": ("x", "y"),
}
TABLES = {"episodes": EPISODES_SCHEMA, "steps": STEPS_SCHEMA}


@dataclass(frozen=True)
class BatchResult:
    batch: str  # the source sha256
    passed: bool
    failures: list[str]  # one line each: column, what was expected, how many broke it
    expectations: int  # how many were evaluated


@dataclass(frozen=True)
class ValidationReport:
    batches: list[BatchResult]

    @property
    def passed_batches(self) -> list[str]:
        return [b.batch for b in self.batches if b.passed]

    @property
    def failed_batches(self) -> list[str]:
        return [b.batch for b in self.batches if not b.passed]

    def as_dict(self) -> dict:
        failed = [{"batch": b.batch, "failures": b.failures} for b in self.batches if not b.passed]
        return {
            "batches": len(self.batches),
            "passed": len(self.passed_batches),
            "failed": failed,
            "excluded_from_training": self.failed_batches,
        }


def validate_batch(
    episodes: pa.Table,
    steps: pa.Table,
    batch: str,
    cell: CellParams,
    params: ValidateParams,
) -> BatchResult:
    """Run the schema check and the GX suites over one batch; report what broke."""
    failures: list[str] = []
    mistyped: set[str] = set()  # "<table>.<column>" present with a type other than the contract's
    missing: set[str] = set()
    for name, table in (("episodes", episodes), ("steps", steps)):
        table_failures, table_mistyped = _schema_failures(name, table, TABLES[name])
        failures += table_failures
        mistyped |= table_mistyped
        missing |= _missing(name, table)

    episode_frame = _scalar_frame("episodes", episodes)
    step_frame = _scalar_frame("steps", steps)
    _derive_step_columns(step_frame, episode_frame, cell)
    _derive_episode_columns(episode_frame, step_frame)

    # A reading is the noisy measurement before the step: a gantry stopped at its safety limit
    # can read a few mm beyond it. Beyond limit + margin, the sensor or its calibration is off.
    joint_reading_limit = cell.safety.joint_limit_m + params.joint_reading_margin_m
    parameters = {
        "joint_limit_m": joint_reading_limit,
        "negative_joint_limit_m": -joint_reading_limit,
        "min_steps": params.min_steps,
        "max_steps": params.max_steps,
        "time_step_tolerance_s": params.time_step_tolerance_s,
        "negative_time_step_tolerance_s": -params.time_step_tolerance_s,
        "dt_s": cell.dt,
        "batch": [batch],
    }
    gx_results = _run_suites({"episodes": episode_frame, "steps": step_frame}, parameters)
    failures += _gx_failures(gx_results, mistyped, missing, parameters)
    evaluated = len(TABLES) + len(gx_results)  # one schema check per table
    return BatchResult(batch, not failures, failures, evaluated)


def validate_dataset(
    dataset: Path,
    cell: CellParams,
    params: ValidateParams,
    batches: list[str] | None = None,
) -> ValidationReport:
    """Validate the named batches, one result each.

    By default every batch whose `episodes/<sha256>.parquet` exists: ingest writes that file
    last, so a steps file without it is an ingest still running (or to be completed by a
    re-run), not a batch. A named batch with either file missing fails.
    """
    dataset = Path(dataset)
    if batches is None:
        batches = sorted(p.stem for p in (dataset / "episodes").glob("*.parquet"))
    return ValidationReport([_validate_stored_batch(dataset, b, cell, params) for b in batches])


def _validate_stored_batch(
    dataset: Path, batch: str, cell: CellParams, params: ValidateParams
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
    if unreadable:
        return BatchResult(batch, False, unreadable, 0)
    return validate_batch(tables["episodes"], tables["steps"], batch, cell, params)


def _read_table(path: Path, contract: pa.Schema) -> pa.Table:
    """Read a Parquet file, restoring vectors that were stored as variable-size lists.

    pyarrow fails to read null fixed-size lists (nullable vectors such as corrected_action)
    from Parquet (apache/arrow#35692), so ingest stores nullable vectors as list<float32>
    (`pipelines.ingest.storage_schema`). The cast restores the contract's type and raises on
    a row of the wrong length, in which case the column is left for the schema check to report.
    Nothing else is cast: a drifted type must reach the schema check as it is.
    """
    table = pq.read_table(path)
    for i, field in enumerate(table.schema):
        want = contract.field(field.name).type if field.name in contract.names else None
        if not (
            want is not None
            and pa.types.is_fixed_size_list(want)
            and pa.types.is_list(field.type)
            and field.type.value_type.equals(want.value_type)
        ):
            continue
        try:
            column = table.column(i).cast(want)
        except pa.ArrowInvalid:
            continue  # a row of the wrong length: left as it is for the schema check
        table = table.set_column(i, field.with_type(want), column)
    return table


# --- schema (pyarrow) -----------------------------------------------------------------------


def _schema_failures(name: str, table: pa.Table, contract: pa.Schema) -> tuple[list[str], set]:
    """Types, nullability, extra columns and order, column by column, so that the message says
    which column differs and how. Missing columns are the GX column check's to report."""
    failures, mistyped = [], set()
    for field in contract:
        if field.name not in table.schema.names:
            continue
        column, actual = f"{name}.{field.name}", table.schema.field(field.name)
        if not actual.type.equals(field.type):
            failures.append(f"{column}: type {actual.type}, contract says {field.type}")
            mistyped.add(column)
        elif actual.nullable != field.nullable:
            declared = "nullable" if actual.nullable else "required"
            expected = "nullable" if field.nullable else "required"
            failures.append(f"{column}: declared {declared}, contract says {expected}")
    extra = [n for n in table.schema.names if n not in contract.names]
    if extra:
        failures.append(f"{name}: columns not in the contract: {', '.join(extra)}")
    elif table.schema.names != contract.names and set(table.schema.names) == set(contract.names):
        failures.append(f"{name}: columns out of the contract's order")
    return failures, mistyped


def _missing(name: str, table: pa.Table) -> set[str]:
    return {f"{name}.{f.name}" for f in TABLES[name] if f.name not in table.schema.names}


# --- frames handed to GX --------------------------------------------------------------------


def _scalar_frame(name: str, table: pa.Table) -> pd.DataFrame:
    """The contract's columns that have the contract's type, vectors split into scalar columns."""
    columns: dict[str, Any] = {}
    for field in TABLES[name]:
        if field.name not in table.schema.names:
            continue
        array = table.column(field.name)
        if not array.type.equals(field.type):
            continue
        if pa.types.is_fixed_size_list(field.type):
            for i, axis in enumerate(VECTOR_AXES[field.name]):
                columns[f"{field.name}_{axis}"] = _widened(pc.list_element(array, i))
        else:
            columns[field.name] = _widened(array)
    return pd.DataFrame(columns, index=pd.RangeIndex(table.num_rows))


def _widened(array: pa.ChunkedArray | pa.Array) -> pd.Series:
    """float32 and int32 as 64-bit: GX compares only int64/float64 columns vectorized and
    falls back to a Python call per value for any other dtype."""
    if pa.types.is_floating(array.type):
        array = array.cast(pa.float64())
    elif pa.types.is_integer(array.type):
        array = array.cast(pa.int64())
    return array.to_pandas()


def _derive_step_columns(steps: pd.DataFrame, episodes: pd.DataFrame, cell: CellParams) -> None:
    """Per-episode advance of time and step index (NaN on an episode's first row)."""
    if {"episode_id", "step", "time_s"} <= set(steps.columns):
        per_episode = steps.groupby("episode_id", sort=False)
        steps["time_advance_s"] = per_episode["time_s"].diff()
        steps["step_advance"] = per_episode["step"].diff()
        steps["time_advance_error_s"] = steps["time_advance_s"] - steps["step_advance"] * cell.dt
    if "episode_id" in steps.columns and "episode_id" in episodes.columns:
        steps["episode_listed"] = steps["episode_id"].isin(episodes["episode_id"])


def _derive_episode_columns(episodes: pd.DataFrame, steps: pd.DataFrame) -> None:
    if "episode_id" in episodes.columns and "episode_id" in steps.columns:
        rows = steps["episode_id"].value_counts()
        episodes["step_rows"] = episodes["episode_id"].map(rows).fillna(0).astype("int64")


# --- the GX suites ---------------------------------------------------------------------------


def _check(table: str, column: str, broke: str, sources: tuple[str, ...] = ()) -> dict:
    """Meta that turns a GX result into a one-line failure (see _gx_failures)."""
    return {"table": table, "column": column, "broke": broke, "sources": list(sources or (column,))}


def _flat(field: pa.Field) -> list[tuple[str, str | None]]:
    """(frame column, axis) pairs of one contract column."""
    if pa.types.is_fixed_size_list(field.type):
        return [(f"{field.name}_{axis}", axis) for axis in VECTOR_AXES[field.name]]
    return [(field.name, None)]


def _between(column: str, low: Any, high: Any, meta: dict, axis: str | None = None, **kw):
    import great_expectations.expectations as gxe

    return gxe.ExpectColumnValuesToBeBetween(
        column=column, min_value=low, max_value=high, meta={**meta, "axis": axis}, **kw
    )


def _param(name: str) -> dict:
    return {"$PARAMETER": name}


def _episode_expectations() -> list:
    import great_expectations.expectations as gxe

    table = "episodes"
    expectations: list = [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=[c for f in EPISODES_SCHEMA for c, _ in _flat(f)],
            exact_match=False,  # extra columns are the schema check's to report
            meta=_check(table, "", "columns missing"),
        ),
        gxe.ExpectTableRowCountToBeBetween(
            min_value=1, meta=_check(table, "", "no episodes in the batch", ("",))
        ),
        gxe.ExpectColumnValuesToBeUnique(
            column="episode_id", meta=_check(table, "episode_id", "duplicate ids")
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="source_sha256",
            value_set=_param("batch"),
            meta=_check(table, "source_sha256", "rows naming another source file"),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="steps",
            min_value=_param("min_steps"),
            max_value=_param("max_steps"),
            meta=_check(table, "steps", "episodes outside {min_steps}..{max_steps} steps"),
        ),
        gxe.ExpectColumnPairValuesToBeEqual(
            column_A="steps",
            column_B="step_rows",
            meta=_check(
                table,
                "steps",
                "episodes whose step count differs from their rows in the steps table",
                ("steps", "episode_id", "steps.episode_id"),
            ),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="safety_stops",
            min_value=0,
            max_value=1,
            meta=_check(table, "safety_stops", "episodes outside 0..1 (a stop ends one)"),
        ),
    ]
    return expectations + _not_null_expectations(table, EPISODES_SCHEMA)


def _step_expectations() -> list:
    import great_expectations.expectations as gxe

    table = "steps"
    expectations: list = [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=[c for f in STEPS_SCHEMA for c, _ in _flat(f)],
            exact_match=False,
            meta=_check(table, "", "columns missing"),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="episode_listed",
            value_set=[True],
            meta=_check(
                table,
                "episode_id",
                "rows of an episode missing from the episodes table",
                ("episode_id", "episodes.episode_id"),
            ),
        ),
        _between(
            "time_advance_s",
            0,
            None,
            _check(
                table,
                "time_s",
                "steps not later than the previous step of their episode",
                ("time_s", "step", "episode_id"),
            ),
            strict_min=True,
        ),
        _between(
            "step_advance",
            1,
            1,
            _check(
                table,
                "step",
                "steps whose index is not the previous step's + 1 in their episode",
                ("time_s", "step", "episode_id"),
            ),
        ),
        _between(
            "time_advance_error_s",
            _param("negative_time_step_tolerance_s"),
            _param("time_step_tolerance_s"),
            _check(
                table,
                "time_s",
                "steps whose time advance differs from (step advance)·{dt_s:g} s "
                "by more than {time_step_tolerance_s:g} s",
                ("time_s", "step", "episode_id"),
            ),
        ),
        _between(
            "part_confidence",
            0,
            1,
            _check(table, "part_confidence", "values outside [0, 1]"),
        ),
    ]
    for column, axis in _flat(STEPS_SCHEMA.field("joint_position")):
        meta = _check(table, "joint_position", "values beyond ±{joint_limit_m:g} m")
        limits = (_param("negative_joint_limit_m"), _param("joint_limit_m"))
        expectations.append(_between(column, *limits, meta, axis))
    for name in ("action", "corrected_action"):  # nulls are allowed in corrected_action
        for column, axis in _flat(STEPS_SCHEMA.field(name)):
            meta = _check(table, name, "values outside [-1, 1]")
            expectations.append(_between(column, -1, 1, meta, axis))
    return expectations + _not_null_expectations(table, STEPS_SCHEMA)


def _not_null_expectations(table: str, schema: pa.Schema) -> list:
    import great_expectations.expectations as gxe

    expectations = []
    for field in schema:
        if field.nullable:
            continue
        for column, axis in _flat(field):
            meta = _check(table, field.name, "null or NaN values in a required column")
            expectations.append(
                gxe.ExpectColumnValuesToNotBeNull(column=column, meta={**meta, "axis": axis})
            )
    return expectations


@dataclass(frozen=True)
class _Runtime:
    batch_definitions: dict  # table -> GX BatchDefinition over a dataframe asset
    suites: dict  # table -> GX ExpectationSuite


# Held while the runtime is built and while a batch is validated: GX's context is not
# documented as thread-safe, and Prefect may run tasks in threads.
_GX_LOCK = threading.Lock()


def warm_up() -> None:
    """Build the GX context and suites now, e.g. before timing anything (GX starts slowly)."""
    with _GX_LOCK:
        _runtime()


@cache
def _runtime() -> _Runtime:  # called with _GX_LOCK held
    """GX context, data source and suites: built once per process (GX starts slowly)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("realloop")
    batch_definitions, suites = {}, {}
    for table, build in (("episodes", _episode_expectations), ("steps", _step_expectations)):
        asset = source.add_dataframe_asset(table)
        batch_definitions[table] = asset.add_batch_definition_whole_dataframe(table)
        suite = gx.ExpectationSuite(name=f"realloop-{table}")
        for expectation in build():
            suite.add_expectation(expectation)
        suites[table] = context.suites.add(suite)
    return _Runtime(batch_definitions, suites)


def _run_suites(frames: dict[str, pd.DataFrame], parameters: dict) -> list:
    """GX results of every expectation over both frames."""
    results = []
    with _GX_LOCK:
        runtime = _runtime()
        for table, frame in frames.items():
            batch = runtime.batch_definitions[table].get_batch(
                batch_parameters={"dataframe": frame}
            )
            # batch.validate keeps no result store (a ValidationDefinition run would grow one).
            outcome = batch.validate(
                runtime.suites[table], result_format="BASIC", expectation_parameters=parameters
            )
            results += outcome.results
    return results


# --- GX results -> one-line failures --------------------------------------------------------


def _gx_failures(
    results: list, mistyped: set[str], missing: set[str], parameters: dict
) -> list[str]:
    """Group failed expectations by (column, what broke), summing the counts over components.

    Mistyped and missing columns are left out of the frame; the expectations that need them
    fail, and are skipped here because the schema and column checks report the cause."""
    counts: dict[tuple[str, str], dict[str | None, int]] = defaultdict(dict)
    lines: list[str] = []
    for result in results:
        if result.success:
            continue
        meta = result.expectation_config.meta
        table, column = meta["table"], meta["column"]
        if _depends_on(table, meta["sources"], mistyped | missing):
            continue
        label = f"{table}.{column}" if column else table
        raised = result.exception_info.get("raised_exception") or not result.result
        if meta["broke"] == "columns missing":
            absent = _missing_contract_columns(result.result, table, mistyped)
            if absent:
                lines.append(f"{table}: columns missing: {', '.join(absent)}")
        elif raised:
            lines.append(f"{label}: could not be checked ({_exception_message(result)})")
        elif "unexpected_count" in result.result:
            broke = meta["broke"].format(**parameters)
            counts[(label, broke)][meta.get("axis")] = result.result["unexpected_count"]
        else:
            lines.append(f"{label}: {meta['broke']}")
    for (label, broke), by_axis in counts.items():
        total = sum(by_axis.values())
        detail = ", ".join(f"{axis}: {n}" for axis, n in by_axis.items() if axis)
        lines.append(f"{label}: {total} {broke}" + (f" ({detail})" if detail else ""))
    return sorted(lines)  # grouped by table and column


def _depends_on(table: str, sources: list[str], columns: set[str]) -> bool:
    qualified = {s if "." in s else f"{table}.{s}" for s in sources if s}
    return bool(qualified & columns)


def _missing_contract_columns(result: dict, table: str, mistyped: set[str]) -> list[str]:
    flat_to_column = {c: f.name for f in TABLES[table] for c, _ in _flat(f)}
    missing = result.get("details", {}).get("mismatched", {}).get("missing", [])
    columns = dict.fromkeys(flat_to_column.get(c, c) for c in missing)
    return [c for c in columns if f"{table}.{c}" not in mistyped]


def _exception_message(result: Any) -> str:
    info = result.exception_info
    if "exception_message" in info:
        return str(info["exception_message"])
    nested = [v.get("exception_message") for v in info.values() if isinstance(v, dict)]
    return str(next((m for m in nested if m), "unknown error"))
