"""Ingest: a recorded shift becomes the canonical dataset; bad files go to quarantine."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipelines.contract import schema
from pipelines.ingest.landing import ingest_file, ingest_landing
from pipelines.ingest.quarantine import REASON_SUFFIX
from pipelines.ingest.report import FileResult, IngestReport
from pipelines.ingest.store import MANIFEST_NAME, read_dataset, read_manifest, sha256_file
from tests.pipelines.test_ingest_helpers import (
    EPISODES,
    PER_FILE,
    ObservingExpert,
    abandoned,
    copy_landing,
    ingest,
    recorded_shift,
    rewrite,
    short_episode,
    truth_rows,
)


@pytest.fixture(scope="module")
def shift():
    return recorded_shift()


@pytest.fixture(scope="module")
def ingested(shift, params, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ingested")
    landing = copy_landing(shift, tmp)
    report = ingest(tmp, landing, params)
    episodes, steps = read_dataset(tmp / "dataset")
    return tmp, landing, report, episodes, steps


# --- a good shift ------------------------------------------------------------------------


def test_shift_becomes_episodes_and_steps(shift, ingested, params):
    _, _, report, episodes, steps = ingested
    summary = report.as_dict()
    assert isinstance(report, IngestReport)
    assert summary["files_ingested"] == len(shift[1]["files"]) == EPISODES // PER_FILE
    assert summary["episodes_ingested"] == EPISODES == episodes.num_rows
    assert summary["files_quarantined"] == summary["files_skipped"] == 0
    assert episodes.schema.equals(schema.EPISODES_SCHEMA)
    assert steps.schema.equals(schema.STEPS_SCHEMA)
    truth = {row["episode_id"]: row for row in truth_rows(shift)}
    assert sorted(episodes.column("episode_id").to_pylist()) == sorted(truth)
    ids, counts = np.unique(steps.column("episode_id").to_numpy(), return_counts=True)
    per_episode = dict(zip(ids, counts, strict=True))
    for row in episodes.to_pylist():
        assert row["steps"] == per_episode[row["episode_id"]] == truth[row["episode_id"]]["steps"]
        assert row["success"] == truth[row["episode_id"]]["success"]
    assert sum(f["steps"] for f in report.ingested) == steps.num_rows
    # steps are 0..n-1 per episode, on the control clock
    for group in (
        steps.group_by("episode_id").aggregate([("step", "min"), ("step", "max")]).to_pylist()
    ):
        assert group["step_min"] == 0 and group["step_max"] == per_episode[group["episode_id"]] - 1
    np.testing.assert_allclose(
        steps.column("time_s").to_numpy(), steps.column("step").to_numpy() / params.cell.control_hz
    )


def test_every_episode_row_carries_provenance(ingested, params):
    tmp, landing, report, episodes, _ = ingested
    by_sha = {f["sha256"]: f for f in report.ingested}
    for row in episodes.to_pylist():
        source = Path(row["source_uri"])
        assert source.is_absolute() and source.parent == landing.resolve()
        assert sha256_file(source) == row["source_sha256"] and row["source_sha256"] in by_sha
        assert row["source_chunk"].startswith("bytes=")
        first, last = map(int, row["source_chunk"].removeprefix("bytes=").split("-"))
        assert 0 < first < last < source.stat().st_size
        assert row["cell_id"] == params.cell.cell_id
        assert row["robot_serial"] == params.cell.robot_serial
        assert row["sensor_calibration_id"] == params.cell.sensor_calibration_id
        assert row["policy_version"] == ObservingExpert.name
        assert row["software_version"] and row["realloop_version"]
        assert row["ingest_run_id"] == "run-1" and row["ingested_at"] is not None
        assert row["episode_id"].startswith(f"{params.cell.cell_id}-20261130T060000Z-")
    layout = {p.relative_to(tmp / "dataset").parts[0] for p in (tmp / "dataset").rglob("*.*")}
    assert layout == {"episodes", "steps", "attachments"}
    for sha in by_sha:
        assert (tmp / "dataset" / "steps" / f"{sha}.parquet").is_file()
        assert (
            pq.read_metadata(tmp / "dataset" / "episodes" / f"{sha}.parquet")
            .row_group(0)
            .column(0)
            .compression
            == "ZSTD"
        )


def test_observations_rebuilt_from_steps_match_the_log(shift, ingested):
    _, _, _, episodes, steps = ingested
    logged = shift[2]  # every step of the shift, in the order it was recorded
    # the dataset is read file by file (in content-hash order); steps follow the episodes table
    assert (
        steps.column("episode_id").unique().to_pylist() == episodes.column("episode_id").to_pylist()
    )
    recorded = np.argsort(episodes.column("start_time").cast("int64").to_numpy(), kind="stable")
    episodes = episodes.take(recorded)
    rank = {e: i for i, e in enumerate(episodes.column("episode_id").to_pylist())}
    steps = steps.take(
        np.lexsort(
            (
                steps.column("step").to_numpy(),
                [rank[e] for e in steps.column("episode_id").to_pylist()],
            )
        )
    )
    ids, goals = episodes.column("episode_id").to_pylist(), episodes.column("target").to_pylist()
    targets = dict(zip(ids, goals, strict=True))
    vec = {name: np.stack(steps.column(name).to_numpy(zero_copy_only=False)) for name in (
        "joint_position", "joint_velocity", "part_pose", "action"
    )}  # fmt: skip
    step = steps.column("step").to_numpy()
    previous = np.where(step[:, None] == 0, 0.0, np.roll(vec["action"], 1, axis=0))
    target = np.array([targets[e] for e in steps.column("episode_id").to_pylist()])
    rebuilt = np.column_stack(
        [
            vec["joint_position"],
            vec["joint_velocity"],
            vec["part_pose"],
            steps.column("part_confidence").to_numpy(),
            target,
            previous,
        ]
    ).astype(np.float32)
    assert rebuilt.shape == logged.shape == (steps.num_rows, schema.OBS_SIZE)
    yaw = slice(6, 7)
    others = np.r_[0:6, 7:12]
    np.testing.assert_allclose(rebuilt[:, others], logged[:, others], rtol=1e-6, atol=1e-6)
    turn = (rebuilt[:, yaw] - logged[:, yaw] + 2 * np.pi) % (4 * np.pi) - 2 * np.pi
    np.testing.assert_allclose(turn, 0.0, atol=1e-5)  # yaw from the quaternion, modulo 4π


def test_interventions_and_corrected_actions_round_trip(shift, ingested):
    _, _, _, episodes, steps = ingested
    summary = shift[1]
    flags = steps.column("intervention").to_numpy(zero_copy_only=False)
    assert flags.sum() == summary["intervention_steps"] > 0
    corrected = steps.column("corrected_action")
    assert np.array_equal(corrected.is_valid().to_numpy(zero_copy_only=False), flags)
    on = steps.filter(pc.field("intervention"))
    action = np.stack(on.column("action").to_numpy(zero_copy_only=False))
    fixed = np.stack(on.column("corrected_action").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(action, fixed, atol=1e-5)  # the command sent is the operator's
    runs = {}
    ids = steps.column("episode_id").to_pylist()
    for i, episode_id in enumerate(ids):
        started = flags[i] and (i == 0 or not flags[i - 1] or ids[i - 1] != episode_id)
        runs[episode_id] = runs.get(episode_id, 0) + int(started)
    for row in episodes.to_pylist():
        assert row["interventions"] == runs[row["episode_id"]]
    assert sum(runs.values()) == summary["interventions"]


def test_captures_mark_edge_cases_and_attachments_are_stored_once(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    captures = landing / "captures"
    sidecars = sorted(captures.glob("*.json"))
    assert sidecars, "the shift should have edge-case captures"
    # A second capture, for another episode, whose snapshot has the same bytes as the first.
    first = json.loads(sidecars[0].read_text())
    other = next(
        e for e in (r["episode_id"] for r in truth_rows(shift)) if e != first["episode_id"]
    )
    shutil.copy(captures / first["attachments"][0], captures / "copy.png")
    duplicate = {
        **first,
        "episode_id": other,
        "reason": "operator_flag",
        "attachments": ["copy.png"],
    }
    (captures / f"{other}_dup.json").write_text(json.dumps(duplicate))
    # And an episode whose captures never arrived: no edge case.
    plain = sorted(r["episode_id"] for r in truth_rows(shift))[-1]
    assert plain not in (first["episode_id"], other)
    for sidecar in captures.glob(f"{plain}_*.json"):
        sidecar.unlink()
    ingest(tmp_path, landing, params)
    episodes, _ = read_dataset(tmp_path / "dataset")
    rows = {r["episode_id"]: r for r in episodes.to_pylist()}
    expected: dict[str, set[str]] = {}
    for sidecar in sorted(captures.glob("*.json")):
        meta = json.loads(sidecar.read_text())
        expected.setdefault(meta["episode_id"], set()).add(meta["reason"])
    for episode_id, row in rows.items():
        assert row["edge_case"] == (episode_id in expected)
        assert set(row["edge_case_reasons"] or []) == expected.get(episode_id, set())
    assert rows[plain]["edge_case"] is False
    assert rows[plain]["edge_case_reasons"] is None and rows[plain]["attachments"] is None
    assert sum(r["edge_case"] for r in rows.values()) == len(expected) == EPISODES - 1
    stored = tmp_path / "dataset" / "attachments"
    shared = sha256_file(captures / "copy.png")
    assert shared in rows[first["episode_id"]]["attachments"]
    assert shared in rows[other]["attachments"]
    referenced = {sha for r in rows.values() for sha in r["attachments"] or []}
    assert sorted(p.name for p in stored.iterdir()) == sorted(f"{s}.png" for s in referenced)
    for path in stored.iterdir():
        assert sha256_file(path) == path.stem
    names = {n for sc in captures.glob("*.json") for n in json.loads(sc.read_text())["attachments"]}
    assert {sha256_file(captures / n) for n in names} == referenced
    assert len(names) == len(referenced) + 1  # two files with one content, stored once


def test_reingest_skips_and_a_crash_before_episodes_is_completed(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    first = ingest(tmp_path, landing, params)
    dataset = tmp_path / "dataset"
    before = {p: p.stat().st_mtime_ns for p in dataset.rglob("*.parquet")}
    again = ingest(tmp_path, landing, params, run_id="run-2").as_dict()
    assert again["files_skipped"] == len(first.ingested) and again["files_ingested"] == 0
    assert {p: p.stat().st_mtime_ns for p in dataset.rglob("*.parquet")} == before
    assert all((landing / Path(f).name).is_file() for f in shift[1]["files"])  # left in place
    # A crash after steps/ but before episodes/: the next run completes that file only.
    lost = first.ingested[0]["sha256"]
    (dataset / "episodes" / f"{lost}.parquet").unlink()
    third = ingest(tmp_path, landing, params, run_id="run-3")
    assert [f["sha256"] for f in third.ingested] == [lost]
    episodes, steps = read_dataset(dataset)
    assert episodes.num_rows == EPISODES and steps.num_rows == sum(
        f["steps"] for f in first.ingested
    )
    only, only_steps = read_dataset(dataset, [lost])
    assert set(only.column("source_sha256").to_pylist()) == {lost}
    assert only.num_rows == first.ingested[0]["episodes"]
    assert only_steps.num_rows == first.ingested[0]["steps"]
    with pytest.raises(FileNotFoundError, match="not in the dataset"):
        read_dataset(dataset, ["0" * 64])


# --- bad files ---------------------------------------------------------------------------


def make_bad_files(landing: Path, good: Path, dt_ns: int) -> dict[str, str]:
    """Bad logs next to good ones; name → words its quarantine reason must hold."""
    data = good.read_bytes()
    (landing / "cut.mcap").write_bytes(data[: len(data) // 2])
    abandoned(landing / "cut.mcap")
    (landing / "notes.mcap").write_text("operator notes, not a log\n")
    (landing / "empty.mcap").write_bytes(b"")
    rewrite(good, landing / "no-confidence.mcap", drop_topic=schema.TOPIC_PART_CONFIDENCE)
    rewrite(good, landing / "no-metadata.mcap", metadata=False)

    def miscount(event, t):
        return ({**event, "steps": event["steps"] + 1} if event["event"] == "end" else event), t

    rewrite(good, landing / "miscounted.mcap", events=miscount)
    short_episode(good, landing / "short.mcap", 3, dt_ns)
    return {
        "cut.mcap": "truncated MCAP",
        "notes.mcap": "not an MCAP file",
        "empty.mcap": "empty file",
        "no-confidence.mcap": f"missing required topic(s): {schema.TOPIC_PART_CONFIDENCE}",
        "no-metadata.mcap": f"no MCAP metadata record '{schema.METADATA_NAME}'",
        "miscounted.mcap": "steps but the log has",
        "short.mcap": "has 3 steps, fewer than ingest.min_steps (5)",
    }


def test_bad_files_are_quarantined_with_reasons_and_the_rest_ingested(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    good = sorted(landing.glob("*.mcap"))
    bad = make_bad_files(landing, good[0], int(1e9 / params.cell.control_hz))
    (landing / "next.mcap.partial").write_bytes(b"still being written")
    (landing / ".hidden").mkdir()
    (landing / ".hidden" / "x.mcap").write_bytes(b"")
    seen = []
    report = ingest_landing(
        landing,
        tmp_path / "dataset",
        tmp_path / "quarantine",
        params.cell,
        params.ingest,
        "run-q",
        progress=lambda done, total: seen.append((done, total)),
    )
    assert seen[-1] == (len(good) + len(bad),) * 2
    assert sorted(Path(f["source"]).name for f in report.ingested) == [p.name for p in good]
    assert report.as_dict()["episodes_ingested"] == EPISODES
    reasons = {Path(q["source"]).name: q for q in report.quarantined}
    assert sorted(reasons) == sorted(bad)
    for name, words in bad.items():
        entry = reasons[name]
        assert words in entry["reason"], (name, entry["reason"])
        moved = Path(entry["moved_to"])
        assert moved == tmp_path / "quarantine" / name and moved.is_file()
        assert not (landing / name).exists()
        assert sha256_file(moved) == entry["sha256"]
        note = moved.with_name(name + REASON_SUFFIX).read_text().splitlines()
        assert note[0] == entry["reason"] and "\n" not in entry["reason"]
        assert f"sha256: {entry['sha256']}" in note and f"source: {entry['source']}" in note
        assert any(line.startswith("time: ") for line in note)
    assert len({q["reason"] for q in report.quarantined}) == len(bad)  # all distinct
    assert (landing / "next.mcap.partial").exists() and (landing / ".hidden" / "x.mcap").exists()


def test_quarantine_never_overwrites(shift, params, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    quarantine = tmp_path / "quarantine"
    quarantine.mkdir()
    (quarantine / "empty.mcap").write_bytes(b"earlier")
    (landing / "empty.mcap").write_bytes(b"")
    report = ingest(tmp_path, landing, params)
    moved = Path(report.quarantined[0]["moved_to"])
    sha = sha256_file(moved)
    assert moved.name == f"empty.{sha[:12]}.mcap"
    assert (quarantine / "empty.mcap").read_bytes() == b"earlier"
    assert (
        (quarantine / f"empty.{sha[:12]}.mcap{REASON_SUFFIX}").read_text().startswith("empty file")
    )


def test_an_episode_below_min_steps_quarantines_its_file(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    strict = dataclasses.replace(params.ingest, min_steps=params.cell.max_steps + 1)
    report = ingest(tmp_path, landing, params, ingest_params=strict)
    assert not report.ingested and len(report.quarantined) == EPISODES // PER_FILE
    assert all("fewer than ingest.min_steps" in q["reason"] for q in report.quarantined)


# --- the per-file API, the report and the manifest -----------------------------------------


def test_ingest_file_is_the_unit_of_work(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    log = sorted(landing.glob("*.mcap"))[0]
    args = (landing, tmp_path / "dataset", tmp_path / "quarantine", params.cell, params.ingest)
    uri = f"s3://cells/cell-07/{log.name}"
    first = ingest_file(log, *args, "run-1", source_uri=uri)
    assert isinstance(first, FileResult)
    assert first.result == "ingested" and first.reason is None and first.moved_to is None
    assert (first.source, first.sha256, first.size) == (uri, sha256_file(log), log.stat().st_size)
    assert first.episodes == PER_FILE and first.unknown_topics == {}
    episodes, steps = read_dataset(tmp_path / "dataset")
    assert first.steps == steps.num_rows
    assert set(episodes.column("source_uri").to_pylist()) == {uri}
    assert any(episodes.column("edge_case").to_pylist())  # captures found next to the log
    # The same bytes under another name: nothing changes.
    copy = shutil.copy(log, landing / "renamed.mcap")
    again = ingest_file(Path(copy), *args, "run-2")
    assert again.result == "skipped" and again.reason == "already ingested (same sha256)"
    assert (again.sha256, again.episodes, again.steps) == (first.sha256, 0, 0)
    assert read_dataset(tmp_path / "dataset")[0].equals(episodes)
    with pytest.raises(FileNotFoundError):
        ingest_file(landing / "never-landed.mcap", *args, "run-3")


def test_counts_add_up_and_the_manifest_has_a_line_per_file_per_run(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path)
    good = sorted(landing.glob("*.mcap"))
    bad = make_bad_files(landing, good[0], int(1e9 / params.cell.control_hz))
    shutil.copy(good[1], landing / "same-bytes.mcap")
    first = ingest(tmp_path, landing, params, run_id="run-1").as_dict()
    second = ingest(tmp_path, landing, params, run_id="run-2").as_dict()
    landed = len(good) + len(bad) + 1
    assert first["files_landed"] == landed == 3 + 7 + 1
    assert (first["files_ingested"], first["files_skipped"], first["files_quarantined"]) == (
        3,
        1,
        7,
    )
    assert second["files_landed"] == len(good) + 1 == second["files_skipped"]
    for report in (first, second):
        assert report["files_landed"] == (
            report["files_ingested"] + report["files_skipped"] + report["files_quarantined"]
        )
    manifest_path = tmp_path / MANIFEST_NAME  # next to the dataset, not in it
    assert manifest_path.is_file() and not list((tmp_path / "dataset").rglob(MANIFEST_NAME))
    lines = read_manifest(tmp_path / "dataset")
    assert len(lines) == first["files_landed"] + second["files_landed"]
    for line in lines:
        assert set(line) >= {"source", "sha256", "size", "result", "reason", "run_id", "time"}
    by_run = {run: [x for x in lines if x["run_id"] == run] for run in ("run-1", "run-2")}
    for run, report in (("run-1", first), ("run-2", second)):
        rows = by_run[run]
        assert sorted(r["source"] for r in rows) == sorted(
            f["source"] for kind in ("ingested", "skipped", "quarantined") for f in report[kind]
        )
        assert len({r["source"] for r in rows}) == len(rows)  # one line per file per run
    results = {Path(r["source"]).name: r for r in by_run["run-1"]}
    assert results["same-bytes.mcap"]["result"] == "skipped"
    assert results["empty.mcap"] == results["empty.mcap"] | {"result": "quarantined", "size": 0}
    assert results[good[0].name]["size"] == good[0].stat().st_size
    # Each landed file is in exactly one place: the dataset (left in landing) or quarantine.
    stored = {p.stem for p in (tmp_path / "dataset" / "episodes").glob("*.parquet")}
    for name, row in results.items():
        in_quarantine = (tmp_path / "quarantine" / name).is_file()
        assert in_quarantine == (row["result"] == "quarantined")
        assert (row["sha256"] in stored) == (row["result"] != "quarantined")
