"""Recorded logs are what a real cell writes, and the official MCAP reader agrees."""

import json
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap_ros2.decoder import DecoderFactory

from pipelines.contract import schema
from refcell.expert import Expert
from refcell.shift import GROUND_TRUTH_DIR, record_shift
from refcell.truth import FAILURE_CLASSES
from refcell.world import load_world

START = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)


class Frozen:
    name = "frozen-0"

    def act(self, obs):
        return np.zeros(2)


class Shover:
    """Drives at the part and keeps going: pushes it off the edge of reach."""

    name = "shover-0"

    def act(self, obs):
        direction = obs[4:6] - obs[0:2]
        return direction / max(np.linalg.norm(direction), 1e-6)


class Runaway:
    """Drives into the corner of the gantry's travel: a joint-limit safety stop."""

    name = "runaway-0"

    def act(self, obs):
        return np.ones(2)


def record(params, tmp_path, controller, episodes, interventions, seed=5):
    return record_shift(
        load_world("line"),
        params.cell,
        params.record,
        controller,
        episodes,
        tmp_path,
        seed,
        interventions=interventions,
        policy_version=controller.name,
        shift_start=START,
    )


def read_all(path: Path):
    with path.open("rb") as stream:
        reader = make_reader(stream, decoder_factories=[DecoderFactory()])
        messages = [
            (c.topic, s.name, m.log_time, ros) for s, c, m, ros in reader.iter_decoded_messages()
        ]
        metadata = {m.name: m.metadata for m in reader.iter_metadata()}
        attachments = [a.name for a in reader.iter_attachments()]
        profile = reader.get_header().profile
    return messages, metadata, attachments, profile


@pytest.fixture(scope="module")
def expert_shift(params, tmp_path_factory):
    out = tmp_path_factory.mktemp("landing")
    small = params.record.__class__(**{**params.record.__dict__, "episodes_per_file": 4})
    summary = record_shift(
        load_world("line"),
        params.cell,
        small,
        Expert(),
        10,
        out,
        5,
        interventions=False,
        policy_version="expert",
        shift_start=START,
    )
    return out, summary


def test_logs_round_trip_through_the_official_reader(expert_shift, params):
    out, summary = expert_shift
    files = sorted(out.glob("*.mcap"))
    assert [str(f) for f in files] == sorted(summary["files"]) and len(files) == 3  # 4+4+2
    episodes = []
    for path in files:
        messages, metadata, _, profile = read_all(path)
        assert profile == "ros2"
        meta = metadata[schema.METADATA_NAME]
        assert meta["cell_id"] == params.cell.cell_id and meta["policy_version"] == "expert"
        assert {"robot_serial", "sensor_calibration_id", "software_version"} <= meta.keys()
        topics = Counter(topic for topic, *_ in messages)
        assert set(schema.REQUIRED_TOPICS) == set(topics)
        per_step = {
            topics[t]
            for t in (
                schema.TOPIC_JOINT_STATES,
                schema.TOPIC_COMMAND,
                schema.TOPIC_PART_POSE,
                schema.TOPIC_PART_CONFIDENCE,
            )
        }
        assert len(per_step) == 1  # every control step logs each topic once
        types = {topic: datatype for topic, datatype, *_ in messages}
        assert types[schema.TOPIC_JOINT_STATES] == "sensor_msgs/msg/JointState"
        assert types[schema.TOPIC_PART_POSE] == "geometry_msgs/msg/PoseStamped"
        events = [json.loads(m.data) for t, _, _, m in messages if t == schema.TOPIC_EVENTS]
        episodes += [e for e in events if e["event"] == "end"]
        joint = next(m for t, _, _, m in messages if t == schema.TOPIC_JOINT_STATES)
        assert list(joint.name) == list(schema.JOINT_NAMES) and len(joint.position) == 2
    assert len(episodes) == 10
    assert sum(e["outcome"] == "success" for e in episodes) == round(summary["success_rate"] * 10)


def test_log_times_are_monotonic_per_topic(expert_shift):
    out, _ = expert_shift
    messages, *_ = read_all(sorted(out.glob("*.mcap"))[0])
    times = {}
    for topic, _, log_time, _ in messages:
        assert log_time >= times.get(topic, 0)
        times[topic] = log_time


def test_ground_truth_side_file_is_hidden_and_complete(expert_shift):
    _, summary = expert_shift
    rows = [json.loads(line) for line in Path(summary["ground_truth"]).read_text().splitlines()]
    assert Path(summary["ground_truth"]).parent.name == GROUND_TRUTH_DIR
    assert len(rows) == 10
    for row in rows:
        assert (row["true_cause"] is None) == row["success"]
        assert row["true_cause"] in (None, *FAILURE_CLASSES)


def test_captures_written_on_each_kind_of_event(params, tmp_path):
    reasons = Counter()
    runs = [(Frozen(), 6, True), (Shover(), 3, False), (Runaway(), 1, False), (Expert(), 12, False)]
    for i, (controller, episodes, interventions) in enumerate(runs):
        summary = record(params, tmp_path / str(i), controller, episodes, interventions)
        for sidecar in map(Path, summary["captures"]):
            meta = json.loads(sidecar.read_text())
            reasons[meta["reason"]] += 1
            assert meta["operator_note"] and meta["episode_id"] and meta["time"]
            window = sidecar.with_suffix(".mcap")
            messages, _, attachments, _ = read_all(window)
            assert messages and attachments == meta["attachments"]
            assert_reviewable_snapshot(sidecar.parent / attachments[0])
    assert {"low_confidence", "operator_flag", "safety_stop", "near_failure", "retry"} <= set(
        reasons
    )


def assert_reviewable_snapshot(path: Path) -> None:
    """At least 320 x 240, with the caption (reason, time, confidence) drawn across the top."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 320 and image.height >= 240
        pixels = np.asarray(image.convert("L"))
    caption_band = pixels[: pixels.shape[0] // 6]
    assert (caption_band < 80).sum() > 200  # dark text pixels, not an empty band


def test_snapshot_caption_says_why_when_and_what_perception_saw():
    from refcell.runner import StepRecord
    from refcell.snapshot import caption

    observation = np.zeros(12, dtype=np.float32)
    observation[4:8] = [0.1, -0.05, 0.0, 0.31]
    record = StepRecord(17, 0.85, observation, np.array([0.5, -1.0]), False, None, None, None)
    text = caption("low_confidence", "2026-11-30T06:00:00.850000+00:00", record, "blurred")
    assert text.splitlines() == [
        "low_confidence at step 17, 2026-11-30T06:00:00.850000+00:00",
        "blurred",
        "perceived part (+0.100, -0.050) m, confidence 0.31",
        "commanded (+0.50, -1.00) of max speed",
    ]


def test_interventions_are_logged_with_corrected_actions(params, tmp_path):
    summary = record(params, tmp_path, Frozen(), 3, True)
    messages, *_ = read_all(Path(summary["files"][0]))
    events = [json.loads(m.data) for t, _, _, m in messages if t == schema.TOPIC_EVENTS]
    corrections = [e for e in events if e["event"] == "intervention"]
    assert len(corrections) == summary["intervention_steps"] > 0
    assert all(len(e["corrected_action"]) == 2 for e in corrections)
    ends = [e for e in events if e["event"] == "end"]
    assert sum(e["interventions"] for e in ends) == summary["interventions"]
