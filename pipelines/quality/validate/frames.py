"""The episodes and captures frames GX checks row by row, with the same counts as the steps.

Episodes get per-episode aggregates of the steps joined on; captures are each reason an
episode lists, joined with its JSON sidecar and checked against the attachment store.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.schema import EPISODES_SCHEMA
from pipelines.quality.expectations import captures as captures_suite
from pipelines.quality.expectations import episodes as episode_suite
from pipelines.quality.validate.step_arrays import StepArrays, floats, matrix, outside

_SIDECAR_NAME = re.compile(r"^(?P<episode>.+-\d{8}T\d{6}Z-\d{5})_.+\.json$")


class FrameRows:
    """A frame GX checks row by row (episodes, captures), and the same counts as StepArrays."""

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
            return outside(pd.to_numeric(series, errors="coerce").to_numpy(float), kwargs)
        return None

    def describe(self, row: int) -> str:
        return str(self._frame["episode_id"].iloc[row]) if "episode_id" in self._frame else ""


# --- episodes and captures: GX row by row ----------------------------------------------------


def episodes_frame(
    episodes: pa.Table, present: set[str], steps: StepArrays, dt: float
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
            frame[field_.name] = matrix(column, field_.type.list_size).min(axis=1)
        elif pa.types.is_floating(field_.type) or pa.types.is_integer(field_.type):
            frame[field_.name] = floats(column) if column.null_count else _widened(column)
        else:
            frame[field_.name] = column.to_pandas()
    frame = pd.DataFrame(frame, index=pd.RangeIndex(episodes.num_rows))
    _derive_episode_columns(frame, episodes, present, steps, dt)
    return frame


def _widened(column: pa.ChunkedArray) -> np.ndarray:
    kind = pa.float64() if pa.types.is_floating(column.type) else pa.int64()
    return column.cast(kind).to_numpy()


def _derive_episode_columns(
    frame: pd.DataFrame, episodes: pa.Table, present: set[str], steps: StepArrays, dt: float
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


def captures_frame(
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
