"""GX's results made readable: exact counts filled in for the Data Docs, and one line per
failed expectation, by severity.

GX only decides pass or fail (BOOLEAN_ONLY: its counting doubles its cost). For a failed
expectation realloop counts the offending rows exactly, per vector axis, names the first
one, and fills the counts into GX's results for the Data Docs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipelines.quality.expectations.common import CRITICAL, WARNING
from pipelines.quality.validate.frames import FrameRows
from pipelines.quality.validate.step_arrays import StepArrays, rows_any

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


_COUNTED = {  # expectation types whose results carry row counts
    "expect_column_values_to_not_be_null",
    "expect_column_values_to_be_between",
    "expect_column_values_to_be_in_set",
    "expect_column_values_to_be_unique",
    "expect_column_pair_values_to_be_equal",
}


def fill_counts(gx_result: dict, found: StepArrays | FrameRows) -> None:
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
            rows = rows_any(bad)
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


def result_lines(
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


def _count_line(label: str, broke: str, config: dict, found: StepArrays | FrameRows) -> str:
    """`<table>.<column>: <count> <what broke> (<per axis>); first: <where>`."""
    bad = found.offending(config)
    if bad is None:
        return f"{label}: {broke}"
    rows = rows_any(bad)
    line = f"{label}: {int(rows.sum())} {broke}"
    axes = VECTOR_AXES.get(config["kwargs"].get("column"))
    if bad.ndim == 2 and axes:
        per_axis = zip(axes, bad.sum(axis=0), strict=True)
        detail = ", ".join(f"{axis}: {int(n)}" for axis, n in per_axis if n)
        line += f" ({detail})"
    line += _examples(found, config, rows)
    where = found.describe(int(np.argmax(rows))) if rows.any() else ""
    return line + (f"; first: {where}" if where else "")


def _examples(found: StepArrays | FrameRows, config: dict, rows: np.ndarray) -> str:
    """Up to three values of the offending episodes (or captures) in the column a failure is
    reported under (an unknown failure cause, a malformed id, a step count)."""
    if not isinstance(found, FrameRows) or not rows.any():
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
