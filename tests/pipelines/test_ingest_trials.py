"""Trial logs: the trial's request, arm and attempt go from the log's metadata (or an export's
columns) into the episodes table; production logs leave them null; older datasets still read."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.contract import schema
from pipelines.ingest.digests import episode_digests
from pipelines.ingest.store import read_dataset, sha256_file
from tests.pipelines.test_ingest_helpers import (
    EPISODES,
    export_table,
    good_logs,
    ingest,
    raw_copy,
    recorded_shift,
    write_jsonl_export,
    write_parquet_export,
)

TRIAL = {
    "trial_request_id": "cell-07-20261203T101500Z-3f9a0c1d",
    "trial_arm": "candidate",
    "trial_attempt": "a1",
}


@pytest.fixture(scope="module")
def logs() -> list[Path]:
    return good_logs(recorded_shift()[0])


def test_a_trial_log_fills_the_trial_columns_and_a_production_log_leaves_them_null(
    logs, params, tmp_path
):
    landing = tmp_path / "landing"
    landing.mkdir()
    trial = raw_copy(logs[0], landing / logs[0].name, cell_metadata=TRIAL)
    incumbent = raw_copy(
        logs[1], landing / logs[1].name, cell_metadata=TRIAL | {"trial_arm": "incumbent"}
    )
    production = raw_copy(logs[2], landing / logs[2].name)
    report = ingest(tmp_path, landing, params).as_dict()
    assert report["files_ingested"] == 3 and report["files_quarantined"] == 0
    dataset = tmp_path / "dataset"
    episodes, _ = read_dataset(dataset)
    assert episodes.schema.equals(schema.EPISODES_SCHEMA)
    rows, _ = read_dataset(dataset, [sha256_file(trial)])
    assert rows.num_rows and all(
        {k: r[k] for k in schema.TRIAL_COLUMNS} == TRIAL for r in rows.to_pylist()
    )
    rows, _ = read_dataset(dataset, [sha256_file(incumbent)])
    assert set(rows.column("trial_arm").to_pylist()) == {"incumbent"}
    rows, _ = read_dataset(dataset, [sha256_file(production)])
    for name in schema.TRIAL_COLUMNS:
        assert rows.column(name).null_count == rows.num_rows


@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        (
            TRIAL | {"trial_arm": "control"},
            "metadata 'realloop.cell': trial_arm 'control' is not one of candidate, incumbent",
        ),
        (
            {"trial_request_id": TRIAL["trial_request_id"], "trial_arm": "candidate"},
            "metadata 'realloop.cell': trial fields incomplete: trial_attempt missing or empty "
            "(a trial log names all of trial_request_id, trial_arm, trial_attempt)",
        ),
        (
            TRIAL | {"trial_request_id": ""},
            "metadata 'realloop.cell': trial fields incomplete: trial_request_id missing or "
            "empty (a trial log names all of trial_request_id, trial_arm, trial_attempt)",
        ),
    ],
)
def test_bad_trial_metadata_is_a_contract_violation(logs, params, tmp_path, metadata, reason):
    landing = tmp_path / "landing"
    landing.mkdir()
    raw_copy(logs[0], landing / "bad-trial.mcap", cell_metadata=metadata)
    report = ingest(tmp_path, landing, params)
    (entry,) = report.quarantined
    assert entry["reason"] == reason
    note = Path(entry["moved_to"]).with_name("bad-trial.mcap.reason.txt").read_text()
    assert note.splitlines()[0] == reason


def test_exports_carry_the_trial_columns_and_a_bad_arm_is_quarantined(logs, params, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    raw_copy(logs[0], landing / logs[0].name, cell_metadata=TRIAL)
    ingest(tmp_path / "first", landing, params)
    rows = export_table(*read_dataset(tmp_path / "first" / "dataset"))
    assert set(rows.column("trial_arm").to_pylist()) == {"candidate"}
    exports = tmp_path / "exports"
    exports.mkdir()
    write_jsonl_export(rows, exports / "trial.jsonl")
    renamed = rows.set_column(
        rows.schema.get_field_index("episode_id"),
        "episode_id",
        pa.array([f"{e}-x" for e in rows.column("episode_id").to_pylist()]),
    )
    arm = renamed.schema.get_field_index("trial_arm")
    bad = renamed.set_column(arm, "trial_arm", pa.array(["both"] * rows.num_rows))
    write_parquet_export(bad, exports / "bad-arm.parquet")
    report = ingest(tmp_path / "second", exports, params).as_dict()
    (quarantined,) = report["quarantined"]
    first_id = bad.column("episode_id")[0].as_py()
    assert quarantined["reason"] == (
        f"episode {first_id}: trial_arm 'both' is not one of candidate, incumbent"
    )
    episodes, _ = read_dataset(tmp_path / "second" / "dataset")
    assert {tuple(r[k] for k in schema.TRIAL_COLUMNS) for r in episodes.to_pylist()} == {
        tuple(TRIAL.values())
    }


def old_format(dataset: Path) -> None:
    """Rewrite every episodes file as ingest wrote it before the trial columns existed."""
    for path in (dataset / "episodes").glob("*.parquet"):
        table = pq.read_table(path)
        pq.write_table(table.drop_columns(list(schema.TRIAL_COLUMNS)), path, compression="zstd")


def test_a_dataset_written_before_the_trial_columns_still_reads_and_validates(
    logs, params, tmp_path
):
    from pipelines.quality.validate import run as validate

    landing = tmp_path / "landing"
    landing.mkdir()
    for log in logs:
        raw_copy(log, landing / log.name)
    ingest(tmp_path, landing, params)
    dataset = tmp_path / "dataset"
    new_episodes, steps = read_dataset(dataset)
    old_format(dataset)
    episodes, _ = read_dataset(dataset)
    assert episodes.num_rows == EPISODES and episodes.schema.equals(schema.EPISODES_SCHEMA)
    assert episodes.column("trial_arm").null_count == EPISODES
    assert episodes.equals(new_episodes)
    # An episode's content digest is the one it had before the columns existed, so the
    # episode index of an older dataset still recognises its episodes.
    without = new_episodes.drop_columns(list(schema.TRIAL_COLUMNS))
    assert episode_digests(without, steps) == episode_digests(new_episodes, steps)
    again = ingest(tmp_path, landing, params, run_id="run-2").as_dict()
    assert again["files_skipped"] == len(logs) and again["files_quarantined"] == 0
    # Validation reads a batch as it is on disk: the missing trial columns are nulls there.
    batch = sha256_file(landing / logs[0].name)
    old = validate._read_table(dataset / "episodes" / f"{batch}.parquet", schema.EPISODES_SCHEMA)
    assert old.schema.names == schema.EPISODES_SCHEMA.names
    batch_steps = pq.read_table(dataset / "steps" / f"{batch}.parquet")
    steps_table = validate._read_table(dataset / "steps" / f"{batch}.parquet", schema.STEPS_SCHEMA)
    assert steps_table.num_rows == batch_steps.num_rows
    result = validate.validate_batch(old, steps_table, batch, params.cell, params.validate)
    assert result.passed, result.failures
