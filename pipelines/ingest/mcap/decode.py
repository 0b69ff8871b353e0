"""Fast decoding of ROS 2 MCAP logs (CDR, as rosbag2 and the reference cell's recorder write them).

The official mcap reader with the mcap-ros2 decoder manages 15-20k messages/s on one core,
too slow for kHz joint states from a fleet. This decoder decodes the message types of the data
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
the caller quarantines the file. This package knows MCAP, CDR and ROS 2 message types, not
the data contract: `pipelines.ingest.decoded.decode_log` adapts its result to a DecodedLog.

This module holds the entry points (decode, iter_batches) and re-exports the public names.
The parts: results (errors and result types), reader (the streaming reader),
chunks (chunks: decompression, CRC, MessageIndex), scan (the record scan),
records (record layout), ros2_types (message types, schema checks), cdr_walk (one CDR
payload in full), cdr_columns (payload groups -> columns), byte_rows (row gathers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipelines.ingest.mcap.cdr_columns import _TypeDecoder
from pipelines.ingest.mcap.limits import DecodeLimits
from pipelines.ingest.mcap.reader import McapDecoder
from pipelines.ingest.mcap.records import MCAP_MAGIC
from pipelines.ingest.mcap.results import (
    BAD_MAGIC,
    CORRUPT,
    CRC_MISMATCH,
    EMPTY,
    KINDS,
    TRUNCATED,
    UNKNOWN_COMPRESSION,
    UNKNOWN_ENCODING,
    UNKNOWN_SCHEMA,
    AttachmentInfo,
    ChannelInfo,
    ChunkInfo,
    DecodedMcap,
    Labels,
    McapDecodeError,
    TopicArrays,
)
from pipelines.ingest.mcap.ros2_types import SUPPORTED_TYPES, check_schema, normalize_type
from pipelines.ingest.mcap.scan import scan_records

__all__ = [
    "BAD_MAGIC",
    "CORRUPT",
    "CRC_MISMATCH",
    "EMPTY",
    "KINDS",
    "MCAP_MAGIC",
    "SUPPORTED_TYPES",
    "TRUNCATED",
    "UNKNOWN_COMPRESSION",
    "UNKNOWN_ENCODING",
    "UNKNOWN_SCHEMA",
    "AttachmentInfo",
    "ChannelInfo",
    "ChunkInfo",
    "DecodedMcap",
    "Labels",
    "McapDecodeError",
    "McapDecoder",
    "TopicArrays",
    "check_schema",
    "decode",
    "iter_batches",
    "normalize_type",
    "scan_records",
]


# --- whole topics ----------------------------------------------------------------------------


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
    limits: DecodeLimits | None = None,
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
        limits=limits,
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
