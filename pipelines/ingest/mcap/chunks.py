"""MCAP chunks: the Chunk record's header, decompression (zstd, lz4 or none, never more output
than the chunk declares) and CRC check, and where the chunk's messages are: the offsets its
MessageIndex records list, once they check out, else a record scan (mcap_scan)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np

from pipelines.ingest.mcap.limits import DecodeLimits
from pipelines.ingest.mcap.records import (
    _MESSAGE_HEAD,
    _OP_CHANNEL,
    _OP_MESSAGE,
    _OP_SCHEMA,
    _RECORD,
    _STRING,
    _MessageHeads,
)
from pipelines.ingest.mcap.results import (
    CORRUPT,
    CRC_MISMATCH,
    OVER_LIMIT,
    UNKNOWN_COMPRESSION,
    McapDecodeError,
)
from pipelines.ingest.mcap.scan import scan_records

# Takes one Schema or Channel record met inside a chunk: (opcode, record body).
Define = Callable[[int, bytes], None]


def chunk_data(
    at: int, body: bytes, decompress: ChunkDecompressor, validate_crcs: bool
) -> tuple[int, int, str, bytes]:
    """(message start time, message end time, compression, decompressed data) of the Chunk
    record at byte `at` whose body is `body`; the CRC checked when asked and present."""
    try:
        start, end, size, crc, n = struct.unpack_from("<QQQII", body, 0)
        compression = body[32 : 32 + n].decode()
        (stored,) = struct.unpack_from("<Q", body, 32 + n)
    except (struct.error, UnicodeDecodeError):
        raise McapDecodeError(CORRUPT, f"unreadable Chunk record at byte {at}") from None
    begin = 40 + n
    if begin + stored > len(body):
        raise McapDecodeError(CORRUPT, f"chunk at byte {at}: data runs past its record")
    data = decompress(memoryview(body)[begin : begin + stored], compression, size, at)
    if validate_crcs and crc:
        computed = zlib.crc32(data)
        if computed != crc:
            raise McapDecodeError(
                CRC_MISMATCH,
                f"chunk at byte {at}: CRC mismatch (stored 0x{crc:08x}, computed 0x{computed:08x})",
            )
    return start, end, compression, data


class ChunkDecompressor:
    """Decompresses chunk data within `limits`; keeps one zstd decompressor per reader, made
    on first use."""

    def __init__(self, limits: DecodeLimits):
        self._zstd = None
        self.limits = limits

    def __call__(self, data, compression: str, size: int, at: int) -> bytes:
        refusal = self.limits.chunk_refusal(size, len(data))
        if refusal is not None:  # before a single byte is inflated
            raise McapDecodeError(OVER_LIMIT, f"chunk at byte {at} {refusal}")
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


def indexed_heads(
    data: bytes, indexes: list[bytes], define: Define, max_records: int
) -> _MessageHeads | None:
    """Message offsets from the chunk's MessageIndex records, if they check out."""
    parts = []
    for body in indexes:
        if len(body) < 6:
            return None
        (n,) = _STRING.unpack_from(body, 2)
        if n % 16 or 6 + n > len(body):
            return None
        parts.append(np.frombuffer(body, "<u8", count=n // 8, offset=6)[1::2])
    if sum(map(len, parts)) > max_records:
        return None  # the scan that replaces it stops at the limit and says so
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
        offs_g, ops_g, _ = scan_records(data, a, b, max_records=max_records)
        if (ops_g == _OP_MESSAGE).any():
            return None  # a message the index does not list
        for o, op in zip(offs_g.tolist(), ops_g.tolist(), strict=True):
            if op in (_OP_SCHEMA, _OP_CHANNEL):
                (length,) = struct.unpack_from("<Q", data, o + 1)
                define(op, memoryview(data)[o + 9 : o + 9 + length])
    return heads


def scanned_heads(data: bytes, define: Define, max_records: int) -> _MessageHeads:
    """The chunk's records found by a scan: Schema and Channel records go to `define`."""
    offs, ops, _ = scan_records(data, 0, len(data), max_records=max_records)
    for o in offs[(ops == _OP_SCHEMA) | (ops == _OP_CHANNEL)].tolist():
        op, length = _RECORD.unpack_from(data, o)
        define(op, memoryview(data)[o + 9 : o + 9 + length])
    return _MessageHeads(data, offs[ops == _OP_MESSAGE])
