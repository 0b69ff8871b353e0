"""The captures suite (sidecars and attachments), and a real recorded shift end to end."""

from __future__ import annotations

import hashlib
import json

import pytest

from pipelines.quality.validate import validate_batch, validate_dataset
from tests.pipelines.test_ingest_helpers import copy_landing, ingest, recorded_shift
from tests.pipelines.test_validate import GOOD, columns, tables

EPISODE = "cell-07-20260101T060000Z-00000"
OTHER = "cell-07-20260101T060000Z-00001"


def png(tag: str) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + tag.encode() * 40


@pytest.fixture
def captured(tmp_path):
    """A batch whose first episode has two captures, their sidecars and snapshots in the
    landing folder and the snapshots in the dataset's attachment store."""
    landing, store = tmp_path / "captures", tmp_path / "attachments"
    landing.mkdir()
    store.mkdir()
    episodes, steps = columns()
    shas = []
    for step, reason in ((2, "operator_flag"), (6, "low_confidence")):
        name = f"{EPISODE}_{reason}"
        snapshot = png(reason)
        (landing / f"{name}.png").write_bytes(snapshot)
        shas.append(hashlib.sha256(snapshot).hexdigest())
        (store / f"{shas[-1]}.png").write_bytes(snapshot)
        sidecar = {
            "reason": reason,
            "time": f"2026-01-01T06:00:0{step // 2}.000000+00:00",
            "log_time_ns": 1767247200000000000 + step * 50_000_000,
            "episode_id": EPISODE,
            "step": step,
            "operator_note": "",
            "cell_id": "cell-07",
            "source_log": "cell-07_20260101T060000Z_0000.mcap",
            "attachments": [f"{name}.png"],
        }
        (landing / f"{name}.json").write_text(json.dumps(sidecar))
    episodes["edge_case"][0] = True
    episodes["edge_case_reasons"][0] = ["operator_flag", "low_confidence"]
    episodes["attachments"][0] = shas
    return episodes, steps, landing, store


def check(params, episodes, steps, landing, store):
    return validate_batch(
        *tables(episodes, steps), GOOD, params.cell, params.validate, landing, store
    )


def test_captures_with_sidecars_and_stored_attachments_pass(params, captured):
    result = check(params, *captured)
    assert result.passed and result.warnings == [], (result.failures, result.warnings)
    assert result.details["captures"] == 2


def test_broken_captures_are_reported_by_severity(params, captured):
    episodes, steps, landing, store = captured
    # The dataset lists a snapshot whose stored copy is corrupt: provenance broken, critical.
    corrupt = store / f"{episodes['attachments'][0][1]}.png"
    corrupt.write_bytes(b"not the snapshot")
    # The operator_flag sidecar names a step beyond its 10-step episode, and another cell.
    sidecar = landing / f"{EPISODE}_operator_flag.json"
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps(meta | {"step": 50, "cell_id": "cell-99"}))
    # The low_confidence sidecar never arrived.
    (landing / f"{EPISODE}_low_confidence.json").unlink()
    # A capture of the second episode landed after ingest, with a reason nobody knows.
    (landing / f"{OTHER}_gremlin.png").write_bytes(png("gremlin"))
    late = meta | {
        "episode_id": OTHER,
        "reason": "gremlin",
        "attachments": [f"{OTHER}_gremlin.png"],
    }
    (landing / f"{OTHER}_gremlin.json").write_text(json.dumps(late))

    result = check(params, episodes, steps, landing, store)
    assert not result.passed
    assert result.failures == [
        "captures.attachments: 2 captures whose episode lists an attachment missing from the "
        f"dataset or corrupt; first: {EPISODE}"
    ]
    assert [w.split("; first:")[0] for w in result.warnings] == [
        "captures.attachments: 1 captures whose attachment files are missing or not listed "
        "with their episode",
        "captures.reason: 1 captures in the landing folder that their episode does not list "
        "(landed after ingest?) (e.g. gremlin)",
        "captures.reason: 1 captures with a reason outside low_confidence, operator_flag, "
        "safety_stop, near_failure, retry, ood, novel_part, rollback (e.g. gremlin)",
        "captures.reason: 1 captures without their JSON sidecar in the landing folder "
        "(e.g. low_confidence)",
        "captures.sidecar: 1 sidecars with a wrong cell, time, step or log time",
        "captures.step: 1 captures whose step lies outside their episode",
    ]


def test_without_a_captures_folder_the_sidecar_checks_are_not_made(params, captured):
    episodes, steps, _, store = captured
    result = check(params, episodes, steps, None, store)
    assert result.passed and result.warnings == []


def test_a_recorded_shift_passes_every_expectation(params, tmp_path):
    landing = copy_landing(recorded_shift(), tmp_path)
    ingest(tmp_path, landing, params)
    report = validate_dataset(
        tmp_path / "dataset", params.cell, params.validate, captures=landing / "captures"
    )
    assert report.failed_batches == [] and len(report.batches) >= 1
    for batch in report.batches:
        assert batch.warnings == [], batch.warnings
    assert sum(b.details["captures"] for b in report.batches) > 0
    assert (tmp_path / "validation" / "unversioned" / "index.html").is_file()
