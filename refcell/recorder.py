"""The cell's recorder: what a real cell writes while it runs a shift.

- ROS 2 MCAP logs (CDR, as rosbag2 writes them), many episodes per file, split by count or size;
- edge-case captures: a short MCAP window plus a JSON sidecar and a snapshot image;
- file metadata (cell, robot, policy, calibration, software) in MCAP metadata records.

`cell record` writes straight into a landing folder, so a log grows as `<name>.partial` and is
renamed when closed: ingest never sees half a file. `cell run` records into the box's own
folder instead and writes in place, as rosbag2 does (the file has its final name while it
grows); its uploader sends a file to the landing zone only once it is closed.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from mcap.writer import CompressionType
from mcap_ros2.writer import Writer

from edge.runtime import NOVEL_PART, OOD, Fallback
from pipelines.contract import schema
from pipelines.contract.params import CellParams, RecordParams
from refcell.cell import PART_LIMIT_M, Cell
from refcell.rosmsgs import DATATYPES, message_definition, stamp
from refcell.runner import StepRecord
from refcell.snapshot import caption, snapshot_png

SOFTWARE_VERSION = "refcell-0.1.0"
EPISODE_GAP_S = 2.0  # part changeover between episodes
CAPTURES_DIR = "captures"
PART_EDGE_MARGIN_M = 0.03
IN_PLACE_CHUNK_BYTES = 256 * 1024  # uncompressed; about five episodes of messages


@dataclass
class CellIdentity:
    cell_id: str
    robot_serial: str
    sensor_calibration_id: str
    policy_version: str
    software_version: str = SOFTWARE_VERSION

    @classmethod
    def from_params(cls, params: CellParams, policy_version: str) -> CellIdentity:
        return cls(
            params.cell_id, params.robot_serial, params.sensor_calibration_id, policy_version
        )


@dataclass
class _Message:
    topic: str
    datatype: str
    body: dict
    log_time: int


class _McapFile:
    """One open MCAP file with our schemas registered."""

    def __init__(self, path: Path, metadata: dict[str, str], in_place: bool = False):
        self.path = path
        self.partial = path if in_place else path.with_name(path.name + ".partial")
        self.stream = self.partial.open("wb")
        # In place, smaller chunks make the file grow every few episodes, as a rosbag2 file
        # does, and bound what a killed cell leaves unindexed.
        chunk = IN_PLACE_CHUNK_BYTES if in_place else 1 << 20
        self.writer = Writer(self.stream, chunk_size=chunk, compression=CompressionType.ZSTD)
        self.schemas = {t: self.writer.register_msgdef(t, message_definition(t)) for t in DATATYPES}
        self.writer.add_metadata(schema.METADATA_NAME, metadata)

    def write(self, message: _Message) -> None:
        self.writer.write_message(
            message.topic, self.schemas[message.datatype], message.body, log_time=message.log_time
        )

    def size(self) -> int:
        return self.stream.tell()

    def close(self) -> Path:
        """Finish (footer and summary) and, unless written in place, move into place."""
        self.writer.finish()
        self.stream.close()
        if self.partial != self.path:
            self.partial.replace(self.path)
        return self.path


@dataclass
class _EpisodeLog:
    episode_id: str
    start_ns: int
    source_log: str  # the shift log the episode is written to
    captured: set[str] = field(default_factory=set)
    touched: bool = False
    steps_without_contact: int = 0
    interventions: int = 0
    intervening: bool = False
    safety_stops: int = 0
    last_step: tuple[Cell, StepRecord] | None = None  # for a capture after the episode


class ShiftRecorder:
    """Observer for `run_episode` that writes a shift's logs and captures under `out_dir`."""

    def __init__(
        self,
        out_dir: Path,
        cell_params: CellParams,
        params: RecordParams,
        identity: CellIdentity,
        shift_start: datetime,
        *,
        in_place: bool = False,
        metadata: dict[str, str] | None = None,
        file_indexes: Iterator[int] | None = None,
    ):
        """`metadata` adds keys to every file's `realloop` record (a trial's keys);
        `file_indexes` is shared by all recorders of one shift, so their file names differ."""
        self.out_dir = Path(out_dir)
        self.in_place = in_place
        self.extra_metadata = dict(metadata or {})
        self.file_indexes = file_indexes
        self.captures_dir = self.out_dir / CAPTURES_DIR
        self.captures_dir.mkdir(parents=True, exist_ok=True)
        self.cell_params, self.params, self.identity = cell_params, params, identity
        self.shift_id = shift_start.astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
        self.clock_ns = int(shift_start.timestamp() * 1e9)
        self.window: deque[list[_Message]] = deque(maxlen=params.capture_window_steps)
        self.files: list[Path] = []
        self.captures: list[Path] = []
        self.current: _McapFile | None = None
        self.episodes_in_file = 0
        self.episode: _EpisodeLog | None = None

    # --- observer --------------------------------------------------------------------
    def __call__(self, cell: Cell, record: StepRecord) -> None:
        if record.index == 0:
            self._start_episode(cell)
        self._log_step(cell, record)
        self._watch_for_edge_cases(cell, record)
        if record.result.done:
            self.episode.last_step = (cell, record)
            self._end_episode(cell, record)

    def close(self) -> list[Path]:
        if self.current:
            self.files.append(self.current.close())
            self.current = None
        return self.files

    def begin_at(self, time_ns: int) -> None:
        """The next episode starts at this cell time (a cell on its own clock sets it)."""
        self.clock_ns = time_ns

    def capture_after_episode(self, reason: str, note: str) -> Path | None:
        """A capture on the last step of the episode just ended (the box's health check
        decides only then, e.g. `rollback`); None if no episode ended here."""
        if self.episode is None or self.episode.last_step is None:
            return None
        self._capture(*self.episode.last_step, reason, note)
        return self.captures[-1] if reason in self.episode.captured else None

    def use_policy(self, policy_version: str) -> None:
        """A new model from now on: close the open file, since its metadata names the old one."""
        if policy_version != self.identity.policy_version:
            self.close()
            self.identity.policy_version = policy_version

    # --- episodes --------------------------------------------------------------------
    def _start_episode(self, cell: Cell) -> None:
        if self.current is None:
            index = next(self.file_indexes) if self.file_indexes else len(self.files)
            name = f"{self.identity.cell_id}_{self.shift_id}_{index:04d}.mcap"
            self.current = _McapFile(self.out_dir / name, self._metadata(index), self.in_place)
            self.episodes_in_file = 0
        episode_id = f"{self.identity.cell_id}-{self.shift_id}-{cell.episode_index:05d}"
        self.episode = _EpisodeLog(episode_id, self.clock_ns, self.current.path.name)
        self.window.clear()
        self.window.append([])
        self._emit(
            schema.TOPIC_TARGET,
            "geometry_msgs/msg/PoseStamped",
            _pose(self.clock_ns, cell.target, 0.0),
            self.clock_ns,
        )
        self._event(
            self.clock_ns,
            "start",
            target=cell.target.round(5).tolist(),
            part_extent_m=cell.part_extent_m.round(4).tolist(),
        )

    def _end_episode(self, cell: Cell, record: StepRecord) -> None:
        result, ep = record.result, self.episode
        end_ns = self._time_ns(record) + self._dt_ns()
        self._event(
            end_ns,
            "end",
            outcome="success" if result.success else "failure",
            failure_cause=result.failure,
            cycle_time_s=round(cell.time_s, 3),
            steps=cell.step_index,
            safety_stops=ep.safety_stops,
            interventions=ep.interventions,
        )
        self.clock_ns = end_ns + int(EPISODE_GAP_S * 1e9)
        self.episodes_in_file += 1
        full = self.episodes_in_file >= self.params.episodes_per_file
        if full or self.current.size() >= self.params.max_file_bytes:
            self.files.append(self.current.close())
            self.current = None
        elif self.in_place:
            self.current.stream.flush()  # finished chunks reach the file between episodes

    # --- messages --------------------------------------------------------------------
    def _log_step(self, cell: Cell, record: StepRecord) -> None:
        if record.index > 0:
            self.window.append([])
        t = self._time_ns(record)
        obs = record.observation
        header = {"stamp": stamp(t), "frame_id": "gantry"}
        self._emit(
            schema.TOPIC_JOINT_STATES,
            "sensor_msgs/msg/JointState",
            {
                "header": header,
                "name": list(schema.JOINT_NAMES),
                "position": obs[0:2].astype(float).tolist(),
                "velocity": obs[2:4].astype(float).tolist(),
                "effort": [],
            },
            t,
        )
        self._emit(
            schema.TOPIC_PART_POSE,
            "geometry_msgs/msg/PoseStamped",
            _pose(t, obs[4:6], float(obs[6])),
            t,
        )
        self._emit(schema.TOPIC_PART_CONFIDENCE, "std_msgs/msg/Float32", {"data": float(obs[7])}, t)
        velocity = record.commanded * self.cell_params.max_speed_mps
        self._emit(
            schema.TOPIC_COMMAND,
            "geometry_msgs/msg/TwistStamped",
            {
                "header": header,
                "twist": {
                    "linear": {"x": float(velocity[0]), "y": float(velocity[1]), "z": 0.0},
                    "angular": {"x": 0.0, "y": 0.0, "z": 0.0},
                },
            },
            t,
        )
        if record.intervention:
            self._event(
                t,
                "intervention",
                step=record.index,
                corrected_action=np.round(record.corrected, 5).tolist(),
            )
        if record.fallback is not None:
            fallback = record.fallback
            self._event(
                t,
                "fallback",
                step=record.index,
                reason=fallback.reason,
                ood_score=round(fallback.score, 4),
                ood_threshold=round(fallback.threshold, 4),
                confidence=round(fallback.confidence, 4),
            )
        if record.result.safety_stop:
            self.episode.safety_stops += 1
            self._event(
                t,
                "safety_stop",
                step=record.index,
                limit=record.result.safety_stop,
                contact_force_n=round(record.result.contact_force_n, 3),
            )

    def _event(self, t: int, kind: str, **fields) -> None:
        body = {"event": kind, "episode_id": self.episode.episode_id, **fields}
        self._emit(schema.TOPIC_EVENTS, "std_msgs/msg/String", {"data": json.dumps(body)}, t)

    def _emit(self, topic: str, datatype: str, body: dict, t: int) -> None:
        message = _Message(topic, datatype, body, t)
        self.current.write(message)
        self.window[-1].append(message)

    # --- edge cases ------------------------------------------------------------------
    def _watch_for_edge_cases(self, cell: Cell, record: StepRecord) -> None:
        ep, result = self.episode, record.result
        if record.intervention and not ep.intervening:
            ep.interventions += 1
        ep.intervening = record.intervention
        if record.observation[7] < self.params.low_confidence:
            self._capture(
                cell, record, "low_confidence", f"perception confidence {record.observation[7]:.2f}"
            )
        if record.fallback is not None:
            fallback = record.fallback
            why = _fallback_reason(fallback)
            # The box's part verdict is a capture reason of its own: the review and the
            # campaign count unfamiliar parts apart from the steps the OOD screen refused.
            reason = NOVEL_PART if fallback.reason == NOVEL_PART else "ood"
            self._capture(cell, record, reason, f"box handed the step to the operator: {why}")
        elif record.intervention:
            self._capture(cell, record, "operator_flag", "operator took over from the policy")
        if result.safety_stop:
            self._capture(cell, record, "safety_stop", f"safety stop: {result.safety_stop}")
        if self._near_failure(cell):
            self._capture(cell, record, "near_failure", "part close to the edge of reach")
        if self._retry(record):
            self._capture(cell, record, "retry", "pusher lost the part and went around again")

    def _near_failure(self, cell: Cell) -> bool:
        part = cell.true_state().part  # the cell's own part-presence sensor at the table edge
        return bool(np.any(np.abs(part) > PART_LIMIT_M - PART_EDGE_MARGIN_M))

    def _retry(self, record: StepRecord) -> bool:
        ep = self.episode
        if record.result.contact_force_n > 0:
            ep.touched, ep.steps_without_contact = True, 0
            return False
        ep.steps_without_contact += 1
        return ep.touched and ep.steps_without_contact == 15 and not record.result.done

    def _capture(self, cell: Cell, record: StepRecord, reason: str, note: str) -> None:
        if reason in self.episode.captured:
            return
        self.episode.captured.add(reason)
        t = self._time_ns(record)
        stem = f"{self.episode.episode_id}_{reason}"
        time_iso = _iso(t)
        snapshot = f"{stem}.png"
        image = snapshot_png(cell, record, caption(reason, time_iso, record, note))
        window = _McapFile(self.captures_dir / f"{stem}.mcap", self._metadata(-1))
        for step_messages in self.window:
            for message in step_messages:
                window.write(message)
        window.writer.add_attachment(t, t, snapshot, "image/png", image)
        window.close()
        _write_atomically(self.captures_dir / snapshot, image)
        sidecar = {
            "reason": reason,
            "time": time_iso,
            "log_time_ns": t,
            "episode_id": self.episode.episode_id,
            "step": record.index,
            "operator_note": note,
            "cell_id": self.identity.cell_id,
            "source_log": self.episode.source_log,
            "attachments": [snapshot],
        }
        path = self.captures_dir / f"{stem}.json"  # written last: the sidecar completes a capture
        _write_atomically(path, (json.dumps(sidecar, indent=2) + "\n").encode())
        self.captures.append(path)

    # --- helpers ---------------------------------------------------------------------
    def _metadata(self, file_index: int) -> dict[str, str]:
        return {
            "cell_id": self.identity.cell_id,
            "robot_serial": self.identity.robot_serial,
            "policy_version": self.identity.policy_version,
            "sensor_calibration_id": self.identity.sensor_calibration_id,
            "software_version": self.identity.software_version,
            "shift_id": self.shift_id,
            "file_index": str(file_index),
            "control_hz": str(self.cell_params.control_hz),
            **self.extra_metadata,
        }

    def _dt_ns(self) -> int:
        return int(self.cell_params.dt * 1e9)

    def _time_ns(self, record: StepRecord) -> int:
        return self.episode.start_ns + record.index * self._dt_ns()


def _pose(t: int, xy, yaw: float) -> dict:
    return {
        "header": {"stamp": stamp(t), "frame_id": "table"},
        "pose": {
            "position": {"x": float(xy[0]), "y": float(xy[1]), "z": 0.0},
            "orientation": {
                "x": 0.0,
                "y": 0.0,
                "z": float(np.sin(yaw / 2)),
                "w": float(np.cos(yaw / 2)),
            },
        },
    }


def _write_atomically(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)


def _iso(t_ns: int) -> str:
    return datetime.fromtimestamp(t_ns / 1e9, tz=UTC).isoformat()


def _fallback_reason(fallback: Fallback) -> str:
    if fallback.reason == NOVEL_PART:
        return (
            f"part footprint {fallback.score * 1000:.1f} mm from every part the policy trained "
            f"on (tolerance {fallback.threshold * 1000:.1f} mm)"
        )
    if fallback.reason == OOD:
        return f"OOD score {fallback.score:.2f} > {fallback.threshold:.2f}"
    return f"perception confidence {fallback.confidence:.2f} below the box's minimum"
