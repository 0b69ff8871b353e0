"""Every way a landed file is quarantined, each with its own one-line reason."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipelines.contract import schema
from pipelines.ingest.landing import ingest_file
from pipelines.ingest.quarantine import REASON_SUFFIX
from pipelines.ingest.store import read_dataset, read_manifest, sha256_file
from tests.pipelines.test_ingest_helpers import (
    EPISODES,
    abandoned,
    chunk_offsets,
    copy_landing,
    flip_byte,
    good_logs,
    ingest,
    raw_copy,
    recorded_shift,
    rewrite,
    step_times,
    summary_start,
    with_joint,
)

JUMP_NS = 5_000_000_000


@pytest.fixture(scope="module")
def shift():
    return recorded_shift()


def make_broken_logs(landing: Path, good: Path, dt_ns: int) -> dict[str, str]:
    """Broken copies of `good` in `landing`: name → the start of its quarantine reason."""
    data = good.read_bytes()
    offset, length = chunk_offsets(good)[0]
    (landing / "cut-mid-chunk.mcap").write_bytes(data[: offset + length // 2])
    (landing / "cut-in-footer.mcap").write_bytes(data[:-20])
    abandoned(landing / "cut-mid-chunk.mcap")
    abandoned(landing / "cut-in-footer.mcap")
    (landing / "notes.mcap").write_text("operator notes, not a log\n")
    (landing / "empty.mcap").write_bytes(b"")
    shutil.copy(good, landing / "bad-chunk-crc.mcap")
    flip_byte(landing / "bad-chunk-crc.mcap", offset + 1 + 8 + 8 + 8 + 8)  # uncompressed_crc
    shutil.copy(good, landing / "bad-summary-crc.mcap")
    flip_byte(landing / "bad-summary-crc.mcap", summary_start(good) + 12)
    confidence = schema.TOPIC_PART_CONFIDENCE

    def as_json(topic, encoding, name):
        return ("json", name) if topic == confidence else (encoding, name)

    def as_float64(topic, encoding, name):
        return (encoding, "std_msgs/msg/Float64") if topic == confidence else (encoding, name)

    raw_copy(good, landing / "json-encoded.mcap", channel=as_json)
    raw_copy(good, landing / "float64-confidence.mcap", channel=as_float64)
    rewrite(good, landing / "no-confidence.mcap", drop_topic=confidence)

    times = step_times(good)
    k = 3  # a step inside the first episode
    per_step = {
        schema.TOPIC_JOINT_STATES,
        schema.TOPIC_PART_POSE,
        schema.TOPIC_PART_CONFIDENCE,
        schema.TOPIC_COMMAND,
    }

    def back(topic, ros, t):  # the clock steps back 1.5 control periods for one step
        return ros, (t - 3 * dt_ns // 2 if topic in per_step and t == times[k] else t)

    def repeat(topic, ros, t):  # one step logged at the time of the step before
        return ros, (times[k - 1] if topic in per_step and t == times[k] else t)

    def jump(topic, ros, t):  # the clock jumps 5 s forward from step k on
        return ros, (t + JUMP_NS if t >= times[k] else t)

    def nan_joint(topic, ros, t):
        if topic == schema.TOPIC_JOINT_STATES and t == times[k]:
            return with_joint(ros, position=[float("nan"), ros.position[1]]), t
        return ros, t

    def beyond_travel(topic, ros, t):
        if topic == schema.TOPIC_JOINT_STATES and t == times[k]:
            return with_joint(ros, position=[0.5, ros.position[1]]), t
        return ros, t

    def inf_command(topic, ros, t):
        if topic == schema.TOPIC_COMMAND and t == times[k]:
            ros.twist.linear.x = float("inf")
        return ros, t

    for name, change in (
        ("backwards.mcap", back),
        ("repeated.mcap", repeat),
        ("clock-jump.mcap", jump),
        ("nan-joint.mcap", nan_joint),
        ("beyond-travel.mcap", beyond_travel),
        ("inf-command.mcap", inf_command),
    ):
        rewrite(good, landing / name, message=change)
    return {
        "cut-mid-chunk.mcap": f"truncated MCAP: cut mid-chunk at byte {offset + length // 2} ",
        "cut-in-footer.mcap": "truncated MCAP: cut inside a footer record",
        "notes.mcap": "not an MCAP file: starts with b'operator'",
        "empty.mcap": "empty file (0 bytes)",
        "bad-chunk-crc.mcap": "corrupt MCAP: ",  # and "CRC mismatch", in the decoder's words
        "bad-summary-crc.mcap": "corrupt MCAP: summary CRC mismatch",
        "json-encoded.mcap": f"unknown message encoding 'json' on topic {confidence}",
        "float64-confidence.mcap": f"unknown schema on topic {confidence}: std_msgs/msg/Float64",
        "no-confidence.mcap": f"missing required topic(s): {confidence}",
        "backwards.mcap": "non-monotonic timestamps: 1 /joint_states message(s) earlier",
        "repeated.mcap": "duplicate timestamps: 1 /joint_states message(s) repeat",
        "clock-jump.mcap": "clock jump: log time jumps 5.050 s between steps 2 and 3 of episode",
        "nan-joint.mcap": "non-finite value (nan) in steps.joint_position at step 3 of episode",
        "beyond-travel.mcap": "joint reading beyond the gantry's travel: gantry_x = 0.5000 m at "
        "step 3 of episode",
        "inf-command.mcap": "non-finite value (inf) in steps.action at step 3 of episode",
    }


@pytest.fixture(scope="module")
def quarantined(shift, params, tmp_path_factory):
    """One ingest run over the good logs and a broken copy for each reason."""
    tmp = tmp_path_factory.mktemp("quarantine")
    landing = copy_landing(shift, tmp, captures=False)
    good = good_logs(landing)
    expected = make_broken_logs(landing, good[0], int(1e9 / params.cell.control_hz))
    report = ingest(tmp, landing, params).as_dict()
    return tmp, landing, good, expected, report


REASONS = [
    "cut-mid-chunk.mcap",
    "cut-in-footer.mcap",
    "notes.mcap",
    "empty.mcap",
    "bad-chunk-crc.mcap",
    "bad-summary-crc.mcap",
    "json-encoded.mcap",
    "float64-confidence.mcap",
    "no-confidence.mcap",
    "backwards.mcap",
    "repeated.mcap",
    "clock-jump.mcap",
    "nan-joint.mcap",
    "beyond-travel.mcap",
    "inf-command.mcap",
]


@pytest.mark.parametrize("name", REASONS)
def test_broken_log_is_quarantined_with_its_reason(quarantined, name):
    tmp, landing, _, expected, report = quarantined
    entry = {Path(q["source"]).name: q for q in report["quarantined"]}[name]
    assert entry["reason"].startswith(expected[name]), entry["reason"]
    if name == "bad-chunk-crc.mcap":
        assert "CRC mismatch (stored 0x" in entry["reason"]
    assert "\n" not in entry["reason"] and len(entry["reason"]) < 300
    moved = Path(entry["moved_to"])
    assert moved == tmp / "quarantine" / name and moved.is_file()
    assert not (landing / name).exists()
    assert sha256_file(moved) == entry["sha256"]
    note = moved.with_name(name + REASON_SUFFIX).read_text().splitlines()
    assert note[0] == entry["reason"]
    lines = [r for r in read_manifest(tmp / "dataset") if Path(r["source"]).name == name]
    assert [(r["result"], r["reason"], r["sha256"]) for r in lines] == [
        ("quarantined", entry["reason"], entry["sha256"])
    ]


def test_reasons_are_distinct_and_good_logs_still_ingested(quarantined):
    _, _, good, expected, report = quarantined
    assert sorted(Path(f["source"]).name for f in report["ingested"]) == [p.name for p in good]
    assert report["episodes_ingested"] == EPISODES
    assert sorted(Path(q["source"]).name for q in report["quarantined"]) == sorted(expected)
    assert len({q["reason"] for q in report["quarantined"]}) == len(expected)
    assert report["files_landed"] == len(good) + len(expected)


def test_a_file_over_the_size_limit_is_quarantined_before_decoding(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path, captures=False)
    small = dataclasses.replace(params.ingest, max_file_bytes=1000)
    report = ingest(tmp_path, landing, params, ingest_params=small).as_dict()
    assert report["files_quarantined"] == len(good_logs(tmp_path / "quarantine")) == 3
    for entry in report["quarantined"]:
        size = Path(entry["moved_to"]).stat().st_size
        assert entry["reason"] == (
            f"file too large: {size} bytes, over ingest.max_file_bytes (1000)"
        )


def test_paths_that_escape_the_landing_folder_are_refused_untouched(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path, captures=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = shutil.copy(good_logs(landing)[0], outside / "secret.mcap")
    before = sha256_file(secret)
    (landing / "link.mcap").symlink_to(secret)
    (landing / "linked-folder").symlink_to(outside, target_is_directory=True)
    report = ingest(tmp_path, landing, params).as_dict()
    entry = {Path(q["source"]).name: q for q in report["quarantined"]}["link.mcap"]
    assert entry["reason"].startswith("file name escapes the landing folder: ")
    assert str(secret) in entry["reason"] and entry["sha256"] == ""
    moved = Path(entry["moved_to"])
    assert moved.is_symlink() and not (landing / "link.mcap").exists()  # the link, not its target
    assert secret.is_file() and sha256_file(secret) == before
    assert report["files_quarantined"] == 1  # the linked folder is never walked
    # A `..` path, as a source with a hostile key name could produce it: not even moved.
    dotdot = landing / ".." / "outside" / "secret.mcap"
    result = ingest_file(
        dotdot,
        landing,
        tmp_path / "dataset",
        tmp_path / "quarantine",
        params.cell,
        params.ingest,
        "run-2",
        source_uri="s3://bucket/shift/../../outside/secret.mcap",
    )
    assert result.result == "quarantined" and result.moved_to is None
    assert result.reason.startswith("file name escapes the landing folder: ")
    assert secret.is_file() and sha256_file(secret) == before
    notes = sorted((tmp_path / "quarantine").glob(f"secret*{REASON_SUFFIX}"))
    assert len(notes) == 1 and notes[0].read_text().startswith(result.reason)
    assert read_manifest(tmp_path / "dataset")[-1]["source"] == result.source
    episodes, _ = read_dataset(tmp_path / "dataset")
    assert episodes.num_rows == EPISODES  # the three real logs, nothing from outside


def test_an_episode_id_already_in_the_dataset_with_other_content(shift, params, tmp_path):
    landing = copy_landing(shift, tmp_path, captures=False)
    good = good_logs(landing)[0]
    ingest(tmp_path, landing, params)
    times = step_times(good)

    def nudge(topic, ros, t):  # the same episodes, one joint reading 1 mm off
        if topic == schema.TOPIC_JOINT_STATES and t == times[7]:
            return with_joint(ros, position=[ros.position[0] + 0.001, ros.position[1]]), t
        return ros, t

    relanded = tmp_path / "later"
    relanded.mkdir()
    rewrite(good, relanded / "edited.mcap", message=nudge)
    report = ingest(tmp_path, relanded, params, run_id="run-2").as_dict()
    (entry,) = report["quarantined"]
    ours = sha256_file(good)
    episode_id = read_dataset(tmp_path / "dataset", [ours])[0].column("episode_id")[0].as_py()
    assert entry["reason"] == (
        f"episode {episode_id} already in the dataset with different content "
        f"(from source {ours[:12]})"
    )
    episodes, _ = read_dataset(tmp_path / "dataset")
    assert episodes.num_rows == EPISODES


def test_unknown_extra_topics_are_counted_and_kept_out(shift, params, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    good = good_logs(shift[0])[0]
    raw_copy(good, landing / "cdr.mcap", extra_topic=("/diagnostics", schema.TOPIC_COMMAND, "cdr"))
    # An extra topic in an encoding ingest cannot read is still only counted: never decoded.
    other = tmp_path / "other"
    other.mkdir()
    raw_copy(
        good_logs(shift[0])[1],
        other / "json.mcap",
        extra_topic=("/foxglove/scene", schema.TOPIC_PART_CONFIDENCE, "json"),
    )
    first = ingest(tmp_path, landing, params).as_dict()
    second = ingest(tmp_path, other, params, run_id="run-2").as_dict()
    steps = int(np.sum([f["steps"] for f in first["ingested"]]))
    assert first["files_ingested"] == second["files_ingested"] == 1
    assert first["unknown_topics"] == {"/diagnostics": steps}
    assert first["ingested"][0]["unknown_topics"] == {"/diagnostics": steps}
    assert second["unknown_topics"] == {"/foxglove/scene": second["steps_ingested"]}
    _, table = read_dataset(tmp_path / "dataset")
    assert table.num_rows == steps + second["steps_ingested"]
    manifest = read_manifest(tmp_path / "dataset")
    assert manifest[0]["unknown_topics"] == {"/diagnostics": steps}


def test_a_dangling_or_special_entry_is_quarantined_not_followed(params, tmp_path):
    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "gone.mcap").symlink_to(landing / "nowhere.mcap")
    os.mkfifo(landing / "pipe.mcap")
    report = ingest(tmp_path, landing, params).as_dict()
    reasons = {Path(q["source"]).name: q["reason"] for q in report["quarantined"]}
    assert reasons["gone.mcap"].startswith("not a regular file: dangling symlink")
    assert reasons["pipe.mcap"] == "not a regular file (a named pipe)"
    assert not os.path.lexists(landing / "pipe.mcap")
