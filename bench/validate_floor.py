"""The floor of `bench.validate`: the suites' checks written directly with pyarrow.compute
(and numpy where pyarrow has no kernel), counting offending rows per check under the same
keys as the suites' results (table.column:kind:severity), so the two can be compared check by
check and timed against each other.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc


def pyarrow_checks(
    episodes: pa.Table, steps: pa.Table, batch: str, cell, params, captures: Path, store: Path
) -> dict[str, int]:
    """Offending rows per check, keyed like `suite_counts` (table.column:kind:severity)."""
    v, dt = params, cell.dt
    out = _not_null_counts(episodes, steps)
    ids, within = _episode_runs(steps)
    out |= _step_checks(episodes, steps, ids, within, cell, v, dt)
    out |= _episode_aggregate_checks(episodes, steps, ids, within)
    out |= _episode_checks(episodes, batch, v, dt)
    out |= _capture_checks(episodes, captures, store)
    return out


def _not_null_counts(episodes: pa.Table, steps: pa.Table) -> dict[str, int]:
    from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA

    out: dict[str, int] = {}
    for table, name, schema in (
        ("episodes", episodes, EPISODES_SCHEMA),
        ("steps", steps, STEPS_SCHEMA),
    ):
        for field in schema:
            if not field.nullable:
                out[f"{table}.{field.name}:not_be_null:critical"] = _nulls(name, field.name)
    return out


def _episode_runs(steps: pa.Table):
    """The steps' episode ids, and which rows continue the episode of the row before."""
    ids = steps.column("episode_id").combine_chunks()
    boundary = pc.fill_null(pc.not_equal(ids[1:], ids[:-1]), True)
    if 1 + _count(boundary) != pc.count_distinct(ids, mode="all").as_py():
        raise ValueError("the floor expects each episode's steps to be consecutive")
    within = pa.concat_arrays([pa.array([False]), pc.invert(boundary)])
    return ids, within


def _step_checks(episodes, steps, ids, within, cell, v, dt) -> dict[str, int]:
    """steps: per-episode order, advances, physics"""
    out: dict[str, int] = {}
    put = functools.partial(_put, out)
    step = steps.column("step").combine_chunks()
    time_s = steps.column("time_s").combine_chunks()
    step_adv = pc.pairwise_diff(step)
    time_adv = pc.pairwise_diff(time_s)
    error = pc.subtract(time_adv, pc.multiply(pc.cast(step_adv, pa.float64()), dt))
    put("steps.step_advance:be_between:critical", pc.and_(within, pc.not_equal(step_adv, 1)))
    put("steps.time_advance_s:be_between:critical", pc.and_(within, pc.less_equal(time_adv, 0)))
    limit, jitter = v.max_time_step_error_s, v.time_step_tolerance_s
    put(
        "steps.time_step_error_s:be_between:critical",
        pc.and_(within, _outside(error, -limit, limit)),
    )
    put(
        "steps.time_step_error_s:be_between:warning",
        pc.and_(within, _outside(error, -jitter, jitter)),
    )
    put("steps.step:be_between:critical", _outside(step, 0, v.max_steps - 1))
    put("steps.time_s:be_between:critical", pc.less(time_s, 0))
    put(
        "steps.part_confidence:be_between:critical",
        _outside(steps.column("part_confidence"), 0, 1),
    )
    for name in ("action", "corrected_action"):
        put(
            f"steps.{name}:be_between:critical",
            _vector_rows(steps.column(name), lambda x: _outside(x, -1, 1)),
        )
    joint = cell.safety.joint_limit_m + v.joint_reading_margin_m
    put(
        "steps.joint_position:be_between:critical",
        _vector_rows(steps.column("joint_position"), lambda x: _outside(x, -joint, joint)),
    )
    put(
        "steps.episode_listed:be_in_set:critical",
        pc.invert(pc.is_in(ids, value_set=episodes.column("episode_id").combine_chunks())),
    )
    out |= _correction_checks(steps, v)
    return out


def _correction_checks(steps: pa.Table, v) -> dict[str, int]:
    out: dict[str, int] = {}
    put = functools.partial(_put, out)
    intervention = steps.column("intervention")
    corrected = steps.column("corrected_action")
    has_correction = pc.invert(pc.or_(pc.is_null(corrected), _vector_rows(corrected, pc.is_nan)))
    put(
        "steps.correction_iff_intervention:be_in_set:critical",
        pc.and_(pc.is_valid(intervention), pc.not_equal(has_correction, intervention)),
    )
    on = pc.and_(pc.fill_null(intervention, False), has_correction)
    # A null vector keeps its slots in the child array: compare the children directly.
    commanded = steps.column("action").combine_chunks().values
    operator = corrected.combine_chunks()
    operator = operator.values.slice(operator.offset * 2, len(operator) * 2)
    gap = _vector_rows(
        pa.FixedSizeListArray.from_arrays(pc.abs(pc.subtract(commanded, operator)), 2),
        lambda x: pc.greater(x, v.action_match_tolerance),
    )
    put("steps.correction_gap:be_between:warning", pc.and_(on, gap))
    return out


def _episode_aggregate_checks(episodes, steps, ids, within) -> dict[str, int]:
    """episodes: per-episode aggregates of the steps"""
    out: dict[str, int] = {}
    put = functools.partial(_put, out)
    step = steps.column("step").combine_chunks()
    intervention = steps.column("intervention")
    takeover = pc.and_(
        pc.fill_null(intervention, False),
        pc.invert(
            pc.and_(
                within,
                pa.concat_arrays(
                    [pa.array([False]), pc.fill_null(intervention, False).combine_chunks()[:-1]]
                ),
            )
        ),
    )
    per_episode = (
        pa.table({"episode_id": ids, "step": step, "takeover": pc.cast(takeover, pa.int64())})
        .group_by("episode_id")
        .aggregate([("step", "count"), ("step", "min"), ("takeover", "sum")])
    )
    at = pc.index_in(episodes.column("episode_id"), value_set=per_episode.column("episode_id"))
    rows = pc.fill_null(pc.take(per_episode.column("step_count"), at), 0)
    first = pc.take(per_episode.column("step_min"), at)
    runs = pc.fill_null(pc.take(per_episode.column("takeover_sum"), at), 0)
    e = episodes
    n_steps = e.column("steps")
    put("episodes.steps:column_pair_values_to_be_equal:critical", pc.not_equal(n_steps, rows))
    put("episodes.first_step:be_between:critical", pc.not_equal(first, 0))
    put(
        "episodes.interventions:column_pair_values_to_be_equal:warning",
        pc.not_equal(e.column("interventions"), runs),
    )
    return out


def _episode_checks(e: pa.Table, batch: str, v, dt) -> dict[str, int]:
    """episodes: identity, source, counts, cycle time, outcome"""
    from pipelines.quality import EPISODE_ID_PATTERN

    out: dict[str, int] = {}
    put = functools.partial(_put, out)
    n_steps = e.column("steps")
    counts = pc.value_counts(e.column("episode_id"))
    repeated = pc.filter(counts.field("counts"), pc.greater(counts.field("counts"), 1))
    out["episodes.episode_id:be_unique:critical"] = int(pc.sum(repeated).as_py() or 0)
    put(
        "episodes.episode_id_well_formed:be_in_set:critical",
        pc.invert(pc.match_substring_regex(e.column("episode_id"), EPISODE_ID_PATTERN)),
    )
    put("episodes.source_sha256:be_in_set:critical", pc.not_equal(e.column("source_sha256"), batch))
    put("episodes.steps:be_between:critical", _outside(n_steps, v.min_steps, v.max_steps))
    put("episodes.safety_stops:be_between:critical", _outside(e.column("safety_stops"), 0, 1))
    cycle = pc.cast(e.column("cycle_time_s"), pa.float64())
    tol = v.cycle_time_tolerance_s
    cycle_error = pc.subtract(cycle, pc.multiply(pc.cast(n_steps, pa.float64()), dt))
    put("episodes.cycle_time_error_s:be_between:critical", _outside(cycle_error, -tol, tol))
    put(
        "episodes.cycle_time_s:be_between:critical",
        _outside(cycle, v.min_steps * dt - tol, v.max_steps * dt + tol),
    )
    out |= _episode_label_checks(e)
    return out


def _episode_label_checks(e: pa.Table) -> dict[str, int]:
    """episodes: outcome, failure and stop labels, edge-case flags, part extent"""
    from pipelines.quality import FAILURE_CAUSES, SAFETY_STOP_KINDS

    out: dict[str, int] = {}
    put = functools.partial(_put, out)
    cause, kind = e.column("failure_cause"), e.column("safety_stop_kind")
    put(
        "episodes.outcome_consistent:be_in_set:critical",
        pc.not_equal(e.column("success"), pc.is_null(cause)),
    )
    put(
        "episodes.failure_cause:be_in_set:warning",
        pc.and_(pc.is_valid(cause), pc.invert(pc.is_in(cause, value_set=pa.array(FAILURE_CAUSES)))),
    )
    put(
        "episodes.safety_stop_kind:be_in_set:warning",
        pc.and_(
            pc.is_valid(kind), pc.invert(pc.is_in(kind, value_set=pa.array(SAFETY_STOP_KINDS)))
        ),
    )
    put(
        "episodes.stop_kind_consistent:be_in_set:warning",
        pc.not_equal(pc.greater(e.column("safety_stops"), 0), pc.is_valid(kind)),
    )
    listed = pc.greater(pc.fill_null(pc.list_value_length(e.column("edge_case_reasons")), 0), 0)
    put(
        "episodes.edge_case_consistent:be_in_set:warning",
        pc.not_equal(e.column("edge_case"), listed),
    )
    extent = e.column("part_extent_m")
    extent_nan = _vector_rows(extent, pc.is_nan)
    put(
        "episodes.part_extent_m:be_between:warning",
        pc.and_(pc.invert(extent_nan), _vector_rows(extent, lambda x: pc.less_equal(x, 0))),
    )
    return out


def _capture_checks(e: pa.Table, captures: Path, store: Path) -> dict[str, int]:
    """captures: the same sidecar and attachment reading as the suite (file I/O, not checks)"""
    from pipelines.quality import CAPTURE_REASONS
    from pipelines.quality.validate.frames import captures_frame as _captures_frame

    out: dict[str, int] = {}
    frame = _captures_frame(e, set(e.schema.names), captures, store)
    for column in ("attachments_stored",):
        out[f"captures.{column}:be_in_set:critical"] = int((frame[column] == False).sum())  # noqa: E712
    for column in (
        "has_sidecar",
        "in_dataset",
        "step_in_episode",
        "sidecar_consistent",
        "attachments_listed",
    ):
        out[f"captures.{column}:be_in_set:warning"] = int((frame[column] == False).sum())  # noqa: E712
    known = frame["reason"].isin(CAPTURE_REASONS) | frame["reason"].isna()
    out["captures.reason:be_in_set:warning"] = int((~known).sum())
    return out


# The floor's small tools: a mask's count, a range test, a vector column's rows.


def _count(mask) -> int:
    return int(pc.sum(pc.fill_null(mask, False)).as_py() or 0)


def _put(out: dict[str, int], key: str, mask) -> None:
    out[key] = _count(mask)


def _outside(values, low, high):
    return pc.or_(pc.less(values, low), pc.greater(values, high))


def _vector_rows(column, test):
    """Rows of a vector column where `test` holds for any component (null rows: no)."""
    flat = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    size = flat.type.list_size
    values = flat.values.slice(flat.offset * size, len(flat) * size)
    hits = pc.fill_null(test(values), False).to_numpy(zero_copy_only=False)
    hits = hits.reshape(len(flat), size)
    rows = hits[:, 0].copy()
    for axis in range(1, size):  # numpy reduces a short last axis slowly
        rows |= hits[:, axis]
    return pa.array(rows & flat.is_valid().to_numpy(zero_copy_only=False))


def _nulls(table, name):
    column = table.column(name)
    if pa.types.is_fixed_size_list(column.type):
        return _count(pc.or_(pc.is_null(column), _vector_rows(column, pc.is_nan)))
    if pa.types.is_floating(column.type):
        return _count(pc.is_null(column, nan_is_null=True))
    return column.null_count
