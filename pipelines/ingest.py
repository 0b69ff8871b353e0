"""Ingest: the cell's ROS 2 MCAP shift logs in a landing folder → the canonical dataset.

docs/data-contract.md is the reference for every mapping here. The dataset layout:

    <dataset>/episodes/<source_sha256>.parquet   one row per episode of that source file
    <dataset>/steps/<source_sha256>.parquet      one row per control step of those episodes
    <dataset>/attachments/<sha256>.<ext>         capture snapshots, content-addressed

One immutable pair per source file, each written to a temporary name in its folder and moved
into place with os.replace: steps first, episodes last, so `episodes/<sha>.parquet` existing
means that source is fully ingested, and a run after a crash completes what is missing.

A landing file that cannot be read or breaks the contract is moved (never deleted) into the
quarantine folder, next to `<name>.reason.txt` whose first line says why. Landing files that
are ingested stay where they are; a later run skips them by their sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines import schema
from pipelines.params import CellParams, IngestParams

MCAP_MAGIC = b"\x89MCAP0\r\n"
CAPTURES_DIR = "captures"
EPISODES_DIR, STEPS_DIR, ATTACHMENTS_DIR = "episodes", "steps", "attachments"
PARQUET_COMPRESSION = "zstd"
REASON_SUFFIX = ".reason.txt"
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
_TMP_PREFIX = ".ingest-"
_STALE_TMP_S = 3600.0


class QuarantineError(ValueError):
    """A landing file that cannot be ingested; the message is the one-line reason."""


class UnreadableLog(QuarantineError):
    """The file is not a complete, readable MCAP log."""


class ContractViolation(QuarantineError):
    """The log reads, but breaks docs/data-contract.md."""


# --- the report ----------------------------------------------------------------------


@dataclass(frozen=True)
class IngestReport:
    run_id: str
    ingested: list[dict] = field(default_factory=list)  # source, sha256, episodes, steps
    skipped: list[dict] = field(default_factory=list)  # source, sha256 (already ingested)
    quarantined: list[dict] = field(default_factory=list)  # source, sha256, reason, moved_to

    def as_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "files_ingested": len(self.ingested),
            "episodes_ingested": sum(f["episodes"] for f in self.ingested),
            "steps_ingested": sum(f["steps"] for f in self.ingested),
            "files_skipped": len(self.skipped),
            "files_quarantined": len(self.quarantined),
            "ingested": list(self.ingested),
            "skipped": list(self.skipped),
            "quarantined": list(self.quarantined),
        }


# --- decoding: the one place that knows how MCAP bytes become arrays -----------------


@dataclass
class DecodedLog:
    """A shift log's content as column arrays per topic, sorted by log time (ns)."""

    metadata: dict[str, dict[str, str]]
    topic_counts: dict[str, int]
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

    @property
    def messages(self) -> int:
        return sum(self.topic_counts.values())


def read_log(path: Path) -> DecodedLog:
    """Decode one MCAP shift log with the official reader and the mcap-ros2 decoder.

    Raises UnreadableLog for anything that is not a complete MCAP file, ContractViolation for
    a topic with the wrong message type.
    """
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    path = Path(path)
    _check_container(path)
    collector = _Collector()
    try:
        with path.open("rb") as stream:
            reader = make_reader(stream, validate_crcs=True, decoder_factories=[DecoderFactory()])
            summary = reader.get_summary()
            if summary is None:
                raise UnreadableLog("MCAP file has no summary section (incomplete write?)")
            _check_topic_types(summary)
            metadata = {m.name: dict(m.metadata) for m in reader.iter_metadata()}
            for _, channel, message, ros in reader.iter_decoded_messages(log_time_order=False):
                collector.add(channel.topic, message.log_time, ros)
            chunks = [
                (c.message_start_time, c.message_end_time, c.chunk_start_offset, c.chunk_length)
                for c in summary.chunk_indexes
            ]
    except QuarantineError:
        raise
    except Exception as exc:  # untrusted bytes: any failure to decode means unreadable
        detail = (str(exc).splitlines() or [""])[0][:200]
        raise UnreadableLog(f"unreadable MCAP ({exc.__class__.__name__}: {detail})") from None
    return collector.finish(metadata, sorted(chunks, key=lambda c: c[2]))


def _check_container(path: Path) -> None:
    size = path.stat().st_size
    if size == 0:
        raise UnreadableLog("empty file (0 bytes)")
    with path.open("rb") as stream:
        head = stream.read(len(MCAP_MAGIC))
        if head != MCAP_MAGIC:
            raise UnreadableLog(
                f"not an MCAP file: starts with {head[:8]!r}, not the MCAP magic {MCAP_MAGIC!r}"
            )
        stream.seek(max(size - len(MCAP_MAGIC), 0))
        tail = stream.read(len(MCAP_MAGIC))
    if size < 2 * len(MCAP_MAGIC) or tail != MCAP_MAGIC:
        raise UnreadableLog(
            f"truncated MCAP: {size} bytes end without the footer and closing magic "
            "(file cut off mid-write?)"
        )


def _check_topic_types(summary) -> None:
    for channel in summary.channels.values():
        expected = TOPIC_TYPES.get(channel.topic)
        found = summary.schemas.get(channel.schema_id)
        name = found.name if found else "no schema"
        if expected and name != expected:
            raise ContractViolation(f"topic {channel.topic} has type {name}, expected {expected}")


class _Collector:
    """Pulls the contract's fields out of decoded messages into flat lists."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.joint_t, self.joint = [], []
        self.pose_t, self.pose = [], []
        self.conf_t, self.conf = [], []
        self.cmd_t, self.cmd = [], []
        self.target_t, self.target = [], []
        self.events: list[tuple[int, str]] = []
        self.joint_names = list(schema.JOINT_NAMES)

    def add(self, topic: str, t: int, msg) -> None:
        self.counts[topic] = self.counts.get(topic, 0) + 1
        if topic == schema.TOPIC_JOINT_STATES:
            if msg.name != self.joint_names:
                raise ContractViolation(
                    f"{topic}: joint names {list(msg.name)}, expected {self.joint_names}"
                )
            p, v = msg.position, msg.velocity
            self.joint_t.append(t)
            self.joint.append((p[0], p[1], v[0], v[1]))
        elif topic == schema.TOPIC_PART_POSE:
            pose = msg.pose
            self.pose_t.append(t)
            self.pose.append(
                (pose.position.x, pose.position.y, pose.orientation.z, pose.orientation.w)
            )
        elif topic == schema.TOPIC_PART_CONFIDENCE:
            self.conf_t.append(t)
            self.conf.append(msg.data)
        elif topic == schema.TOPIC_COMMAND:
            linear = msg.twist.linear
            self.cmd_t.append(t)
            self.cmd.append((linear.x, linear.y))
        elif topic == schema.TOPIC_TARGET:
            self.target_t.append(t)
            self.target.append((msg.pose.position.x, msg.pose.position.y))
        elif topic == schema.TOPIC_EVENTS:
            self.events.append((t, msg.data))

    def finish(self, metadata: dict, chunks: list) -> DecodedLog:
        joint_t, joint = _sorted(self.joint_t, self.joint, 4)
        pose_t, pose = _sorted(self.pose_t, self.pose, 4)
        conf_t, conf = _sorted(self.conf_t, self.conf, None)
        cmd_t, cmd = _sorted(self.cmd_t, self.cmd, 2)
        target_t, target = _sorted(self.target_t, self.target, 2)
        return DecodedLog(
            metadata=metadata,
            topic_counts=dict(self.counts),
            joint_time=joint_t,
            joint_position=joint[:, 0:2],
            joint_velocity=joint[:, 2:4],
            pose_time=pose_t,
            pose_xy=pose[:, 0:2],
            pose_zw=pose[:, 2:4],
            confidence_time=conf_t,
            confidence=conf.astype(np.float32),
            command_time=cmd_t,
            command_mps=cmd,
            target_time=target_t,
            target_xy=target,
            events=sorted(self.events, key=lambda e: e[0]),
            chunks=chunks,
        )


def _sorted(times: list[int], values: list, width: int | None) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(times, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    if width is not None:
        v = v.reshape(len(times), width)
    order = np.argsort(t, kind="stable")
    return t[order], v[order]


# --- the contract: a decoded log → episodes and steps tables ------------------------


@dataclass(frozen=True)
class Provenance:
    """Where rows come from and which ingest run wrote them."""

    source_uri: str
    source_sha256: str
    ingest_run_id: str
    ingested_at: datetime
    realloop_version: str


@dataclass
class _Episode:
    episode_id: str
    start_ns: int
    start: dict
    end_ns: int = -1
    end: dict | None = None
    interventions: list[dict] = field(default_factory=list)
    safety_stops: list[dict] = field(default_factory=list)


def build_tables(
    log: DecodedLog, cell: CellParams, min_steps: int, provenance: Provenance
) -> tuple[pa.Table, pa.Table]:
    """The episodes and steps tables of one decoded log, conforming to the schemas.

    Edge-case columns are left empty here (`edge_case` false, lists null); see
    `with_edge_cases`. Raises ContractViolation with a one-line reason.
    """
    meta = cell_metadata(log)
    missing = [t for t in schema.REQUIRED_TOPICS if log.topic_counts.get(t, 0) == 0]
    if missing:
        raise ContractViolation(f"missing required topic(s): {', '.join(missing)}")
    dt_ns = int(1e9 / int(meta["control_hz"]))
    episodes = _episodes_from_events(log.events)
    rows = _align_steps(log, episodes, dt_ns, min_steps)
    steps = _steps_table(log, episodes, rows, cell)
    return _episodes_table(log, episodes, meta, provenance), steps


def cell_metadata(log: DecodedLog) -> dict[str, str]:
    """The `realloop.cell` metadata record: provenance and the control rate."""
    meta = log.metadata.get(schema.METADATA_NAME)
    if meta is None:
        found = ", ".join(sorted(log.metadata)) or "none"
        raise ContractViolation(
            f"no MCAP metadata record '{schema.METADATA_NAME}' (cell provenance); "
            f"metadata records found: {found}"
        )
    lacking = [k for k in METADATA_KEYS if not meta.get(k)]
    if lacking:
        raise ContractViolation(f"metadata '{schema.METADATA_NAME}' lacks {', '.join(lacking)}")
    try:
        hz = int(meta["control_hz"])
    except ValueError:
        hz = 0
    if hz <= 0:
        raise ContractViolation(f"metadata control_hz={meta['control_hz']!r} is not a positive int")
    return meta


def _episodes_from_events(events: list[tuple[int, str]]) -> list[_Episode]:
    by_id: dict[str, _Episode] = {}
    for t, text in events:
        try:
            event = json.loads(text)
            kind, episode_id = event["event"], event["episode_id"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise ContractViolation(
                f"{schema.TOPIC_EVENTS} at log time {t}: not a JSON object with event and "
                "episode_id"
            ) from None
        episode = by_id.get(episode_id)
        if kind == "start":
            if episode is not None:
                raise ContractViolation(f"episode {episode_id}: two start events")
            by_id[episode_id] = _Episode(episode_id, t, event)
        elif episode is None:
            if kind in ("end", "intervention", "safety_stop"):
                raise ContractViolation(f"episode {episode_id}: {kind} event before its start")
        elif kind == "end":
            if episode.end is not None:
                raise ContractViolation(f"episode {episode_id}: two end events")
            episode.end_ns, episode.end = t, event
        elif kind == "intervention":
            episode.interventions.append(event)
        elif kind == "safety_stop":
            episode.safety_stops.append(event)
    episodes = sorted(by_id.values(), key=lambda e: e.start_ns)
    if not episodes:
        raise ContractViolation("no episodes: the log has no start events")
    for episode, following in zip(episodes, [*episodes[1:], None], strict=True):
        if episode.end is None:
            raise ContractViolation(f"episode {episode.episode_id}: start event without an end")
        if following is not None and following.start_ns < episode.end_ns:
            raise ContractViolation(
                f"episodes {episode.episode_id} and {following.episode_id} overlap"
            )
    return episodes


@dataclass
class _Rows:
    """Per control step: the episode (index into the episode list) and the step index."""

    episode: np.ndarray
    step: np.ndarray
    time_ns: np.ndarray
    offsets: np.ndarray  # first row of each episode


def _align_steps(log: DecodedLog, episodes: list[_Episode], dt_ns: int, min_steps: int) -> _Rows:
    t = log.joint_time
    for topic, other in (
        (schema.TOPIC_PART_POSE, log.pose_time),
        (schema.TOPIC_PART_CONFIDENCE, log.confidence_time),
        (schema.TOPIC_COMMAND, log.command_time),
    ):
        if not np.array_equal(t, other):
            raise ContractViolation(
                f"per-step topics not aligned: {len(t)} {schema.TOPIC_JOINT_STATES} vs "
                f"{len(other)} {topic} messages, or their log times differ"
            )
    starts = np.array([e.start_ns for e in episodes], dtype=np.int64)
    ends = np.array([e.end_ns for e in episodes], dtype=np.int64)
    episode = np.searchsorted(starts, t, side="right") - 1
    outside = (episode < 0) | (t >= ends[np.clip(episode, 0, None)])
    if outside.any():
        raise ContractViolation(
            f"{int(outside.sum())} control steps lie outside every episode window "
            f"(first at log time {int(t[outside][0])})"
        )
    counts = np.bincount(episode, minlength=len(episodes))
    for ep, n in zip(episodes, counts, strict=True):
        declared = ep.end.get("steps")
        if not isinstance(declared, int) or declared != n:
            raise ContractViolation(
                f"episode {ep.episode_id}: end event says {declared!r} steps but the log has "
                f"{int(n)} step timestamps"
            )
    for ep, n in zip(episodes, counts, strict=True):
        if n < min_steps:
            raise ContractViolation(
                f"episode {ep.episode_id} has {int(n)} steps, fewer than ingest.min_steps "
                f"({min_steps})"
            )
    offsets = np.cumsum(counts) - counts
    relative = t - starts[episode]
    step = (relative + dt_ns // 2) // dt_ns  # round((log_time - start) / dt_ns)
    expected = np.arange(len(t)) - offsets[episode]
    if not np.array_equal(step, expected):
        bad = int(np.flatnonzero(step != expected)[0])
        raise ContractViolation(
            f"episode {episodes[episode[bad]].episode_id}: step timestamps are not one per "
            f"{dt_ns / 1e6:g} ms from its start (row {int(expected[bad])} falls on step "
            f"{int(step[bad])})"
        )
    return _Rows(episode, step.astype(np.int32), relative, offsets)


def _steps_table(
    log: DecodedLog, episodes: list[_Episode], rows: _Rows, cell: CellParams
) -> pa.Table:
    n = len(rows.step)
    intervention = np.zeros(n, dtype=bool)
    corrected = np.zeros((n, 2), dtype=np.float32)
    for index, ep in enumerate(episodes):
        steps = ep.end["steps"]
        for event in ep.interventions:
            step, action = event.get("step"), event.get("corrected_action")
            if not isinstance(step, int) or not 0 <= step < steps:
                raise ContractViolation(
                    f"episode {ep.episode_id}: intervention event at step {step!r} is outside "
                    f"its {steps} steps"
                )
            if not _is_vector(action, 2):
                raise ContractViolation(
                    f"episode {ep.episode_id}: intervention at step {step} lacks a "
                    "corrected_action [vx, vy]"
                )
            row = rows.offsets[index] + step
            intervention[row] = True
            corrected[row] = action
    yaw = 2.0 * np.arctan2(log.pose_zw[:, 0], log.pose_zw[:, 1])
    part_pose = np.column_stack([log.pose_xy, yaw])
    action = log.command_mps / cell.max_speed_mps
    ids = pa.array([e.episode_id for e in episodes], pa.string())
    table = pa.table(
        {
            "episode_id": pa.DictionaryArray.from_arrays(
                pa.array(rows.episode.astype(np.int32)), ids
            ).cast(pa.string()),
            "step": pa.array(rows.step, pa.int32()),
            "time_s": pa.array(rows.time_ns / 1e9, pa.float64()),
            "joint_position": _vectors(log.joint_position),
            "joint_velocity": _vectors(log.joint_velocity),
            "part_pose": _vectors(part_pose),
            "part_confidence": pa.array(log.confidence, pa.float32()),
            "action": _vectors(action),
            "intervention": pa.array(intervention, pa.bool_()),
            "corrected_action": _vectors(corrected, null=~intervention),
        }
    )
    return conform(table, schema.STEPS_SCHEMA, "steps")


def _episodes_table(
    log: DecodedLog, episodes: list[_Episode], meta: dict[str, str], prov: Provenance
) -> pa.Table:
    n = len(episodes)
    starts = [e.start_ns for e in episodes]
    ends = [e.end for e in episodes]
    columns = {
        "episode_id": [e.episode_id for e in episodes],
        **{key: [meta[key]] * n for key in METADATA_KEYS if key != "control_hz"},
        "source_uri": [prov.source_uri] * n,
        "source_sha256": [prov.source_sha256] * n,
        "source_chunk": [_byte_range(log.chunks, e.start_ns, e.end_ns) for e in episodes],
        "ingest_run_id": [prov.ingest_run_id] * n,
        "ingested_at": pa.array([prov.ingested_at] * n, pa.timestamp("us", tz="UTC")),
        "realloop_version": [prov.realloop_version] * n,
        "start_time": pa.array(np.array(starts, dtype=np.int64), pa.int64()).cast(
            pa.timestamp("ns", tz="UTC")
        ),
        "target": _vectors(np.array([_target(log, e) for e in episodes]).reshape(n, 2)),
        "part_extent_m": pa.array(
            [_optional_vector(e.start.get("part_extent_m"), 2) for e in episodes],
            pa.list_(pa.float32(), 2),
        ),
        "success": [_end_field(e, "outcome", str) == "success" for e in episodes],
        "failure_cause": [end.get("failure_cause") for end in ends],
        "safety_stops": [_end_field(e, "safety_stops", int) for e in episodes],
        "safety_stop_kind": [
            e.safety_stops[-1].get("limit") if e.safety_stops else None for e in episodes
        ],
        "interventions": [_end_field(e, "interventions", int) for e in episodes],
        "steps": [end["steps"] for end in ends],
        "cycle_time_s": [float(_end_field(e, "cycle_time_s", (int, float))) for e in episodes],
        "edge_case": [False] * n,
        "edge_case_reasons": pa.nulls(n, pa.list_(pa.string())),
        "attachments": pa.nulls(n, pa.list_(pa.string())),
    }
    table = pa.table({k: v if isinstance(v, pa.Array) else pa.array(v) for k, v in columns.items()})
    return conform(table, schema.EPISODES_SCHEMA, "episodes")


def _target(log: DecodedLog, episode: _Episode) -> list[float]:
    """/target_pose at the episode start (full precision), else the start event's target."""
    i = int(np.searchsorted(log.target_time, episode.start_ns))
    if i < len(log.target_time) and log.target_time[i] == episode.start_ns:
        return log.target_xy[i].tolist()
    target = episode.start.get("target")
    if not _is_vector(target, 2):
        raise ContractViolation(f"episode {episode.episode_id}: no target at its start")
    return [float(x) for x in target]


def _end_field(episode: _Episode, name: str, kind):
    value = episode.end.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ContractViolation(
            f"episode {episode.episode_id}: end event field {name}={value!r} is missing or "
            "of the wrong type"
        )
    return value


def _byte_range(chunks: list[tuple[int, int, int, int]], start: int, end: int) -> str | None:
    """HTTP-style inclusive byte range of the chunks holding the episode's messages."""
    spans = [
        (off, off + length) for first, last, off, length in chunks if first <= end and last >= start
    ]
    if not spans:
        return None
    return f"bytes={min(s for s, _ in spans)}-{max(e for _, e in spans) - 1}"


def _is_vector(value, size: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == size
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)
    )


def _optional_vector(value, size: int) -> list[float] | None:
    return [float(x) for x in value] if _is_vector(value, size) else None


def _vectors(values: np.ndarray, null: np.ndarray | None = None) -> pa.FixedSizeListArray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    flat = pa.array(values.reshape(-1), pa.float32())
    mask = None if null is None else pa.array(null, pa.bool_())
    return pa.FixedSizeListArray.from_arrays(flat, values.shape[1], mask=mask)


def conform(table: pa.Table, target: pa.Schema, what: str) -> pa.Table:
    """Cast to the schema exactly (column order, types) and enforce its non-null columns."""
    try:
        table = table.select(target.names).cast(target)
    except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise ContractViolation(f"{what} table does not fit the schema ({exc})") from None
    for f in target:
        if not f.nullable and table.column(f.name).null_count:
            raise ContractViolation(f"{what} column {f.name} has nulls")
    return table


# --- edge-case captures ---------------------------------------------------------------


@dataclass(frozen=True)
class Capture:
    """An edge-case capture's sidecar: which episode, why, and its attachment files."""

    episode_id: str
    reason: str
    log_time_ns: int
    attachments: tuple[Path, ...]
    sidecar: Path


def read_capture(sidecar: Path) -> Capture:
    """Parse a capture's JSON sidecar; raise ContractViolation with a one-line reason."""
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ContractViolation(f"capture sidecar is not readable JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ContractViolation("capture sidecar is not a JSON object")
    episode_id, reason = meta.get("episode_id"), meta.get("reason")
    names = meta.get("attachments", [])
    if not isinstance(episode_id, str) or not isinstance(reason, str):
        raise ContractViolation("capture sidecar lacks episode_id or reason")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ContractViolation("capture sidecar attachments is not a list of file names")
    files = []
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            raise ContractViolation(f"capture attachment {name!r} is not a plain file name")
        path = sidecar.parent / name
        if not path.is_file():
            raise ContractViolation(f"capture attachment {name} is missing")
        files.append(path)
    log_time = meta.get("log_time_ns")
    return Capture(
        episode_id, reason, log_time if isinstance(log_time, int) else 0, tuple(files), sidecar
    )


def with_edge_cases(
    episodes: pa.Table, captures: Mapping[str, list[Capture]], attachments_dir: Path
) -> pa.Table:
    """Fill edge_case, edge_case_reasons and attachments; store attachment files.

    Episodes without captures keep edge_case false and null lists.
    """
    flags, reasons, shas = [], [], []
    for episode_id in episodes.column("episode_id").to_pylist():
        found = sorted(captures.get(episode_id, []), key=lambda c: (c.log_time_ns, c.reason))
        flags.append(bool(found))
        reasons.append(list(dict.fromkeys(c.reason for c in found)) if found else None)
        stored = [store_attachment(p, attachments_dir) for c in found for p in c.attachments]
        shas.append(list(dict.fromkeys(stored)) if found else None)
    for name, values in (
        ("edge_case", flags),
        ("edge_case_reasons", reasons),
        ("attachments", shas),
    ):
        index = episodes.schema.get_field_index(name)
        episodes = episodes.set_column(
            index, episodes.schema.field(index), pa.array(values, episodes.schema.field(index).type)
        )
    return episodes


def store_attachment(path: Path, attachments_dir: Path) -> str:
    """Copy `path` to `<attachments_dir>/<sha256>.<ext>` unless that content is stored."""
    sha = sha256_file(path)
    ext = path.suffix.lower().lstrip(".") or "bin"
    dest = attachments_dir / f"{sha}.{ext}"
    if not dest.exists():

        def copy(stream) -> None:
            with path.open("rb") as source:
                shutil.copyfileobj(source, stream)

        _write_atomically(dest, copy)
    return sha


# --- the landing folder → the dataset ---------------------------------------------------


def sha256_file(path: Path) -> str:
    with Path(path).open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def ingest_landing(
    landing: Path,
    dataset: Path,
    quarantine: Path,
    cell: CellParams,
    params: IngestParams,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
) -> IngestReport:
    """Ingest every new shift log under `landing`; quarantine what cannot be ingested.

    `progress(done, total)` is called after each log file.
    """
    landing, dataset, quarantine = Path(landing), Path(dataset), Path(quarantine)
    if not landing.is_dir():
        raise FileNotFoundError(f"{landing}: landing folder not found")
    folders = {name: dataset / name for name in (EPISODES_DIR, STEPS_DIR, ATTACHMENTS_DIR)}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(folder)
    ingested_at = datetime.now(UTC)
    version = _realloop_version()
    report = IngestReport(run_id)
    logs, sidecars = landing_files(landing, exclude=(dataset, quarantine))
    captures: dict[str, list[Capture]] = {}
    for sidecar in sidecars:
        try:
            capture = read_capture(sidecar)
        except ContractViolation as exc:
            entry = quarantine_file(sidecar, f"capture: {exc}", quarantine, run_id)
            report.quarantined.append(entry)
            continue
        captures.setdefault(capture.episode_id, []).append(capture)
    for done, path in enumerate(logs, start=1):
        source = str(path.resolve())
        try:
            sha = sha256_file(path)
        except FileNotFoundError:  # moved away since the listing: not ours to report
            continue
        if (folders[EPISODES_DIR] / f"{sha}.parquet").exists():
            report.skipped.append({"source": source, "sha256": sha})
        else:
            provenance = Provenance(source, sha, run_id, ingested_at, version)
            try:
                episodes, steps = build_tables(read_log(path), cell, params.min_steps, provenance)
            except QuarantineError as exc:
                report.quarantined.append(quarantine_file(path, str(exc), quarantine, run_id, sha))
            else:
                episodes = with_edge_cases(episodes, captures, folders[ATTACHMENTS_DIR])
                write_table(steps, folders[STEPS_DIR] / f"{sha}.parquet", schema.STEPS_SCHEMA)
                write_table(
                    episodes, folders[EPISODES_DIR] / f"{sha}.parquet", schema.EPISODES_SCHEMA
                )
                report.ingested.append(
                    {
                        "source": source,
                        "sha256": sha,
                        "episodes": episodes.num_rows,
                        "steps": steps.num_rows,
                    }
                )
        if progress:
            progress(done, len(logs))
    return report


def landing_files(landing: Path, exclude: Iterable[Path] = ()) -> tuple[list[Path], list[Path]]:
    """(shift logs, capture sidecars) under `landing`, sorted.

    Skips dot-folders and dotfiles, `*.partial` files (still being written) and the folders
    in `exclude`. MCAP files in `captures/` folders are capture windows, not shift logs.
    """
    skip = {Path(p).resolve() for p in exclude}
    logs, sidecars = [], []
    for root, dirs, files in os.walk(landing):
        here = Path(root)
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and (here / d).resolve() not in skip
        )
        in_captures = here.name == CAPTURES_DIR
        for name in sorted(files):
            if name.startswith("."):
                continue
            if in_captures and name.endswith(".json"):
                sidecars.append(here / name)
            elif not in_captures and name.endswith(".mcap"):
                logs.append(here / name)
    return logs, sidecars


def quarantine_file(
    path: Path, reason: str, quarantine: Path, run_id: str, sha256: str | None = None
) -> dict:
    """Move `path` into `quarantine`, next to `<name>.reason.txt`; never overwrite."""
    quarantine.mkdir(parents=True, exist_ok=True)
    sha = sha256 or sha256_file(path)
    reason = " ".join(reason.split())  # one line
    dest = _free_name(quarantine, path.name, sha)
    source = str(path.resolve())
    note = (
        f"{reason}\nsource: {source}\nsha256: {sha}\n"
        f"time: {datetime.now(UTC).isoformat(timespec='seconds')}\ningest_run_id: {run_id}\n"
    )
    # The reason first: a crash before the move leaves the file in landing for the next run.
    reason_path = dest.with_name(dest.name + REASON_SUFFIX)
    _write_atomically(reason_path, lambda stream: stream.write(note.encode()))
    shutil.move(path, dest)
    return {"source": source, "sha256": sha, "reason": reason, "moved_to": str(dest)}


def _free_name(folder: Path, name: str, sha: str) -> Path:
    stem, suffix = Path(name).stem, Path(name).suffix
    candidates = [name, f"{stem}.{sha[:12]}{suffix}"]
    candidates += [f"{stem}.{sha[:12]}-{i}{suffix}" for i in range(2, 1000)]
    for candidate in candidates:
        dest = folder / candidate
        if not dest.exists() and not dest.with_name(candidate + REASON_SUFFIX).exists():
            return dest
    raise FileExistsError(f"{folder}: no free quarantine name for {name}")


def storage_schema(target: pa.Schema) -> pa.Schema:
    """The schema as stored in Parquet: nullable vectors as variable-size lists.

    pyarrow's Parquet reader cannot read a null fixed-size list (apache/arrow#35692, open in
    pyarrow 25), so `corrected_action` and `part_extent_m` are stored as `list<float32>`;
    `read_dataset` casts them back to the contract's `list<float32>[n]`.
    """
    return pa.schema(
        [
            pa.field(f.name, pa.list_(f.type.value_type), f.nullable)
            if f.nullable and pa.types.is_fixed_size_list(f.type)
            else f
            for f in target
        ]
    )


def write_table(table: pa.Table, path: Path, target: pa.Schema) -> None:
    """Write Parquet (zstd) to a temporary name, read it back against the contract, then
    move it into place."""
    stored = conform(table, target, path.parent.name).cast(storage_schema(target))

    def write(stream) -> None:
        pq.write_table(stored, stream, compression=PARQUET_COMPRESSION)

    def check(tmp: Path) -> None:
        back = read_table(tmp, target)
        if not back.schema.equals(target) or back.num_rows != table.num_rows:
            raise RuntimeError(f"{path.name}: written table differs from the data contract")

    _write_atomically(path, write, check)


def read_table(path: Path, target: pa.Schema) -> pa.Table:
    """One dataset Parquet file, cast to the contract schema exactly."""
    return pq.read_table(path, schema=storage_schema(target)).cast(target)


def _write_atomically(path: Path, write, check=None) -> None:
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with tmp.open("wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        if check:
            check(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporaries left by a crashed run (older than an hour, so never a live run's)."""
    cutoff = time.time() - _STALE_TMP_S
    for tmp in folder.glob(f"{_TMP_PREFIX}*.tmp"):
        try:
            if tmp.stat().st_mtime < cutoff:
                tmp.unlink()
        except FileNotFoundError:
            pass


def _realloop_version() -> str:
    try:
        return importlib_metadata.version("realloop")
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


# --- reading the dataset back -------------------------------------------------------------


def read_dataset(dataset: Path, sources: list[str] | None = None) -> tuple[pa.Table, pa.Table]:
    """(episodes, steps) of the fully ingested sources, all or only the given sha256s."""
    dataset = Path(dataset)
    episodes_dir, steps_dir = dataset / EPISODES_DIR, dataset / STEPS_DIR
    if sources is None:
        shas = sorted(p.stem for p in episodes_dir.glob("*.parquet"))
    else:
        shas = list(dict.fromkeys(sources))
        missing = [s for s in shas if not (episodes_dir / f"{s}.parquet").is_file()]
        if missing:
            raise FileNotFoundError(f"{dataset}: sources not in the dataset: {', '.join(missing)}")
    return (
        _read_tables([episodes_dir / f"{s}.parquet" for s in shas], schema.EPISODES_SCHEMA),
        _read_tables([steps_dir / f"{s}.parquet" for s in shas], schema.STEPS_SCHEMA),
    )


def _read_tables(paths: list[Path], target: pa.Schema) -> pa.Table:
    if not paths:
        return target.empty_table()
    return pa.concat_tables([read_table(p, target) for p in paths])
