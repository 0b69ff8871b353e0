"""Ingest: landed cell logs (ROS 2 MCAP, or JSONL/Parquet exports) → the canonical dataset.

docs/data-contract.md is the reference for every mapping and every quarantine reason here.

    <dataset>/episodes/<source_sha256>.parquet   one row per episode of that source file
    <dataset>/steps/<source_sha256>.parquet      one row per control step of those episodes
    <dataset>/attachments/<sha256>.<ext>         capture snapshots, content-addressed
    <dataset>/../ingest-manifest.jsonl           one line per landed file per run (append-only)
    <dataset>/../.ingest.lock                    held around every check-and-publish
    <dataset>/../.ingest-tmp/                    staged Parquet, never inside the dataset
    <dataset>/../.ingest-index-<name>.jsonl      episode id → content digest, a cache

`ingest_file` is the unit of work (one Prefect task per file); `ingest_landing` loops over a
landing folder. Per file: refuse paths that escape the landing folder, files over
`ingest.max_file_bytes` and empty files; hash; skip a sha256 already in the dataset; decode
and check against the contract; stage both tables in the hidden temp folder. Then, holding
the lock: look again (another run may have published the same file meanwhile), check the
file's episode ids against the dataset's, and publish with os.replace, steps first and
episodes last, so `episodes/<sha>.parquet` existing means that source is fully ingested and
readers never see a partial file. A SIGKILL anywhere leaves either nothing of the file in
the dataset, or its steps without its episodes; either way the next run completes it with
the same bytes (the tables are a pure function of the file, the run id and the run time).

A file that cannot be ingested is moved (never deleted, never overwritten) into quarantine,
next to `<name>.reason.txt` whose first line says why. Ingested files stay where they
landed; a later run skips them by their sha256. Every file's outcome is also appended to the
manifest, so each landed file is accounted for in exactly one place.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import stat
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.contract import schema
from pipelines.contract.params import CellParams, IngestParams
from pipelines.ingest.decode import McapDecodeError, decode_log
from pipelines.ingest.decoded import (
    METADATA_KEYS,
    PER_STEP_TOPICS,
    ContractViolation,
    DecodedLog,
    QuarantineError,
    UnreadableLog,
    check_channels,
)

MCAP_MAGIC = b"\x89MCAP0\r\n"
CAPTURES_DIR = "captures"
EPISODES_DIR, STEPS_DIR, ATTACHMENTS_DIR = "episodes", "steps", "attachments"
PARQUET_COMPRESSION = "zstd"
REASON_SUFFIX = ".reason.txt"
MANIFEST_NAME = "ingest-manifest.jsonl"
LOCK_NAME = ".ingest.lock"
TMP_DIR_NAME = ".ingest-tmp"
LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX = ".mcap", ".jsonl", ".parquet"
INGESTED, SKIPPED, QUARANTINED = "ingested", "skipped", "quarantined"
# Columns that differ between two ingest runs of the same file: left out of content hashes.
RUN_COLUMNS = ("ingest_run_id", "ingested_at")
# Episode columns that say where a row came from rather than what happened: left out of the
# digest that decides whether two episodes with one id are the same episode.
_NOT_CONTENT = {
    "source_uri",
    "source_sha256",
    "source_chunk",
    "ingest_run_id",
    "ingested_at",
    "realloop_version",
    "edge_case",
    "edge_case_reasons",
    "attachments",
}
ALREADY_INGESTED = "already ingested (same sha256)"
_TMP_PREFIX = ".ingest-"
_STALE_TMP_S = 3600.0
_READ_BLOCK = 1 << 20


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileResult:
    """What became of one landed file."""

    source: str  # URI as given: a local path, or s3://... from the sources module
    sha256: str  # "" only when the file was never read (its path escapes the landing folder)
    size: int
    result: str  # "ingested" | "skipped" | "quarantined"
    reason: str | None  # why it was skipped or quarantined (or what was left out of it)
    episodes: int
    steps: int
    moved_to: str | None  # where quarantine put it
    unknown_topics: dict[str, int] = field(default_factory=dict)  # extra topic → messages

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class IngestReport:
    run_id: str
    ingested: list[dict] = field(default_factory=list)  # source, sha256, size, episodes, steps
    skipped: list[dict] = field(default_factory=list)  # source, sha256, size, reason
    quarantined: list[dict] = field(default_factory=list)  # source, sha256, reason, moved_to
    unknown_topics: dict[str, int] = field(default_factory=dict)  # over all ingested files

    @classmethod
    def from_results(cls, run_id: str, results: Iterable[FileResult]) -> IngestReport:
        report = cls(run_id)
        for result in results:
            report.add(result)
        return report

    def add(self, result: FileResult) -> None:
        row = {"source": result.source, "sha256": result.sha256, "size": result.size}
        if result.result == INGESTED:
            row |= {"episodes": result.episodes, "steps": result.steps}
            if result.reason:
                row["reason"] = result.reason
            if result.unknown_topics:
                row["unknown_topics"] = dict(result.unknown_topics)
            self.ingested.append(row)
            for topic, count in result.unknown_topics.items():
                self.unknown_topics[topic] = self.unknown_topics.get(topic, 0) + count
        elif result.result == SKIPPED:
            self.skipped.append(row | {"reason": result.reason})
        elif result.result == QUARANTINED:
            self.quarantined.append(row | {"reason": result.reason, "moved_to": result.moved_to})
        else:
            raise ValueError(f"unknown ingest result {result.result!r}")

    def as_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "files_landed": len(self.ingested) + len(self.skipped) + len(self.quarantined),
            "files_ingested": len(self.ingested),
            "episodes_ingested": sum(f["episodes"] for f in self.ingested),
            "steps_ingested": sum(f["steps"] for f in self.ingested),
            "files_skipped": len(self.skipped),
            "files_quarantined": len(self.quarantined),
            "unknown_topics": dict(sorted(self.unknown_topics.items())),
            "ingested": list(self.ingested),
            "skipped": list(self.skipped),
            "quarantined": list(self.quarantined),
        }


def read_log(path: Path) -> DecodedLog:
    """Decode one MCAP shift log: container checks (incl. the summary CRC), then the
    vectorized decoder of pipelines/ingest/decode.py on the contract's topics (extra topics are
    only counted).

    Raises UnreadableLog for anything that is not a complete, intact MCAP file,
    ContractViolation for a contract topic with another encoding or message type.
    """
    path = Path(path)
    check_container(path)
    try:
        return decode_log(path)
    except QuarantineError:
        raise
    except McapDecodeError as exc:
        message = str(exc).splitlines()[0]
        if exc.kind in ("unknown_encoding", "unknown_schema"):
            raise ContractViolation(message) from None
        prefix = "truncated MCAP" if exc.kind == "truncated" else "corrupt MCAP"
        raise UnreadableLog(
            message if message.startswith(prefix) else f"{prefix}: {message}"
        ) from None
    except Exception as exc:  # untrusted bytes: any failure to decode means unreadable
        raise UnreadableLog(_decode_failure(exc)) from None


def _decode_failure(exc: Exception) -> str:
    detail = (str(exc).splitlines() or [""])[0][:200]
    kind = type(exc)
    if kind.__name__ == "CRCValidationError":
        expected, actual = getattr(exc, "expected", 0), getattr(exc, "actual", 0)
        return (
            f"corrupt MCAP: chunk CRC mismatch (stored {expected:#010x}, computed "
            f"{actual:#010x}): bytes damaged after writing"
        )
    if kind.__module__.split(".")[0] in ("zstandard", "zstd", "lz4", "backports"):
        return f"corrupt MCAP: a chunk does not decompress ({kind.__name__}: {detail})"
    return f"unreadable MCAP ({kind.__name__}: {detail})"


_OPCODES = {
    0x01: "header",
    0x02: "footer",
    0x03: "schema",
    0x04: "channel",
    0x05: "message",
    0x06: "chunk",
    0x07: "message index",
    0x08: "chunk index",
    0x09: "attachment",
    0x0A: "attachment index",
    0x0B: "statistics",
    0x0C: "metadata",
    0x0D: "metadata index",
    0x0E: "summary offset",
    0x0F: "data end",
}
_OP_FOOTER, _OP_CHUNK, _OP_DATA_END = 0x02, 0x06, 0x0F
_RECORD_HEAD = struct.Struct("<BQ")  # opcode, content length
_FOOTER = struct.Struct("<BQQQI")  # opcode, length, summary start, summary offset start, crc
_DATA_END = struct.Struct("<BQI")  # opcode, length, data section crc


def check_container(path: Path) -> None:
    """The MCAP container around the records: magic at both ends, a footer, and the CRCs
    that cover the summary and (when the writer computed it) the data section.

    Cheap: reads the ends of the file, plus the whole data section only when it carries a
    CRC. Chunk CRCs are the decoder's to check as it decompresses. Raises UnreadableLog.
    """
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
        if size < 2 * len(MCAP_MAGIC) + _FOOTER.size or stream.read() != MCAP_MAGIC:
            raise UnreadableLog(_truncation(stream, size))
        footer_at = size - len(MCAP_MAGIC) - _FOOTER.size
        stream.seek(footer_at)
        opcode, length, summary_start, _, summary_crc = _FOOTER.unpack(stream.read(_FOOTER.size))
        if opcode != _OP_FOOTER or length != _FOOTER.size - _RECORD_HEAD.size:
            raise UnreadableLog("corrupt MCAP: no footer record before the closing magic")
        if summary_start and not len(MCAP_MAGIC) < summary_start <= footer_at:
            raise UnreadableLog(
                f"corrupt MCAP: footer points to a summary at byte {summary_start}, outside "
                f"the file's {size} bytes"
            )
        if summary_start and summary_crc:
            computed = _crc32(stream, summary_start, size - len(MCAP_MAGIC) - 4)
            if computed != summary_crc:
                raise UnreadableLog(
                    f"corrupt MCAP: summary CRC mismatch (stored {summary_crc:#010x}, computed "
                    f"{computed:#010x}): bytes damaged after writing"
                )
        data_end_at = (summary_start or footer_at) - _DATA_END.size
        if data_end_at < len(MCAP_MAGIC):
            return
        stream.seek(data_end_at)
        opcode, length, data_crc = _DATA_END.unpack(stream.read(_DATA_END.size))
        if opcode != _OP_DATA_END or length != 4 or not data_crc:
            return  # no data-section CRC to check (rosbag2 and most writers leave it 0)
        computed = _crc32(stream, 0, data_end_at)
        if computed != data_crc:
            raise UnreadableLog(
                f"corrupt MCAP: data section CRC mismatch (stored {data_crc:#010x}, computed "
                f"{computed:#010x}): bytes damaged after writing"
            )


def _truncation(stream, size: int) -> str:
    """Why a file without its closing magic is incomplete: walk its records to the cut."""
    at = len(MCAP_MAGIC)
    while at + _RECORD_HEAD.size <= size:
        stream.seek(at)
        opcode, length = _RECORD_HEAD.unpack(stream.read(_RECORD_HEAD.size))
        end = at + _RECORD_HEAD.size + length
        if end > size:
            if opcode == _OP_CHUNK:
                return (
                    f"truncated MCAP: cut mid-chunk at byte {size} (the chunk at byte {at} "
                    f"needs {end - at} bytes; file cut off mid-write?)"
                )
            kind = _OPCODES.get(opcode, f"unknown (opcode {opcode:#04x})")
            return (
                f"truncated MCAP: cut inside a {kind} record at byte {size} (the record at "
                f"byte {at} needs {end - at} bytes; file cut off mid-write?)"
            )
        at = end
    return (
        f"truncated MCAP: {size} bytes end without the footer and closing magic "
        "(file cut off mid-write?)"
    )


def _crc32(stream, start: int, end: int) -> int:
    stream.seek(start)
    crc, left = 0, end - start
    while left > 0:
        block = stream.read(min(_READ_BLOCK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc


def _channel_info(channel, schema_) -> tuple[str, str, str, str]:
    name = schema_.name if schema_ is not None else ""
    encoding = schema_.encoding if schema_ is not None else ""
    return (channel.topic, channel.message_encoding, name, encoding)


class _Collector:
    """Pulls the contract's fields out of decoded messages into flat lists."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.backsteps: dict[str, tuple[int, int, int]] = {}
        self.joint_t, self.joint = [], []
        self.pose_t, self.pose = [], []
        self.conf_t, self.conf = [], []
        self.cmd_t, self.cmd = [], []
        self.target_t, self.target = [], []
        self.events: list[tuple[int, str]] = []
        self.joint_names = list(schema.JOINT_NAMES)

    def count(self, topic: str, t: int) -> None:
        self.counts[topic] = self.counts.get(topic, 0) + 1
        before = self.last.get(topic)
        if before is not None and t < before:
            count, first, previous = self.backsteps.get(topic, (0, t, before))
            self.backsteps[topic] = (count + 1, first, previous)
        self.last[topic] = t

    def add(self, topic: str, t: int, msg) -> None:
        self.count(topic, t)
        if topic == schema.TOPIC_JOINT_STATES:
            if list(msg.name) != self.joint_names:
                raise ContractViolation(
                    f"{topic}: joint names {list(msg.name)}, expected {self.joint_names}"
                )
            p, v = msg.position, msg.velocity
            if len(p) < 2 or len(v) < 2:
                raise ContractViolation(
                    f"{topic} at log time {t}: {len(p)} positions and {len(v)} velocities, "
                    "expected 2 each"
                )
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

    def finish(self, metadata: dict, chunks: list, channels: list) -> DecodedLog:
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
            channels=channels,
            time_backsteps=dict(self.backsteps),
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
    log: DecodedLog,
    cell: CellParams,
    min_steps: int,
    provenance: Provenance,
    *,
    max_clock_jump_s: float | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The episodes and steps tables of one decoded log, conforming to the schemas.

    Edge-case columns are left empty here (`edge_case` false, lists null); see
    `mark_edge_cases`. Values are checked by `check_values`. Raises ContractViolation with a
    one-line reason.
    """
    check_channels(log.channels)
    meta = cell_metadata(log)
    missing = [t for t in schema.REQUIRED_TOPICS if log.topic_counts.get(t, 0) == 0]
    if missing:
        raise ContractViolation(f"missing required topic(s): {', '.join(missing)}")
    dt_ns = int(1e9 / int(meta["control_hz"]))
    episodes = _episodes_from_events(log.events)
    rows = _align_steps(log, episodes, dt_ns, min_steps, max_clock_jump_s)
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
        if not isinstance(episode_id, str) or not episode_id:
            raise ContractViolation(
                f"{schema.TOPIC_EVENTS} at log time {t}: episode_id {episode_id!r} is not a string"
            )
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


def _align_steps(
    log: DecodedLog,
    episodes: list[_Episode],
    dt_ns: int,
    min_steps: int,
    max_clock_jump_s: float | None = None,
) -> _Rows:
    t = log.joint_time
    per_step = {
        schema.TOPIC_JOINT_STATES: t,
        schema.TOPIC_PART_POSE: log.pose_time,
        schema.TOPIC_PART_CONFIDENCE: log.confidence_time,
        schema.TOPIC_COMMAND: log.command_time,
    }
    _check_time_order(log, per_step, episodes)
    for topic, other in per_step.items():
        if not np.array_equal(t, other):
            raise ContractViolation(
                f"per-step topics not aligned: {len(t)} {schema.TOPIC_JOINT_STATES} vs "
                f"{len(other)} {topic} messages, or their log times differ"
            )
    starts = np.array([e.start_ns for e in episodes], dtype=np.int64)
    ends = np.array([e.end_ns for e in episodes], dtype=np.int64)
    episode = np.searchsorted(starts, t, side="right") - 1
    if max_clock_jump_s is not None:
        _check_clock_jumps(t, episode, starts, episodes, max_clock_jump_s)
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


def _check_time_order(
    log: DecodedLog, per_step: dict[str, np.ndarray], episodes: list[_Episode]
) -> None:
    """Log times that go back in file order, then log times that repeat."""
    for topic in (*PER_STEP_TOPICS, schema.TOPIC_EVENTS):
        count, at, before = log.time_backsteps.get(topic, (0, 0, 0))
        if count:
            raise ContractViolation(
                f"non-monotonic timestamps: {count} {topic} message(s) earlier than the one "
                f"before them in the file (first at log time {at}, after {before}"
                f"{_in_episode(episodes, at)})"
            )
    for topic, times in per_step.items():
        repeats = np.flatnonzero(np.diff(times) == 0)
        if repeats.size:
            at = int(times[repeats[0]])
            raise ContractViolation(
                f"duplicate timestamps: {repeats.size} {topic} message(s) repeat the log time "
                f"of the one before (first at log time {at}{_in_episode(episodes, at)})"
            )


def _in_episode(episodes: list[_Episode], t: int) -> str:
    for episode in episodes:
        if episode.start_ns <= t <= episode.end_ns:
            return f", in episode {episode.episode_id}"
    return ""


def _check_clock_jumps(
    t: np.ndarray,
    episode: np.ndarray,
    starts: np.ndarray,
    episodes: list[_Episode],
    max_clock_jump_s: float,
) -> None:
    """A gap between consecutive control steps of one episode (or between its start event
    and its first step) longer than max_clock_jump_s: the clock stepped, not the cell."""
    if not len(t):
        return
    first = np.r_[True, episode[1:] != episode[:-1]]
    previous = np.where(first, starts[np.clip(episode, 0, None)], np.r_[0, t[:-1]])
    gap = t - previous
    over = np.flatnonzero((episode >= 0) & (gap > int(max_clock_jump_s * 1e9)))
    if not over.size:
        return
    i = int(over[0])
    index = int(episode[i])
    step = i - int(np.flatnonzero(episode == index)[0])
    where = "its start event and its first step" if first[i] else f"steps {step - 1} and {step}"
    raise ContractViolation(
        f"clock jump: log time jumps {gap[i] / 1e9:.3f} s between {where} of episode "
        f"{episodes[index].episode_id} (over ingest.max_clock_jump_s = {max_clock_jump_s:g} s)"
    )


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
        "source_chunk": [_byte_range(log.chunks, e.start_ns, e.end_ns) for e in episodes],
        "start_time": pa.array(np.array(starts, dtype=np.int64), pa.int64()).cast(
            pa.timestamp("ns", tz="UTC")
        ),
        "target": _vectors(np.array([_target(log, e) for e in episodes]).reshape(n, 2)),
        "part_extent_m": pa.array(
            [_optional_vector(e.start.get("part_extent_m"), 2) for e in episodes],
            pa.list_(pa.float32(), 2),
        ),
        "success": [_end_field(e, "outcome", str) == "success" for e in episodes],
        "failure_cause": [
            _optional_text(e, end, "failure_cause") for e, end in zip(episodes, ends, strict=True)
        ],
        "safety_stops": [_end_field(e, "safety_stops", int) for e in episodes],
        "safety_stop_kind": [
            _text(e.safety_stops[-1].get("limit")) if e.safety_stops else None for e in episodes
        ],
        "interventions": [_end_field(e, "interventions", int) for e in episodes],
        "steps": [end["steps"] for end in ends],
        "cycle_time_s": [float(_end_field(e, "cycle_time_s", (int, float))) for e in episodes],
    }
    return _finish_episodes(columns, n, prov)


def _finish_episodes(columns: dict, n: int, prov: Provenance) -> pa.Table:
    """Add provenance and empty edge-case columns; conform to the episodes schema."""
    columns = {
        **columns,
        "source_uri": [prov.source_uri] * n,
        "source_sha256": [prov.source_sha256] * n,
        "ingest_run_id": [prov.ingest_run_id] * n,
        "ingested_at": pa.array([prov.ingested_at] * n, pa.timestamp("us", tz="UTC")),
        "realloop_version": [prov.realloop_version] * n,
        "edge_case": [False] * n,
        "edge_case_reasons": pa.nulls(n, pa.list_(pa.string())),
        "attachments": pa.nulls(n, pa.list_(pa.string())),
    }
    table = pa.table(
        {
            k: v if isinstance(v, pa.Array | pa.ChunkedArray) else pa.array(v)
            for k, v in columns.items()
        }
    )
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


def _optional_text(episode: _Episode, event: dict, name: str) -> str | None:
    value = event.get(name)
    if value is not None and not isinstance(value, str):
        raise ContractViolation(
            f"episode {episode.episode_id}: event field {name}={value!r} is not a string"
        )
    return value


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


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


# --- value checks, the same for logs and exports ---------------------------------------


def check_values(
    episodes: pa.Table, steps: pa.Table, cell: CellParams, params: IngestParams
) -> None:
    """No NaN or inf in any numeric column; no joint reading beyond the gantry's travel.

    A reading beyond cell.safety.joint_limit_m + ingest.joint_limit_margin_m is not a
    position this gantry can be in (its mechanical travel ends there): a broken encoder or
    wrong units, so the file is quarantined. validate.joint_reading_margin_m is the tighter,
    per-batch expectation that the validate stage reports on.
    """
    for table, what in ((steps, "steps"), (episodes, "episodes")):
        for name in table.schema.names:
            matrix, valid = _numeric_matrix(table.column(name))
            if matrix is None or not np.issubdtype(matrix.dtype, np.floating):
                continue
            bad = ~np.isfinite(matrix).all(axis=1) & valid
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                value = matrix[row][~np.isfinite(matrix[row])][0]
                raise ContractViolation(
                    f"non-finite value ({value}) in {what}.{name} {_row_name(table, row)}"
                )
    limit = cell.safety.joint_limit_m + params.joint_limit_margin_m
    position, _ = _numeric_matrix(steps.column("joint_position"))
    beyond = np.abs(position) > np.float32(limit)
    if beyond.any():
        row, axis = (int(i) for i in np.argwhere(beyond)[0])
        raise ContractViolation(
            f"joint reading beyond the gantry's travel: {schema.JOINT_NAMES[axis]} = "
            f"{float(position[row, axis]):.4f} m {_row_name(steps, row)} (limit ±{limit:g} m = "
            "cell.safety.joint_limit_m + ingest.joint_limit_margin_m)"
        )


def _row_name(table: pa.Table, row: int) -> str:
    episode_id = table.column("episode_id")[row].as_py()
    if "step" in table.schema.names:
        return f"at step {table.column('step')[row].as_py()} of episode {episode_id}"
    return f"of episode {episode_id}"


def _numeric_matrix(column) -> tuple[np.ndarray | None, np.ndarray]:
    """(values as an (n, k) array with zeros in null rows, validity), or (None, ...) for a
    column that is not numeric or a vector of numbers."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(array)
    valid = np.ones(n, dtype=bool)
    if array.null_count:
        valid = array.is_valid().to_numpy(zero_copy_only=False)
    kind = array.type
    if pa.types.is_fixed_size_list(kind):
        size = kind.list_size
        values = array.values.slice(array.offset * size, n * size)
        if not (pa.types.is_floating(values.type) or pa.types.is_integer(values.type)):
            return None, valid
        matrix = values.to_numpy(zero_copy_only=False).reshape(n, size)
    elif pa.types.is_floating(kind) or pa.types.is_integer(kind) or pa.types.is_boolean(kind):
        matrix = array.to_numpy(zero_copy_only=False).reshape(n, 1)
    elif pa.types.is_timestamp(kind):
        matrix = array.cast(pa.int64()).to_numpy(zero_copy_only=False).reshape(n, 1)
    else:
        return None, valid
    if not valid.all():
        matrix = matrix.copy()
        matrix[~valid] = 0
    return matrix, valid


# --- exports: JSONL and Parquet files that follow the data contract ---------------------

# What ingest fills itself; an export carries every other column of both tables.
_FILLED_BY_INGEST = (
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
)
EXPORT_EPISODE_COLUMNS = tuple(
    f.name for f in schema.EPISODES_SCHEMA if f.name not in _FILLED_BY_INGEST
)
EXPORT_STEP_COLUMNS = tuple(f.name for f in schema.STEPS_SCHEMA if f.name != "episode_id")
# One row per control step: the step's columns and its episode's, as in the two tables.
EXPORT_SCHEMA = pa.schema(
    [schema.EPISODES_SCHEMA.field(name) for name in EXPORT_EPISODE_COLUMNS]
    + [schema.STEPS_SCHEMA.field(name) for name in EXPORT_STEP_COLUMNS]
)


def _jsonl_type(kind: pa.DataType) -> pa.DataType:
    """How a contract type is spelled in JSON: numbers as float64/int64, start_time as
    integer nanoseconds since the Unix epoch."""
    if pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind):
        inner = kind.value_type
        return pa.list_(pa.float64() if pa.types.is_floating(inner) else inner)
    if pa.types.is_timestamp(kind) or pa.types.is_integer(kind):
        return pa.int64()
    if pa.types.is_floating(kind):
        return pa.float64()
    return kind


_JSONL_SCHEMA = pa.schema([pa.field(f.name, _jsonl_type(f.type)) for f in EXPORT_SCHEMA])


@dataclass(frozen=True)
class Export:
    """An export's rows, conformed to EXPORT_SCHEMA, and the columns it had beyond it."""

    rows: pa.Table
    unknown_columns: dict[str, int]


def read_export(path: Path) -> Export:
    """Read a `.jsonl` or `.parquet` export and conform it to EXPORT_SCHEMA.

    Raises UnreadableLog when the bytes do not parse, ContractViolation when a column is
    missing or of a type that cannot stand for the contract's.
    """
    import pyarrow.json as pj

    path = Path(path)
    if path.stat().st_size == 0:
        raise UnreadableLog("empty file (0 bytes)")
    try:
        if path.suffix == JSONL_SUFFIX:
            raw = pj.read_json(
                path,
                parse_options=pj.ParseOptions(
                    explicit_schema=_JSONL_SCHEMA, unexpected_field_behavior="infer"
                ),
            )
            present = [n for n in raw.schema.names if raw.column(n).null_count < raw.num_rows]
        else:
            raw = pq.read_table(path)
            present = raw.schema.names
    except (pa.ArrowException, OSError) as exc:
        kind = "JSONL" if path.suffix == JSONL_SUFFIX else "Parquet"
        detail = (str(exc).splitlines() or [""])[0][:200]
        raise UnreadableLog(
            f"unreadable {kind} export ({exc.__class__.__name__}: {detail})"
        ) from None
    missing = [f.name for f in EXPORT_SCHEMA if not f.nullable and f.name not in present]
    if missing:
        raise ContractViolation(f"missing required column(s): {', '.join(missing)}")
    columns = {}
    for f in EXPORT_SCHEMA:
        if f.name in raw.schema.names:
            columns[f.name] = _export_column(raw.column(f.name), f)
        else:
            columns[f.name] = pa.nulls(raw.num_rows, f.type)
    rows = pa.table(columns, schema=EXPORT_SCHEMA)
    for f in EXPORT_SCHEMA:
        if not f.nullable and rows.column(f.name).null_count:
            raise ContractViolation(f"export column {f.name} has nulls")
    extra = {n: raw.num_rows for n in raw.schema.names if n not in EXPORT_SCHEMA.names}
    return Export(rows, extra)


def _export_column(column: pa.ChunkedArray, target: pa.Field) -> pa.Array:
    array = column.combine_chunks()
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    if pa.types.is_large_string(array.type):
        array = array.cast(pa.string())
    kind, want = array.type, target.type

    def wrong() -> ContractViolation:
        return ContractViolation(f"export column {target.name} has type {kind}, expected {want}")

    try:
        if pa.types.is_fixed_size_list(want):
            if not (
                pa.types.is_list(kind)
                or pa.types.is_large_list(kind)
                or pa.types.is_fixed_size_list(kind)
            ) or not (
                pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)
            ):
                raise wrong()
            lengths = pc.list_value_length(array).to_numpy(zero_copy_only=False)
            valid = array.is_valid().to_numpy(zero_copy_only=False)
            short = np.flatnonzero(valid & (lengths != want.list_size))
            if short.size:
                row = int(short[0])
                raise ContractViolation(
                    f"export column {target.name}: row {row} has {int(lengths[row])} values, "
                    f"expected {want.list_size}"
                )
            values = pc.list_flatten(array).cast(want.value_type)
            flat = values.to_numpy(zero_copy_only=False)
            matrix = np.zeros((len(array), want.list_size), dtype=np.float32)
            matrix[valid] = flat.reshape(-1, want.list_size)
            return _vectors(matrix, null=~valid if not valid.all() else None)
        if pa.types.is_timestamp(want):
            if pa.types.is_timestamp(kind):
                return array.cast(pa.timestamp(kind.unit, tz="UTC")).cast(want)
            if pa.types.is_integer(kind):
                return array.cast(pa.int64()).cast(want)
            raise wrong()
        if pa.types.is_string(want) and not (pa.types.is_string(kind) or pa.types.is_null(kind)):
            raise wrong()
        if pa.types.is_boolean(want) and not (pa.types.is_boolean(kind) or pa.types.is_null(kind)):
            raise wrong()
        if (pa.types.is_integer(want) or pa.types.is_floating(want)) and not (
            pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind)
        ):
            raise wrong()
        return array.cast(want)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise wrong() from None


def build_export_tables(
    export: Export,
    min_steps: int,
    provenance: Provenance,
    *,
    max_clock_jump_s: float | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The episodes and steps tables of one export (rows of one episode contiguous, in step
    order). Raises ContractViolation with a one-line reason."""
    rows = export.rows
    n = rows.num_rows
    if not n:
        raise ContractViolation("no episodes: the export has no rows")
    ids = rows.column("episode_id").to_numpy(zero_copy_only=False)
    boundary = np.r_[True, ids[1:] != ids[:-1]]
    firsts = np.flatnonzero(boundary)
    lasts = np.r_[firsts[1:], n]
    order = ids[firsts]
    if len(set(order)) != len(order):
        seen, twice = set(), None
        for episode_id in order:
            if episode_id in seen:
                twice = episode_id
                break
            seen.add(episode_id)
        raise ContractViolation(f"episode {twice}: its rows are not contiguous in the export")
    time_s = rows.column("time_s").to_numpy()
    step = rows.column("step").to_numpy()
    bound = max_clock_jump_s if max_clock_jump_s is not None else math.inf
    for a, b in zip(firsts, lasts, strict=True):
        _check_export_episode(str(ids[a]), time_s[a:b], step[a:b], int(a), bound, min_steps)
    for name in EXPORT_EPISODE_COLUMNS:
        changes = _row_changes(rows.column(name)) & ~boundary[1:]
        if changes.any():
            row = int(np.flatnonzero(changes)[0]) + 1
            raise ContractViolation(
                f"episode {ids[row]}: export column {name} differs between its rows (row {row})"
            )
    intervention = rows.column("intervention").to_numpy(zero_copy_only=False)
    corrected = rows.column("corrected_action").is_valid().to_numpy(zero_copy_only=False)
    stray = np.flatnonzero(corrected & ~intervention)
    if stray.size:
        row = int(stray[0])
        raise ContractViolation(
            f"episode {ids[row]}: corrected_action on step {int(step[row])}, which is not an "
            "intervention"
        )
    head = rows.take(pa.array(firsts))
    columns = {name: head.column(name) for name in EXPORT_EPISODE_COLUMNS}
    columns["steps"] = pa.array(lasts - firsts, pa.int32())
    columns["source_chunk"] = pa.array(
        [f"rows={a}-{b - 1}" for a, b in zip(firsts, lasts, strict=True)], pa.string()
    )
    episodes = _finish_episodes(columns, len(firsts), provenance)
    steps = conform(rows.select(["episode_id", *EXPORT_STEP_COLUMNS]), schema.STEPS_SCHEMA, "steps")
    return episodes, steps


def _check_export_episode(
    episode_id: str, time_s: np.ndarray, step: np.ndarray, first_row: int, bound: float, min_steps
) -> None:
    gaps = np.diff(time_s)
    if (gaps < 0).any():
        i = int(np.flatnonzero(gaps < 0)[0]) + 1
        raise ContractViolation(
            f"non-monotonic timestamps: time_s goes back from {time_s[i - 1]:g} to "
            f"{time_s[i]:g} s at row {first_row + i}, in episode {episode_id}"
        )
    if (gaps == 0).any():
        i = int(np.flatnonzero(gaps == 0)[0]) + 1
        raise ContractViolation(
            f"duplicate timestamps: time_s {time_s[i]:g} s repeats at row {first_row + i}, "
            f"in episode {episode_id}"
        )
    jumps = np.r_[time_s[0], gaps]
    if (jumps > bound).any():
        i = int(np.flatnonzero(jumps > bound)[0])
        where = "its start and its first step" if i == 0 else f"steps {i - 1} and {i}"
        raise ContractViolation(
            f"clock jump: time_s jumps {jumps[i]:.3f} s between {where} of episode "
            f"{episode_id} (over ingest.max_clock_jump_s = {bound:g} s)"
        )
    if not np.array_equal(step, np.arange(len(step))):
        i = int(np.flatnonzero(step != np.arange(len(step)))[0])
        raise ContractViolation(
            f"episode {episode_id}: steps are not 0..n-1 in row order (row {first_row + i} "
            f"has step {int(step[i])}, expected {i})"
        )
    if len(step) < min_steps:
        raise ContractViolation(
            f"episode {episode_id} has {len(step)} steps, fewer than ingest.min_steps ({min_steps})"
        )


def _row_changes(column) -> np.ndarray:
    """Per row after the first: does its value differ from the row before (nulls equal)."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    matrix, valid = _numeric_matrix(array)
    if matrix is None:
        values = array.to_numpy(zero_copy_only=False)
        return np.asarray(values[1:] != values[:-1], dtype=bool)
    same = (matrix[1:] == matrix[:-1]) | (
        np.isnan(matrix[1:]) & np.isnan(matrix[:-1])
        if np.issubdtype(matrix.dtype, np.floating)
        else False
    )
    return ~same.all(axis=1) | (valid[1:] != valid[:-1])


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
        if not path.resolve().is_relative_to(sidecar.parent.resolve()):
            raise ContractViolation(f"capture attachment {name} escapes the captures folder")
        files.append(path)
    log_time = meta.get("log_time_ns")
    return Capture(
        episode_id, reason, log_time if isinstance(log_time, int) else 0, tuple(files), sidecar
    )


def mark_edge_cases(
    episodes: pa.Table, captures: Mapping[str, list[Capture]]
) -> tuple[pa.Table, dict[str, list[Path]]]:
    """Fill edge_case, edge_case_reasons and attachments (sha256s); return the table and
    each episode's attachment files to store. Episodes without captures keep edge_case
    false and null lists."""
    flags, reasons, shas, files = [], [], [], {}
    for episode_id in episodes.column("episode_id").to_pylist():
        found = sorted(captures.get(episode_id, []), key=lambda c: (c.log_time_ns, c.reason))
        flags.append(bool(found))
        reasons.append(list(dict.fromkeys(c.reason for c in found)) if found else None)
        paths = [p for c in found for p in c.attachments]
        if paths:
            files[episode_id] = paths
        shas.append(list(dict.fromkeys(sha256_file(p) for p in paths)) if found else None)
    for name, values in (
        ("edge_case", flags),
        ("edge_case_reasons", reasons),
        ("attachments", shas),
    ):
        index = episodes.schema.get_field_index(name)
        episodes = episodes.set_column(
            index, episodes.schema.field(index), pa.array(values, episodes.schema.field(index).type)
        )
    return episodes, files


def with_edge_cases(
    episodes: pa.Table, captures: Mapping[str, list[Capture]], attachments_dir: Path
) -> pa.Table:
    """`mark_edge_cases`, storing the attachment files at once."""
    episodes, files = mark_edge_cases(episodes, captures)
    for paths in files.values():
        for path in paths:
            store_attachment(path, attachments_dir)
    return episodes


def store_attachment(path: Path, attachments_dir: Path, tmp_dir: Path | None = None) -> str:
    """Copy `path` to `<attachments_dir>/<sha256>.<ext>` unless that content is stored."""
    sha = sha256_file(path)
    ext = path.suffix.lower().lstrip(".") or "bin"
    dest = attachments_dir / f"{sha}.{ext}"
    if not dest.exists():

        def copy(stream) -> None:
            with path.open("rb") as source:
                shutil.copyfileobj(source, stream)

        _write_atomically(dest, copy, tmp_dir=tmp_dir)
    return sha


def read_captures(
    sidecars: Iterable[Path], quarantine: Path, run_id: str
) -> tuple[dict[str, list[Capture]], list[FileResult]]:
    """Captures by episode id, and a quarantine result for each sidecar that cannot be read."""
    captures: dict[str, list[Capture]] = {}
    results = []
    for sidecar in sidecars:
        try:
            capture = read_capture(sidecar)
        except ContractViolation as exc:
            try:
                entry = quarantine_file(sidecar, f"capture: {exc}", quarantine, run_id)
            except FileNotFoundError:
                continue  # another run quarantined it
            results.append(
                FileResult(
                    entry["source"],
                    entry["sha256"],
                    entry["size"],
                    QUARANTINED,
                    entry["reason"],
                    0,
                    0,
                    entry["moved_to"],
                )
            )
            continue
        captures.setdefault(capture.episode_id, []).append(capture)
    return captures, results


def ingest_captures(
    sidecars: Iterable[Path], dataset: Path, quarantine: Path, run_id: str
) -> tuple[dict[str, list[Capture]], list[FileResult]]:
    """`read_captures`, with a manifest line for each sidecar it quarantines. A flow calls it
    once per run and passes the captures to each `ingest_file`."""
    captures, rejected = read_captures(sidecars, quarantine, run_id)
    for result in rejected:
        record_in_manifest(dataset, result, run_id)
    return captures, rejected


def record_in_manifest(dataset: Path, result: FileResult, run_id: str) -> FileResult:
    """Append a manifest line for a file handled outside `ingest_file` (e.g. quarantined by
    a source that refused its name)."""
    store = _Store(dataset)
    store.parent.mkdir(parents=True, exist_ok=True)
    with store.locked():
        return store.record(result, run_id)


def _captures_near(path: Path, landing: Path, episode_ids: Iterable[str]) -> dict:
    """The readable captures of these episodes in `<landing>/captures/` and in the
    `captures/` folder next to the file (unreadable sidecars are ingest_landing's to
    quarantine)."""
    wanted = set(episode_ids)
    folders = dict.fromkeys([Path(landing) / CAPTURES_DIR, Path(path).parent / CAPTURES_DIR])
    captures: dict[str, list[Capture]] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        for sidecar in sorted(folder.glob("*.json")):
            if sidecar.name.startswith(".") or not any(
                sidecar.name.startswith(f"{e}_") for e in wanted
            ):
                continue
            try:
                capture = read_capture(sidecar)
            except ContractViolation:
                continue
            if capture.episode_id in wanted:
                captures.setdefault(capture.episode_id, []).append(capture)
    return captures


# --- digests: is an episode the same episode? -------------------------------------------


def episode_digests(episodes: pa.Table, steps: pa.Table) -> dict[str, str]:
    """sha256 per episode id over what happened (its episode row without provenance or
    edge-case columns, and its steps), the same for a log and an export of it."""
    content = [n for n in episodes.schema.names if n not in _NOT_CONTENT]
    rows = episodes.select(content)
    if "start_time" in content:
        index = rows.schema.get_field_index("start_time")
        rows = rows.set_column(index, "start_time", rows.column("start_time").cast(pa.int64()))
    codes, names = _codes(steps.column("episode_id"))
    if not _grouped(codes, steps.column("step").to_numpy()):
        order = pc.sort_indices(steps, [("episode_id", "ascending"), ("step", "ascending")])
        steps = steps.take(order)
        codes, names = _codes(steps.column("episode_id"))
    columns = []
    for name in steps.schema.names:
        if name == "episode_id":
            continue
        matrix, valid = _numeric_matrix(steps.column(name))
        columns += [np.ascontiguousarray(matrix), np.ascontiguousarray(valid)]
    bounds = {}
    if len(codes):
        firsts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        lasts = np.r_[firsts[1:], len(codes)]
        bounds = {names[codes[a]]: (a, b) for a, b in zip(firsts, lasts, strict=True)}
    digests = {}
    for row in rows.to_pylist():
        h = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode())
        a, b = bounds.get(row["episode_id"], (0, 0))
        for column in columns:
            h.update(column[a:b].tobytes())
        digests[row["episode_id"]] = h.hexdigest()
    return digests


def _codes(column) -> tuple[np.ndarray, list[str]]:
    """A string column as integer codes and the strings they stand for."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    encoded = array.dictionary_encode()
    return encoded.indices.to_numpy(zero_copy_only=False), encoded.dictionary.to_pylist()


def _grouped(ids: np.ndarray, step: np.ndarray) -> bool:
    """Each episode's rows together and in step order (as ingest builds them)?"""
    if len(ids) < 2:
        return True
    change = ids[1:] != ids[:-1]
    if len(set(ids[np.r_[True, change]])) != int(change.sum()) + 1:
        return False
    return bool(np.all(change | (np.diff(step) > 0)))


def dataset_content_hash(dataset: Path, exclude: Iterable[str] = RUN_COLUMNS) -> str:
    """sha256 over every file under the dataset folder, by relative path; the episodes files
    with the `exclude` columns left out (by default which run wrote them and when).

    With exclude=() this is a plain hash of every file's bytes.
    """
    dataset = Path(dataset)
    exclude = tuple(exclude)
    h = hashlib.sha256()
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        relative = path.relative_to(dataset).as_posix()
        if exclude and relative.startswith(f"{EPISODES_DIR}/") and path.suffix == ".parquet":
            table = read_table(path, schema.EPISODES_SCHEMA).drop_columns(list(exclude))
            rows = table.select([n for n in table.schema.names if n != "start_time"]).to_pylist()
            starts = table.column("start_time").cast(pa.int64()).to_pylist()
            text = json.dumps([r | {"start_time": s} for r, s in zip(rows, starts, strict=True)])
            digest = hashlib.sha256(text.encode()).hexdigest()
        else:
            digest = sha256_file(path)
        h.update(f"{relative}\0{digest}\n".encode())
    return h.hexdigest()


# --- the dataset's neighbours: lock, temp folder, manifest, episode index ---------------


# Per process: index file → (inode, bytes read, the last of them, {sha256: {episode: digest}}).
_INDEX_CACHE: dict[Path, tuple[int | None, int, bytes, dict[str, dict[str, str]]]] = {}
_INDEX_GUARD = threading.Lock()


class _Store:
    """The dataset folder and the files ingest keeps next to it."""

    def __init__(self, dataset: Path):
        self.dataset = Path(dataset)
        self.parent = self.dataset.parent
        self.episodes = self.dataset / EPISODES_DIR
        self.steps = self.dataset / STEPS_DIR
        self.attachments = self.dataset / ATTACHMENTS_DIR
        self.tmp = self.parent / TMP_DIR_NAME
        self.lock_path = self.parent / LOCK_NAME
        self.manifest = self.parent / MANIFEST_NAME
        self.index = self.parent / f".ingest-index-{self.dataset.name}.jsonl"

    def prepare(self) -> None:
        for folder in (self.episodes, self.steps, self.attachments, self.tmp):
            folder.mkdir(parents=True, exist_ok=True)

    def remove_stale_temporaries(self) -> None:
        """Temporaries left by a crashed run (older than an hour, so never a live run's).
        Those in the temp folder are invisible to the dataset anyway; older versions of
        ingest left theirs inside the dataset's folders."""
        for folder, pattern in (
            (self.tmp, "*"),
            (self.episodes, f"{_TMP_PREFIX}*.tmp"),
            (self.steps, f"{_TMP_PREFIX}*.tmp"),
            (self.attachments, f"{_TMP_PREFIX}*.tmp"),
        ):
            _remove_old(folder, pattern)

    def has_source(self, sha: str) -> bool:
        return (self.episodes / f"{sha}.parquet").is_file()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The dataset's check-and-publish lock (flock: released if the process dies)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def record(self, result: FileResult, run_id: str) -> FileResult:
        """Append the file's manifest line (hold the lock)."""
        row = {
            "source": result.source,
            "sha256": result.sha256 or None,
            "size": result.size,
            "result": result.result,
            "reason": result.reason,
            "run_id": run_id,
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "episodes": result.episodes,
            "steps": result.steps,
            "moved_to": result.moved_to,
        }
        if result.unknown_topics:
            row["unknown_topics"] = result.unknown_topics
        _append_line(self.manifest, row)
        return result

    def episode_index(self) -> dict[str, tuple[str, str]]:
        """episode id → (source sha256, content digest) for every source in the dataset
        (hold the lock). Read from the index file, which is a cache: sources it lacks are
        digested from their Parquet files and added; lines of sources no longer in the
        dataset are ignored."""
        with _INDEX_GUARD:
            known = self._read_index()
        present = sorted(p.stem for p in self.episodes.glob("*.parquet"))
        for sha in present:
            if sha not in known:
                known[sha] = _stored_digests(self, sha)
                self.add_to_index(sha, known[sha])
        index: dict[str, tuple[str, str]] = {}
        for sha in present:
            for episode_id, digest in known.get(sha, {}).items():
                index.setdefault(episode_id, (sha, digest))
        return index

    def _read_index(self) -> dict[str, dict[str, str]]:
        """The index file's entries, reading only what was appended since this process last
        read it (the cache is dropped when the file is another one or was rewritten)."""
        try:
            info = self.index.stat()
        except FileNotFoundError:
            _INDEX_CACHE.pop(self.index, None)
            return {}
        inode, offset, tail, known = _INDEX_CACHE.get(self.index, (None, 0, b"", {}))
        with self.index.open("rb") as stream:
            if inode != info.st_ino or info.st_size < offset:
                offset, tail, known = 0, b"", {}
            elif offset:
                stream.seek(offset - len(tail))
                if stream.read(len(tail)) != tail:
                    offset, tail, known = 0, b"", {}
            known = dict(known)
            stream.seek(offset)
            data = stream.read(info.st_size - offset)
        whole = data.rfind(b"\n") + 1
        for line in data[:whole].splitlines():
            try:
                entry = json.loads(line)
                known[entry["sha256"]] = dict(entry["episodes"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash: that source is digested again
        if whole:
            offset, tail = offset + whole, data[max(0, whole - 256) : whole]
        _INDEX_CACHE[self.index] = (info.st_ino, offset, tail, known)
        return known

    def add_to_index(self, sha: str, digests: dict[str, str]) -> None:
        _append_line(self.index, {"sha256": sha, "episodes": digests})


def _stored_digests(store: _Store, sha: str) -> dict[str, str]:
    episodes = read_table(store.episodes / f"{sha}.parquet", schema.EPISODES_SCHEMA)
    steps_path = store.steps / f"{sha}.parquet"
    steps = (
        read_table(steps_path, schema.STEPS_SCHEMA)
        if steps_path.is_file()
        else schema.STEPS_SCHEMA.empty_table()
    )
    return episode_digests(episodes, steps)


def read_manifest(dataset: Path) -> list[dict]:
    """The manifest lines next to `dataset`, oldest first (a line cut by a crash skipped)."""
    path = Path(dataset).parent / MANIFEST_NAME
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _append_line(path: Path, row: dict) -> None:
    """Append one JSON line with one write; a line left unfinished by a crash is closed
    first so that it cannot swallow this one."""
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


# --- one landed file → the dataset ------------------------------------------------------


def sha256_file(path: Path) -> str:
    with Path(path).open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def ingest_file(
    path: Path,
    landing: Path,
    dataset: Path,
    quarantine: Path,
    cell: CellParams,
    params: IngestParams,
    run_id: str,
    source_uri: str | None = None,
    *,
    ingested_at: datetime | None = None,
    captures: Mapping[str, list[Capture]] | None = None,
) -> FileResult:
    """Ingest one landed file (an MCAP log or a JSONL/Parquet export): into the dataset, or
    into quarantine with a reason, or skipped because its content is there already.

    `source_uri` is recorded as the episodes' source (default: the file's resolved path).
    `ingested_at` defaults to now; a flow passes its run's start so that all its files share
    it. `captures` (by episode id) default to the readable sidecars in `<landing>/captures/`
    and in `captures/` next to the file. Raises FileNotFoundError when the file is gone
    before it could be ingested (another run quarantined it, or it was removed): that file
    did not land after all. Safe to run concurrently, from threads or processes.
    """
    path, landing, quarantine = Path(path), Path(landing), Path(quarantine)
    store = _Store(dataset)
    store.prepare()
    escape = _escape_reason(path, landing)
    if escape:
        # Move only an entry that is itself in the landing folder (a symlink), never what it
        # points to; a `..` path is not the landing folder's to move.
        inside = path.is_symlink() and path.parent.resolve().is_relative_to(landing.resolve())
        source = source_uri or str(path)
        return _quarantine(store, path, escape, quarantine, run_id, source, "", 0, move=inside)
    source = source_uri or str(path.resolve())
    try:
        info = path.stat()
    except FileNotFoundError:
        if not path.is_symlink():
            raise
        reason = f"not a regular file: dangling symlink to {os.readlink(path)}"
        source = source_uri or str(path.absolute())
        return _quarantine(store, path, reason, quarantine, run_id, source, "", 0)
    if not stat.S_ISREG(info.st_mode):
        reason = f"not a regular file ({_file_kind(info.st_mode)})"
        return _quarantine(store, path, reason, quarantine, run_id, source, "", 0)
    size = info.st_size
    sha = sha256_file(path)
    refused = _refusal(path, size, params)
    if refused:
        return _quarantine(store, path, refused, quarantine, run_id, source, sha, size)
    if store.has_source(sha):
        with store.locked():
            return store.record(_skipped(source, sha, size, ALREADY_INGESTED), run_id)
    provenance = Provenance(
        source, sha, run_id, ingested_at or datetime.now(UTC), _realloop_version()
    )
    try:
        episodes, steps, unknown = _decode(path, cell, params, provenance)
    except QuarantineError as exc:
        return _quarantine(store, path, str(exc), quarantine, run_id, source, sha, size)
    ids = episodes.column("episode_id").to_pylist()
    found = captures if captures is not None else _captures_near(path, landing, ids)
    episodes, attachment_files = mark_edge_cases(episodes, found)
    digests = episode_digests(episodes, steps)
    staged = [
        _stage(store, steps, schema.STEPS_SCHEMA),
        _stage(store, episodes, schema.EPISODES_SCHEMA),
    ]
    try:
        with store.locked():
            if store.has_source(sha):  # another run published it meanwhile
                return store.record(_skipped(source, sha, size, ALREADY_INGESTED), run_id)
            index = store.episode_index()
            same, note = [], None
            for episode_id, digest in digests.items():
                held = index.get(episode_id)
                if held is None or held[0] == sha:
                    continue
                if held[1] != digest:
                    reason = (
                        f"episode {episode_id} already in the dataset with different content "
                        f"(from source {held[0][:12]})"
                    )
                    return _quarantine(
                        store, path, reason, quarantine, run_id, source, sha, size, locked=True
                    )
                same.append(episode_id)
            if same:
                sources = sorted({index[e][0][:12] for e in same})
                if len(same) == len(digests):
                    reason = (
                        f"all {len(same)} episodes already in the dataset with the same content "
                        f"(from source {', '.join(sources)})"
                    )
                    return store.record(_skipped(source, sha, size, reason), run_id)
                note = (
                    f"{len(same)} of {len(digests)} episodes left out: already in the dataset "
                    f"with the same content (from source {', '.join(sources)})"
                )
                keep = pa.array([e not in same for e in ids])
                episodes = episodes.filter(keep)
                steps = steps.filter(
                    pc.invert(pc.is_in(steps.column("episode_id"), pa.array(same)))
                )
                digests = {e: d for e, d in digests.items() if e not in same}
                for tmp in staged:
                    tmp.unlink(missing_ok=True)
                staged = [
                    _stage(store, steps, schema.STEPS_SCHEMA),
                    _stage(store, episodes, schema.EPISODES_SCHEMA),
                ]
                attachment_files = {
                    e: paths for e, paths in attachment_files.items() if e not in same
                }
            for paths in attachment_files.values():
                for attachment in paths:
                    store_attachment(attachment, store.attachments, store.tmp)
            # steps first, episodes last: an episodes file means its source is complete
            os.replace(staged[0], store.steps / f"{sha}.parquet")
            os.replace(staged[1], store.episodes / f"{sha}.parquet")
            _fsync_dirs(store.attachments, store.steps, store.episodes)
            store.add_to_index(sha, digests)
            result = FileResult(
                source, sha, size, INGESTED, note, episodes.num_rows, steps.num_rows, None, unknown
            )
            return store.record(result, run_id)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)


def _decode(
    path: Path, cell: CellParams, params: IngestParams, provenance: Provenance
) -> tuple[pa.Table, pa.Table, dict[str, int]]:
    """(episodes, steps, unknown topics or columns) of a log or an export, values checked."""
    if path.suffix == LOG_SUFFIX:
        log = read_log(path)
        episodes, steps = build_tables(
            log, cell, params.min_steps, provenance, max_clock_jump_s=params.max_clock_jump_s
        )
        unknown = log.unknown_topics
    else:
        export = read_export(path)
        episodes, steps = build_export_tables(
            export, params.min_steps, provenance, max_clock_jump_s=params.max_clock_jump_s
        )
        unknown = export.unknown_columns
    check_values(episodes, steps, cell, params)
    return episodes, steps, unknown


def _refusal(path: Path, size: int, params: IngestParams) -> str | None:
    """Reasons to quarantine a file before reading it."""
    if path.suffix not in (LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX):
        return (
            f"unsupported file type {path.suffix or '(none)'!r}: ingest reads "
            f"{LOG_SUFFIX} logs and {JSONL_SUFFIX}/{PARQUET_SUFFIX} exports"
        )
    if size > params.max_file_bytes:
        return f"file too large: {size} bytes, over ingest.max_file_bytes ({params.max_file_bytes})"
    if size == 0:
        return "empty file (0 bytes)"
    return None


def _escape_reason(path: Path, landing: Path) -> str | None:
    """A path that leads outside the landing folder (through `..` or a symlink)."""
    root = landing.resolve()
    real = path.resolve()
    if real == root or not real.is_relative_to(root):
        return f"file name escapes the landing folder: {path} resolves to {real}, outside {root}"
    return None


def _file_kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _skipped(source: str, sha: str, size: int, reason: str) -> FileResult:
    return FileResult(source, sha, size, SKIPPED, reason, 0, 0, None)


def _quarantine(
    store: _Store,
    path: Path,
    reason: str,
    quarantine: Path,
    run_id: str,
    source: str,
    sha: str,
    size: int,
    *,
    move: bool = True,
    locked: bool = False,
) -> FileResult:
    """Quarantine under the dataset lock (unless the caller holds it) and record it.

    `move=False` writes only the reason file (a path that is not the landing folder's)."""
    if not locked:
        with store.locked():
            return _quarantine(
                store, path, reason, quarantine, run_id, source, sha, size, move=move, locked=True
            )
    entry = quarantine_file(path, reason, quarantine, run_id, sha or None, source=source, move=move)
    result = FileResult(
        source, sha or entry["sha256"], size, QUARANTINED, entry["reason"], 0, 0, entry["moved_to"]
    )
    return store.record(result, run_id)


# --- a landing folder → the dataset -----------------------------------------------------


def ingest_landing(
    landing: Path,
    dataset: Path,
    quarantine: Path,
    cell: CellParams,
    params: IngestParams,
    run_id: str,
    progress: Callable[[int, int], None] | None = None,
    *,
    ingested_at: datetime | None = None,
) -> IngestReport:
    """Ingest every new log and export under `landing`; quarantine what cannot be ingested.

    `progress(done, total)` is called after each file.
    """
    landing, dataset, quarantine = Path(landing), Path(dataset), Path(quarantine)
    if not landing.is_dir():
        raise FileNotFoundError(f"{landing}: landing folder not found")
    store = _Store(dataset)
    store.prepare()
    store.remove_stale_temporaries()
    ingested_at = ingested_at or datetime.now(UTC)
    report = IngestReport(run_id)
    files, sidecars = landing_files(landing, exclude=(dataset, quarantine, store.manifest))
    captures, rejected = ingest_captures(sidecars, dataset, quarantine, run_id)
    for result in rejected:
        report.add(result)
    for done, path in enumerate(files, start=1):
        try:
            result = ingest_file(
                path,
                landing,
                dataset,
                quarantine,
                cell,
                params,
                run_id,
                ingested_at=ingested_at,
                captures=captures,
            )
        except FileNotFoundError:
            pass  # moved away since the listing (another run quarantined it): not ours
        else:
            report.add(result)
        if progress:
            progress(done, len(files))
    return report


def landing_files(landing: Path, exclude: Iterable[Path] = ()) -> tuple[list[Path], list[Path]]:
    """(logs and exports, capture sidecars) under `landing`, sorted.

    Skips dot-folders and dotfiles, `*.partial` files (still being written) and the paths
    in `exclude`. MCAP files in `captures/` folders are capture windows, not shift logs.
    Symlinks are listed as they are (ingest_file refuses those that lead outside).
    """
    skip = {Path(p).absolute() for p in exclude} | {Path(p).resolve() for p in exclude}
    logs, sidecars = [], []
    for root, dirs, files in os.walk(landing):
        here = Path(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and (here / d).absolute() not in skip
            and (here / d).resolve() not in skip
        )
        in_captures = here.name == CAPTURES_DIR
        for name in sorted(files):
            if name.startswith(".") or (here / name).absolute() in skip:
                continue
            if in_captures and name.endswith(".json"):
                sidecars.append(here / name)
            elif not in_captures and name.endswith((LOG_SUFFIX, JSONL_SUFFIX, PARQUET_SUFFIX)):
                logs.append(here / name)
    return logs, sidecars


def quarantine_file(
    path: Path,
    reason: str,
    quarantine: Path,
    run_id: str,
    sha256: str | None = None,
    *,
    source: str | None = None,
    move: bool = True,
) -> dict:
    """Move `path` into `quarantine`, next to `<name>.reason.txt`; never overwrite.

    The reason file is written first: a crash before the move leaves the file in landing,
    and the next run quarantines it under the same name. `move=False` writes only the reason
    file (for a path that must not be touched). A symlink is moved as the link, never
    followed. Raises FileNotFoundError (and leaves no reason file) when `path` is gone.
    """
    quarantine.mkdir(parents=True, exist_ok=True)
    path = Path(path)
    # Read only a regular file (never through a symlink, never a pipe that would block).
    readable = move and os.path.lexists(path) and stat.S_ISREG(os.lstat(path).st_mode)
    sha = sha256 or (sha256_file(path) if readable else "")
    size = path.lstat().st_size if move and os.path.lexists(path) else 0
    reason = " ".join(reason.split())  # one line
    source = source or str(path.resolve() if readable else path.absolute())
    with _quarantine_lock(quarantine):
        if move and not os.path.lexists(path):
            raise FileNotFoundError(f"{path}: gone before it could be quarantined")
        dest = _free_name(quarantine, path.name, sha)
        note = (
            f"{reason}\nsource: {source}\nsha256: {sha}\n"
            f"time: {datetime.now(UTC).isoformat(timespec='seconds')}\ningest_run_id: {run_id}\n"
            f"moved_to: {dest if move else '(not moved: outside the landing folder)'}\n"
        )
        reason_path = dest.with_name(dest.name + REASON_SUFFIX)
        _write_atomically(reason_path, lambda stream: stream.write(note.encode()))
        if move:
            try:
                os.rename(path, dest)
            except OSError as exc:
                if not os.path.lexists(path):
                    reason_path.unlink(missing_ok=True)
                    raise FileNotFoundError(f"{path}: gone before it could be quarantined") from exc
                shutil.move(path, dest)  # another filesystem
            _fsync_dirs(quarantine)
    return {
        "source": source,
        "sha256": sha,
        "size": size,
        "reason": reason,
        "moved_to": str(dest) if move else None,
    }


@contextmanager
def _quarantine_lock(quarantine: Path) -> Iterator[None]:
    fd = os.open(quarantine / ".quarantine.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _free_name(folder: Path, name: str, sha: str) -> Path:
    """`name`, else `<stem>.<sha12><suffix>`, else numbered; a name whose reason file was
    left by a crash before the move, for this same content, is taken up again."""
    stem, suffix = Path(name).stem, Path(name).suffix
    candidates = [name, f"{stem}.{sha[:12]}{suffix}"]
    candidates += [f"{stem}.{sha[:12]}-{i}{suffix}" for i in range(2, 1000)]
    for candidate in candidates:
        dest = folder / candidate
        if os.path.lexists(dest):
            continue
        reason = dest.with_name(candidate + REASON_SUFFIX)
        if not reason.exists() or _orphan_of(reason, sha):
            return dest
    raise FileExistsError(f"{folder}: no free quarantine name for {name}")


def _orphan_of(reason: Path, sha: str) -> bool:
    try:
        lines = reason.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return (
        bool(sha)
        and f"sha256: {sha}" in lines
        and not any(line.startswith("moved_to: (not moved") for line in lines)
    )


# --- Parquet files --------------------------------------------------------------------------


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


def _parquet_writer(table: pa.Table, target: pa.Schema, where: str):
    """Conform `table` and return a function that writes it as Parquet to a stream, and a
    function that reads a written file back against the contract."""
    stored = conform(table, target, where).cast(storage_schema(target))

    def write(stream) -> None:
        pq.write_table(stored, stream, compression=PARQUET_COMPRESSION)

    def check(tmp: Path) -> None:
        back = read_table(tmp, target)
        if not back.schema.equals(target) or back.num_rows != table.num_rows:
            raise RuntimeError(f"{where}: written table differs from the data contract")

    return write, check


def write_table(table: pa.Table, path: Path, target: pa.Schema) -> None:
    """Write Parquet (zstd) to a temporary name, read it back against the contract, then
    move it into place."""
    write, check = _parquet_writer(table, target, path.parent.name)
    _write_atomically(path, write, check)


def _stage(store: _Store, table: pa.Table, target: pa.Schema) -> Path:
    """Write a table to a new file in the hidden temp folder, checked; return its path."""
    what = EPISODES_DIR if target is schema.EPISODES_SCHEMA else STEPS_DIR
    write, check = _parquet_writer(table, target, what)
    tmp = store.tmp / f"{what}.{os.getpid()}.{uuid.uuid4().hex[:12]}.parquet.tmp"
    try:
        with tmp.open("wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        check(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def read_table(path: Path, target: pa.Schema) -> pa.Table:
    """One dataset Parquet file, cast to the contract schema exactly."""
    return pq.read_table(path, schema=storage_schema(target)).cast(target)


def _write_atomically(path: Path, write, check=None, tmp_dir: Path | None = None) -> None:
    folder = tmp_dir or path.parent
    tmp = folder / f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}.tmp"
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


def _fsync_dirs(*folders: Path) -> None:
    """Make renames into these folders durable (a power cut, not only a killed process)."""
    for folder in folders:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _remove_old(folder: Path, pattern: str) -> None:
    cutoff = time.time() - _STALE_TMP_S
    for tmp in folder.glob(pattern):
        try:
            if tmp.is_file() and tmp.stat().st_mtime < cutoff:
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
