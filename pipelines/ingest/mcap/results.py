"""What the MCAP decoder raises and returns: McapDecodeError with its kinds (what the caller
maps to quarantine reasons), and the result types: TopicArrays (one topic as columns), the
channel, chunk and attachment descriptions, and DecodedMcap (a whole file)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# McapDecodeError.kind values: what the ingest owner maps to quarantine reasons.
EMPTY = "empty"  # a 0-byte file
BAD_MAGIC = "bad_magic"  # does not start with the MCAP magic
TRUNCATED = "truncated"  # cut off: no footer and closing magic, or a record cut short
CRC_MISMATCH = "crc_mismatch"  # a chunk or data-section CRC that is present does not match
CORRUPT = "corrupt"  # bytes that do not parse as MCAP records or CDR messages
UNKNOWN_COMPRESSION = "unknown_compression"  # a chunk compression other than zstd, lz4, none
UNKNOWN_ENCODING = "unknown_encoding"  # a message encoding other than cdr, or a CDR variant
UNKNOWN_SCHEMA = "unknown_schema"  # no schema, an unsupported schema, or one that differs
OVER_LIMIT = "over_limit"  # asks more work than DecodeLimits allow (a bomb or a record flood)
KINDS = (
    EMPTY,
    BAD_MAGIC,
    TRUNCATED,
    CRC_MISMATCH,
    CORRUPT,
    UNKNOWN_COMPRESSION,
    UNKNOWN_ENCODING,
    UNKNOWN_SCHEMA,
    OVER_LIMIT,
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
