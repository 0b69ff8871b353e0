"""What a decoded shift log is, and the contract's checks on its channels.

The decoder (decode.py) fills a DecodedLog; the store (store.py) turns it into tables. Both
raise the quarantine errors defined here, so neither needs the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pipelines.contract import schema

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
