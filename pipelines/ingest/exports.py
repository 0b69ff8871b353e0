"""Exports: JSONL and Parquet files that follow the data contract, one row per control step
with its episode's columns, read and turned into the episodes and steps tables."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.contract import schema
from pipelines.ingest.decoded import ContractViolation, UnreadableLog
from pipelines.ingest.landing_layout import JSONL_SUFFIX
from pipelines.ingest.tables import (
    Provenance,
    _finish_episodes,
    _numeric_matrix,
    _vectors,
    check_trial_columns,
    conform,
)

# What ingest fills itself; an export carries every other column of both tables.
_FILLED_BY_INGEST = (
    "source_uri",
    "source_sha256",
    "source_chunk",
    "ingest_run_id",
    "ingested_at",
    "realloop_version",
    "steps",
    "edge_case",
    "edge_case_reasons",
    "attachments",
)
EXPORT_EPISODE_COLUMNS = tuple(
    f.name for f in schema.EPISODES_SCHEMA if f.name not in _FILLED_BY_INGEST
)
EXPORT_STEP_COLUMNS = tuple(f.name for f in schema.STEPS_SCHEMA if f.name != "episode_id")
# One row per control step: the step's columns and its episode's, as in the two tables.
EXPORT_SCHEMA = pa.schema(
    [schema.EPISODES_SCHEMA.field(name) for name in EXPORT_EPISODE_COLUMNS]
    + [schema.STEPS_SCHEMA.field(name) for name in EXPORT_STEP_COLUMNS]
)


def _jsonl_type(kind: pa.DataType) -> pa.DataType:
    """How a contract type is spelled in JSON: numbers as float64/int64, start_time as
    integer nanoseconds since the Unix epoch."""
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind):
        inner = kind.value_type
        return pa.list_(pa.float64() if pa.types.is_floating(inner) else inner)
    if pa.types.is_timestamp(kind) or pa.types.is_integer(kind):
        return pa.int64()
    if pa.types.is_floating(kind):
        return pa.float64()
    return kind


_JSONL_SCHEMA = pa.schema([pa.field(f.name, _jsonl_type(f.type)) for f in EXPORT_SCHEMA])


@dataclass(frozen=True)
class Export:
    """An export's rows, conformed to EXPORT_SCHEMA, and the columns it had beyond it."""

    rows: pa.Table
    unknown_columns: dict[str, int]


def read_export(path: Path) -> Export:
    """Read a `.jsonl` or `.parquet` export and conform it to EXPORT_SCHEMA.

    Raises UnreadableLog when the bytes do not parse, ContractViolation when a column is
    missing or of a type that cannot stand for the contract's.
    """
    import pyarrow.json as pj

    path = Path(path)
    if path.stat().st_size == 0:
        raise UnreadableLog("empty file (0 bytes)")
    try:
        if path.suffix == JSONL_SUFFIX:
            raw = pj.read_json(
                path,
                parse_options=pj.ParseOptions(
                    explicit_schema=_JSONL_SCHEMA, unexpected_field_behavior="infer"
                ),
            )
            present = [n for n in raw.schema.names if raw.column(n).null_count < raw.num_rows]
        else:
            raw = pq.read_table(path)
            present = raw.schema.names
    except (pa.ArrowException, OSError) as exc:
        kind = "JSONL" if path.suffix == JSONL_SUFFIX else "Parquet"
        detail = (str(exc).splitlines() or [""])[0][:200]
        raise UnreadableLog(
            f"unreadable {kind} export ({exc.__class__.__name__}: {detail})"
        ) from None
    missing = [f.name for f in EXPORT_SCHEMA if not f.nullable and f.name not in present]
    if missing:
        raise ContractViolation(f"missing required column(s): {', '.join(missing)}")
    columns = {}
    for f in EXPORT_SCHEMA:
        if f.name in raw.schema.names:
            columns[f.name] = _export_column(raw.column(f.name), f)
        else:
            columns[f.name] = pa.nulls(raw.num_rows, f.type)
    rows = pa.table(columns, schema=EXPORT_SCHEMA)
    for f in EXPORT_SCHEMA:
        if not f.nullable and rows.column(f.name).null_count:
            raise ContractViolation(f"export column {f.name} has nulls")
    extra = {n: raw.num_rows for n in raw.schema.names if n not in EXPORT_SCHEMA.names}
    return Export(rows, extra)


def _export_column(column: pa.ChunkedArray, target: pa.Field) -> pa.Array:
    array = column.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa.types.is_large_string(array.type):
        array = array.cast(pa.string())
    kind, want = array.type, target.type

    def wrong() -> ContractViolation:
        return ContractViolation(f"export column {target.name} has type {kind}, expected {want}")

    try:
        if pa.types.is_fixed_size_list(want):
            if not (
                pa.types.is_list(kind)
                or pa.types.is_large_list(kind)
                or pa.types.is_fixed_size_list(kind)
            ) or not (
                pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)
            ):
                raise wrong()
            lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
            valid = array.is_valid().to_numpy(zero_copy_only=False)
            short = np.flatnonzero(valid & (lengths != want.list_size))
            if short.size:
                row = int(short[0])
                raise ContractViolation(
                    f"export column {target.name}: row {row} has {int(lengths[row])} values, "
                    f"expected {want.list_size}"
                )
            values = pc.list_flatten(array).cast(want.value_type)
            flat = values.to_numpy(zero_copy_only=False)
            matrix = np.zeros((len(array), want.list_size), dtype=np.float32)
            matrix[valid] = flat.reshape(-1, want.list_size)
            return _vectors(matrix, null=~valid if not valid.all() else None)
        if pa.types.is_timestamp(want):
            if pa.types.is_timestamp(kind):
                return array.cast(pa.timestamp(kind.unit, tz="UTC")).cast(want)
            if pa.types.is_integer(kind):
                return array.cast(pa.int64()).cast(want)
            raise wrong()
        if pa.types.is_string(want) and not (pa.types.is_string(kind) or pa.types.is_null(kind)):
            raise wrong()
        if pa.types.is_boolean(want) and not (pa.types.is_boolean(kind) or pa.types.is_null(kind)):
            raise wrong()
        if (pa.types.is_integer(want) or pa.types.is_floating(want)) and not (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind)
        ):
            raise wrong()
        return array.cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise wrong() from None


def build_export_tables(
    export: Export,
    min_steps: int,
    provenance: Provenance,
    *,
    max_clock_jump_s: float | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The episodes and steps tables of one export (rows of one episode contiguous, in step
    order). Raises ContractViolation with a one-line reason."""
    rows = export.rows
    n = rows.num_rows
    if not n:
        raise ContractViolation("no episodes: the export has no rows")
    ids = rows.column("episode_id").to_numpy(zero_copy_only=False)
    boundary = np.r_[True, ids[1:] != ids[:-1]]
    firsts = np.flatnonzero(boundary)
    lasts = np.r_[firsts[1:], n]
    order = ids[firsts]
    if len(set(order)) != len(order):
        seen, twice = set(), None
        for episode_id in order:
            if episode_id in seen:
                twice = episode_id
                break
            seen.add(episode_id)
        raise ContractViolation(f"episode {twice}: its rows are not contiguous in the export")
    time_s = rows.column("time_s").to_numpy()
    step = rows.column("step").to_numpy()
    bound = max_clock_jump_s if max_clock_jump_s is not None else math.inf
    for a, b in zip(firsts, lasts, strict=True):
        _check_export_episode(str(ids[a]), time_s[a:b], step[a:b], int(a), bound, min_steps)
    for name in EXPORT_EPISODE_COLUMNS:
        changes = _row_changes(rows.column(name)) & ~boundary[1:]
        if changes.any():
            row = int(np.flatnonzero(changes)[0]) + 1
            raise ContractViolation(
                f"episode {ids[row]}: export column {name} differs between its rows (row {row})"
            )
    intervention = rows.column("intervention").to_numpy(zero_copy_only=False)
    corrected = rows.column("corrected_action").is_valid().to_numpy(zero_copy_only=False)
    stray = np.flatnonzero(corrected & ~intervention)
    if stray.size:
        row = int(stray[0])
        raise ContractViolation(
            f"episode {ids[row]}: corrected_action on step {int(step[row])}, which is not an "
            "intervention"
        )
    head = rows.take(pa.array(firsts))
    columns = {name: head.column(name) for name in EXPORT_EPISODE_COLUMNS}
    columns["steps"] = pa.array(lasts - firsts, pa.int32())
    columns["source_chunk"] = pa.array(
        [f"rows={a}-{b - 1}" for a, b in zip(firsts, lasts, strict=True)], pa.string()
    )
    episodes = _finish_episodes(columns, len(firsts), provenance)
    check_trial_columns(episodes)
    steps = conform(rows.select(["episode_id", *EXPORT_STEP_COLUMNS]), schema.STEPS_SCHEMA, "steps")
    return episodes, steps


def _check_export_episode(
    episode_id: str, time_s: np.ndarray, step: np.ndarray, first_row: int, bound: float, min_steps
) -> None:
    gaps = np.diff(time_s)
    if (gaps < 0).any():
        i = int(np.flatnonzero(gaps < 0)[0]) + 1
        raise ContractViolation(
            f"non-monotonic timestamps: time_s goes back from {time_s[i - 1]:g} to "
            f"{time_s[i]:g} s at row {first_row + i}, in episode {episode_id}"
        )
    if (gaps == 0).any():
        i = int(np.flatnonzero(gaps == 0)[0]) + 1
        raise ContractViolation(
            f"duplicate timestamps: time_s {time_s[i]:g} s repeats at row {first_row + i}, "
            f"in episode {episode_id}"
        )
    jumps = np.r_[time_s[0], gaps]
    if (jumps > bound).any():
        i = int(np.flatnonzero(jumps > bound)[0])
        where = "its start and its first step" if i == 0 else f"steps {i - 1} and {i}"
        raise ContractViolation(
            f"clock jump: time_s jumps {jumps[i]:.3f} s between {where} of episode "
            f"{episode_id} (over ingest.max_clock_jump_s = {bound:g} s)"
        )
    if not np.array_equal(step, np.arange(len(step))):
        i = int(np.flatnonzero(step != np.arange(len(step)))[0])
        raise ContractViolation(
            f"episode {episode_id}: steps are not 0..n-1 in row order (row {first_row + i} "
            f"has step {int(step[i])}, expected {i})"
        )
    if len(step) < min_steps:
        raise ContractViolation(
            f"episode {episode_id} has {len(step)} steps, fewer than ingest.min_steps ({min_steps})"
        )


def _row_changes(column) -> np.ndarray:
    """Per row after the first: does its value differ from the row before (nulls equal)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    matrix, valid = _numeric_matrix(array)
    if matrix is None:
        values = array.to_numpy(zero_copy_only=False)
        return np.asarray(values[1:] != values[:-1], dtype=bool)
    same = (matrix[1:] == matrix[:-1]) | (
        np.isnan(matrix[1:]) & np.isnan(matrix[:-1])
        if np.issubdtype(matrix.dtype, np.floating)
        else False
    )
    return ~same.all(axis=1) | (valid[1:] != valid[:-1])
