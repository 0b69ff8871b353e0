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
    <dataset_version>/report.json             every batch of that version, admissions applied
    <dataset_version>/index.html              Data Docs index of the version, links to pages/
    admissions.jsonl                          append-only: who re-admitted which batch, why

`<suites>` is a fingerprint of the suites' code, the contract and the limits. A batch's files
never change (they are named by the source's sha256), so a result stored under the current
fingerprint is reused and GX is not started for it again; changing a suite or a limit
re-validates every batch once.
"""

from __future__ import annotations

import contextlib
import gc
import getpass
import hashlib
import html
import json
import os
import re
import socket
import threading
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cache
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.contract.params import CellParams, ValidateParams
from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
from pipelines.quality.expectations import CRITICAL, WARNING
from pipelines.quality.expectations import captures as captures_suite
from pipelines.quality.expectations import episodes as episode_suite

# Names of the components of each vector column (failure messages count per axis).
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
SUITES = ("episodes", "steps", "captures")
# GX decides pass or fail; realloop counts the offending rows of a failed expectation (GX
# sees only the extremes of the steps, and its BASIC results cost twice the time).
RESULT_FORMAT = "BOOLEAN_ONLY"
VALIDATION_DIR = "validation"  # next to the dataset folder, like ingest's manifest
BATCHES_DIR = "batches"
ADMISSIONS_FILE = "admissions.jsonl"
UNVERSIONED = "unversioned"
_SIDECAR_NAME = re.compile(r"^(?P<episode>.+-\d{8}T\d{6}Z-\d{5})_.+\.json$")
_SOURCES = (  # what the fingerprint covers besides the limits
    Path(__file__).resolve().parent / "expectations",
    Path(__file__).resolve(),
    Path(__file__).resolve().parent / "schema.py",
)


# --- results ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BatchResult:
    batch: str  # the source sha256
    passed: bool  # no critical expectation failed
    failures: list[str]  # critical, one line each: column, what broke, how many
    expectations: int  # how many were evaluated
    warnings: list[str] = field(default_factory=list)  # one line each, never exclude
    admitted: dict | None = None  # the admission honoured for a failed batch
    cached: bool = False  # read from a stored result: GX did not run for it
    details: dict = field(default_factory=dict)  # source_uri, episodes, steps, captures

    @property
    def trainable(self) -> bool:
        return self.passed or self.admitted is not None


@dataclass(frozen=True)
class ValidationReport:
    batches: list[BatchResult]
    dataset_version: str | None = None
    results: str | None = None  # <validation>/<dataset_version>/report.json
    data_docs: str | None = None  # <validation>/<dataset_version>/index.html

    @property
    def passed_batches(self) -> list[str]:
        """What training may use: batches without critical failures, and re-admitted ones."""
        return [b.batch for b in self.batches if b.trainable]

    @property
    def failed_batches(self) -> list[str]:
        """Batches failing a critical expectation, admitted or not."""
        return [b.batch for b in self.batches if not b.passed]

    @property
    def excluded_batches(self) -> list[str]:
        return [b.batch for b in self.batches if not b.trainable]

    def as_dict(self) -> dict:
        failed = [
            {"batch": b.batch, "failures": b.failures, "admitted": b.admitted is not None}
            for b in self.batches
            if not b.passed
        ]
        return {
            "dataset_version": self.dataset_version,
            "batches": len(self.batches),
            "passed": sum(b.passed for b in self.batches),
            "failed": failed,
            "warnings": [
                {"batch": b.batch, "warnings": b.warnings} for b in self.batches if b.warnings
            ],
            "admitted": [b.admitted | {"batch": b.batch} for b in self.batches if b.admitted],
            "excluded_from_training": self.excluded_batches,
            "validated": sum(not b.cached for b in self.batches),
            "cached": sum(b.cached for b in self.batches),
            "results": self.results,
            "data_docs": self.data_docs,
        }


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
        _warm_up_in_background()
    results = []
    for batch in batches:
        result = stored[batch]
        if result is None:
            result = _validate_stored_batch(dataset, batch, cell, params, captures, fingerprint)
        if not result.passed and batch in admissions:
            result = replace(result, admitted=admissions[batch])
        results.append(result)
    report = ValidationReport(results, version)
    return _write_version(dataset, root / version, report, fingerprint)


def validation_root(dataset: Path) -> Path:
    return Path(dataset).parent / VALIDATION_DIR


def current_dataset_version(dataset: Path) -> str:
    """The version `<dataset>.dvc` records, or "unversioned" before the first `dvc add`."""
    from pipelines.ingest.versioning import current_version

    dataset = Path(dataset).resolve()
    try:
        return current_version(dataset.parent, dataset)
    except (ValueError, OSError, KeyError, TypeError, IndexError):
        return UNVERSIONED


# --- admissions ------------------------------------------------------------------------------


def admit_batch(
    dataset: Path,
    cell: CellParams,
    params: ValidateParams,
    batch: str,
    reason: str,
    by: str | None = None,
) -> dict:
    """Re-admit a batch that failed a critical expectation; append the record and return it.

    `batch` is its sha256 or a unique prefix (6+ characters). Raises ValueError with a
    one-line reason when there is nothing to admit."""
    dataset = Path(dataset)
    reason = reason.strip()
    if not reason:
        raise ValueError("admit: --reason must say why the batch may be trained on")
    sha = resolve_batch(dataset, batch)
    result = load_result(dataset, sha, suite_fingerprint(cell, params))
    if result is None:
        raise ValueError(
            f"batch {sha[:12]} has no result under the current suites; run `realloop validate`"
        )
    if result.passed:
        raise ValueError(f"batch {sha[:12]} passed every critical expectation: nothing to admit")
    record = {
        "batch": sha,
        "reason": reason,
        "by": by or _user(),
        "host": socket.gethostname(),
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "suites": suite_fingerprint(cell, params),
        "failures": result.failures,
    }
    path = validation_root(dataset) / ADMISSIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:  # one short line per write: appends do not interleave
        handle.write(json.dumps(record, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    return record | {"admissions": str(path)}


def read_admissions(dataset: Path) -> dict[str, dict]:
    """The latest admission of each batch (the file keeps every one, oldest first)."""
    path = validation_root(dataset) / ADMISSIONS_FILE
    if not path.is_file():
        return {}
    admitted: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if isinstance(record, dict) and isinstance(record.get("batch"), str):
            admitted[record["batch"]] = {
                k: record.get(k) for k in ("reason", "by", "at", "host", "suites")
            }
    return admitted


def resolve_batch(dataset: Path, batch: str) -> str:
    """A batch's sha256 from itself or a unique prefix of 6+ characters."""
    batch = batch.strip().lower()
    shas = sorted(p.stem for p in (Path(dataset) / "episodes").glob("*.parquet"))
    if len(batch) < 6:
        raise ValueError(f"batch {batch!r}: give the sha256 or a prefix of 6+ characters")
    found = [s for s in shas if s.startswith(batch)]
    if not found:
        raise ValueError(f"batch {batch}: not in {dataset}")
    if len(found) > 1:
        raise ValueError(f"batch {batch}: ambiguous, matches {len(found)} batches")
    return found[0]


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in a bare container
        return "unknown"


# --- stored results --------------------------------------------------------------------------


def suite_parameters(cell: CellParams, params: ValidateParams) -> dict[str, Any]:
    """Values of the suites' $PARAMETERs, from params.yaml (the batch's sha256 comes apart)."""
    # A reading is the noisy measurement before the step: a gantry stopped at its safety limit
    # can read a few mm beyond it. Beyond limit + margin, the sensor or its calibration is off.
    joint = cell.safety.joint_limit_m + params.joint_reading_margin_m
    cycle = params.cycle_time_tolerance_s
    return {
        "dt_s": cell.dt,
        "min_steps": params.min_steps,
        "max_steps": params.max_steps,
        "max_step_index": params.max_steps - 1,
        "joint_limit_m": joint,
        "negative_joint_limit_m": -joint,
        "time_step_tolerance_s": params.time_step_tolerance_s,
        "negative_time_step_tolerance_s": -params.time_step_tolerance_s,
        "max_time_step_error_s": params.max_time_step_error_s,
        "negative_max_time_step_error_s": -params.max_time_step_error_s,
        "cycle_time_tolerance_s": cycle,
        "negative_cycle_time_tolerance_s": -cycle,
        "min_cycle_time_s": params.min_steps * cell.dt - cycle,
        "max_cycle_time_s": params.max_steps * cell.dt + cycle,
        "action_match_tolerance": params.action_match_tolerance,
    }


def suite_fingerprint(cell: CellParams, params: ValidateParams) -> str:
    """Identifies what a stored result was checked against: the suites' and this module's
    code, the contract, the limits and the GX version. Computed without importing GX."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        for path in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(json.dumps(suite_parameters(cell, params), sort_keys=True).encode())
    digest.update(metadata.version("great_expectations").encode())
    return digest.hexdigest()[:16]


def load_result(dataset: Path, batch: str, fingerprint: str) -> BatchResult | None:
    path = _batch_folder(dataset, batch, fingerprint) / "result.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return BatchResult(
        batch=stored["batch"],
        passed=stored["passed"],
        failures=stored["failures"],
        expectations=stored["expectations"],
        warnings=stored["warnings"],
        cached=True,
        details=stored["details"],
    )


def _store_result(
    dataset: Path, result: BatchResult, fingerprint: str, gx_results: dict, pages: dict
) -> BatchResult:
    """Write the batch's pages and GX results, then its result.json (last: it marks the
    stored result complete)."""
    folder = _batch_folder(dataset, result.batch, fingerprint)
    folder.mkdir(parents=True, exist_ok=True)
    for table, page in pages.items():
        _write_atomically(folder / f"{table}.html", page)
    _write_atomically(folder / "gx.json", json.dumps(gx_results, default=str))
    stored = {
        "batch": result.batch,
        "suites": fingerprint,
        "validated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "passed": result.passed,
        "failures": result.failures,
        "warnings": result.warnings,
        "expectations": result.expectations,
        "details": result.details,
    }
    _write_atomically(folder / "result.json", json.dumps(stored, indent=1))
    return result


def _batch_folder(dataset: Path, batch: str, fingerprint: str) -> Path:
    return validation_root(dataset) / BATCHES_DIR / batch / fingerprint


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _validate_stored_batch(
    dataset: Path,
    batch: str,
    cell: CellParams,
    params: ValidateParams,
    captures: Path | None,
    fingerprint: str,
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
    return _store_result(dataset, result, fingerprint, gx_results, _render_pages(gx_results))


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
    step_rows = _StepArrays.build(steps, present["steps"], episode_ids, cell.dt)
    rows = {
        "episodes": _FrameRows(_episodes_frame(episodes, present["episodes"], step_rows, cell.dt)),
        "steps": step_rows,
        "captures": _FrameRows(
            _captures_frame(episodes, present["episodes"], captures, attachments)
        ),
    }
    frames = {table: found.frame() for table, found in rows.items()}
    parameters = suite_parameters(cell, params) | {"batch": [batch]}
    outcomes = _run_suites(frames, parameters)
    gx_results = {table: outcome.to_json_dict() for table, outcome in outcomes.items()}
    for table, found in rows.items():
        _fill_counts(gx_results[table], found)
    lines = _result_lines(gx_results, rows, unusable, parameters)
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


# --- schema (pyarrow) ------------------------------------------------------------------------


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


# --- steps: full arrays, and their extremes for GX --------------------------------------------


def _matrix(column: pa.ChunkedArray | pa.Array, size: int) -> np.ndarray:
    """A fixed-size list column as an (n, size) float array, NaN where the vector is null."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not array.null_count:
        return array.flatten().to_numpy(zero_copy_only=False).reshape(len(array), size)
    # A null vector keeps its slots in the child array; reading them and masking the rows is
    # far faster than pc.fill_null with a list scalar.
    start = array.offset * size
    child = array.values.slice(start, len(array) * size).to_numpy(zero_copy_only=False)
    values = child.astype(np.float32, copy=True).reshape(len(array), size)
    values[array.is_null().to_numpy(zero_copy_only=False)] = np.nan
    return values


def _floats(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as float64, NaN where null."""
    return column.cast(pa.float64()).to_numpy()


@dataclass
class _StepArrays:
    """The steps table as numpy arrays (rows grouped by episode), derived per-step columns,
    and per-episode aggregates. GX checks `frame()`, the extremes; failures are counted here."""

    rows: int
    columns: dict[str, np.ndarray]  # contract and derived columns, (n,) or (n, axes)
    nulls: dict[str, np.ndarray]  # contract columns: rows with a null or NaN value
    episode_ids: pa.Array | None  # per row, in the order of `columns`
    episodes: dict[str, Any]  # ids, rows, first_step, intervention_runs: one entry per episode

    @classmethod
    def build(
        cls, steps: pa.Table, present: set[str], listed: pa.ChunkedArray | None, dt: float
    ) -> _StepArrays:
        ids = steps.column("episode_id").combine_chunks() if "episode_id" in present else None
        if ids is not None and not _grouped(ids):
            # Rows of an episode are not consecutive (ingest writes them so; an export may
            # not): a stable sort by episode keeps each episode's own order.
            codes = pc.dictionary_encode(ids).indices.fill_null(-1).to_numpy()
            order = pa.array(np.argsort(codes, kind="stable"))
            steps, ids = steps.take(order), ids.take(order)
        n = steps.num_rows
        columns: dict[str, np.ndarray] = {}
        nulls: dict[str, np.ndarray] = {}
        for field_ in STEPS_SCHEMA:
            if field_.name not in present:
                continue
            column = steps.column(field_.name)
            if pa.types.is_fixed_size_list(field_.type):
                columns[field_.name] = _matrix(column, field_.type.list_size)
                nulls[field_.name] = _rows_any(np.isnan(columns[field_.name]))
            elif pa.types.is_boolean(field_.type):
                nulls[field_.name] = column.is_null().to_numpy()
                columns[field_.name] = pc.fill_null(column, False).to_numpy()
            elif pa.types.is_string(field_.type):
                nulls[field_.name] = column.is_null().to_numpy()
            else:
                columns[field_.name] = _floats(column)
                nulls[field_.name] = np.isnan(columns[field_.name])
        starts = _episode_starts(ids, n)
        arrays = cls(n, columns, nulls, ids, {})
        arrays._derive(starts, listed, dt)
        return arrays

    def _derive(self, starts: np.ndarray, listed: pa.ChunkedArray | None, dt: float) -> None:
        c, n = self.columns, self.rows
        first = np.zeros(n, bool)
        first[starts] = True
        if "intervention" in c and "corrected_action" in c:
            corrected = ~self.nulls["corrected_action"]
            on_intervention = c["intervention"]
            # An unknown intervention flag is the not-null check's to report.
            c["correction_iff_intervention"] = (corrected == on_intervention) | self.nulls[
                "intervention"
            ]
            if "action" in c:
                gap = np.full(n, np.nan, np.float32)
                on = corrected & on_intervention
                differs = np.abs(c["action"][on] - c["corrected_action"][on])
                gap[on] = np.maximum.reduce([differs[:, i] for i in range(differs.shape[1])])
                c["correction_gap"] = gap
        if self.episode_ids is None:
            return

        def advance(values: np.ndarray) -> np.ndarray:
            out = np.full(n, np.nan)
            out[1:] = values[1:] - values[:-1]
            out[first] = np.nan
            return out

        sizes = np.diff(np.append(starts, n))
        run_ids = self.episode_ids.take(pa.array(starts, pa.int64()))
        self.episodes = {"ids": run_ids, "rows": sizes}
        if "step" in c:
            c["step_advance"] = advance(c["step"])
            self.episodes["first_step"] = _per_episode(np.fmin.reduceat, c["step"], starts)
        if "time_s" in c:
            c["time_advance_s"] = advance(c["time_s"])
        if "step" in c and "time_s" in c:
            c["time_step_error_s"] = c["time_advance_s"] - c["step_advance"] * dt
        if listed is not None:
            known = pc.is_in(run_ids, value_set=listed.combine_chunks()).to_numpy(
                zero_copy_only=False
            )
            c["episode_listed"] = np.repeat(known, sizes)
        if "intervention" in c:
            held = c["intervention"]
            previous = np.append(False, held[:-1]) & ~first
            takeovers = (held & ~previous).astype(np.int64)
            self.episodes["intervention_runs"] = _per_episode(np.add.reduceat, takeovers, starts)

    def frame(self) -> pd.DataFrame:
        """Three rows per column: min, max, and a null if the column holds one (else min)."""
        frame: dict[str, Any] = {}
        for name, values in self.columns.items():
            frame[name] = _extremes(values, self.nulls.get(name))
        if self.episode_ids is not None:
            frame["episode_id"] = _any_value(self.episode_ids, self.nulls["episode_id"])
        if self.rows == 0:
            return pd.DataFrame({name: pd.Series([], dtype=object) for name in frame})
        return pd.DataFrame(frame)

    def offending(self, config: dict) -> np.ndarray | None:
        """Per row and axis, which values break an expectation (None: not countable here)."""
        kind, kwargs = config["type"], config["kwargs"]
        column = kwargs.get("column")
        if column not in self.columns and column not in self.nulls:
            return None
        if kind == "expect_column_values_to_not_be_null":
            if column in self.columns and self.columns[column].ndim == 2:
                return np.isnan(self.columns[column])
            return self.nulls[column]
        values = self.columns.get(column)
        if values is None:
            return None
        if kind == "expect_column_values_to_be_between":
            return _outside(values, kwargs)
        if kind == "expect_column_values_to_be_in_set":
            bad = ~np.isin(values, list(kwargs["value_set"]))
            return bad & ~self.nulls[column] if column in self.nulls else bad
        return None

    def values(self, column: str) -> np.ndarray | None:
        return self.columns.get(column)

    def missing(self, column: str) -> int:
        return int(self.nulls[column].sum()) if column in self.nulls else 0

    def describe(self, row: int) -> str:
        episode = self.episode_ids[row].as_py() if self.episode_ids is not None else "?"
        step = self.columns.get("step")
        index = "?" if step is None or np.isnan(step[row]) else int(step[row])
        return f"{episode} step {index}"


class _FrameRows:
    """A frame GX checks row by row (episodes, captures), and the same counts as _StepArrays."""

    def __init__(self, frame: pd.DataFrame):
        self._frame = frame
        self.rows = len(frame)

    def frame(self) -> pd.DataFrame:
        return self._frame

    def values(self, column: str) -> np.ndarray | None:
        return self._frame[column].to_numpy() if column in self._frame else None

    def missing(self, column: str) -> int:
        return int(self._frame[column].isna().sum()) if column in self._frame else 0

    def offending(self, config: dict) -> np.ndarray | None:
        kind, kwargs = config["type"], config["kwargs"]
        frame = self._frame
        if kind == "expect_column_pair_values_to_be_equal":
            a, b = kwargs["column_A"], kwargs["column_B"]
            if a not in frame or b not in frame:
                return None
            both_missing = (frame[a].isna() & frame[b].isna()).to_numpy()
            return ~(frame[a] == frame[b]).to_numpy() & ~both_missing
        column = kwargs.get("column")
        if column not in frame:
            return None
        series = frame[column]
        known = series.notna().to_numpy()
        if kind == "expect_column_values_to_not_be_null":
            return ~known
        if kind == "expect_column_values_to_be_unique":
            return series.duplicated(keep=False).to_numpy() & known
        if kind == "expect_column_values_to_be_in_set":
            return ~series.isin(list(kwargs["value_set"])).to_numpy() & known
        if kind == "expect_column_values_to_be_between":
            return _outside(pd.to_numeric(series, errors="coerce").to_numpy(float), kwargs)
        return None

    def describe(self, row: int) -> str:
        return str(self._frame["episode_id"].iloc[row]) if "episode_id" in self._frame else ""


def _outside(values: np.ndarray, kwargs: dict) -> np.ndarray:
    """Values outside an expect_column_values_to_be_between's bounds (NaN is not counted)."""
    bad = np.zeros(values.shape, bool)
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    with np.errstate(invalid="ignore"):  # NaN compares False
        if low is not None:
            bad |= values <= low if kwargs.get("strict_min") else values < low
        if high is not None:
            bad |= values >= high if kwargs.get("strict_max") else values > high
    return bad


_COUNTED = {  # expectation types whose results carry row counts
    "expect_column_values_to_not_be_null",
    "expect_column_values_to_be_between",
    "expect_column_values_to_be_in_set",
    "expect_column_values_to_be_unique",
    "expect_column_pair_values_to_be_equal",
}


def _fill_counts(gx_result: dict, found: _StepArrays | _FrameRows) -> None:
    """Put exact counts and a sample of offending values into GX's results (GX ran with
    BOOLEAN_ONLY, and on the extremes of the steps), so that the Data Docs show them."""
    for result in gx_result["results"]:
        config = result["expectation_config"]
        if result.get("exception_info", {}).get("raised_exception"):
            continue
        if config["type"] not in _COUNTED:
            continue
        column = config["kwargs"].get("column") or config["kwargs"].get("column_A")
        count, sample = 0, []  # what passed has no offending row: nothing to count
        if not result["success"]:
            bad = found.offending(config)
            if bad is None:
                continue
            rows = _rows_any(bad)
            values = found.values(column)
            count = int(rows.sum())
            sample = [] if values is None or not count else values[rows][:20].tolist()
        missing = found.missing(column)
        result["result"] = {
            "element_count": found.rows,
            "missing_count": missing,
            "unexpected_count": count,
            "unexpected_percent": 100.0 * count / max(found.rows - missing, 1),
            "partial_unexpected_list": [_plain(v) for v in sample],
        }


def _plain(value: Any) -> Any:
    """A sample value as JSON can hold it."""
    if isinstance(value, float) and np.isnan(value):
        return None
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value if isinstance(value, str | int | float | bool | type(None)) else str(value)


def _rows_any(mask: np.ndarray) -> np.ndarray:
    """Rows with any True: column by column (numpy reduces a short axis slowly)."""
    if mask.ndim == 1:
        return mask
    out = mask[:, 0].copy()
    for axis in range(1, mask.shape[1]):
        out |= mask[:, axis]
    return out


def _grouped(ids: pa.Array) -> bool:
    """Whether each episode's rows are consecutive (one run per distinct id)."""
    if len(ids) < 2:
        return True
    changes = pc.fill_null(pc.not_equal(ids[1:], ids[:-1]), True)
    runs = 1 + pc.sum(changes).as_py()
    return runs == pc.count_distinct(ids, mode="all").as_py()


def _episode_starts(ids: pa.Array | None, n: int) -> np.ndarray:
    if ids is None or n == 0:
        return np.zeros(0 if n == 0 else 1, np.int64)
    changes = pc.fill_null(pc.not_equal(ids[1:], ids[:-1]), True).to_numpy(zero_copy_only=False)
    return np.flatnonzero(np.append(True, changes))


def _per_episode(reduce, values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    return reduce(values, starts) if len(starts) else np.zeros(0, values.dtype)


def _extremes(values: np.ndarray, nulls: np.ndarray | None) -> list:
    has_null = bool(nulls is not None and nulls.any())
    if values.dtype == bool:
        valid = values[~nulls] if has_null else values
        low, high = (bool(valid.min()), bool(valid.max())) if valid.size else (None, None)
        return [low, high, None if has_null else low]
    finite = ~np.isnan(values)
    if not finite.any():
        return [np.nan, np.nan, np.nan]
    low, high = float(np.nanmin(values)), float(np.nanmax(values))
    return [low, high, np.nan if has_null else low]


def _any_value(ids: pa.Array, nulls: np.ndarray) -> list:
    valid = np.flatnonzero(~nulls)
    value = ids[int(valid[0])].as_py() if valid.size else None
    return [value, value, None if nulls.any() else value]


# --- episodes and captures: GX row by row ----------------------------------------------------


def _episodes_frame(
    episodes: pa.Table, present: set[str], steps: _StepArrays, dt: float
) -> pd.DataFrame:
    """The episodes table for GX: vectors as their smallest component (NaN if any is null or
    NaN), 32-bit numbers widened (GX compares only 64-bit columns vectorized), per-episode
    aggregates of the steps joined on."""
    frame: dict[str, Any] = {}
    for field_ in EPISODES_SCHEMA:
        if field_.name not in present:
            continue
        column = episodes.column(field_.name)
        if pa.types.is_fixed_size_list(field_.type):
            frame[field_.name] = _matrix(column, field_.type.list_size).min(axis=1)
        elif pa.types.is_floating(field_.type) or pa.types.is_integer(field_.type):
            frame[field_.name] = _floats(column) if column.null_count else _widened(column)
        else:
            frame[field_.name] = column.to_pandas()
    frame = pd.DataFrame(frame, index=pd.RangeIndex(episodes.num_rows))
    _derive_episode_columns(frame, episodes, present, steps, dt)
    return frame


def _widened(column: pa.ChunkedArray) -> np.ndarray:
    kind = pa.float64() if pa.types.is_floating(column.type) else pa.int64()
    return column.cast(kind).to_numpy()


def _derive_episode_columns(
    frame: pd.DataFrame, episodes: pa.Table, present: set[str], steps: _StepArrays, dt: float
) -> None:
    if "episode_id" in present and "ids" in steps.episodes:
        at = pc.index_in(episodes.column("episode_id"), value_set=steps.episodes["ids"])
        at = at.to_numpy(zero_copy_only=False)
        found = ~np.isnan(at)
        index = np.where(found, at, 0).astype(np.int64)

        def joined(values: np.ndarray, default: float) -> np.ndarray:
            if not len(values):
                return np.full(len(at), default)
            return np.where(found, values[index], default)

        frame["step_rows"] = joined(steps.episodes["rows"], 0).astype(np.int64)
        if "first_step" in steps.episodes:
            frame["first_step"] = joined(steps.episodes["first_step"].astype(float), np.nan)
        if "intervention_runs" in steps.episodes:
            frame["intervention_runs"] = joined(steps.episodes["intervention_runs"], 0).astype(
                np.int64
            )
    if "episode_id" in present:
        well_formed = pc.match_substring_regex(
            episodes.column("episode_id"), episode_suite.EPISODE_ID_PATTERN
        )
        frame["episode_id_well_formed"] = pc.fill_null(well_formed, True).to_numpy()
    if {"cycle_time_s", "steps"} <= present:
        frame["cycle_time_error_s"] = frame["cycle_time_s"] - frame["steps"] * dt
    if {"success", "failure_cause"} <= present:
        success = frame["success"]
        frame["outcome_consistent"] = success.isna() | (success == frame["failure_cause"].isna())
    if {"safety_stops", "safety_stop_kind"} <= present:
        stopped = frame["safety_stops"] > 0
        frame["stop_kind_consistent"] = stopped == frame["safety_stop_kind"].notna()
    if {"edge_case", "edge_case_reasons"} <= present:
        listed = pc.fill_null(pc.list_value_length(episodes.column("edge_case_reasons")), 0)
        has_reasons = listed.to_numpy() > 0
        flag = frame["edge_case"]
        frame["edge_case_consistent"] = flag.isna() | (flag == has_reasons)


def _captures_frame(
    episodes: pa.Table, present: set[str], folder: Path | None, store: Path | None
) -> pd.DataFrame:
    """One row per capture: each reason an episode lists, joined with its sidecar when
    found, and each sidecar of the batch's episodes whose reason the episode does not list."""
    wanted = ("episode_id", "cell_id", "steps", "edge_case_reasons", "attachments")
    rows: list[dict] = []
    if not set(wanted) <= present:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in captures_suite.COLUMNS})
    listed = {r["episode_id"]: r for r in episodes.select(list(wanted)).to_pylist()}
    stored = _StoredAttachments(store)
    sidecars = _sidecars(folder, listed)
    for episode_id, episode in listed.items():
        found = sidecars.pop(episode_id, [])
        reasons = list(dict.fromkeys(episode["edge_case_reasons"] or []))
        for reason in reasons:
            match = next((s for s in found if s.get("reason") == reason), None)
            if match is not None:
                found.remove(match)
            rows.append(_capture_row(episode, reason, match, folder, stored, in_dataset=True))
        for sidecar in found:  # landed after ingest, or a second capture for one reason
            reason = sidecar.get("reason")
            rows.append(_capture_row(episode, reason, sidecar, folder, stored, reason in reasons))
    if not rows:
        return pd.DataFrame({c: pd.Series([], dtype=object) for c in captures_suite.COLUMNS})
    return pd.DataFrame(rows, columns=list(captures_suite.COLUMNS)).astype(object)


def _capture_row(
    episode: dict,
    reason: Any,
    sidecar: dict | None,
    folder: Path | None,
    stored: _StoredAttachments,
    in_dataset: bool,
) -> dict:
    row: dict[str, Any] = {
        "episode_id": episode["episode_id"],
        "reason": reason,
        "in_dataset": in_dataset,
        "has_sidecar": None if folder is None else sidecar is not None,
        "step_in_episode": None,
        "sidecar_consistent": None,
        "attachments_listed": None,
        "attachments_stored": stored.holds(episode["attachments"] or []),
    }
    if sidecar is None:
        return row
    step, steps = sidecar.get("step"), episode["steps"]
    row["step_in_episode"] = _is_int(step) and steps is not None and 0 <= step < steps
    row["sidecar_consistent"] = (
        sidecar.get("cell_id") == episode["cell_id"]
        and _is_utc_time(sidecar.get("time"))
        and _is_int(step)
        and _is_int(sidecar.get("log_time_ns"))
    )
    names = sidecar.get("attachments", [])
    listed = set(episode["attachments"] or [])
    row["attachments_listed"] = isinstance(names, list) and all(
        isinstance(n, str) and _file_sha256(folder / Path(n).name) in listed for n in names
    )
    return row


def _sidecars(folder: Path | None, episodes: dict) -> dict[str, list[dict]]:
    """The JSON sidecars of these episodes in `folder`, by episode id. A sidecar that does not
    parse is kept as {} (its checks fail); ingest quarantines those before they get here."""
    found: dict[str, list[dict]] = {}
    if folder is None or not Path(folder).is_dir():
        return found
    for entry in os.scandir(folder):
        match = _SIDECAR_NAME.match(entry.name)
        if not match or match["episode"] not in episodes or not entry.is_file():
            continue
        try:
            sidecar = json.loads(Path(entry.path).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            sidecar = {}
        if not isinstance(sidecar, dict):
            sidecar = {}
        episode = sidecar.get("episode_id", match["episode"])
        if episode in episodes:
            found.setdefault(episode, []).append(sidecar)
    return found


class _StoredAttachments:
    """The dataset's content-addressed attachment store, each file hashed at most once."""

    def __init__(self, store: Path | None):
        self.files: dict[str, Path] | None = None
        if store is not None:
            store = Path(store)
            entries = os.scandir(store) if store.is_dir() else []
            self.files = {Path(e.name).stem: Path(e.path) for e in entries if e.is_file()}
        self.intact: dict[str, bool] = {}

    def holds(self, shas: list[str]) -> bool | None:
        if self.files is None:
            return None
        for sha in shas:
            if sha not in self.intact:
                path = self.files.get(sha)
                self.intact[sha] = path is not None and _file_sha256(path) == sha
            if not self.intact[sha]:
                return False
        return True


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_utc_time(value: Any) -> bool:
    try:
        return datetime.fromisoformat(value).utcoffset() is not None
    except (TypeError, ValueError):
        return False


# --- GX --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Runtime:
    batch_definitions: dict  # table -> GX BatchDefinition over a dataframe asset
    suites: dict  # table -> GX ExpectationSuite


# Held while the runtime is built and while a batch is validated: GX's context is not
# documented as thread-safe, and Prefect may run tasks in threads.
_GX_LOCK = threading.RLock()


def warm_up() -> None:
    """Build the GX context and suites now, and run them once on an empty batch (GX's first
    validation in a process imports more of it), e.g. before timing anything."""
    global _WARM
    with _GX_LOCK:  # re-entrant: the dry run below takes it again
        _runtime()
        if not _WARM:
            # Only what suite_parameters and the step arrays read; the limits do not matter.
            cell = SimpleNamespace(dt=0.05, safety=SimpleNamespace(joint_limit_m=0.3))
            limits = dict.fromkeys(ValidateParams.__dataclass_fields__, 1)
            empty = EPISODES_SCHEMA.empty_table(), STEPS_SCHEMA.empty_table()
            _check_batch(*empty, "0" * 64, cell, SimpleNamespace(**limits), None, None)
            _WARM = True


def _warm_up_in_background() -> None:
    """Start GX while the caller reads and prepares batches: GX's import is Python code
    (holding the GIL) while Parquet reads and pyarrow kernels release it, so they overlap."""
    global _WARMING
    with _WARMING_LOCK:
        if _WARMING is not None:
            return

        def run() -> None:
            # Only the import and the context: a dry run here would stand in the caller's way
            # (it waits for the lock), where its first real run pays the same once.
            with contextlib.suppress(Exception), _GX_LOCK:  # the caller's GX call raises it
                _runtime()

        _WARMING = threading.Thread(target=run, name="gx-warm-up", daemon=True)
        _WARMING.start()


_WARM = False
_WARMING: threading.Thread | None = None
_WARMING_LOCK = threading.Lock()


@cache
def _runtime() -> _Runtime:  # called with _GX_LOCK held
    """GX context, data source and suites: built once per process (GX starts slowly)."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    from pipelines.quality.expectations import suites

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    source = context.data_sources.add_pandas("realloop")
    batch_definitions, built = {}, {}
    for table, expectations in suites().items():
        asset = source.add_dataframe_asset(table)
        batch_definitions[table] = asset.add_batch_definition_whole_dataframe(table)
        suite = gx.ExpectationSuite(name=f"realloop-{table}")
        for expectation in expectations:
            suite.add_expectation(expectation)
        built[table] = context.suites.add(suite)
    # GX's import leaves millions of long-lived objects. Freezing them keeps the cyclic
    # garbage collector from walking them again in every later full collection, including
    # the one at interpreter exit, which otherwise takes about 2 s. Frozen objects are still
    # freed by reference counting; only cycles among them would outlive the process.
    gc.freeze()
    return _Runtime(batch_definitions, built)


def _run_suites(frames: dict[str, pd.DataFrame], parameters: dict) -> dict:
    """GX's validation result of each suite over its frame."""
    outcomes = {}
    with _GX_LOCK:
        runtime = _runtime()
        for table in SUITES:
            batch = runtime.batch_definitions[table].get_batch(
                batch_parameters={"dataframe": frames[table]}
            )
            # batch.validate keeps no result store (a ValidationDefinition run would grow one).
            outcomes[table] = batch.validate(
                runtime.suites[table],
                result_format=RESULT_FORMAT,
                expectation_parameters=parameters,
            )
    return outcomes


# --- GX results -> one-line failures and warnings --------------------------------------------


def _result_lines(
    gx_results: dict, rows: dict, unusable: set[str], parameters: dict
) -> dict[str, list[str]]:
    """One line per failed expectation, by severity. Expectations that need a missing or
    mistyped column are skipped: the schema check already reports the cause."""
    lines: dict[str, list[str]] = {CRITICAL: [], WARNING: []}
    for table, outcome in gx_results.items():
        for result in outcome["results"]:
            if result["success"]:
                continue
            config = result["expectation_config"]
            meta = config["meta"]
            if meta["broke"] == "columns missing" or _depends_on(table, meta["sources"], unusable):
                continue
            column = meta["column"]
            label = f"{table}.{column}" if column else table
            broke = meta["broke"].format(**parameters)
            info = result.get("exception_info") or {}
            if info.get("raised_exception"):
                line = f"{label}: could not be checked ({_exception_message(info)})"
            else:
                line = _count_line(label, broke, config, rows[table])
            lines[meta["severity"]].append(line)
    return {severity: sorted(found) for severity, found in lines.items()}


def _count_line(label: str, broke: str, config: dict, found: _StepArrays | _FrameRows) -> str:
    """`<table>.<column>: <count> <what broke> (<per axis>); first: <where>`."""
    bad = found.offending(config)
    if bad is None:
        return f"{label}: {broke}"
    rows = _rows_any(bad)
    line = f"{label}: {int(rows.sum())} {broke}"
    axes = VECTOR_AXES.get(config["kwargs"].get("column"))
    if bad.ndim == 2 and axes:
        per_axis = zip(axes, bad.sum(axis=0), strict=True)
        detail = ", ".join(f"{axis}: {int(n)}" for axis, n in per_axis if n)
        line += f" ({detail})"
    line += _examples(found, config, rows)
    where = found.describe(int(np.argmax(rows))) if rows.any() else ""
    return line + (f"; first: {where}" if where else "")


def _examples(found: _StepArrays | _FrameRows, config: dict, rows: np.ndarray) -> str:
    """Up to three values of the offending episodes (or captures) in the column a failure is
    reported under (an unknown failure cause, a malformed id, a step count)."""
    if not isinstance(found, _FrameRows) or not rows.any():
        return ""
    values = found.values(config["meta"]["column"])
    if values is None or values.dtype == bool:
        return ""
    distinct = list(dict.fromkeys(_plain(v) for v in values[rows][:100]))[:3]
    if not distinct or all(isinstance(v, bool) or v is None for v in distinct):
        return ""
    shown = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in distinct]
    return f" (e.g. {', '.join(shown)})"


def _depends_on(table: str, sources: list[str], columns: set[str]) -> bool:
    qualified = {s if "." in s else f"{table}.{s}" for s in sources if s}
    return bool(qualified & columns)


def _exception_message(info: dict) -> str:
    if info.get("exception_message"):
        return str(info["exception_message"])
    nested = [v.get("exception_message") for v in info.values() if isinstance(v, dict)]
    return str(next((m for m in nested if m), "unknown error"))


# --- Data Docs -------------------------------------------------------------------------------


def _render_pages(gx_results: dict) -> dict[str, str]:
    """GX's own Data Docs page (HTML) for each suite's validation result."""
    from great_expectations.core.expectation_validation_result import (
        expectationSuiteValidationResultSchema,
    )
    from great_expectations.render.renderer import ValidationResultsPageRenderer
    from great_expectations.render.view import DefaultJinjaPageView

    renderer, view = ValidationResultsPageRenderer(), DefaultJinjaPageView()
    pages = {}
    for table, result in gx_results.items():
        loaded = expectationSuiteValidationResultSchema.load(json.loads(json.dumps(result)))
        pages[table] = view.render(renderer.render(loaded))
    return pages


def _write_version(
    dataset: Path, folder: Path, report: ValidationReport, fingerprint: str
) -> ValidationReport:
    """report.json and the Data Docs index of one dataset version; each batch's pages are
    linked into `pages/` so that the folder stands on its own."""
    pages = folder / "pages"
    pages.mkdir(parents=True, exist_ok=True)
    links: dict[str, dict[str, str]] = {}
    for result in report.batches:
        for table in SUITES:
            source = _batch_folder(dataset, result.batch, fingerprint) / f"{table}.html"
            if source.is_file():
                name = f"{result.batch}.{table}.html"
                _link(source, pages / name)
                links.setdefault(result.batch, {})[table] = f"pages/{name}"
    report = replace(
        report, results=str(folder / "report.json"), data_docs=str(folder / "index.html")
    )
    summary = report.as_dict() | {
        "suites": fingerprint,
        "written_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "batch_results": [
            {
                "batch": b.batch,
                "passed": b.passed,
                "trainable": b.trainable,
                "failures": b.failures,
                "warnings": b.warnings,
                "admitted": b.admitted,
                "expectations": b.expectations,
                **b.details,
                "pages": links.get(b.batch, {}),
            }
            for b in report.batches
        ],
    }
    _write_atomically(folder / "report.json", json.dumps(summary, indent=1))
    _write_atomically(folder / "index.html", _index_html(summary))
    return report


def _link(source: Path, target: Path) -> None:
    if target.exists() and os.path.samefile(source, target):
        return
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:  # another filesystem: copy
        tmp.write_bytes(source.read_bytes())
    os.replace(tmp, target)


def _index_html(summary: dict) -> str:
    esc = html.escape
    rows = []
    for b in summary["batch_results"]:
        if not b["passed"]:
            status = ("admitted", "#b7791f") if b["admitted"] else ("EXCLUDED", "#c53030")
        else:
            status = ("passed, warnings", "#b7791f") if b["warnings"] else ("passed", "#2f855a")
        notes = [f"<li class=critical>{esc(f)}</li>" for f in b["failures"]]
        notes += [f"<li class=warning>{esc(w)}</li>" for w in b["warnings"]]
        if b["admitted"]:
            a = b["admitted"]
            notes.append(
                f"<li>admitted by {esc(str(a['by']))} at {esc(str(a['at']))}: "
                f"{esc(str(a['reason']))}</li>"
            )
        docs = " ".join(f'<a href="{esc(p)}">{esc(t)}</a>' for t, p in b["pages"].items())
        rows.append(
            f"<tr><td><code title='{esc(b['batch'])}'>{esc(b['batch'][:12])}</code><br>"
            f"<small>{esc(str(b.get('source_uri') or ''))}</small></td>"
            f"<td style='color:{status[1]}'><b>{status[0]}</b></td>"
            f"<td>{b.get('episodes', '')}</td><td>{b.get('steps', '')}</td>"
            f"<td><ul>{''.join(notes)}</ul></td><td>{docs}</td></tr>"
        )
    excluded, version = len(summary["excluded_from_training"]), esc(str(summary["dataset_version"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>realloop validation {version}</title>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{border-bottom:1px solid #ddd;padding:4px 8px;
vertical-align:top;text-align:left}}table{{border-collapse:collapse}}ul{{margin:0;padding-left:1.2em}}
.critical{{color:#c53030}}.warning{{color:#b7791f}}</style></head><body>
<h1>Validation of dataset {version}</h1>
<p>{summary["batches"]} batches: {summary["passed"]} passed every critical expectation,
{excluded} excluded from training, {len(summary["admitted"])} re-admitted,
{len(summary["warnings"])} with warnings. Suites {esc(summary["suites"])},
written {esc(summary["written_at"])}. Machine-readable: <a href="report.json">report.json</a>.
Each batch links to Great Expectations' Data Docs page of every suite.</p>
<table><tr><th>batch</th><th>status</th><th>episodes</th><th>steps</th>
<th>critical failures and warnings</th><th>Data Docs</th></tr>
{"".join(rows)}
</table></body></html>
"""
