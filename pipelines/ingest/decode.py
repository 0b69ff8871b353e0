"""Fast decoding of ROS 2 MCAP logs (CDR, as rosbag2 and refcell's recorder write them).

The official mcap reader with the mcap-ros2 decoder manages 15-20k messages/s on one core,
too slow for kHz joint states from a fleet. This module decodes the message types of the data
contract into numpy column arrays per topic, in pure Python and numpy (about 1.7 million
7-joint JointState messages/s on one core; bench/ingest and docs/benchmarks.md):

- Streaming. The data section is read record by record with plain file reads; each chunk is
  read, decompressed (zstd, lz4 or none) and CRC-checked on its own, so memory holds a few
  chunks whatever the file size. The summary section is never needed: files with and without
  one decode the same. `iter_batches` yields one batch per chunk for callers that stream on.
- Finding messages. The MessageIndex records after a chunk list each message's offset. They are
  checked (every offset points at a Message record, and with the chunk's Schema/Channel records
  they tile the chunk exactly) and then used as they are. Without them, or if they do not check
  out, a scan finds the records: it walks records one by one until their (opcode, length)
  pattern repeats, then predicts the following record positions from that period and verifies
  the predictions with one numpy gather, so that a chunk of regular records costs a few
  vectorized steps instead of one Python step per record. Every accepted record is verified.
- Decoding. Messages of one channel almost always share one byte layout (same frame_id, same
  joint names). Payloads are grouped by (channel, length); the first payload of a group is
  parsed in full (the template), every other payload is checked against the template's
  structural bytes (encapsulation, string and sequence lengths, string contents, not padding)
  in one vectorized comparison, and the numeric fields are views at the template's offsets
  (CDR alignment from the 4-byte encapsulation header). Payloads that do not match get a
  template of their own, and past a few templates a correct per-message slow path.

Errors are `McapDecodeError`, one line, with a `kind` saying which problem it is (see KINDS);
the caller quarantines the file. `decode_log` adapts the result
to `pipelines.ingest.store.DecodedLog`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipelines.contract import schema
from pipelines.ingest.decoded import TOPIC_TYPES, ContractViolation, DecodedLog, check_channels

MCAP_MAGIC = b"\x89MCAP0\r\n"

# McapDecodeError.kind values: what the ingest owner maps to quarantine reasons.
EMPTY = "empty"  # a 0-byte file
BAD_MAGIC = "bad_magic"  # does not start with the MCAP magic
TRUNCATED = "truncated"  # cut off: no footer and closing magic, or a record cut short
CRC_MISMATCH = "crc_mismatch"  # a chunk or data-section CRC that is present does not match
CORRUPT = "corrupt"  # bytes that do not parse as MCAP records or CDR messages
UNKNOWN_COMPRESSION = "unknown_compression"  # a chunk compression other than zstd, lz4, none
UNKNOWN_ENCODING = "unknown_encoding"  # a message encoding other than cdr, or a CDR variant
UNKNOWN_SCHEMA = "unknown_schema"  # no schema, an unsupported schema, or one that differs
KINDS = (
    EMPTY,
    BAD_MAGIC,
    TRUNCATED,
    CRC_MISMATCH,
    CORRUPT,
    UNKNOWN_COMPRESSION,
    UNKNOWN_ENCODING,
    UNKNOWN_SCHEMA,
)


class McapDecodeError(ValueError):
    """A log that cannot be decoded. str() is a one-line reason; `kind` is one of KINDS."""

    def __init__(self, kind: str, reason: str):
        reason = " ".join(str(reason).split())
        super().__init__(reason)
        self.kind = kind


# --- results -------------------------------------------------------------------------------


@dataclass
class Labels:
    """A string field stored once per distinct value: `values[codes[i]]` is message i's."""

    values: list  # str, or tuple[str, ...] for string sequences (joint names)
    codes: np.ndarray  # int32 (n,)

    def __getitem__(self, i: int):
        return self.values[self.codes[i]]


@dataclass
class TopicArrays:
    """One topic's messages as columns, row i being message i.

    `fields` by message type (float sequences whose length varies between messages are
    padded with NaN to the longest):
    - sensor_msgs/msg/JointState: stamp int64 ns (n,); position, velocity, effort float64 (n, k)
      with their lengths per message, and labels frame_id and name (tuples, in the order of
      the arrays' columns);
    - geometry_msgs/msg/PoseStamped: stamp; position (n, 3), orientation (n, 4) x, y, z, w;
      label frame_id;
    - geometry_msgs/msg/TwistStamped: stamp; linear (n, 3), angular (n, 3); label frame_id;
    - std_msgs/msg/Float32: data float32 (n,);
    - std_msgs/msg/String: data object (n,) of str.
    """

    topic: str
    datatype: str
    log_time: np.ndarray  # int64 ns (n,)
    fields: dict[str, np.ndarray]
    labels: dict[str, Labels] = field(default_factory=dict)
    lengths: dict[str, np.ndarray] = field(default_factory=dict)  # int32 (n,) per sequence

    def __len__(self) -> int:
        return len(self.log_time)


@dataclass(frozen=True)
class ChannelInfo:
    id: int
    topic: str
    message_encoding: str
    schema_name: str  # "" without a schema
    schema_encoding: str


@dataclass(frozen=True)
class ChunkInfo:
    message_start_time: int
    message_end_time: int
    offset: int  # of the Chunk record in the file
    length: int  # of the whole record (opcode and length prefix included)
    compression: str
    messages: int


@dataclass(frozen=True)
class AttachmentInfo:
    name: str
    media_type: str
    log_time: int
    create_time: int
    offset: int  # of the Attachment record in the file
    length: int  # of the whole record
    data_size: int


@dataclass
class DecodedMcap:
    """A whole file decoded: `topics` holds the decoded topics, sorted by log time."""

    profile: str
    library: str
    metadata: dict[str, dict[str, str]]
    channels: list[ChannelInfo]
    topic_counts: dict[str, int]  # every message, decoded or not
    topics: dict[str, TopicArrays]
    chunks: list[ChunkInfo]
    attachments: list[AttachmentInfo]
    # per topic, messages logged earlier than the topic's previous message in file order:
    # (count, log time of the first such message, log time of the message before it)
    time_backsteps: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    @property
    def messages(self) -> int:
        return sum(self.topic_counts.values())


# --- message types: programs for the CDR walker, and schema signatures -------------------

# A program lists a message's fields in wire order: (kind, name). Kinds:
#   time: builtin_interfaces/Time (int32 sec, uint32 nanosec) -> int64 ns
#   string: a label; string[]: a label of tuples; f8[]: float64 sequence;
#   f8*N: N float64 in a row (nested structs of float64 only); f4: one float32.
_PROGRAMS: dict[str, tuple[tuple[str, str], ...]] = {
    "sensor_msgs/msg/JointState": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("string[]", "name"),
        ("f8[]", "position"),
        ("f8[]", "velocity"),
        ("f8[]", "effort"),
    ),
    "geometry_msgs/msg/PoseStamped": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("f8*3", "position"),
        ("f8*4", "orientation"),
    ),
    "geometry_msgs/msg/TwistStamped": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("f8*3", "linear"),
        ("f8*3", "angular"),
    ),
    "std_msgs/msg/Float32": (("f4", "data"),),
    "std_msgs/msg/String": (("string", "data"),),
}
SUPPORTED_TYPES = tuple(_PROGRAMS)

# Field lists (type, name) of each type and of its dependencies, as in the .msg files.
_SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "JointState": (
        ("Header", "header"),
        ("string[]", "name"),
        ("float64[]", "position"),
        ("float64[]", "velocity"),
        ("float64[]", "effort"),
    ),
    "PoseStamped": (("Header", "header"), ("Pose", "pose")),
    "TwistStamped": (("Header", "header"), ("Twist", "twist")),
    "Float32": (("float32", "data"),),
    "String": (("string", "data"),),
    "Header": (("Time", "stamp"), ("string", "frame_id")),
    "Time": (("int32", "sec"), ("uint32", "nanosec")),
    "Pose": (("Point", "position"), ("Quaternion", "orientation")),
    "Point": (("float64", "x"), ("float64", "y"), ("float64", "z")),
    "Quaternion": (("float64", "x"), ("float64", "y"), ("float64", "z"), ("float64", "w")),
    "Twist": (("Vector3", "linear"), ("Vector3", "angular")),
    "Vector3": (("float64", "x"), ("float64", "y"), ("float64", "z")),
}
_SCHEMA_ENCODINGS = ("ros2msg", "ros2idl")
_SEPARATOR = re.compile(r"^={10,}\s*$", re.MULTILINE)


def normalize_type(name: str) -> str:
    """`pkg/Name` or `pkg/msg/Name` -> `pkg/msg/Name`."""
    parts = name.strip().split("/")
    if len(parts) == 2:
        return f"{parts[0]}/msg/{parts[1]}"
    return name.strip()


def check_schema(datatype: str, encoding: str, data: bytes) -> None:
    """Raise McapDecodeError(UNKNOWN_SCHEMA) unless the schema is the standard one.

    ros2msg text is compared field by field with the standard definitions (comments, constants
    and default values ignored; dependency sections that are left out are taken as standard).
    ros2idl schemas are accepted by name.
    """
    if datatype not in _PROGRAMS:
        raise McapDecodeError(UNKNOWN_SCHEMA, f"unsupported message type {datatype!r}")
    if encoding not in _SCHEMA_ENCODINGS:
        raise McapDecodeError(
            UNKNOWN_SCHEMA, f"schema {datatype!r} has encoding {encoding!r}, not ros2msg"
        )
    if encoding == "ros2idl":
        return
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise McapDecodeError(UNKNOWN_SCHEMA, f"schema {datatype!r} is not UTF-8 text") from None
    sections = _SEPARATOR.split(text)
    found = {datatype.rsplit("/", 1)[-1]: _msg_fields(sections[0])}
    for section in sections[1:]:
        lines = section.strip().splitlines()
        if lines and lines[0].startswith("MSG:"):
            found[lines[0][4:].strip().rsplit("/", 1)[-1]] = _msg_fields("\n".join(lines[1:]))
    for name, fields in found.items():
        expected = _SIGNATURES.get(name)
        if expected is not None and fields != expected:
            shown = ", ".join(f"{t} {n}" for t, n in fields)
            raise McapDecodeError(
                UNKNOWN_SCHEMA,
                f"schema {datatype!r}: {name} has fields ({shown}), not the standard definition",
            )


def _msg_fields(text: str) -> tuple[tuple[str, str], ...]:
    fields = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2 or "=" in parts[1] or (len(parts) > 2 and parts[2].startswith("=")):
            continue  # a constant: no bytes on the wire
        ftype = parts[0]
        base, bracket, rest = ftype.partition("[")
        ftype = base.rsplit("/", 1)[-1] + bracket + rest
        fields.append((ftype, parts[1]))
    return tuple(fields)


# --- the CDR walker: one payload in full (templates and the slow path) --------------------


@dataclass(frozen=True)
class _Layout:
    """Where a payload's fields are, for every payload with the same structural bytes."""

    little_endian: bool
    const: tuple[tuple[int, int], ...]  # payload byte ranges that must equal the template's
    numbers: tuple[tuple[str, str, int, int], ...]  # (name, kind, payload offset, count)
    labels: dict  # name -> the template's value


_ENCAPSULATIONS = {b"\x00\x00": False, b"\x00\x01": True}  # CDR_BE, CDR_LE (XCDR1)


def _walk(payload, program) -> tuple[dict, _Layout]:
    """Decode one CDR payload; also say where its fields are. Raises McapDecodeError."""
    p = bytes(payload)
    head = p[:2]
    if head not in _ENCAPSULATIONS:
        if len(p) < 4:
            raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes has no header")
        raise McapDecodeError(
            UNKNOWN_ENCODING,
            f"CDR encapsulation 0x{p[0]:02x}{p[1]:02x} is not plain CDR (XCDR1 LE/BE)",
        )
    little = _ENCAPSULATIONS[head]
    e = "<" if little else ">"
    u32 = struct.Struct(e + "I")
    off = 4
    const = [(0, 4)]
    numbers, values, labels = [], {}, {}

    def align(n: int) -> int:
        return off + (-(off - 4)) % n

    def string() -> str:
        nonlocal off
        off = align(4)
        (n,) = u32.unpack_from(p, off)
        if off + 4 + n > len(p):
            raise McapDecodeError(CORRUPT, "CDR string runs past the payload")
        raw = p[off + 4 : off + 4 + n]
        const.append((off, off + 4 + n))
        off += 4 + n
        try:
            return raw[:-1].decode() if n else ""
        except UnicodeDecodeError:
            raise McapDecodeError(CORRUPT, "CDR string is not UTF-8") from None

    try:
        for kind, name in program:
            if kind == "time":
                off = align(4)
                sec, nanosec = struct.unpack_from(e + "iI", p, off)
                values[name] = sec * 1_000_000_000 + nanosec
                numbers.append((name, "time", off, 1))
                off += 8
            elif kind == "string":
                values[name] = labels[name] = string()
            elif kind == "string[]":
                off = align(4)
                (count,) = u32.unpack_from(p, off)
                const.append((off, off + 4))
                off += 4
                if count > (len(p) - off) // 4:
                    raise McapDecodeError(CORRUPT, f"CDR sequence of {count} strings is too long")
                values[name] = labels[name] = tuple(string() for _ in range(count))
            elif kind == "f8[]":
                off = align(4)
                (count,) = u32.unpack_from(p, off)
                const.append((off, off + 4))
                off += 4
                if count:  # no alignment before an empty sequence's (absent) elements
                    off = align(8)
                if off + 8 * count > len(p):
                    raise McapDecodeError(CORRUPT, f"CDR sequence of {count} float64 too long")
                values[name] = struct.unpack_from(f"{e}{count}d", p, off)
                numbers.append((name, "f8[]", off, count))
                off += 8 * count
            elif kind.startswith("f8*"):
                count = int(kind[3:])
                off = align(8)
                values[name] = struct.unpack_from(f"{e}{count}d", p, off)
                numbers.append((name, "f8", off, count))
                off += 8 * count
            elif kind == "f4":
                off = align(4)
                (values[name],) = struct.unpack_from(e + "f", p, off)
                numbers.append((name, "f4", off, 1))
                off += 4
            else:  # pragma: no cover - programs are ours
                raise AssertionError(kind)
    except struct.error:
        raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes is cut short") from None
    if off > len(p):
        raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes is cut short")
    return values, _Layout(little, tuple(const), tuple(numbers), labels)


# --- per-type decoders: groups of payloads -> column pieces -------------------------------

_MAX_TEMPLATES = 8  # distinct layouts tried per (channel, length) group before the slow path


@dataclass
class _Piece:
    rows: np.ndarray | None  # indices into the messages decoded together; None: all, in order
    numbers: dict[str, np.ndarray]
    labels: dict[str, np.ndarray | int]  # name -> codes (n,), or one code for all rows
    lengths: dict[str, np.ndarray | int] = field(default_factory=dict)  # of float sequences


class _TypeDecoder:
    """Decodes the payloads of one message type; keeps the label tables of one topic."""

    def __init__(self, datatype: str):
        self.datatype = datatype
        self.program = _PROGRAMS[datatype]
        self.strings = datatype == "std_msgs/msg/String"  # free text: one str per message
        self.label_names = [
            n for k, n in self.program if k in ("string", "string[]") and not self.strings
        ]
        self.tables: dict[str, dict] = {n: {} for n in self.label_names}

    def code(self, name: str, value) -> int:
        table = self.tables[name]
        code = table.get(value)
        if code is None:
            code = table[value] = len(table)
        return code

    def decode(self, data: bytes, data_off: np.ndarray, data_len: np.ndarray) -> _Piece:
        """The payloads at data[data_off[i] : data_off[i] + data_len[i]], in this order."""
        if self.strings:
            return self._strings(data, data_off, data_len)
        raw = np.frombuffer(data, np.uint8)
        if data_len.min() == data_len.max():
            return self._group(data, raw, data_off, int(data_len[0]))
        lengths = np.unique(data_len)
        pieces = []
        for length in lengths.tolist():
            rows = np.flatnonzero(data_len == length)
            piece = self._group(data, raw, data_off[rows], length)
            piece.rows = rows if piece.rows is None else rows[piece.rows]
            pieces.append(piece)
        return _merge(pieces, len(data_off))

    def _group(self, data: bytes, raw: np.ndarray, data_off: np.ndarray, length: int) -> _Piece:
        """Payloads of one length: a template, a vectorized check, views at its offsets; the
        payloads that do not match get templates of their own, then the slow path."""
        total = len(data_off)
        pieces, todo = [], np.arange(total)
        for _ in range(_MAX_TEMPLATES):
            if not len(todo):
                break
            start = int(data_off[todo[0]])
            template = data[start : start + length]
            _, layout = _walk(template, self.program)
            matrix, match = _match(raw, data_off[todo], length, template, layout)
            if match.all():
                pieces.append(self._piece(todo, matrix, layout, total))
                todo = todo[:0]
            else:
                pieces.append(self._piece(todo[match], matrix[match], layout, total))
                todo = todo[~match]
        for i in todo.tolist():  # odd payloads: one by one
            start = int(data_off[i])
            pieces.append(self._slow(np.array([i]), data[start : start + length]))
        return pieces[0] if len(pieces) == 1 else _merge(pieces, total)

    def _piece(self, rows: np.ndarray, matrix: np.ndarray, layout: _Layout, total: int) -> _Piece:
        e = "<" if layout.little_endian else ">"
        numbers = {}
        for name, kind, off, count in layout.numbers:
            col = off + 4  # matrix rows start 4 bytes before the payload
            if kind == "time":
                words = matrix.view(e + "u4")
                sec = words[:, col // 4].view(e + "i4").astype(np.int64)
                numbers[name] = sec * 1_000_000_000 + words[:, col // 4 + 1]
            elif kind in ("f8", "f8[]"):
                view = matrix.view(e + "f8")[:, col // 8 : col // 8 + count]
                numbers[name] = np.ascontiguousarray(view, dtype=np.float64)
            else:  # f4
                numbers[name] = np.ascontiguousarray(matrix.view(e + "f4")[:, col // 4], np.float32)
        labels = {name: self.code(name, value) for name, value in layout.labels.items()}
        lengths = {name: count for name, kind, _, count in layout.numbers if kind == "f8[]"}
        return _Piece(None if len(rows) == total else rows, numbers, labels, lengths)

    def _slow(self, rows: np.ndarray, payload: bytes) -> _Piece:
        values, _ = _walk(payload, self.program)
        numbers, labels, lengths = {}, {}, {}
        for kind, name in self.program:
            value = values[name]
            if kind == "f8[]":
                lengths[name] = len(value)
            if kind in ("string", "string[]"):
                labels[name] = self.code(name, value)
            elif kind == "time":
                numbers[name] = np.array([value], np.int64)
            elif kind == "f4":
                numbers[name] = np.array([value], np.float32)
            else:
                numbers[name] = np.array([value], np.float64).reshape(1, -1)
        return _Piece(rows, numbers, labels, lengths)

    def _strings(self, data: bytes, data_off: np.ndarray, data_len: np.ndarray) -> _Piece:
        out = np.empty(len(data_off), dtype=object)
        for i, (start, length) in enumerate(zip(data_off.tolist(), data_len.tolist(), strict=True)):
            payload = data[start : start + length]
            if length >= 8 and payload[:2] == b"\x00\x01":
                n = int.from_bytes(payload[4:8], "little")
                if 8 + n <= length:
                    try:
                        out[i] = payload[8 : 7 + n].decode() if n else ""
                        continue
                    except UnicodeDecodeError:
                        pass
            out[i] = _walk(payload, self.program)[0]["data"]  # raises the precise error
        return _Piece(None, {"data": out}, {})


def _match(raw, data_off, length, template, layout) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, match): the payloads as rows starting 4 bytes before each payload, padded to a
    multiple of 8 bytes so that CDR-aligned numbers are aligned views; match says which rows
    have the template's structural bytes."""
    width, mask_w, tpl_w, runs = _plan(length, layout.const, template)
    matrix = _rows(raw, data_off - 4, width)
    words = matrix.view("<u8")
    diffs = []
    for w0, w1 in runs:  # runs of words holding structural bytes (not the numbers between)
        diff = words[:, w0:w1] & mask_w[w0:w1]
        diff ^= tpl_w[w0:w1]
        diffs.append(diff)
    if not any(d.any() for d in diffs):  # the usual case: all have the template's layout
        return matrix, np.ones(len(matrix), bool)
    bad = np.zeros(len(matrix), bool)
    for diff in diffs:
        bad |= diff.any(axis=1)
    return matrix, ~bad


@functools.lru_cache(maxsize=256)
def _plan_cached(length: int, const: tuple, structural: bytes):
    width = (length + 4 + 7) // 8 * 8
    mask = np.zeros(width, np.uint8)
    tpl = np.zeros(width, np.uint8)
    at = 0
    for a, b in const:
        mask[a + 4 : b + 4] = 0xFF
        tpl[a + 4 : b + 4] = np.frombuffer(structural[at : at + b - a], np.uint8)
        at += b - a
    mask_w, tpl_w = mask.view("<u8"), tpl.view("<u8")
    return width, mask_w, tpl_w, _runs(np.flatnonzero(mask_w))


def _plan(length: int, const: tuple, template: bytes):
    """Row width, word mask and template words of the structural bytes, and their runs."""
    structural = b"".join(template[a:b] for a, b in const)
    return _plan_cached(length, const, structural)


def _runs(words: np.ndarray) -> list[tuple[int, int]]:
    """Sorted word indices -> [(first, last + 1)] of runs, bridging gaps of one word."""
    breaks = np.flatnonzero(np.diff(words) > 2)
    starts = np.concatenate(([words[0]], words[breaks + 1]))
    ends = np.concatenate((words[breaks], [words[-1]])) + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _rows(raw: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """raw[s : s + width] for each start s, as an (n, width) array (zero past the end).

    Equally spaced starts (one channel with one message size) are a strided view of raw,
    no copy; numpy's constructor refuses a view that would reach past the buffer.
    """
    size, n = len(raw), len(starts)
    step = int(starts[1] - starts[0]) if n > 1 else 0
    if step >= width and int(starts[-1]) + width <= size and (np.diff(starts) == step).all():
        return np.ndarray((n, width), np.uint8, raw, int(starts[0]), (step, 1))
    if size >= width:
        window = np.ndarray((size - width + 1, width), np.uint8, raw, 0, (1, 1))
        inside = starts <= size - width
        if inside.all():
            return window[starts]
        out = np.zeros((n, width), np.uint8)
        out[inside] = window[starts[inside]]
    else:
        out, inside = np.zeros((n, width), np.uint8), np.zeros(n, bool)
    for i in np.flatnonzero(~inside):  # at most the chunk's last record
        s = int(starts[i])
        out[i, : size - s] = raw[s:]
    return out


def _merge(pieces: list[_Piece], n: int) -> _Piece:
    """Pieces covering rows 0..n-1 between them -> one piece in row order."""
    numbers: dict[str, np.ndarray] = {}
    labels: dict[str, np.ndarray] = {}
    order = [np.arange(n) if p.rows is None else p.rows for p in pieces]
    for name in pieces[0].numbers:
        parts = [p.numbers[name] for p in pieces]
        numbers[name] = _scatter(parts, order, n)
    lengths: dict[str, np.ndarray] = {}
    for out, key in ((labels, "labels"), (lengths, "lengths")):
        for name in getattr(pieces[0], key):
            codes = np.empty(n, np.int32)
            for p, rows in zip(pieces, order, strict=True):
                codes[rows] = getattr(p, key)[name]
            out[name] = codes
    return _Piece(None, numbers, labels, lengths)


def _scatter(parts: list[np.ndarray], order: list[np.ndarray], n: int) -> np.ndarray:
    first = parts[0]
    if first.dtype == object:
        out = np.empty(n, dtype=object)
        for part, rows in zip(parts, order, strict=True):
            out[rows] = part
        return out
    dtype = np.result_type(*[p.dtype for p in parts]).newbyteorder("=")
    if first.ndim == 1:
        out = np.empty(n, dtype)
        for part, rows in zip(parts, order, strict=True):
            out[rows] = part
        return out
    width = max(p.shape[1] for p in parts)
    same = all(p.shape[1] == width for p in parts)
    out = np.empty((n, width), dtype) if same else np.full((n, width), np.nan, dtype)
    for part, rows in zip(parts, order, strict=True):
        out[rows, : part.shape[1]] = part
    return out


# --- record scanning -----------------------------------------------------------------------

_OP_HEADER, _OP_FOOTER, _OP_SCHEMA, _OP_CHANNEL, _OP_MESSAGE = 0x01, 0x02, 0x03, 0x04, 0x05
_OP_CHUNK, _OP_MESSAGE_INDEX, _OP_ATTACHMENT, _OP_METADATA, _OP_DATA_END = (
    0x06,
    0x07,
    0x09,
    0x0C,
    0x0F,
)
_OP_NAMES = {
    0x01: "Header",
    0x02: "Footer",
    0x03: "Schema",
    0x04: "Channel",
    0x05: "Message",
    0x06: "Chunk",
    0x07: "MessageIndex",
    0x08: "ChunkIndex",
    0x09: "Attachment",
    0x0A: "AttachmentIndex",
    0x0B: "Statistics",
    0x0C: "Metadata",
    0x0D: "MetadataIndex",
    0x0E: "SummaryOffset",
    0x0F: "DataEnd",
}
_RECORD = struct.Struct("<BQ")
_MESSAGE_HEAD = 31  # opcode, length, channel id, sequence, log time, publish time
_MAX_PERIOD = 8
_EMPTY = np.zeros(0, np.int64)


_HEAD = np.dtype(
    {
        "names": ["op", "length", "channel", "log_time"],
        "formats": ["u1", "<i8", "<u2", "<i8"],
        "offsets": [0, 1, 9, 15],
        "itemsize": _MESSAGE_HEAD,
    }
)


class _MessageHeads:
    """The fixed fields of the Message records at `offs`: a strided view of the chunk when
    they are equally spaced (one channel, one size), else one gather."""

    def __init__(self, data: bytes, offs: np.ndarray):
        self.offs = offs
        n = len(offs)
        step = int(offs[1] - offs[0]) if n > 1 else 0
        if (
            step >= _MESSAGE_HEAD
            and int(offs[-1]) + _MESSAGE_HEAD <= len(data)
            and (np.diff(offs) == step).all()
        ):
            head = np.ndarray((n,), _HEAD, data, int(offs[0]), (step,))
        else:
            rows = _rows(np.frombuffer(data, np.uint8), offs, _MESSAGE_HEAD)
            head = np.ascontiguousarray(rows).view(_HEAD).reshape(n)
        self.op, self.length, self.channel = head["op"], head["length"], head["channel"]
        self.log_time = np.ascontiguousarray(head["log_time"])


def _heads(raw: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(opcodes, lengths) of the records at `offsets` (each must have 9 bytes in raw)."""
    if not len(offsets):
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    heads = np.ndarray((len(raw) - 8, 9), np.uint8, raw, 0, (1, 1))[offsets]
    return heads[:, 0], np.ascontiguousarray(heads[:, 1:]).view("<i8").ravel()


def scan_records(buf: bytes, start: int, end: int, *, partial: bool = False) -> tuple:
    """Offsets, opcodes and lengths (int64 arrays) of the records in buf[start:end].

    With partial=False the records must fill the range exactly (chunk contents); with
    partial=True the scan stops before the first record that does not fit, and also returns
    where it stopped. Periodic runs of records are verified in vectorized steps (see above).
    """
    raw = np.frombuffer(buf, np.uint8)
    offs, ops, lens = [], [], []
    starts: list[int] = []  # records walked one by one since the last vectorized run
    keys: list[tuple[int, int]] = []  # their (opcode, length)
    seen: dict[tuple[int, int], int] = {}  # key -> its last index in keys
    pos, wait, backoff = start, 0, 1

    def flush() -> None:
        if starts:
            offs.append(np.array(starts, np.int64))
            ops.append(np.array([k[0] for k in keys], np.int64))
            lens.append(np.array([k[1] for k in keys], np.int64))
            starts.clear()
            keys.clear()
            seen.clear()

    while pos < end:
        if end - pos < 9:
            if partial:
                break
            raise McapDecodeError(CORRUPT, f"{end - pos} stray bytes at the end of a chunk")
        key = _RECORD.unpack_from(buf, pos)
        nxt = pos + 9 + key[1]
        if nxt > end:
            if partial:
                break
            name = _OP_NAMES.get(key[0], hex(key[0]))
            raise McapDecodeError(CORRUPT, f"{name} record runs past the end of its chunk")
        i = len(keys)
        starts.append(pos)
        keys.append(key)
        last, seen[key] = seen.get(key), i
        pos = nxt
        if wait:
            wait -= 1
            continue
        if last is None:
            continue
        period = i - last  # the same record one period ago: does the whole period repeat?
        if period > _MAX_PERIOD or i + 1 < 2 * period:
            continue
        pattern = keys[i + 1 - period :]
        if keys[i + 1 - 2 * period : i + 1 - period] != pattern:
            continue
        runs = _speculate(raw, pos, end, pattern)
        if runs is None:
            wait, backoff = backoff, min(backoff * 2, 64)
            continue
        flush()
        for run in runs:
            offs.append(run[0])
            ops.append(run[1])
            lens.append(run[2])
        pos = int(runs[-1][0][-1] + 9 + runs[-1][2][-1])
        backoff = 1
    flush()
    result = tuple(np.concatenate(x) if x else _EMPTY for x in (offs, ops, lens))
    return (*result, pos) if partial else result


def _speculate(raw: np.ndarray, pos: int, end: int, pattern: list) -> list | None:
    """Predict records from `pos` on as repetitions of `pattern` [(opcode, length)]; keep the
    verified prefix. Returns [(offsets, opcodes, lengths)] of accepted runs, or None."""
    period = len(pattern)
    phase = np.cumsum([0] + [9 + length for _, length in pattern])
    stride = int(phase[-1])
    want_op = np.array([op for op, _ in pattern], np.int64)
    want_len = np.array([length for _, length in pattern], np.int64)
    runs, reps = [], 16
    while True:
        reps = min(reps, (end - pos) // stride)
        if reps <= 0:
            break
        starts = (pos + stride * np.arange(reps)[:, None] + phase[:-1]).ravel()
        op, length = _heads(raw, starts)
        bad = (op.reshape(reps, period) != want_op) | (length.reshape(reps, period) != want_len)
        good = int(np.argmax(bad)) if bad.any() else len(starts)  # first bad, row-major
        if good:
            ops = np.broadcast_to(want_op, (reps, period)).ravel()[:good]
            lens = np.broadcast_to(want_len, (reps, period)).ravel()[:good]
            runs.append((starts[:good], ops, lens))
            pos = int(starts[good - 1] + 9 + lens[-1])
        if good < len(starts):
            break
        reps *= 4
    return runs or None


# --- the streaming reader --------------------------------------------------------------------

_BLOCK = 4 << 20  # bytes read at a time for messages outside chunks
_MAX_CHUNK_BYTES = 1 << 32  # uncompressed; writers use about 1 MiB
_STRING = struct.Struct("<I")


class _Channel:
    def __init__(
        self, info: ChannelInfo, decoder: _TypeDecoder | None, error: McapDecodeError | None
    ):
        self.info, self.decoder, self.error = info, decoder, error


class McapDecoder:
    """Streams one MCAP file: `batches()` yields {topic: TopicArrays} per chunk (file order).

    What it meets on the way is kept: profile, library, metadata, channels, topic_counts,
    time_backsteps, chunks, attachments. `topics` limits decoding to those topics (all are
    counted). `unknown_types`: "count" counts messages of types this module does not decode,
    "raise" raises McapDecodeError(UNKNOWN_SCHEMA) on the first such message.
    `check_channel(info)` is called on each channel as it is defined, before its messages.
    """

    def __init__(
        self,
        path: Path,
        *,
        topics: set[str] | None = None,
        unknown_types: str = "count",
        validate_crcs: bool = True,
        check_channel: Callable[[ChannelInfo], None] | None = None,
    ):
        if unknown_types not in ("count", "raise"):
            raise ValueError("unknown_types must be 'count' or 'raise'")
        self.path = Path(path)
        self.only = set(topics) if topics is not None else None
        self.unknown_types = unknown_types
        self.validate_crcs = validate_crcs
        self.check_channel = check_channel
        self.profile = self.library = ""
        self.metadata: dict[str, dict[str, str]] = {}
        self.topic_counts: dict[str, int] = {}
        self.time_backsteps: dict[str, tuple[int, int, int]] = {}
        self._last_time: dict[str, int] = {}
        self.chunks: list[ChunkInfo] = []
        self.attachments: list[AttachmentInfo] = []
        self._schemas: dict[int, tuple[str, str, bytes]] = {}
        self._channels: dict[int, _Channel] = {}
        self._decoders: dict[str, _TypeDecoder] = {}
        self._zstd = None

    @property
    def channels(self) -> list[ChannelInfo]:
        """Every channel met so far, by id."""
        return [self._channels[cid].info for cid in sorted(self._channels)]

    # -- the file -------------------------------------------------------------------------
    def batches(self) -> Iterator[dict[str, TopicArrays]]:
        with self.path.open("rb", buffering=0) as f:
            self._f = f
            self._open()
            yield from self._data_section()

    def _open(self) -> None:
        f = self._f
        size = os.fstat(f.fileno()).st_size
        self._size = size
        if size == 0:
            raise McapDecodeError(EMPTY, "empty file (0 bytes)")
        head = f.read(8)
        if head != MCAP_MAGIC:
            raise McapDecodeError(
                BAD_MAGIC, f"not an MCAP file: starts with {head!r}, not {MCAP_MAGIC!r}"
            )
        footer_at = size - 8 - 29
        tail = self._pread(size - 8, 8) if size >= 16 else b""
        if tail != MCAP_MAGIC or footer_at < 8:
            raise McapDecodeError(TRUNCATED, self._describe_cut())
        op, length, summary_start, _, _ = struct.unpack("<BQQQI", self._pread(footer_at, 29))
        if op != _OP_FOOTER or length != 20:
            raise McapDecodeError(CORRUPT, "no Footer record before the closing magic")
        self._data_end = summary_start if summary_start else footer_at
        if not 8 < self._data_end <= footer_at:
            raise McapDecodeError(CORRUPT, f"footer points at summary byte {summary_start}")
        self._data_crc_expected = 0
        if self.validate_crcs and self._data_end >= 8 + 13:
            op, length, crc = struct.unpack("<BQI", self._pread(self._data_end - 13, 13))
            if op == _OP_DATA_END and length == 4:
                self._data_crc_expected = crc
        self._crc = zlib.crc32(MCAP_MAGIC) if self._data_crc_expected else None
        self._pos = 8

    def _pread(self, offset: int, n: int) -> bytes:
        return os.pread(self._f.fileno(), n, offset)

    def _read(self, n: int) -> bytes:
        """n bytes at the current position, inside the data section."""
        if self._pos + n > self._data_end:
            raise McapDecodeError(
                CORRUPT,
                f"record at byte {self._pos} runs past the end of the data section "
                f"(byte {self._data_end})",
            )
        data = self._pread(self._pos, n)
        if len(data) != n:
            raise McapDecodeError(TRUNCATED, f"file ends inside the record at byte {self._pos}")
        if self._crc is not None:
            self._crc = zlib.crc32(data, self._crc)
        self._pos += n
        return data

    def _skip(self, n: int) -> None:
        if self._crc is None:
            if self._pos + n > self._data_end:
                self._read(n)  # raises
            self._pos += n
            return
        while n:
            step = min(n, 1 << 20)
            self._read(step)
            n -= step

    def _data_section(self) -> Iterator[dict[str, TopicArrays]]:
        op, length = _RECORD.unpack(self._read(9))
        if op != _OP_HEADER:
            raise McapDecodeError(CORRUPT, "the first record is not an MCAP Header")
        body = self._read(length)
        try:
            self.profile, at = _string(body, 0)
            self.library, _ = _string(body, at)
        except (struct.error, UnicodeDecodeError):
            raise McapDecodeError(CORRUPT, "unreadable MCAP Header record") from None
        chunk = None  # (offset, record body) waiting for its MessageIndex records
        indexes: list[bytes] = []
        while True:
            at = self._pos
            if at + 9 > self._data_end:
                raise McapDecodeError(
                    CORRUPT, f"data section ends at byte {at} without a DataEnd record"
                )
            op, length = _RECORD.unpack(self._pread(at, 9))
            if op == _OP_MESSAGE_INDEX:
                self._read(9)
                body = self._read(length)
                if chunk is not None:
                    indexes.append(body)
                continue
            if chunk is not None:
                batch = self._chunk(*chunk, indexes)
                chunk, indexes = None, []
                if batch:
                    yield batch
            if op == _OP_MESSAGE:  # messages outside chunks
                batch = self._loose_messages()
                if batch:
                    yield batch
                continue
            crc_before = self._crc
            self._read(9)
            if op == _OP_CHUNK:
                chunk = (at, self._read(length))
            elif op == _OP_DATA_END:
                self._check_data_crc(self._read(length), crc_before)
                if self._pos != self._data_end:  # a damaged record posing as the end
                    raise McapDecodeError(
                        CORRUPT,
                        f"DataEnd record at byte {at}, but the data section runs to byte "
                        f"{self._data_end}",
                    )
                return
            elif op in (_OP_SCHEMA, _OP_CHANNEL):
                self._definition(op, self._read(length))
            elif op == _OP_METADATA:
                self._metadata(self._read(length))
            elif op == _OP_ATTACHMENT:
                self._attachment(at, length)
            elif op in (_OP_HEADER, _OP_FOOTER):
                raise McapDecodeError(CORRUPT, f"{_OP_NAMES[op]} record inside the data section")
            else:  # index and summary records, private records: nothing to decode
                self._skip(length)

    def _check_data_crc(self, body: bytes, computed: int | None) -> None:
        if computed is None or len(body) < 4:
            return
        (stored,) = _STRING.unpack_from(body, 0)
        if stored and computed != stored:
            raise McapDecodeError(
                CRC_MISMATCH,
                f"data section CRC mismatch: stored 0x{stored:08x}, computed 0x{computed:08x}",
            )

    def _describe_cut(self) -> str:
        """Where a file without its footer and closing magic was cut off."""
        size, pos, last = self._size, 8, "Header"
        for _ in range(100_000):
            if pos == size:
                return (
                    f"truncated MCAP ({size} bytes): ends after a complete {last} record, "
                    "without the footer and closing magic (the writer did not finish)"
                )
            if size - pos < 9:
                return f"truncated MCAP ({size} bytes): cut inside a record header at byte {pos}"
            op, length = _RECORD.unpack(self._pread(pos, 9))
            name = _OP_NAMES.get(op, f"0x{op:02x}")
            if pos + 9 + length > size:
                where = "mid-chunk" if op == _OP_CHUNK else f"inside a {name} record"
                return (
                    f"truncated MCAP ({size} bytes): cut {where} at byte {pos} "
                    f"({size - pos - 9} of {length} bytes present)"
                )
            last, pos = name, pos + 9 + length
        return f"truncated MCAP ({size} bytes): no footer and closing magic"

    # -- records ----------------------------------------------------------------------------
    def _definition(self, op: int, body: bytes) -> None:
        try:
            if op == _OP_SCHEMA:
                (sid,) = struct.unpack_from("<H", body, 0)
                name, at = _string(body, 2)
                encoding, at = _string(body, at)
                (n,) = _STRING.unpack_from(body, at)
                data = bytes(body[at + 4 : at + 4 + n])
                if len(data) != n:
                    raise struct.error
                self._add_schema(sid, name, encoding, data)
            else:
                cid, sid = struct.unpack_from("<HH", body, 0)
                topic, at = _string(body, 4)
                encoding, at = _string(body, at)
                self._add_channel(cid, sid, topic, encoding)
        except (struct.error, UnicodeDecodeError):
            kind = "Schema" if op == _OP_SCHEMA else "Channel"
            raise McapDecodeError(CORRUPT, f"unreadable {kind} record") from None

    def _add_schema(self, sid: int, name: str, encoding: str, data: bytes) -> None:
        old = self._schemas.get(sid)
        if old is not None and old != (name, encoding, data):
            raise McapDecodeError(CORRUPT, f"schema id {sid} defined twice, differently")
        self._schemas[sid] = (name, encoding, data)

    def _add_channel(self, cid: int, sid: int, topic: str, encoding: str) -> None:
        old = self._channels.get(cid)
        if old is not None:
            if (old.info.topic, old.info.message_encoding) != (topic, encoding):
                raise McapDecodeError(CORRUPT, f"channel id {cid} defined twice, differently")
            return
        schema = self._schemas.get(sid)
        if sid and schema is None:
            raise McapDecodeError(CORRUPT, f"channel {topic!r} refers to unknown schema id {sid}")
        name, schema_encoding, data = schema or ("", "", b"")
        info = ChannelInfo(cid, topic, encoding, name, schema_encoding)
        if self.check_channel is not None:
            self.check_channel(info)
        decoder, error = None, None
        datatype = normalize_type(name) if name else ""
        if encoding != "cdr":
            error = McapDecodeError(
                UNKNOWN_ENCODING, f"topic {topic!r}: message encoding {encoding!r}, not cdr"
            )
        elif not name:
            error = McapDecodeError(UNKNOWN_SCHEMA, f"topic {topic!r} has no schema")
        elif datatype not in _PROGRAMS:
            if self.unknown_types == "raise":
                error = McapDecodeError(
                    UNKNOWN_SCHEMA, f"topic {topic!r}: unsupported message type {name!r}"
                )
        elif self.only is None or topic in self.only:
            try:
                check_schema(datatype, schema_encoding, data)
            except McapDecodeError as exc:
                error = McapDecodeError(exc.kind, f"topic {topic!r}: {exc}")
            else:
                decoder = self._decoders.get(topic)
                if decoder is None:
                    decoder = self._decoders[topic] = _TypeDecoder(datatype)
                elif decoder.datatype != datatype:
                    error = McapDecodeError(
                        CORRUPT, f"topic {topic!r} has two types: {decoder.datatype}, {datatype}"
                    )
                    decoder = None
        self._channels[cid] = _Channel(info, decoder, error)

    def _metadata(self, body: bytes) -> None:
        try:
            name, at = _string(body, 0)
            self.metadata[name] = _string_map(body, at)
        except (struct.error, UnicodeDecodeError, ValueError):
            raise McapDecodeError(CORRUPT, "unreadable Metadata record") from None

    def _attachment(self, at: int, length: int) -> None:
        head = self._read(min(length, 1 << 16))
        try:
            log_time, create_time = struct.unpack_from("<QQ", head, 0)
            name, pos = _string(head, 16)
            media_type, pos = _string(head, pos)
            (size,) = struct.unpack_from("<Q", head, pos)
        except (struct.error, UnicodeDecodeError):
            raise McapDecodeError(CORRUPT, f"unreadable Attachment record at byte {at}") from None
        self._skip(length - len(head))
        self.attachments.append(
            AttachmentInfo(name, media_type, log_time, create_time, at, 9 + length, size)
        )

    # -- chunks -----------------------------------------------------------------------------
    def _chunk(self, at: int, body: bytes, indexes: list[bytes]) -> dict[str, TopicArrays]:
        try:
            start, end, size, crc, n = struct.unpack_from("<QQQII", body, 0)
            compression = body[32 : 32 + n].decode()
            (stored,) = struct.unpack_from("<Q", body, 32 + n)
        except (struct.error, UnicodeDecodeError):
            raise McapDecodeError(CORRUPT, f"unreadable Chunk record at byte {at}") from None
        begin = 40 + n
        if begin + stored > len(body):
            raise McapDecodeError(CORRUPT, f"chunk at byte {at}: data runs past its record")
        data = self._decompress(memoryview(body)[begin : begin + stored], compression, size, at)
        if self.validate_crcs and crc:
            computed = zlib.crc32(data)
            if computed != crc:
                raise McapDecodeError(
                    CRC_MISMATCH,
                    f"chunk at byte {at}: CRC mismatch (stored 0x{crc:08x}, "
                    f"computed 0x{computed:08x})",
                )
        heads = self._indexed(data, indexes) if indexes else None
        if heads is None:
            offs, ops, _ = scan_records(data, 0, len(data))
            for o in offs[(ops == _OP_SCHEMA) | (ops == _OP_CHANNEL)].tolist():
                op, length = _RECORD.unpack_from(data, o)
                self._definition(op, memoryview(data)[o + 9 : o + 9 + length])
            heads = _MessageHeads(data, offs[ops == _OP_MESSAGE])
        self.chunks.append(ChunkInfo(start, end, at, 9 + len(body), compression, len(heads.offs)))
        return self._messages(data, heads)

    def _decompress(self, data, compression: str, size: int, at: int) -> bytes:
        if size > _MAX_CHUNK_BYTES:
            raise McapDecodeError(
                CORRUPT, f"chunk at byte {at} claims {size} bytes uncompressed: implausible"
            )
        try:  # never more output than the chunk declares (a corrupt header is no zip bomb)
            if compression == "zstd":
                import zstandard

                if self._zstd is None:
                    self._zstd = zstandard.ZstdDecompressor()
                declared = zstandard.frame_content_size(data)
                if declared not in (-1, size):
                    raise ValueError(f"zstd frame holds {declared} bytes, the chunk says {size}")
                out = self._zstd.decompress(data, max_output_size=size)
            elif compression == "lz4":
                import lz4.frame

                lz4_frame = lz4.frame.LZ4FrameDecompressor()
                out = lz4_frame.decompress(data, max_length=size)
                if not lz4_frame.eof:
                    raise ValueError(f"lz4 frame does not end after the chunk's {size} bytes")
            elif compression == "":
                out = bytes(data)
            else:
                raise McapDecodeError(
                    UNKNOWN_COMPRESSION,
                    f"chunk at byte {at}: compression {compression!r} (known: zstd, lz4, none)",
                )
        except McapDecodeError:
            raise
        except Exception as exc:  # the codecs' own error types
            detail = (str(exc).splitlines() or [""])[0][:120]
            raise McapDecodeError(
                CORRUPT, f"chunk at byte {at}: {compression} data does not decompress ({detail})"
            ) from None
        if len(out) != size:
            raise McapDecodeError(
                CORRUPT, f"chunk at byte {at}: {len(out)} bytes decompressed, {size} expected"
            )
        return out

    def _indexed(self, data: bytes, indexes: list[bytes]) -> _MessageHeads | None:
        """Message offsets from the chunk's MessageIndex records, if they check out."""
        parts = []
        for body in indexes:
            if len(body) < 6:
                return None
            (n,) = _STRING.unpack_from(body, 2)
            if n % 16 or 6 + n > len(body):
                return None
            parts.append(np.frombuffer(body, "<u8", count=n // 8, offset=6)[1::2])
        offs = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        size = len(data)
        if not len(offs) or int(offs.max()) > size - _MESSAGE_HEAD:
            return None
        offs = offs.astype(np.int64)
        heads = _MessageHeads(data, offs)
        length = heads.length
        if (heads.op != _OP_MESSAGE).any() or ((length < 22) | (length > size)).any():
            return None
        ends = offs + 9 + length
        if offs[0] == 0 and ends[-1] == size and (offs[1:] == ends[:-1]).all():
            return heads  # the messages tile the chunk: nothing else in it, none left out
        if len(parts) > 1 or (offs[1:] <= offs[:-1]).any():
            order = np.argsort(offs, kind="stable")
            offs, ends = offs[order], ends[order]
            heads = _MessageHeads(data, offs)
        gap_start = np.concatenate(([0], ends))
        gap_end = np.concatenate((offs, [size]))
        if (gap_end < gap_start).any():
            return None  # overlapping records
        gaps = np.flatnonzero(gap_end != gap_start)
        for g in gaps.tolist():  # Schema and Channel records between messages
            a, b = int(gap_start[g]), int(gap_end[g])
            offs_g, ops_g, _ = scan_records(data, a, b)
            if (ops_g == _OP_MESSAGE).any():
                return None  # a message the index does not list
            for o, op in zip(offs_g.tolist(), ops_g.tolist(), strict=True):
                if op in (_OP_SCHEMA, _OP_CHANNEL):
                    (length,) = struct.unpack_from("<Q", data, o + 1)
                    self._definition(op, memoryview(data)[o + 9 : o + 9 + length])
        return heads

    def _loose_messages(self) -> dict[str, TopicArrays]:
        """Messages outside chunks: read a block, scan it, decode the records that fit."""
        at = self._pos
        first = _RECORD.unpack(self._pread(at, 9))[1] + 9
        block = self._pread(at, min(max(_BLOCK, first), self._data_end - at))
        if len(block) < first:
            raise McapDecodeError(TRUNCATED, f"file ends inside the record at byte {at}")
        offs, ops, _, stop = scan_records(block, 0, len(block), partial=True)
        keep = (ops == _OP_MESSAGE) | (ops == _OP_SCHEMA) | (ops == _OP_CHANNEL)
        cut = int(np.argmin(keep)) if not keep.all() else len(offs)
        if cut < len(offs):
            stop = int(offs[cut])
        offs, ops = offs[:cut], ops[:cut]
        for o, op in zip(offs.tolist(), ops.tolist(), strict=True):
            if op != _OP_MESSAGE:
                (length,) = struct.unpack_from("<Q", block, o + 1)
                self._definition(op, memoryview(block)[o + 9 : o + 9 + length])
        self._read_consumed(block, stop)
        return self._messages(block, _MessageHeads(block, offs[ops == _OP_MESSAGE]))

    def _read_consumed(self, block: bytes, n: int) -> None:
        if self._crc is not None:
            self._crc = zlib.crc32(memoryview(block)[:n], self._crc)
        self._pos += n

    # -- messages -> columns ------------------------------------------------------------------
    def _messages(self, data: bytes, heads: _MessageHeads) -> dict[str, TopicArrays]:
        offs = heads.offs
        if not len(offs):
            return {}
        if (heads.length < 22).any():
            raise McapDecodeError(CORRUPT, "Message record shorter than its fixed fields")
        chan, log_time = heads.channel, heads.log_time
        if (log_time < 0).any():  # a uint64 past int64: no clock reads that
            raise McapDecodeError(CORRUPT, "message log time past 2**63 ns (year 2262)")
        data_off, data_len = offs + _MESSAGE_HEAD, heads.length - 22
        single = chan.min() == chan.max()
        by_topic: dict[str, list[_Channel]] = {}
        for cid in [int(chan[0])] if single else np.unique(chan).tolist():
            channel = self._channels.get(cid)
            if channel is None:
                raise McapDecodeError(CORRUPT, f"message on channel id {cid}, never defined")
            by_topic.setdefault(channel.info.topic, []).append(channel)
        out = {}
        for topic, channels in by_topic.items():
            ids = [c.info.id for c in channels]
            if single:
                rows = None
            elif len(ids) == 1:
                rows = np.flatnonzero(chan == ids[0])
            else:
                rows = np.flatnonzero(np.isin(chan, ids))
            times = log_time if rows is None else log_time[rows]
            self._count(topic, times)
            if self.only is not None and topic not in self.only:
                continue
            for channel in channels:
                if channel.error is not None:
                    raise channel.error
            decodable = [c.info.id for c in channels if c.decoder is not None]
            if not decodable:
                continue
            if len(decodable) < len(ids):  # some channels of the topic have unknown types
                keep = np.isin(chan if rows is None else chan[rows], decodable)
                rows = np.flatnonzero(keep) if rows is None else rows[keep]
                times = log_time[rows]
            decoder = self._decoders[topic]
            if rows is None:
                piece = decoder.decode(data, data_off, data_len)
            else:
                piece = decoder.decode(data, data_off[rows], data_len[rows])
            out[topic] = _arrays(topic, decoder, times, piece)
        return out

    def _count(self, topic: str, times: np.ndarray) -> None:
        """Message counts, and log times that step back, per topic in file order."""
        self.topic_counts[topic] = self.topic_counts.get(topic, 0) + len(times)
        last = self._last_time.get(topic)
        previous = times[:-1] if last is None else np.concatenate(([last], times[:-1]))
        current = times[1:] if last is None else times
        back = current < previous
        if back.any():
            i = int(np.argmax(back))
            count, first, before = self.time_backsteps.get(
                topic, (0, int(current[i]), int(previous[i]))
            )
            self.time_backsteps[topic] = (count + int(back.sum()), first, before)
        self._last_time[topic] = int(times[-1])


def _arrays(topic: str, decoder: _TypeDecoder, log_time: np.ndarray, piece: _Piece) -> TopicArrays:
    n = len(log_time)

    def column(codes) -> np.ndarray:
        return codes if isinstance(codes, np.ndarray) else np.full(n, codes, np.int32)

    labels = {
        name: Labels(list(decoder.tables[name]), column(piece.labels[name]))
        for name in decoder.label_names
    }
    lengths = {name: column(value) for name, value in piece.lengths.items()}
    return TopicArrays(topic, decoder.datatype, log_time, dict(piece.numbers), labels, lengths)


def _concat_topic(parts: list[TopicArrays], decoder: _TypeDecoder) -> TopicArrays:
    """Batches of one topic -> one TopicArrays (label values from the decoder's table)."""
    first = parts[0]

    def joined(arrays: list[np.ndarray]) -> np.ndarray:
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)

    fields = {}
    for name in first.fields:
        arrays = [p.fields[name] for p in parts]
        if arrays[0].ndim == 2 and len({a.shape[1] for a in arrays}) > 1:
            width = max(a.shape[1] for a in arrays)
            arrays = [
                np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=np.nan) for a in arrays
            ]
        fields[name] = joined(arrays)
    labels = {
        name: Labels(list(decoder.tables[name]), joined([p.labels[name].codes for p in parts]))
        for name in first.labels
    }
    lengths = {name: joined([p.lengths[name] for p in parts]) for name in first.lengths}
    log_time = joined([p.log_time for p in parts])
    return TopicArrays(first.topic, first.datatype, log_time, fields, labels, lengths)


def _take(arrays: TopicArrays, order: np.ndarray) -> TopicArrays:
    return TopicArrays(
        arrays.topic,
        arrays.datatype,
        arrays.log_time[order],
        {k: v[order] for k, v in arrays.fields.items()},
        {k: Labels(v.values, v.codes[order]) for k, v in arrays.labels.items()},
        {k: v[order] for k, v in arrays.lengths.items()},
    )


def _relabel(arrays: TopicArrays) -> TopicArrays:
    """Label values in order of first appearance, only those that appear."""
    labels = {}
    for name, label in arrays.labels.items():
        used, first = np.unique(label.codes, return_index=True)
        used = used[np.argsort(first)]
        recode = np.zeros(len(label.values), np.int32)
        recode[used] = np.arange(len(used), dtype=np.int32)
        labels[name] = Labels([label.values[c] for c in used.tolist()], recode[label.codes])
    return dataclasses.replace(arrays, labels=labels)


# --- whole files ------------------------------------------------------------------------------


def iter_batches(
    path: Path,
    *,
    topics: set[str] | None = None,
    unknown_types: str = "count",
    validate_crcs: bool = True,
) -> Iterator[dict[str, TopicArrays]]:
    """One {topic: TopicArrays} per chunk, in file order: memory stays at a chunk's worth.

    Label codes index into the topic's values so far (a later batch may add values).
    Use McapDecoder directly to see metadata, counts and channels as well.
    """
    reader = McapDecoder(
        path, topics=topics, unknown_types=unknown_types, validate_crcs=validate_crcs
    )
    yield from reader.batches()


def decode(
    path: Path,
    *,
    topics: set[str] | None = None,
    unknown_types: str = "count",
    validate_crcs: bool = True,
    check_channel: Callable[[ChannelInfo], None] | None = None,
) -> DecodedMcap:
    """Decode a whole MCAP file; each topic sorted by log time (stable: file order on ties).

    `topics` limits decoding to those topics (every message is counted in topic_counts);
    see McapDecoder for the other options. Raises McapDecodeError.
    """
    reader = McapDecoder(
        path,
        topics=topics,
        unknown_types=unknown_types,
        validate_crcs=validate_crcs,
        check_channel=check_channel,
    )
    parts: dict[str, list[TopicArrays]] = {}
    for batch in reader.batches():
        for topic, arrays in batch.items():
            parts.setdefault(topic, []).append(arrays)
    decoded = {}
    for topic, pieces in parts.items():
        arrays = _concat_topic(pieces, reader._decoders[topic])
        t = arrays.log_time
        if len(t) > 1 and (t[1:] < t[:-1]).any():
            arrays = _take(arrays, np.argsort(t, kind="stable"))
        decoded[topic] = _relabel(arrays)
    return DecodedMcap(
        profile=reader.profile,
        library=reader.library,
        metadata=reader.metadata,
        channels=reader.channels,
        topic_counts=reader.topic_counts,
        topics=decoded,
        chunks=reader.chunks,
        attachments=reader.attachments,
        time_backsteps=reader.time_backsteps,
    )


def decode_log(path: Path):
    """`pipelines.ingest.store.read_log`, fast: the same DecodedLog (fields, dtypes, order).

    Raises McapDecodeError where read_log raises UnreadableLog, and ingest's
    ContractViolation where read_log does: a contract topic with another encoding or type
    (ingest.check_channels, as each channel is defined), joint names other than
    schema.JOINT_NAMES, fewer than 2 positions or velocities. Differences: it also decodes
    files without a summary section, never reads the summary (so checks no summary CRC: run
    ingest.check_container first for that), and rejects a contract type whose definition
    differs from the standard one (McapDecodeError, kind unknown_schema).
    """

    def check(channel: ChannelInfo) -> None:
        check_channels([_channel_tuple(channel)])

    log = decode(Path(path), topics=set(TOPIC_TYPES), check_channel=check)
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


def _string(buf, at: int) -> tuple[str, int]:
    (n,) = _STRING.unpack_from(buf, at)
    end = at + 4 + n
    if end > len(buf):
        raise struct.error("string runs past its record")
    return bytes(buf[at + 4 : end]).decode(), end


def _string_map(buf, at: int) -> dict[str, str]:
    (n,) = _STRING.unpack_from(buf, at)
    at, end = at + 4, at + 4 + n
    if end > len(buf):
        raise struct.error("map runs past its record")
    out = {}
    while at < end:
        key, at = _string(buf, at)
        value, at = _string(buf, at)
        out[key] = value
    return out
