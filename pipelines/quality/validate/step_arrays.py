"""The steps table checked vectorized (pyarrow/numpy): full arrays, per-step derived
columns and per-episode aggregates, the extremes GX checks, and exact counts of what fails.

GX never walks the steps table: its per-row work is slow on millions of rows. It checks the
extremes (per column its min, its max and a null if it has any), which pass exactly when
every step does (pipelines/quality/expectations/steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.schema import STEPS_SCHEMA


def matrix(column: pa.ChunkedArray | pa.Array, size: int) -> np.ndarray:
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


def floats(column: pa.ChunkedArray) -> np.ndarray:
    """A numeric column as float64, NaN where null."""
    return column.cast(pa.float64()).to_numpy()


@dataclass
class StepArrays:
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
    ) -> StepArrays:
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
                columns[field_.name] = matrix(column, field_.type.list_size)
                nulls[field_.name] = rows_any(np.isnan(columns[field_.name]))
            elif pa.types.is_boolean(field_.type):
                nulls[field_.name] = column.is_null().to_numpy()
                columns[field_.name] = pc.fill_null(column, False).to_numpy()
            elif pa.types.is_string(field_.type):
                nulls[field_.name] = column.is_null().to_numpy()
            else:
                columns[field_.name] = floats(column)
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
            return outside(values, kwargs)
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


def outside(values: np.ndarray, kwargs: dict) -> np.ndarray:
    """Values outside an expect_column_values_to_be_between's bounds (NaN is not counted)."""
    bad = np.zeros(values.shape, bool)
    low, high = kwargs.get("min_value"), kwargs.get("max_value")
    with np.errstate(invalid="ignore"):  # NaN compares False
        if low is not None:
            bad |= values <= low if kwargs.get("strict_min") else values < low
        if high is not None:
            bad |= values >= high if kwargs.get("strict_max") else values > high
    return bad


def rows_any(mask: np.ndarray) -> np.ndarray:
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
