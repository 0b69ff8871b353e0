"""The MCAP record layout: the magic, opcodes and their names, the (opcode, length) prefix, the
fixed fields of Message records as numpy views, string and map fields, and where a file that
lacks its footer was cut off."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from pipelines.ingest.mcap.byte_rows import _rows

MCAP_MAGIC = b"\x89MCAP0\r\n"

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
_STRING = struct.Struct("<I")


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


def describe_cut(pread: Callable[[int, int], bytes], size: int) -> str:
    """Where a file of `size` bytes without its footer and closing magic was cut off
    (`pread(offset, n)` reads it)."""
    pos, last = 8, "Header"
    for _ in range(100_000):
        if pos == size:
            return (
                f"truncated MCAP ({size} bytes): ends after a complete {last} record, "
                "without the footer and closing magic (the writer did not finish)"
            )
        if size - pos < 9:
            return f"truncated MCAP ({size} bytes): cut inside a record header at byte {pos}"
        op, length = _RECORD.unpack(pread(pos, 9))
        name = _OP_NAMES.get(op, f"0x{op:02x}")
        if pos + 9 + length > size:
            where = "mid-chunk" if op == _OP_CHUNK else f"inside a {name} record"
            return (
                f"truncated MCAP ({size} bytes): cut {where} at byte {pos} "
                f"({size - pos - 9} of {length} bytes present)"
            )
        last, pos = name, pos + 9 + length
    return f"truncated MCAP ({size} bytes): no footer and closing magic"
