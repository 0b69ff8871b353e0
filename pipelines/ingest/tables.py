"""What the tables of a shift log and of an export share: the provenance and empty edge-case
columns of the episodes table, conforming to the contract's schemas, and the value checks (no
NaN or inf, no joint reading beyond the gantry's travel) that quarantine a file."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pyarrow as pa

from pipelines.contract import schema
from pipelines.contract.params import CellParams, IngestParams
from pipelines.ingest.decoded import ContractViolation


@dataclass(frozen=True)
class Provenance:
    """Where rows come from and which ingest run wrote them."""

    source_uri: str
    source_sha256: str
    ingest_run_id: str
    ingested_at: datetime
    realloop_version: str


def _finish_episodes(columns: dict, n: int, prov: Provenance) -> pa.Table:
    """Add provenance and empty edge-case columns; conform to the episodes schema."""
    columns = {
        **columns,
        "source_uri": [prov.source_uri] * n,
        "source_sha256": [prov.source_sha256] * n,
        "ingest_run_id": [prov.ingest_run_id] * n,
        "ingested_at": pa.array([prov.ingested_at] * n, pa.timestamp("us", tz="UTC")),
        "realloop_version": [prov.realloop_version] * n,
        "edge_case": [False] * n,
        "edge_case_reasons": pa.nulls(n, pa.list_(pa.string())),
        "attachments": pa.nulls(n, pa.list_(pa.string())),
    }
    table = pa.table(
        {
            k: v if isinstance(v, pa.Array | pa.ChunkedArray) else pa.array(v)
            for k, v in columns.items()
        }
    )
    return conform(table, schema.EPISODES_SCHEMA, "episodes")


def trial_problem(values: dict) -> str | None:
    """What is wrong with a row's trial fields (schema.TRIAL_COLUMNS), or None: a trial
    episode names its request, arm and attempt, a production episode none of them."""
    given = [name for name in schema.TRIAL_COLUMNS if values.get(name) is not None]
    if not given:
        return None
    lacking = [name for name in schema.TRIAL_COLUMNS if not values.get(name)]
    if lacking:
        return (
            f"trial fields incomplete: {', '.join(lacking)} missing or empty "
            f"(a trial log names all of {', '.join(schema.TRIAL_COLUMNS)})"
        )
    arm = values["trial_arm"]
    if arm not in schema.TRIAL_ARMS:
        return f"trial_arm {arm!r} is not one of {', '.join(schema.TRIAL_ARMS)}"
    return None


def check_trial_columns(episodes: pa.Table) -> None:
    """trial_problem of every episode row; ContractViolation naming the first episode."""
    if all(episodes.column(n).null_count == episodes.num_rows for n in schema.TRIAL_COLUMNS):
        return  # production episodes only: the common case, no row loop
    rows = episodes.select(["episode_id", *schema.TRIAL_COLUMNS]).to_pylist()
    for row in rows:
        problem = trial_problem(row)
        if problem:
            raise ContractViolation(f"episode {row['episode_id']}: {problem}")


def _vectors(values: np.ndarray, null: np.ndarray | None = None) -> pa.FixedSizeListArray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    flat = pa.array(values.reshape(-1), pa.float32())
    mask = None if null is None else pa.array(null, pa.bool_())
    return pa.FixedSizeListArray.from_arrays(flat, values.shape[1], mask=mask)


def conform(table: pa.Table, target: pa.Schema, what: str) -> pa.Table:
    """Cast to the schema exactly (column order, types) and enforce its non-null columns."""
    try:
        table = table.select(target.names).cast(target)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ContractViolation(f"{what} table does not fit the schema ({exc})") from None
    for f in target:
        if not f.nullable and table.column(f.name).null_count:
            raise ContractViolation(f"{what} column {f.name} has nulls")
    return table


# --- value checks, the same for logs and exports ---------------------------------------


def check_values(
    episodes: pa.Table, steps: pa.Table, cell: CellParams, params: IngestParams
) -> None:
    """No NaN or inf in any numeric column; no joint reading beyond the gantry's travel.

    A reading beyond cell.safety.joint_limit_m + ingest.joint_limit_margin_m is not a
    position this gantry can be in (its mechanical travel ends there): a broken encoder or
    wrong units, so the file is quarantined. validate.joint_reading_margin_m is the tighter,
    per-batch expectation that the validate stage reports on.
    """
    for table, what in ((steps, "steps"), (episodes, "episodes")):
        for name in table.schema.names:
            matrix, valid = _numeric_matrix(table.column(name))
            if matrix is None or not np.issubdtype(matrix.dtype, np.floating):
                continue
            bad = ~np.isfinite(matrix).all(axis=1) & valid
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                value = matrix[row][~np.isfinite(matrix[row])][0]
                raise ContractViolation(
                    f"non-finite value ({value}) in {what}.{name} {_row_name(table, row)}"
                )
    limit = cell.safety.joint_limit_m + params.joint_limit_margin_m
    position, _ = _numeric_matrix(steps.column("joint_position"))
    beyond = np.abs(position) > np.float32(limit)
    if beyond.any():
        row, axis = (int(i) for i in np.argwhere(beyond)[0])
        raise ContractViolation(
            f"joint reading beyond the gantry's travel: {schema.JOINT_NAMES[axis]} = "
            f"{float(position[row, axis]):.4f} m {_row_name(steps, row)} (limit ±{limit:g} m = "
            "cell.safety.joint_limit_m + ingest.joint_limit_margin_m)"
        )


def _row_name(table: pa.Table, row: int) -> str:
    episode_id = table.column("episode_id")[row].as_py()
    if "step" in table.schema.names:
        return f"at step {table.column('step')[row].as_py()} of episode {episode_id}"
    return f"of episode {episode_id}"


def _numeric_matrix(column) -> tuple[np.ndarray | None, np.ndarray]:
    """(values as an (n, k) array with zeros in null rows, validity), or (None, ...) for a
    column that is not numeric or a vector of numbers."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(array)
    valid = np.ones(n, dtype=bool)
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
    kind = array.type
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        values = array.values.slice(array.offset * size, n * size)
        if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
            return None, valid
        matrix = values.to_numpy(zero_copy_only=False).reshape(n, size)
    elif pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        matrix = array.to_numpy(zero_copy_only=False).reshape(n, 1)
    elif pa.types.is_timestamp(kind):
        matrix = array.cast(pa.int64()).to_numpy(zero_copy_only=False).reshape(n, 1)
    else:
        return None, valid
    if not valid.all():
        matrix = matrix.copy()
        matrix[~valid] = 0
    return matrix, valid
