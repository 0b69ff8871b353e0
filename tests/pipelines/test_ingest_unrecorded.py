"""A run killed between moving a log's tables into the dataset and writing its manifest line:
the next run writes the missing "ingested" line (pipelines/ingest/store.py:
record_unrecorded). tests/faults/test_worker_killed.py meets this window for real."""

from __future__ import annotations

import json

from pipelines.ingest.store import read_manifest, record_unrecorded
from tests.pipelines.test_ingest_helpers import copy_landing, ingest, recorded_shift


def test_a_published_but_unrecorded_log_gets_its_ingested_line_from_the_next_run(tmp_path, params):
    landing = copy_landing(recorded_shift(), tmp_path)
    first = ingest(tmp_path, landing, params, run_id="run-1")
    dataset = tmp_path / "dataset"
    rows = read_manifest(dataset)
    assert len([r for r in rows if r["result"] == "ingested"]) == len(first.ingested) >= 2
    lost = next(r for r in rows if r["result"] == "ingested")
    manifest = dataset.parent / "ingest-manifest.jsonl"  # as if the kill came before its line:
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows if r is not lost))

    second = ingest(tmp_path, landing, params, run_id="run-2")
    assert second.ingested == []  # nothing ingested again
    rows = read_manifest(dataset)
    (recovered,) = [r for r in rows if r["run_id"] == "run-2" and r["result"] == "ingested"]
    assert recovered["result"] == "ingested" and recovered["sha256"] == lost["sha256"]
    assert (recovered["episodes"], recovered["steps"]) == (lost["episodes"], lost["steps"])
    assert recovered["source"] == lost["source"]
    assert record_unrecorded(dataset, "run-3") == []  # once recorded, never again
