"""Re-admissions: a person says why a batch that failed a critical expectation may be
trained on; `<dataset>/../validation/admissions.jsonl` keeps every one, append-only."""

from __future__ import annotations

import getpass
import json
import os
import socket
from datetime import UTC, datetime
from pathlib import Path

from pipelines.contract.params import CellParams, ValidateParams
from pipelines.quality.validate.stored import load_result, suite_fingerprint, validation_root

ADMISSIONS_FILE = "admissions.jsonl"


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
