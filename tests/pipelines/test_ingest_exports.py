"""JSONL and Parquet exports that follow the data contract ingest to the same tables."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.contract import schema
from pipelines.ingest.digests import episode_digests
from pipelines.ingest.exports import EXPORT_SCHEMA
from pipelines.ingest.landing import ingest_file
from pipelines.ingest.report import IngestReport
from pipelines.ingest.store import RUN_COLUMNS, read_dataset, sha256_file
from tests.pipelines.test_ingest_helpers import (
    EPISODES,
    copy_landing,
    export_table,
    good_logs,
    ingest,
    recorded_shift,
    write_jsonl_export,
    write_parquet_export,
)

WHERE_FROM = {"source_uri", "source_sha256", "source_chunk", *RUN_COLUMNS}


@pytest.fixture(scope="module")
def from_logs(params, tmp_path_factory):
    """The shift's logs ingested the usual way, and each log's tables."""
    tmp = tmp_path_factory.mktemp("logs")
    landing = copy_landing(recorded_shift(), tmp)
    ingest(tmp, landing, params)
    per_log = [read_dataset(tmp / "dataset", [sha256_file(p)]) for p in good_logs(landing)]
    return tmp, landing, per_log


def by_episode(table: pa.Table) -> list[dict]:
    keep = [n for n in table.schema.names if n not in WHERE_FROM]
    return sorted(table.select(keep).to_pylist(), key=lambda r: (r["episode_id"], r.get("step")))


def test_exports_ingest_to_the_same_tables_with_provenance(from_logs, params, tmp_path):
    _, log_landing, per_log = from_logs
    landing = tmp_path / "landing"
    (landing / "captures").mkdir(parents=True)
    for sidecar in (log_landing / "captures").iterdir():  # the same edge-case captures
        (landing / "captures" / sidecar.name).write_bytes(sidecar.read_bytes())
    write_jsonl_export(export_table(*per_log[0]), landing / "export-0.jsonl")
    write_parquet_export(export_table(*per_log[1]), landing / "export-1.parquet")
    report = ingest(tmp_path, landing, params).as_dict()
    assert report["files_ingested"] == 2 and report["files_quarantined"] == 0
    for name, (episodes, steps) in zip(
        ("export-0.jsonl", "export-1.parquet"), per_log[:2], strict=True
    ):
        sha = sha256_file(landing / name)
        got_episodes, got_steps = read_dataset(tmp_path / "dataset", [sha])
        assert by_episode(got_episodes) == by_episode(episodes)
        assert by_episode(got_steps) == by_episode(steps)
        assert episode_digests(got_episodes, got_steps) == episode_digests(episodes, steps)
        rows = got_episodes.to_pylist()
        assert {r["source_uri"] for r in rows} == {str((landing / name).resolve())}
        assert {r["source_sha256"] for r in rows} == {sha}
        assert all(r["ingest_run_id"] == "run-1" and r["realloop_version"] for r in rows)
        first = 0
        for row in rows:  # rows of an episode in the export file
            assert row["source_chunk"] == f"rows={first}-{first + row['steps'] - 1}"
            first += row["steps"]


def test_exports_of_episodes_already_ingested_change_nothing(from_logs, params, tmp_path):
    tmp, _, per_log = from_logs
    landing = tmp_path / "landing"
    landing.mkdir()
    write_jsonl_export(export_table(*per_log[0]), landing / "again.jsonl")
    write_parquet_export(export_table(*per_log[1]), landing / "again.parquet")
    before = {p: p.stat().st_mtime_ns for p in (tmp / "dataset").rglob("*.parquet")}
    report = ingest_landing_into(tmp, landing, params)
    assert report["files_ingested"] == 0 and report["files_skipped"] == 2
    for entry in report["skipped"]:
        assert entry["reason"].startswith("all 2 episodes already in the dataset with the same")
    assert {p: p.stat().st_mtime_ns for p in (tmp / "dataset").rglob("*.parquet")} == before
    episodes, _ = read_dataset(tmp / "dataset")
    assert episodes.num_rows == EPISODES


def ingest_landing_into(tmp: Path, landing: Path, params) -> dict:
    """Ingest `landing` into the dataset at `tmp` (whose own landing is elsewhere)."""
    results = [
        ingest_file(
            p,
            landing,
            tmp / "dataset",
            tmp / "quarantine",
            params.cell,
            params.ingest,
            "run-exports",
        )
        for p in sorted(landing.iterdir())
    ]
    return IngestReport.from_results("run-exports", results).as_dict()


def test_an_export_with_some_new_episodes_adds_only_those(from_logs, params, tmp_path):
    """A re-export that overlaps the dataset: the known episodes are left out, not doubled."""
    _, _, per_log = from_logs
    first = tmp_path / "first"
    first.mkdir()
    write_parquet_export(export_table(*per_log[0]), first / "part.parquet")
    ingest(tmp_path, first, params)
    both = pa.concat_tables([export_table(*per_log[0]), export_table(*per_log[1])])
    second = tmp_path / "second"
    second.mkdir()
    write_jsonl_export(both, second / "whole.jsonl")
    report = ingest(tmp_path, second, params, run_id="run-2").as_dict()
    (entry,) = report["ingested"]
    assert entry["episodes"] == per_log[1][0].num_rows and entry["steps"] == per_log[1][1].num_rows
    assert entry["reason"].startswith("2 of 4 episodes left out: already in the dataset")
    episodes, steps = read_dataset(tmp_path / "dataset")
    assert sorted(episodes.column("episode_id").to_pylist()) == sorted(
        per_log[0][0].column("episode_id").to_pylist()
        + per_log[1][0].column("episode_id").to_pylist()
    )
    assert steps.num_rows == per_log[0][1].num_rows + per_log[1][1].num_rows


def test_export_contract_violations_are_quarantined(from_logs, params, tmp_path):
    _, _, per_log = from_logs
    rows = export_table(*per_log[2])
    landing = tmp_path / "landing"
    landing.mkdir()
    write_parquet_export(rows.drop_columns(["part_pose"]), landing / "no-pose.parquet")
    as_text = rows.set_column(
        rows.schema.get_field_index("step"), "step", rows.column("step").cast(pa.string())
    )
    pq.write_table(
        as_text.drop_columns(["corrected_action", "part_extent_m"]), landing / "text.parquet"
    )
    (landing / "cut.parquet").write_bytes(
        (write_parquet_export(rows, tmp_path / "x.parquet")).read_bytes()[:500]
    )
    lines = write_jsonl_export(rows, tmp_path / "all.jsonl").read_text().splitlines()
    (landing / "swapped.jsonl").write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    (landing / "broken.jsonl").write_text(lines[0] + "\n{not json\n")
    bad_joint = json.loads(lines[4]) | {"joint_position": [0.1, float("nan")]}
    (landing / "nan.jsonl").write_text(
        "\n".join([*lines[:4], json.dumps(bad_joint), *lines[5:]]) + "\n"
    )
    extra = rows.append_column("operator_note", pa.array(["fine"] * rows.num_rows))
    write_parquet_export(extra, landing / "extra.parquet")
    report = ingest(tmp_path, landing, params).as_dict()
    reasons = {Path(q["source"]).name: q["reason"] for q in report["quarantined"]}
    assert reasons["no-pose.parquet"] == "missing required column(s): part_pose"
    assert reasons["text.parquet"] == "export column step has type string, expected int32"
    assert reasons["cut.parquet"].startswith("unreadable Parquet export (")
    assert reasons["swapped.jsonl"].startswith("non-monotonic timestamps: time_s goes back")
    assert reasons["broken.jsonl"].startswith("unreadable JSONL export (")
    assert reasons["nan.jsonl"] == (  # pyarrow reads the NaN token that json.dumps writes
        "non-finite value (nan) in steps.joint_position at step 4 of episode "
        f"{rows.column('episode_id')[4].as_py()}"
    )
    assert len(reasons) == 6
    (entry,) = report["ingested"]
    assert Path(entry["source"]).name == "extra.parquet"
    assert entry["unknown_topics"] == {"operator_note": rows.num_rows}  # a column, kept out
    _, steps = read_dataset(tmp_path / "dataset")
    assert steps.schema.equals(schema.STEPS_SCHEMA)


def test_export_schema_is_both_tables_less_what_ingest_fills():
    names = set(EXPORT_SCHEMA.names)
    assert names == (set(schema.EPISODES_SCHEMA.names) | set(schema.STEPS_SCHEMA.names)) - {
        "source_uri",
        "source_sha256",
        "source_chunk",
        "ingest_run_id",
        "ingested_at",
        "realloop_version",
        "steps",
        "edge_case",
        "edge_case_reasons",
        "attachments",
    }
