"""A log written in place (as rosbag2 writes: the file grows where it lands and gets its
footer when closed) is left alone while open, quarantined only once abandoned, and taken back
from quarantine when its writer finishes it after all."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipelines.ingest.quarantine import REASON_SUFFIX
from pipelines.ingest.store import read_manifest
from tests.pipelines.test_ingest_helpers import abandoned, ingest, recorded_shift


@pytest.fixture(scope="module")
def log_bytes() -> bytes:
    return sorted(recorded_shift()[0].glob("*.mcap"))[0].read_bytes()


def landing_with_open_log(tmp_path: Path, data: bytes) -> Path:
    """A landing folder whose one log has been written up to half its bytes so far."""
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "shift.mcap").write_bytes(data[: len(data) // 2])
    return landing


def test_a_log_being_written_waits_until_it_is_closed(log_bytes, params, tmp_path):
    landing = landing_with_open_log(tmp_path, log_bytes)
    first = ingest(tmp_path, landing, params, "run-1")
    assert (first.ingested, first.quarantined) == ([], [])
    assert [Path(w["source"]).name for w in first.waiting] == ["shift.mcap"]
    assert "still being written" in first.waiting[0]["reason"]
    assert (landing / "shift.mcap").exists() and not (tmp_path / "quarantine").exists()
    assert read_manifest(tmp_path / "dataset") == []  # it has not landed yet
    with open(landing / "shift.mcap", "ab") as writer:  # the writer finishes and closes it
        writer.write(log_bytes[len(log_bytes) // 2 :])
    second = ingest(tmp_path, landing, params, "run-2")
    assert [Path(f["source"]).name for f in second.ingested] == ["shift.mcap"]
    assert second.waiting == []


def test_a_log_abandoned_past_stale_after_s_is_quarantined_as_truncated(
    log_bytes, params, tmp_path
):
    landing = landing_with_open_log(tmp_path, log_bytes)
    abandoned(landing / "shift.mcap", hours=params.ingest.stale_after_s / 3600 + 0.01)
    report = ingest(tmp_path, landing, params)
    assert [q["reason"][:14] for q in report.quarantined] == ["truncated MCAP"]
    assert report.waiting == []


def test_a_quarantined_log_its_writer_finished_is_ingested(log_bytes, params, tmp_path):
    landing = landing_with_open_log(tmp_path, log_bytes)
    abandoned(landing / "shift.mcap")
    assert len(ingest(tmp_path, landing, params, "run-1").quarantined) == 1
    moved = tmp_path / "quarantine" / "shift.mcap"
    with open(moved, "ab") as writer:  # the writer held the file open through the move
        writer.write(log_bytes[len(log_bytes) // 2 :])
    abandoned(moved, hours=0.01)  # and closed it a while ago
    report = ingest(tmp_path, landing, params, "run-2")
    assert [Path(f["source"]).name for f in report.ingested] == ["shift.mcap"]
    assert not moved.exists() and not moved.with_name(moved.name + REASON_SUFFIX).exists()


def test_a_closed_log_still_changing_within_settle_s_waits(log_bytes, params, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    log = landing / "shift.mcap"
    log.write_bytes(log_bytes)
    # A writer that touches the file again right after its footer (a reindex, a copy tool
    # setting times): the file changes during the settle time.
    toucher = threading.Timer(params.ingest.settle_s / 4, lambda: log.write_bytes(log_bytes))
    toucher.start()
    report = ingest(tmp_path, landing, params, "run-1")
    toucher.join()
    assert [w["reason"][:30] for w in report.waiting] == ["closed but still changing with"]
    later = ingest(tmp_path, landing, params, "run-2")  # unchanged since: ingested
    assert [Path(f["source"]).name for f in later.ingested] == ["shift.mcap"]
