"""What a decoded shift log is, and how the MCAP decoder's columns become one.

`decode_log` runs the decoder (mcap/) on the contract's topics with the contract's checks on
channels and joints, and adapts its columns to a DecodedLog; log_tables.py turns that into
tables. Both raise the quarantine errors defined here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.contract import schema
from pipelines.ingest.mcap import ChannelInfo, DecodeLimits, TopicArrays
from pipelines.ingest.mcap.decode import decode

METADATA_KEYS = (
    "cell_id",
    "robot_serial",
    "policy_version",
    "sensor_calibration_id",
    "software_version",
    "control_hz",
)
TOPIC_TYPES = {
    schema.TOPIC_JOINT_STATES: "sensor_msgs/msg/JointState",
    schema.TOPIC_PART_POSE: "geometry_msgs/msg/PoseStamped",
    schema.TOPIC_PART_CONFIDENCE: "std_msgs/msg/Float32",
    schema.TOPIC_COMMAND: "geometry_msgs/msg/TwistStamped",
    schema.TOPIC_TARGET: "geometry_msgs/msg/PoseStamped",
    schema.TOPIC_EVENTS: "std_msgs/msg/String",
}
PER_STEP_TOPICS = (
    schema.TOPIC_JOINT_STATES,
    schema.TOPIC_PART_POSE,
    schema.TOPIC_PART_CONFIDENCE,
    schema.TOPIC_COMMAND,
)


class QuarantineError(ValueError):
    """A landing file that cannot be ingested; the message is the one-line reason."""


class UnreadableLog(QuarantineError):
    """The file is not a complete, readable log or export."""


class ContractViolation(QuarantineError):
    """The file reads, but breaks docs/data-contract.md."""


@dataclass
class DecodedLog:
    """A shift log's content as column arrays per topic, sorted by log time (ns)."""

    metadata: dict[str, dict[str, str]]
    topic_counts: dict[str, int]  # every topic in the file, the contract's and extra ones
    joint_time: np.ndarray  # int64 (n,)
    joint_position: np.ndarray  # float64 (n, 2) in JOINT_NAMES order
    joint_velocity: np.ndarray  # float64 (n, 2)
    pose_time: np.ndarray
    pose_xy: np.ndarray  # float64 (n, 2)
    pose_zw: np.ndarray  # float64 (n, 2): quaternion z, w
    confidence_time: np.ndarray
    confidence: np.ndarray  # float32 (n,)
    command_time: np.ndarray
    command_mps: np.ndarray  # float64 (n, 2): twist.linear.x, .y
    target_time: np.ndarray
    target_xy: np.ndarray  # float64 (n, 2)
    events: list[tuple[int, str]]  # (log time, JSON text), in log-time order
    chunks: list[tuple[int, int, int, int]]  # (first, last message time, byte offset, length)
    # For validation, filled by the decoder when it can (empty: not checked here):
    # (topic, message encoding, schema name, schema encoding) of every channel,
    channels: list[tuple[str, str, str, str]] = field(default_factory=list)
    # and per topic, messages whose log time is earlier than the previous message's on that
    # topic in file order: (count, first such log time, the log time before it).
    time_backsteps: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def messages(self) -> int:
        return sum(self.topic_counts.values())

    @property
    def unknown_topics(self) -> dict[str, int]:
        """Extra topics (not in the contract) and their message counts: never decoded."""
        return {t: n for t, n in sorted(self.topic_counts.items()) if t not in TOPIC_TYPES}


def check_channels(channels: Iterable[tuple[str, str, str, str]]) -> None:
    """The contract's topics are CDR messages with ros2msg schemas of the contract's types.

    Extra topics are not checked: ingest never decodes them, only counts them.
    """
    for topic, message_encoding, schema_name, schema_encoding in channels:
        expected = TOPIC_TYPES.get(topic)
        if expected is None:
            continue
        if message_encoding != "cdr":
            raise ContractViolation(
                f"unknown message encoding {message_encoding!r} on topic {topic} "
                "(the contract's topics are CDR)"
            )
        if schema_encoding != "ros2msg" or schema_name != expected:
            found = f"{schema_name or 'no schema'} ({schema_encoding or 'no encoding'})"
            raise ContractViolation(
                f"unknown schema on topic {topic}: {found}, expected {expected} (ros2msg)"
            )


def decode_log(path: Path, limits: DecodeLimits | None = None) -> DecodedLog:
    """`shift_log.read_log` without its container checks: the same DecodedLog (fields, dtypes,
    order).

    Raises McapDecodeError where read_log raises UnreadableLog, and ingest's
    ContractViolation where read_log does: a contract topic with another encoding or type
    (check_channels, as each channel is defined), joint names other than
    schema.JOINT_NAMES, fewer than 2 positions or velocities. Differences: it also decodes
    files without a summary section, never reads the summary (so checks no summary CRC: run
    shift_log.check_container first for that), and rejects a contract type whose definition
    differs from the standard one (McapDecodeError, kind unknown_schema).
    """

    def check(channel: ChannelInfo) -> None:
        check_channels([_channel_tuple(channel)])

    log = decode(Path(path), topics=set(TOPIC_TYPES), check_channel=check, limits=limits)
    joints = log.topics.get(schema.TOPIC_JOINT_STATES)
    if joints is not None:
        _check_joints(joints, list(schema.JOINT_NAMES), ContractViolation)

    def pairs(topic: str, fields: dict[str, int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Log time and, per field, the two columns from the given one on."""
        arrays = log.topics.get(topic)
        if arrays is None:
            return np.zeros(0, np.int64), [np.zeros((0, 2)) for _ in fields]
        return arrays.log_time, [arrays.fields[f][:, i : i + 2] for f, i in fields.items()]

    joint_time, (position, velocity) = pairs(
        schema.TOPIC_JOINT_STATES, {"position": 0, "velocity": 0}
    )
    pose_time, (pose_xy, pose_zw) = pairs(schema.TOPIC_PART_POSE, {"position": 0, "orientation": 2})
    command_time, (command,) = pairs(schema.TOPIC_COMMAND, {"linear": 0})
    target_time, (target,) = pairs(schema.TOPIC_TARGET, {"position": 0})
    confidence = log.topics.get(schema.TOPIC_PART_CONFIDENCE)
    events = log.topics.get(schema.TOPIC_EVENTS)
    return DecodedLog(
        metadata=log.metadata,
        topic_counts=log.topic_counts,
        joint_time=joint_time,
        joint_position=position,
        joint_velocity=velocity,
        pose_time=pose_time,
        pose_xy=pose_xy,
        pose_zw=pose_zw,
        confidence_time=confidence.log_time if confidence is not None else np.zeros(0, np.int64),
        confidence=confidence.fields["data"] if confidence is not None else np.zeros(0, np.float32),
        command_time=command_time,
        command_mps=command,
        target_time=target_time,
        target_xy=target,
        events=list(zip(events.log_time.tolist(), events.fields["data"].tolist(), strict=True))
        if events is not None
        else [],
        chunks=sorted(
            ((c.message_start_time, c.message_end_time, c.offset, c.length) for c in log.chunks),
            key=lambda c: c[2],
        ),
        channels=[_channel_tuple(c) for c in log.channels],
        time_backsteps=log.time_backsteps,
    )


def _channel_tuple(channel: ChannelInfo) -> tuple[str, str, str, str]:
    return (channel.topic, channel.message_encoding, channel.schema_name, channel.schema_encoding)


def _check_joints(joints: TopicArrays, expected: list[str], error: type[Exception]) -> None:
    """read_log's checks, in its words: the joint names, then 2 positions and velocities."""
    topic, names = joints.topic, joints.labels["name"]
    for code in np.unique(names.codes).tolist():
        if list(names.values[code]) != expected:
            raise error(f"{topic}: joint names {list(names.values[code])}, expected {expected}")
    p, v = joints.lengths["position"], joints.lengths["velocity"]
    short = (p < 2) | (v < 2)
    if short.any():
        i = int(np.argmax(short))
        raise error(
            f"{topic} at log time {joints.log_time[i]}: {p[i]} positions and {v[i]} "
            "velocities, expected 2 each"
        )
