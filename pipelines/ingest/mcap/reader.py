"""The streaming MCAP reader: reads the data section record by record with plain file reads
(a few chunks in memory whatever the file size; the summary section is never needed), keeps
what it meets (header, metadata, schemas, channels, chunks, attachments, counts) and turns each
chunk's messages into {topic: TopicArrays}."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from pipelines.ingest.mcap.cdr_columns import _arrays, _TypeDecoder
from pipelines.ingest.mcap.chunks import ChunkDecompressor, chunk_data, indexed_heads, scanned_heads
from pipelines.ingest.mcap.limits import DecodeLimits
from pipelines.ingest.mcap.records import (
    _MESSAGE_HEAD,
    _OP_ATTACHMENT,
    _OP_CHANNEL,
    _OP_CHUNK,
    _OP_DATA_END,
    _OP_FOOTER,
    _OP_HEADER,
    _OP_MESSAGE,
    _OP_MESSAGE_INDEX,
    _OP_METADATA,
    _OP_NAMES,
    _OP_SCHEMA,
    _RECORD,
    _STRING,
    MCAP_MAGIC,
    _MessageHeads,
    _string,
    _string_map,
    describe_cut,
)
from pipelines.ingest.mcap.results import (
    BAD_MAGIC,
    CORRUPT,
    CRC_MISMATCH,
    EMPTY,
    OVER_LIMIT,
    TRUNCATED,
    UNKNOWN_ENCODING,
    UNKNOWN_SCHEMA,
    AttachmentInfo,
    ChannelInfo,
    ChunkInfo,
    McapDecodeError,
    TopicArrays,
)
from pipelines.ingest.mcap.ros2_types import _PROGRAMS, check_schema, normalize_type
from pipelines.ingest.mcap.scan import scan_records

_BLOCK = 4 << 20  # bytes read at a time for messages outside chunks


class _Channel:
    def __init__(
        self, info: ChannelInfo, decoder: _TypeDecoder | None, error: McapDecodeError | None
    ):
        self.info, self.decoder, self.error = info, decoder, error


class McapDecoder:
    """Streams one MCAP file: `batches()` yields {topic: TopicArrays} per chunk (file order).

    What it meets on the way is kept: profile, library, metadata, channels, topic_counts,
    time_backsteps, chunks, attachments. `topics` limits decoding to those topics (all are
    counted). `unknown_types`: "count" counts messages of types the decoder does not decode,
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
        limits: DecodeLimits | None = None,
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
        self.limits = limits or DecodeLimits()
        self._decompress = ChunkDecompressor(self.limits)

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
            raise McapDecodeError(TRUNCATED, describe_cut(self._pread, size))
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

    def _header(self) -> None:
        """The Header record that opens the data section: profile and library."""
        op, length = _RECORD.unpack(self._read(9))
        if op != _OP_HEADER:
            raise McapDecodeError(CORRUPT, "the first record is not an MCAP Header")
        body = self._read(length)
        try:
            self.profile, at = _string(body, 0)
            self.library, _ = _string(body, at)
        except (struct.error, UnicodeDecodeError):
            raise McapDecodeError(CORRUPT, "unreadable MCAP Header record") from None

    def _data_section(self) -> Iterator[dict[str, TopicArrays]]:
        self._header()
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
        if len(self.chunks) >= self.limits.max_chunks_per_file:
            raise McapDecodeError(
                OVER_LIMIT,
                f"more than {self.limits.max_chunks_per_file} chunks "
                "(ingest.decode_limits.max_chunks_per_file): a chunk flood",
            )
        start, end, compression, data = chunk_data(at, body, self._decompress, self.validate_crcs)
        most = self.limits.max_records_per_chunk
        heads = indexed_heads(data, indexes, self._definition, most) if indexes else None
        if heads is None:
            heads = scanned_heads(data, self._definition, most)
        self.chunks.append(ChunkInfo(start, end, at, 9 + len(body), compression, len(heads.offs)))
        return self._messages(data, heads)

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
