"""The cached per-batch results, under a fingerprint of what they were checked against.

    <dataset>/../validation/batches/<sha256>/<suites>/result.json   one batch's verdict
    <dataset>/../validation/batches/<sha256>/<suites>/gx.json       GX's validation results
    <dataset>/../validation/batches/<sha256>/<suites>/<suite>.html  GX's Data Docs page per suite
    <dataset>/../validation/suites/<suites>/realloop-<suite>.html    GX's page of each suite

`<suites>` is a fingerprint of the suites' code, this package's code, the contract and the
limits: a batch's files never change, so a result stored under it is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from pipelines.contract import schema
from pipelines.contract.params import CellParams, ValidateParams
from pipelines.quality.validate.results import BatchResult

SUITES = ("episodes", "steps", "captures")
VALIDATION_DIR = "validation"  # next to the dataset folder, like ingest's manifest
BATCHES_DIR = "batches"
SUITES_DIR = "suites"
_SOURCES = (  # what the fingerprint covers besides the limits
    Path(__file__).resolve().parents[1] / "expectations",
    Path(__file__).resolve().parent,  # this package: the checks and how results are read
    Path(schema.__file__).resolve(),
)


def suite_name(table: str) -> str:
    """The GX suite of a table, as GX's pages and paths name it."""
    return f"realloop-{table}"


def validation_root(dataset: Path) -> Path:
    return Path(dataset).parent / VALIDATION_DIR


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
    """Identifies what a stored result was checked against: the suites' and this package's
    code, the contract, the limits and the GX version. Computed without importing GX."""
    digest = hashlib.sha256()
    for source in _SOURCES:
        for path in sorted(source.glob("*.py")) if source.is_dir() else [source]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(json.dumps(suite_parameters(cell, params), sort_keys=True).encode())
    digest.update(metadata.version("great_expectations").encode())
    return digest.hexdigest()[:16]


def load_result(dataset: Path, batch: str, fingerprint: str) -> BatchResult | None:
    path = batch_folder(dataset, batch, fingerprint) / "result.json"
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


def store_result(
    dataset: Path, result: BatchResult, fingerprint: str, gx_results: dict, pages: dict
) -> BatchResult:
    """Write the batch's pages and GX results, then its result.json (last: it marks the
    stored result complete)."""
    folder = batch_folder(dataset, result.batch, fingerprint)
    folder.mkdir(parents=True, exist_ok=True)
    for table, page in pages.items():
        write_atomically(folder / f"{table}.html", page)
    write_atomically(folder / "gx.json", json.dumps(gx_results, default=str))
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
    write_atomically(folder / "result.json", json.dumps(stored, indent=1))
    return result


def batch_folder(dataset: Path, batch: str, fingerprint: str) -> Path:
    return validation_root(dataset) / BATCHES_DIR / batch / fingerprint


def suite_pages_folder(dataset: Path, fingerprint: str) -> Path:
    """GX's page of each suite, as checked under `fingerprint`."""
    return validation_root(dataset) / SUITES_DIR / fingerprint


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
