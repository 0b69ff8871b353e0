"""The validate stage: critical vs warning expectations, exact counts from the extremes,
stored results reused, admissions, Data Docs (captures: test_validate_captures.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
from pipelines.quality.validate import (
    ValidationReport,
    admit_batch,
    read_admissions,
    validate_batch,
    validate_dataset,
    validation_root,
)
from pipelines.quality.validate import run as validate_module

GOOD = "a" * 64
BAD = "b" * 64
HZ = 20  # params.yaml cell.control_hz


def columns(source: str = GOOD, lengths: tuple[int, ...] = (10, 10)) -> tuple[dict, dict]:
    """Columns of a valid batch, as lists a test can edit before the tables are built."""
    episodes: dict[str, list] = {name: [] for name in EPISODES_SCHEMA.names}
    steps: dict[str, list] = {name: [] for name in STEPS_SCHEMA.names}
    for index, length in enumerate(lengths):
        episode_id = f"cell-07-20260101T060000Z-{index:05d}"
        episode = {
            "episode_id": episode_id,
            "cell_id": "cell-07",
            "robot_serial": "GX-2041-0193",
            "policy_version": "sim-policy-1",
            "sensor_calibration_id": "cam-cal-2026-11-14",
            "software_version": "cellsw-3.2",
            "source_uri": f"data/landing/cell-07_20260101T060000Z_{index:04d}.mcap",
            "source_sha256": source,
            "source_chunk": "0-1000",
            "ingest_run_id": "run-1",
            "ingested_at": datetime(2026, 1, 2, tzinfo=UTC),
            "realloop_version": "0.1.0",
            "start_time": datetime(2026, 1, 1, 6, tzinfo=UTC) + timedelta(seconds=8 * index),
            "target": [0.1, -0.05],
            "part_extent_m": [0.04, 0.04],
            "success": True,
            "failure_cause": None,
            "safety_stops": 0,
            "safety_stop_kind": None,
            "interventions": 1,
            "steps": length,
            "cycle_time_s": length / HZ,
            "edge_case": False,
            "edge_case_reasons": None,
            "attachments": None,
            "trial_request_id": None,  # a production episode
            "trial_arm": None,
            "trial_attempt": None,
        }
        for name, value in episode.items():
            episodes[name].append(value)
        for step in range(length):
            row = {
                "episode_id": episode_id,
                "step": step,
                "time_s": step / HZ,
                "joint_position": [0.1, -0.27],
                "joint_velocity": [0.02, 0.0],
                "part_pose": [0.05, 0.0, 0.3],
                "part_confidence": 0.9,
                "action": [0.5, -1.0],
                "intervention": step == 2,  # the operator drives step 2 of every episode
                "corrected_action": [0.5, -1.0] if step == 2 else None,
            }
            for name, value in row.items():
                steps[name].append(value)
    return episodes, steps


def tables(episodes: dict, steps: dict) -> tuple[pa.Table, pa.Table]:
    return (
        pa.Table.from_pydict(episodes, schema=EPISODES_SCHEMA),
        pa.Table.from_pydict(steps, schema=STEPS_SCHEMA),
    )


def validate(params, episodes: dict, steps: dict, batch: str = GOOD):
    return validate_batch(*tables(episodes, steps), batch, params.cell, params.validate)


def test_a_valid_batch_passes_without_warnings(params):
    result = validate(params, *columns())
    assert result.passed, result.failures
    assert result.failures == [] and result.warnings == [] and result.expectations > 60


def test_each_broken_property_is_critical_and_names_its_column(params):
    # One batch, each property broken in its own rows (one GX run instead of one each).
    episodes, steps = columns(lengths=(10, 10, 10))
    episodes["source_sha256"][0] = BAD
    episodes["cycle_time_s"][0] = 0.6  # 10 steps at 20 Hz last 0.5 s
    episodes["robot_serial"][1] = None
    episodes["steps"][1], episodes["cycle_time_s"][1] = 9, 9 / HZ  # but it has 10 rows
    steps["episode_id"] = ["episode-2" if e.endswith("00002") else e for e in steps["episode_id"]]
    episodes["episode_id"][2] = "episode-2"
    steps["part_pose"][3] = None
    steps["intervention"][3] = None
    steps["joint_position"][4] = [0.1, 0.3]
    steps["time_s"][5] = 0.1  # step 5 of episode 0 goes back in time
    steps["part_confidence"][7] = 1.5
    steps["part_confidence"][8] = -0.1
    steps["action"][15] = [1.2, 0.0]
    result = validate(params, episodes, steps)
    assert not result.passed
    expected = [
        "episodes.cycle_time_s: 1 episodes whose cycle time differs from steps·0.05 s by more "
        "than 0.001 s (e.g. 0.6)",
        "episodes.episode_id: 1 ids not of the form <cell_id>-<shift_id>-<NNNNN> (e.g. episode-2)",
        "episodes.robot_serial: 1 null or NaN values in a required column",
        f"episodes.source_sha256: 1 rows naming another source file (e.g. {BAD})",
        "episodes.steps: 1 episodes whose step count differs from their rows in the steps table "
        "(e.g. 9)",
        "steps.action: 1 steps with a command outside [-1, 1] (x: 1)",
        "steps.intervention: 1 steps with a null or NaN value in a required column",
        "steps.joint_position: 1 steps with a joint reading beyond ±0.29 m (y: 1)",
        "steps.part_confidence: 2 steps with a confidence outside [0, 1]",
        "steps.part_pose: 1 steps with a null or NaN value in a required column "
        "(x: 1, y: 1, yaw: 1)",
        "steps.time_s: 1 steps not later than the previous step of their episode",
        "steps.time_s: 2 steps whose time advance differs from (step advance)·0.05 s by more "
        "than 0.0125 s",
    ]
    assert [f.split("; first:")[0] for f in result.failures] == expected, result.failures
    assert result.failures[-1].endswith("; first: cell-07-20260101T060000Z-00000 step 5")


def test_physical_sanity_jitter_cycle_time_and_actuator_limits(params):
    episodes, steps = columns(lengths=(10, 10))
    steps["time_s"][4] += 0.02  # a late sample: beyond a quarter period, critical
    episodes["cycle_time_s"][1] = 7.0  # beyond max_steps / control_hz (6 s)
    steps["corrected_action"][2] = [0.5, -1.01]  # the operator's command beyond the limits
    steps["action"][2] = [0.5, -1.01]
    result = validate(params, episodes, steps)
    lines = "\n".join(result.failures)
    assert "steps.time_s: 2 steps whose time advance differs from (step advance)·0.05 s" in lines
    assert "episodes.cycle_time_s: 1 episodes outside 0.249..6.001 s" in lines
    assert "steps.corrected_action: 1 steps with a correction outside [-1, 1] (y: 1)" in lines
    assert "steps.action: 1 steps with a command outside [-1, 1] (y: 1)" in lines


def test_warnings_are_reported_and_do_not_fail_the_batch(params):
    episodes, steps = columns()
    steps["time_s"][4] += 0.002  # jitter within a quarter period: a warning
    episodes["success"][0], episodes["failure_cause"][0] = False, "gripper_jam"  # unknown cause
    episodes["safety_stop_kind"][1] = "speed"  # a stop kind without a stop
    steps["action"][12] = [0.51, -1.0]  # the command differs from the operator's correction
    episodes["interventions"][1] = 3  # one run of intervention steps, not three
    result = validate(params, episodes, steps)
    assert result.passed and result.failures == [], result.failures
    assert result.warnings == [
        "episodes.failure_cause: 1 episodes with a cause outside timeout, part_lost, "
        "safety_stop (e.g. gripper_jam); first: cell-07-20260101T060000Z-00000",
        "episodes.interventions: 1 episodes whose takeover count differs from their runs of "
        "intervention steps (e.g. 3); first: cell-07-20260101T060000Z-00001",
        "episodes.safety_stop_kind: 1 episodes whose stop kind contradicts safety_stops "
        "(e.g. speed); first: cell-07-20260101T060000Z-00001",
        "steps.action: 1 intervention steps whose command differs from the correction by more "
        "than 0.001; first: cell-07-20260101T060000Z-00001 step 2",
        "steps.time_s: 2 steps with sampling jitter beyond ±0.001 s (advance vs (step "
        "advance)·0.05 s); first: cell-07-20260101T060000Z-00000 step 4",
    ]


def test_counts_from_the_extremes_are_exact_per_axis_with_the_first_step(params):
    episodes, steps = columns(lengths=(10, 10))
    for row in (3, 4, 15):
        steps["action"][row] = [1.5, -1.0]
    steps["action"][16] = [1.5, -2.0]
    steps["part_confidence"][17] = float("nan")  # NaN is a null, never "in range"
    result = validate(params, episodes, steps)
    assert sorted(result.failures) == [
        "steps.action: 4 steps with a command outside [-1, 1] (x: 4, y: 1); "
        "first: cell-07-20260101T060000Z-00000 step 3",
        "steps.part_confidence: 1 steps with a null or NaN value in a required column; "
        "first: cell-07-20260101T060000Z-00001 step 7",
    ]


def test_too_few_steps_in_an_episode(params):
    result = validate(params, *columns(lengths=(10, 3)))
    assert result.failures == [
        "episodes.cycle_time_s: 1 episodes outside 0.249..6.001 s (e.g. 0.15); "
        "first: cell-07-20260101T060000Z-00001",
        "episodes.steps: 1 episodes outside 5..120 steps (e.g. 3); "
        "first: cell-07-20260101T060000Z-00001",
    ]


def test_a_step_index_gap_and_an_orphan_step_are_reported(params):
    episodes, steps = columns()
    steps["step"][7] = 8  # 6, 8, 8: a jump of 2, then no advance at all
    steps["episode_id"][-1] = "cell-07-20260101T060000Z-00099"
    failures = validate(params, episodes, steps).failures
    assert any(f.startswith("steps.step: 2 steps whose index is not") for f in failures)
    assert any(f.startswith("steps.episode_id: 1 steps of an episode missing") for f in failures)


def test_interleaved_episodes_are_checked_in_their_own_order(params):
    episodes, steps = columns(lengths=(10, 10))
    order = [i for pair in zip(range(10), range(10, 20), strict=True) for i in pair]
    interleaved = {name: [values[i] for i in order] for name, values in steps.items()}
    assert validate(params, episodes, interleaved).failures == []
    interleaved["time_s"][5] = 0.0  # row 5 after interleaving: episode 00001, step 2
    failures = validate(params, episodes, interleaved).failures
    assert failures[0].startswith("steps.time_s: 1 steps not later than the previous step")
    assert failures[0].endswith("first: cell-07-20260101T060000Z-00001 step 2"), failures


def test_schema_drift_is_reported_per_column(params):
    episode_table, step_table = tables(*columns())
    step_table = step_table.drop_columns(["joint_velocity"]).set_column(
        1, "step", step_table.column("step").cast(pa.int64())
    )
    result = validate_batch(episode_table, step_table, GOOD, params.cell, params.validate)
    assert sorted(result.failures) == [
        "steps.step: type int64, contract says int32",
        "steps: columns missing: joint_velocity",
    ]


def write_batch(dataset, batch: str, episodes: dict, steps: dict, as_ingest=True) -> None:
    """As ingest stores a batch: nullable vectors as list<float32> (apache/arrow#35692)."""
    for name, table in zip(("episodes", "steps"), tables(episodes, steps), strict=True):
        if as_ingest:
            table = table.cast(pa.schema([storage_field(f) for f in table.schema]))
        (dataset / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(table, dataset / name / f"{batch}.parquet")


def storage_field(field: pa.Field) -> pa.Field:
    if field.nullable and pa.types.is_fixed_size_list(field.type):
        return pa.field(field.name, pa.list_(field.type.value_type), nullable=True)
    return field


@pytest.fixture(scope="session")
def validated(params, tmp_path_factory):
    """A dataset folder with a good batch and one whose steps go back in time, validated
    once (GX runs for it here only), and that first report."""
    dataset = tmp_path_factory.mktemp("validated") / "data" / "dataset"
    episodes, steps = columns(source=BAD)
    steps["time_s"][4] = 0.0
    write_batch(dataset, GOOD, *columns())
    write_batch(dataset, BAD, episodes, steps)
    (dataset / "steps" / f"{'c' * 64}.parquet").write_bytes(b"ingest still running")
    return dataset, validate_dataset(dataset, params.cell, params.validate)


@pytest.fixture
def two_batches(validated, tmp_path):
    """A copy of the validated dataset and its stored results, admissions empty."""
    copy = tmp_path / "data"
    shutil.copytree(validated[0].parent, copy)
    return copy / "dataset"


def test_dataset_reports_exactly_the_bad_batch_and_writes_data_docs(validated):
    dataset, report = validated
    assert isinstance(report, ValidationReport)
    assert report.passed_batches == [GOOD] and report.failed_batches == [BAD]
    summary = report.as_dict()
    assert summary["batches"] == 2 and summary["passed"] == 1 and summary["validated"] == 2
    assert summary["excluded_from_training"] == [BAD]
    assert [f["batch"] for f in summary["failed"]] == [BAD]
    assert all(f.startswith("steps.time_s:") for f in summary["failed"][0]["failures"])
    assert summary["dataset_version"] == "unversioned"  # no data/dataset.dvc here

    version = validation_root(dataset) / "unversioned"
    assert summary["data_docs"] == str(version / "index.html")
    assert summary["results"] == str(version / "report.json")
    index = (version / "index.html").read_text()
    assert "EXCLUDED" in index and BAD[:12] in index and "steps.time_s:" in index
    stored = json.loads((version / "report.json").read_text())
    assert [b["batch"] for b in stored["batch_results"]] == [GOOD, BAD]
    for table in ("episodes", "steps", "captures"):
        path = stored["batch_results"][1]["pages"][table]
        assert f"realloop-{table}" in (version / path).read_text()  # GX's page for that suite
        assert f'href="{path}"' in index
    steps_page = (version / stored["batch_results"][1]["pages"]["steps"]).read_text()
    assert "[critical] within an episode, time_s strictly increases" in steps_page


def test_gx_prints_nothing(params, two_batches, capfd):
    stricter = dataclasses.replace(params.validate, time_step_tolerance_s=0.0005)
    validate_dataset(two_batches, params.cell, stricter, batches=[GOOD])
    assert capfd.readouterr() == ("", "")  # no progress bars or logs


def test_stored_results_are_reused_without_running_gx(params, validated, two_batches, monkeypatch):
    def no_gx(*args, **kwargs):
        raise AssertionError("GX ran for a batch with a stored result")

    monkeypatch.setattr(validate_module, "_run_suites", no_gx)
    again = validate_dataset(two_batches, params.cell, params.validate, dataset_version="v2")
    assert [b.cached for b in again.batches] == [True, True]
    assert again.as_dict()["cached"] == 2 and again.as_dict()["validated"] == 0
    assert [(b.passed, b.failures) for b in again.batches] == [
        (b.passed, b.failures) for b in validated[1].batches
    ]
    # Results and Data Docs are written for the new version too, from the stored results.
    assert again.data_docs.endswith("v2/index.html")
    pages = (validation_root(two_batches) / "v2" / "validations" / "realloop-steps").rglob("*")
    assert f"{BAD}.html" in {page.name for page in pages}

    # Another limit is another suite: the batch is validated again.
    stricter = dataclasses.replace(params.validate, cycle_time_tolerance_s=0.002)
    with pytest.raises(AssertionError, match="GX ran"):
        validate_dataset(two_batches, params.cell, stricter, batches=[GOOD])


def test_admit_re_includes_a_batch_and_is_recorded(params, two_batches):
    record = admit_batch(
        two_batches, params.cell, params.validate, BAD[:8], "clock fixed upstream", by="ana"
    )
    assert record["batch"] == BAD and record["by"] == "ana"
    assert record["reason"] == "clock fixed upstream" and record["failures"]
    assert datetime.fromisoformat(record["at"]).tzinfo is not None
    report = validate_dataset(two_batches, params.cell, params.validate)
    assert report.passed_batches == [GOOD, BAD]
    assert report.failed_batches == [BAD] and report.excluded_batches == []
    summary = report.as_dict()
    assert summary["excluded_from_training"] == []
    assert summary["failed"] == [
        {"batch": BAD, "failures": report.batches[1].failures, "admitted": True}
    ]
    assert summary["admitted"][0]["by"] == "ana"
    index = (validation_root(two_batches) / "unversioned/index.html").read_text()
    assert "admitted by ana" in index

    # Append-only: a second admission adds a line, the latest one is honoured.
    admit_batch(two_batches, params.cell, params.validate, BAD, "checked by hand", by="bo")
    lines = (validation_root(two_batches) / "admissions.jsonl").read_text().splitlines()
    assert [json.loads(line)["by"] for line in lines] == ["ana", "bo"]
    assert read_admissions(two_batches)[BAD]["reason"] == "checked by hand"


@pytest.mark.parametrize(
    ("batch", "reason", "message"),
    [
        (GOOD, "why not", "passed every critical expectation: nothing to admit"),
        ("c" * 64, "why not", "not in"),
        ("bb", "why not", "prefix of 6+ characters"),
        (BAD, "  ", "--reason must say why"),
    ],
)
def test_admit_refuses_what_it_cannot_admit(params, two_batches, batch, reason, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        admit_batch(two_batches, params.cell, params.validate, batch, reason)
    assert not (validation_root(two_batches) / "admissions.jsonl").exists()


def test_admit_needs_a_stored_result(params, two_batches):
    shutil.rmtree(validation_root(two_batches) / "batches")
    with pytest.raises(ValueError, match="run `realloop validate`"):
        admit_batch(two_batches, params.cell, params.validate, BAD, "no result yet")


def test_dataset_reports_unreadable_and_incomplete_batches(params, tmp_path):
    # Null fixed-size lists stored as such hit apache/arrow#35692 when read back.
    dataset = tmp_path / "dataset"
    write_batch(dataset, GOOD, *columns(), as_ingest=False)
    (dataset / "episodes" / f"{BAD}.parquet").write_bytes(b"not parquet")
    report = validate_dataset(dataset, params.cell, params.validate)
    good, bad = report.batches
    assert good.passed or "apache/arrow#35692" in good.failures[0], good.failures
    assert bad.failures[0].startswith("episodes: ") and "not readable Parquet" in bad.failures[0]
    assert bad.failures[1].startswith("steps: ") and bad.failures[1].endswith("is missing")
    # Not stored: ingest may yet complete the batch.
    assert not (validation_root(dataset) / "batches" / BAD).exists()
