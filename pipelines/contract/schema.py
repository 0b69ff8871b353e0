"""The data contract: the observation a policy sees and the canonical dataset tables.

docs/data-contract.md is the prose reference for this module; change them together.
"""

from __future__ import annotations

import pyarrow as pa

# What a policy observes each control step, in this order (metres, m/s, radians).
OBS_FIELDS = (
    "joint_x",
    "joint_y",
    "joint_vx",
    "joint_vy",
    "part_x",
    "part_y",
    "part_yaw",
    "confidence",
    "target_x",
    "target_y",
    "last_action_x",
    "last_action_y",
)
OBS_SIZE = len(OBS_FIELDS)
# Normalised velocity command per gantry axis, in [-1, 1] of the cell's max speed.
ACTION_FIELDS = ("velocity_x", "velocity_y")
ACTION_SIZE = len(ACTION_FIELDS)
JOINT_NAMES = ("gantry_x", "gantry_y")


def _vector(size: int) -> pa.DataType:
    return pa.list_(pa.float32(), size)


EPISODES_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("cell_id", pa.string(), nullable=False),
        pa.field("robot_serial", pa.string(), nullable=False),
        pa.field("policy_version", pa.string(), nullable=False),
        pa.field("sensor_calibration_id", pa.string(), nullable=False),
        pa.field("software_version", pa.string(), nullable=False),
        pa.field("source_uri", pa.string(), nullable=False),
        pa.field("source_sha256", pa.string(), nullable=False),
        pa.field("source_chunk", pa.string()),  # byte range of the episode in the source file
        pa.field("ingest_run_id", pa.string(), nullable=False),
        pa.field("ingested_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("realloop_version", pa.string(), nullable=False),
        pa.field("start_time", pa.timestamp("ns", tz="UTC"), nullable=False),
        pa.field("target", _vector(2), nullable=False),
        pa.field("part_extent_m", _vector(2)),
        pa.field("success", pa.bool_(), nullable=False),
        pa.field("failure_cause", pa.string()),  # as the cell reports it: timeout, part_lost, ...
        pa.field("safety_stops", pa.int32(), nullable=False),
        pa.field("safety_stop_kind", pa.string()),
        pa.field("interventions", pa.int32(), nullable=False),
        pa.field("steps", pa.int32(), nullable=False),
        pa.field("cycle_time_s", pa.float32(), nullable=False),
        pa.field("edge_case", pa.bool_(), nullable=False),
        pa.field("edge_case_reasons", pa.list_(pa.string())),
        pa.field("attachments", pa.list_(pa.string())),  # sha256 of content-addressed files
        # Hardware trials (docs/operations.md, section 3), null on production episodes. Last
        # in the table: files written before they existed read back with them null.
        pa.field("trial_request_id", pa.string()),
        pa.field("trial_arm", pa.string()),  # TRIAL_ARMS
        pa.field("trial_attempt", pa.string()),
    ]
)
# The `realloop.cell` metadata keys a trial log adds, copied into the same-named columns.
TRIAL_COLUMNS = ("trial_request_id", "trial_arm", "trial_attempt")
TRIAL_ARMS = ("candidate", "incumbent")

STEPS_SCHEMA = pa.schema(
    [
        pa.field("episode_id", pa.string(), nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("time_s", pa.float64(), nullable=False),  # since episode start
        pa.field("joint_position", _vector(2), nullable=False),
        pa.field("joint_velocity", _vector(2), nullable=False),
        pa.field("part_pose", _vector(3), nullable=False),  # perceived x, y, yaw
        pa.field("part_confidence", pa.float32(), nullable=False),
        pa.field("action", _vector(ACTION_SIZE), nullable=False),  # commanded, normalised
        pa.field("intervention", pa.bool_(), nullable=False),
        pa.field("corrected_action", _vector(ACTION_SIZE)),  # operator's, on interventions
    ]
)

# How a cell log maps onto the tables (docs/data-contract.md has the field-level mapping).
TOPIC_JOINT_STATES = "/joint_states"  # sensor_msgs/msg/JointState, control rate
TOPIC_COMMAND = "/cmd_vel"  # geometry_msgs/msg/TwistStamped, commanded action (m/s)
TOPIC_PART_POSE = "/part_pose"  # geometry_msgs/msg/PoseStamped, perceived part pose
TOPIC_PART_CONFIDENCE = "/part_pose/confidence"  # std_msgs/msg/Float32, same log time as pose
TOPIC_TARGET = "/target_pose"  # geometry_msgs/msg/PoseStamped, once per episode
TOPIC_EVENTS = "/episode_events"  # std_msgs/msg/String holding one JSON event
REQUIRED_TOPICS = (
    TOPIC_JOINT_STATES,
    TOPIC_COMMAND,
    TOPIC_PART_POSE,
    TOPIC_PART_CONFIDENCE,
    TOPIC_TARGET,
    TOPIC_EVENTS,
)
METADATA_NAME = "realloop.cell"  # MCAP metadata record holding the file's provenance
